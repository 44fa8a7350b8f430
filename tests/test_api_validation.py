"""Every bad request is a 400 that names the field, never a 5xx, and queues nothing."""

from __future__ import annotations

import pytest

GOOD = {
    "mode": "vocal",
    "tags": "pop, female vocal",
    "lyrics": "[verse]\nhello world",
    "duration_s": 3,
    "num_tracks": 2,
    "seed": 1,
    "temperature": 1.0,
    "top_k": 80,
}

CASES = [
    ("mode", {"mode": "opera"}),
    ("tags", {"tags": 5}),
    ("tags", {"tags": "", "prompt": ""}),
    ("tags", {"tags": "x" * 1001}),
    ("prompt", {"prompt": ["list"]}),
    ("lyrics", {"lyrics": None}),
    ("lyrics", {"lyrics": "   \n  "}),
    ("lyrics", {"lyrics": "la " * 4000}),
    ("lyrics", {"lyrics": 12}),
    ("duration_s", {"duration_s": "3"}),
    ("duration_s", {"duration_s": 0.5}),
    ("duration_s", {"duration_s": 100000}),
    ("duration_s", {"duration_s": 547}),  # past the longest song the backbone can write (546 s)
    ("duration_s", {"duration_s": True}),
    ("num_tracks", {"num_tracks": 0}),
    ("num_tracks", {"num_tracks": 99}),
    ("num_tracks", {"num_tracks": 1.5}),
    ("seed", {"seed": -1}),
    ("seed", {"seed": "abc"}),
    ("temperature", {"temperature": 0.1}),
    ("temperature", {"temperature": 2}),
    ("temperature", {"temperature": "hot"}),
    ("top_k", {"top_k": 0}),
    ("top_k", {"top_k": 500}),
    ("top_k", {"top_k": 8.5}),
    ("surprise", {"surprise": 1}),
]


@pytest.fixture
def stack(make_stack):
    return make_stack()


def _nothing_queued(stack) -> bool:
    return stack.client.get("/api/v1/jobs").get_json()["jobs"] == [] and stack.redis.zcard("encore:unrouted") == 0


@pytest.mark.parametrize("field,change", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_bad_field_is_400_naming_it(stack, field, change):
    reply = stack.client.post("/api/v1/music", json={**GOOD, **change})
    assert reply.status_code == 400, reply.get_json()
    body = reply.get_json()
    assert body["field"] == field
    assert field in body["error"]
    assert _nothing_queued(stack)


@pytest.mark.parametrize(
    "data,content_type",
    [
        ("not json", "application/json"),
        ("[1, 2]", "application/json"),
        ("mode=vocal", "text/plain"),
        ("", "application/json"),
        ('{"mode": ', "application/json"),
    ],
)
def test_non_json_body_is_400(stack, data, content_type):
    reply = stack.client.post("/api/v1/music", data=data, content_type=content_type)
    assert reply.status_code == 400
    assert reply.get_json()["field"] == "body"
    assert _nothing_queued(stack)


def test_instrumental_needs_no_lyrics_and_good_request_is_accepted(stack):
    reply = stack.client.post("/api/v1/music", json={"mode": "instrumental", "prompt": "calm piano", "duration_s": 2})
    assert reply.status_code == 202
    body = reply.get_json()
    record = stack.job(body["job_id"])
    assert record["params"]["lyrics"] == ""
    assert record["params"]["num_tracks"] == 2 and len(record["tracks"]) == 2
    assert record["params"]["temperature"] == 1.0 and record["params"]["top_k"] == 80


def test_lyrics_are_cleaned_in_the_record(stack):
    reply = stack.client.post("/api/v1/music", json={**GOOD, "lyrics": "ＨＥＬＬＯ|world\u200b★"})
    assert reply.status_code == 202
    assert stack.job(reply.get_json()["job_id"])["params"]["lyrics"] == "HELLO-world"


def test_unknown_job_and_bad_ids_are_404(stack):
    assert stack.client.get("/api/v1/jobs/" + "0" * 32).status_code == 404
    assert stack.client.get("/api/v1/jobs/../../etc/passwd").status_code == 404
    assert stack.client.delete("/api/v1/jobs/nope").status_code == 404
    assert stack.client.get("/api/v1/jobs/nope/tracks/0.mp3").status_code == 404


def test_every_404_names_its_field(stack):
    """An unknown job is `job_id` on every route that takes one (the retry route's named nothing), a file or a
    track that is not there names `file` or `track`; the Khala-compatible routes name theirs too."""
    unknown = "0" * 32
    for method, path in [
        ("get", f"/api/v1/jobs/{unknown}"),
        ("get", f"/api/v1/jobs/{unknown}/events"),
        ("delete", f"/api/v1/jobs/{unknown}"),
        ("post", f"/api/v1/jobs/{unknown}/retry"),
        ("get", f"/api/v1/jobs/{unknown}/video.mp4"),
        ("get", f"/api/v1/jobs/{unknown}/tracks/0.mp3"),
        ("get", f"/job/{unknown}"),
        ("get", f"/job/{unknown}/track/0/mp3"),
    ]:
        reply = getattr(stack.client, method)(path)
        assert reply.status_code == 404 and reply.get_json()["field"] == "job_id", (method, path, reply.get_json())
    job_id = stack.submit_music(duration_s=2.0, num_tracks=2)  # no worker: it waits
    for path, field in [
        (f"/api/v1/jobs/{job_id}/tracks/0.mp3", "track"),  # not done
        (f"/api/v1/jobs/{job_id}/tracks/5.mp3", "track"),
        (f"/api/v1/jobs/{job_id}/tracks/x.mp3", "file"),
        (f"/job/{job_id}/track/0/ogg", "format"),
        (f"/job/{job_id}/track/0/mp3", "index"),  # not ready
    ]:
        reply = stack.client.get(path)
        assert reply.status_code == 404 and reply.get_json()["field"] == field, (path, reply.get_json())


def test_job_waits_without_workers_and_status_says_so(stack):
    job_id = stack.submit_music(num_tracks=2)
    record = stack.job(job_id)
    assert record["state"] == "queued"
    assert [t["queue_position"] for t in record["tracks"]] == [1, 2]
    assert all(t["detail"] == "waiting for a worker" for t in record["tracks"])
    status = stack.client.get("/api/v1/status").get_json()
    assert status["unrouted"] == 2 and status["workers"] == []


def test_healthz(stack):
    assert stack.client.get("/healthz").get_json() == {"web": "ok", "redis": "ok"}


def test_wrong_method_is_json_405(stack):
    reply = stack.client.get("/api/v1/music")
    assert reply.status_code == 405 and "error" in reply.get_json()
