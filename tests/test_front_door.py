"""Hostile requests against the real app (issue 11): each is a 4xx naming the field, never a 5xx, and
nothing is queued. The app talks to a real redis-server; no worker runs here."""

from __future__ import annotations

import json

import pytest

MUSIC = {"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0, "num_tracks": 1}
KHALA = {"mode": "instrumental", "prompt_mode": "tags", "tags": "lo-fi", "duration": 1}


@pytest.fixture
def stack(make_stack):
    return make_stack(API_TOKEN="tok")


AUTH = {"Authorization": "Bearer tok"}


def _post_raw(stack, path: str, raw: str | bytes):
    return stack.client.post(path, data=raw, headers={**AUTH, "Content-Type": "application/json"})


def _nothing_queued(stack) -> None:
    assert stack.client.get("/api/v1/jobs", headers=AUTH).get_json()["jobs"] == []


@pytest.mark.parametrize("path", ["/api/v1/music", "/generate", "/api/generate"])
def test_deeply_nested_json_is_400_before_it_is_parsed(stack, path):
    reply = _post_raw(stack, path, "[" * 50_000 + "]" * 50_000)
    assert reply.status_code == 400 and "nested deeper than 32 levels" in reply.get_json()["error"]
    object_nest = '{"tags": ' + '{"a": ' * 40 + "1" + "}" * 40 + "}"
    assert _post_raw(stack, path, object_nest).status_code == 400
    brackets_in_a_string = json.dumps({**(MUSIC if path == "/api/v1/music" else KHALA), "tags": "[" * 500})
    assert _post_raw(stack, path, brackets_in_a_string).status_code in (202, 200)  # only real nesting counts


@pytest.mark.parametrize("path,body", [("/api/v1/music", MUSIC), ("/generate", KHALA)])
def test_a_number_too_large_for_a_float_is_400_naming_it(stack, path, body):
    raw = json.dumps(body)[:-1] + ', "temperature": 1' + "0" * 400 + "}"
    reply = _post_raw(stack, path, raw)
    assert reply.status_code == 400, reply.get_json()
    assert reply.get_json()["error"].startswith("temperature")
    huge = json.dumps(body)[:-1] + ', "temperature": 1' + "0" * 5000 + "}"  # past Python's int digit limit
    assert _post_raw(stack, path, huge).status_code == 400
    _nothing_queued(stack)


@pytest.mark.parametrize("header", ["Bearer é", "Bearer tok\u00e9", "Bearer \u00ff\u00fe", "Basic é"])
def test_a_non_ascii_authorization_header_is_401(stack, header):
    reply = stack.client.get("/api/v1/status", headers={"Authorization": header})
    assert reply.status_code == 401 and reply.get_json()["field"] == "authorization"
    assert stack.client.get("/api/v1/status", headers=AUTH).status_code == 200


@pytest.mark.parametrize("field", ["tags", "lyrics", "prompt"])
@pytest.mark.parametrize("bad", ["\\ud800", "a\\udfffb", "x\\u0000y", "\\u001b[31m"])
def test_text_the_tokenizer_cannot_take_is_400_naming_the_field(stack, field, bad):
    body = {"mode": "vocal", "tags": "pop", "lyrics": "[verse]\nla la", "duration_s": 2.0, "num_tracks": 1}
    raw = (
        json.dumps(body)[:-1] + f', "{field}": "{bad}"' + "}"
        if field == "prompt"
        else json.dumps(body).replace(json.dumps(body[field]), f'"{bad}"')
    )
    reply = _post_raw(stack, "/api/v1/music", raw)
    assert reply.status_code == 400, reply.get_json()
    assert reply.get_json()["field"] == field and "U+" in reply.get_json()["error"]
    _nothing_queued(stack)


def test_lyrics_keep_their_line_breaks_and_tabs(stack):
    body = {"mode": "vocal", "tags": "pop", "lyrics": "[verse]\r\nla\tla\nla", "duration_s": 2.0, "num_tracks": 1}
    assert _post_raw(stack, "/api/v1/music", json.dumps(body)).status_code == 202


@pytest.mark.parametrize(
    "method,path,allowed",
    [
        ("TRACE", "/api/v1/music", "POST"),
        ("PUT", "/api/v1/jobs/" + "a" * 32, "DELETE, GET"),
        ("DELETE", "/generate", "POST"),
    ],
)
def test_405_says_which_methods_are_allowed(stack, method, path, allowed):
    reply = stack.client.open(path, method=method, headers=AUTH)
    assert reply.status_code == 405 and reply.get_json()["error"]
    assert set(reply.headers["Allow"].split(", ")) >= set(allowed.split(", "))


@pytest.mark.parametrize("name", ["0.mp3%0a", "%D9%A0.mp3", "000.mp3", "01.wav", "0.mp3.", "0.MP3", "1000.mp3"])
def test_track_file_names_are_matched_exactly(stack, name):
    reply = stack.client.get(f"/api/v1/jobs/{'a' * 32}/tracks/{name}", headers=AUTH)
    assert reply.status_code == 404 and reply.get_json()["field"] == "file", (name, reply.get_json())
    known = stack.client.get(f"/api/v1/jobs/{'a' * 32}/tracks/0.mp3", headers=AUTH)
    assert known.status_code == 404 and "not found" in known.get_json()["error"]  # the name passed; no such job


def test_metrics_names_one_charset(stack):
    content_type = stack.client.get("/metrics").headers["Content-Type"]
    assert content_type.count("charset") == 1, content_type


def test_a_lipsync_jobs_track_download_says_where_its_result_is(stack):
    svc = stack.app.config["SERVICES"]
    job_id = svc.jobs.create("lipsync", {}, [{}], cost=1.0)
    ids = ["p", "l", "m"]
    assert svc.jobs.route(job_id, 0, "gpu0", ids)
    for task_id, stage in zip(ids, ("prepare", "lipsync", "mux"), strict=True):  # the transitions a worker makes
        owner = f"gpu0@x|{task_id}|1"
        assert svc.jobs.transition(
            "start", job_id, 0, stage=stage, owner=owner, task_id=task_id, worker="gpu0@x", lease_ms=60_000
        )
        assert svc.jobs.transition("finish", job_id, 0, {"artifacts": ["output.mp4"]}, stage=stage, owner=owner)
    reply = stack.client.get(f"/api/v1/jobs/{job_id}/tracks/0.mp3", headers=AUTH)
    assert reply.status_code == 404
    assert reply.get_json()["error"] == (
        f"track 0 has no file track0.mp3 (a lip-sync job: its result is /api/v1/jobs/{job_id}/video.mp4)"
    )


# ---- a job that is accepted can run (item 3)

LONG_LYRICS = "\n".join(["[verse]"] + ["la " * 12] * 110)  # ~4,000 bytes: a prompt of up to ~4,000 tokens


def test_a_song_too_long_for_its_prompt_is_400_with_the_largest_duration(stack):
    profile = stack.settings.music()
    body = {"mode": "vocal", "tags": "pop", "lyrics": LONG_LYRICS, "num_tracks": 1}
    reply = _post_raw(stack, "/api/v1/music", json.dumps({**body, "duration_s": profile.max_duration_s}))
    assert reply.status_code == 400 and reply.get_json()["field"] == "duration_s", reply.get_json()
    error = reply.get_json()["error"]
    largest = float(error.split("at most ")[1].split(" seconds")[0])
    assert 400 < largest < profile.max_duration_s and "25600 positions" in error
    _nothing_queued(stack)
    accepted = _post_raw(stack, "/api/v1/music", json.dumps({**body, "duration_s": largest}))
    assert accepted.status_code == 202, accepted.get_json()
    assert _post_raw(stack, "/api/v1/music", json.dumps({**body, "duration_s": largest + 1})).status_code == 400


def test_every_duration_the_profile_allows_fits_a_short_prompt(stack):
    profile = stack.settings.music()
    assert profile.backbone.max_sequence_length == 25_600  # the real model's --inference-max-seq-length
    body = {
        "mode": "vocal",
        "tags": "pop",
        "lyrics": "[verse]\nla la",
        "num_tracks": 1,
        "duration_s": profile.max_duration_s,
    }
    assert _post_raw(stack, "/api/v1/music", json.dumps(body)).status_code == 202


@pytest.mark.parametrize("path", ["/generate", "/api/generate"])
def test_the_khala_layer_clamps_a_long_song_to_what_its_prompt_leaves_room_for(stack, path):
    body = {"mode": "vocal", "prompt_mode": "tags", "tags": "pop", "lyrics": LONG_LYRICS, "duration": 10}
    reply = _post_raw(stack, path, json.dumps(body))
    assert reply.status_code == 200, reply.get_json()
    duration = stack.client.get(f"/api/v1/jobs/{reply.get_json()['job_id']}", headers=AUTH).get_json()
    too_long = _post_raw(
        stack,
        "/api/v1/music",
        json.dumps(
            {
                "mode": "vocal",
                "tags": "pop",
                "lyrics": LONG_LYRICS,
                "num_tracks": 1,
                "duration_s": duration["params"]["duration_s"] + 1,
            }
        ),
    )
    assert 400 < duration["params"]["duration_s"] < stack.settings.music().max_duration_s
    assert too_long.status_code == 400 and too_long.get_json()["field"] == "duration_s"


@pytest.fixture
def lipsync_stack(make_stack):
    return make_stack(API_TOKEN="tok", ENCORE_MAX_VIDEO_PIXELS=str(200 * 200), ENCORE_MIN_VIDEO_S="0.5")


def _upload(stack, video, audio):
    with open(video, "rb") as v, open(audio, "rb") as a:
        return stack.client.post(
            "/api/v1/lipsync",
            headers=AUTH,
            content_type="multipart/form-data",
            data={"video": (v, video.name), "audio": (a, audio.name)},
        )


def test_a_video_larger_than_the_pixel_limit_is_400_from_its_probe(lipsync_stack, tmp_path):
    from harness.media import face_video, tone

    audio = tone(tmp_path / "a.wav", 1.0)
    reply = _upload(lipsync_stack, face_video(tmp_path / "big.mp4", 1.0, size=256), audio)
    assert reply.status_code == 400 and reply.get_json()["field"] == "video", reply.get_json()
    assert "256x256 (65536 pixels); the limit is 40000 pixels" in reply.get_json()["error"]
    _nothing_queued(lipsync_stack)
    assert _upload(lipsync_stack, face_video(tmp_path / "ok.mp4", 1.0, size=192), audio).status_code == 202


def test_a_driving_audio_shorter_than_the_minimum_is_400(lipsync_stack, tmp_path):
    from harness.media import face_video, tone

    video = face_video(tmp_path / "v.mp4", 1.0, size=192)
    reply = _upload(lipsync_stack, video, tone(tmp_path / "short.wav", 0.1))
    assert reply.status_code == 400 and reply.get_json()["field"] == "audio", reply.get_json()
    assert "at least 0.5 s needed" in reply.get_json()["error"]
    _nothing_queued(lipsync_stack)
    assert _upload(lipsync_stack, video, tone(tmp_path / "ok.wav", 0.6)).status_code == 202


def test_the_default_upload_limits():
    from app.core.config import Settings

    settings = Settings()
    assert settings.max_video_pixels == 4096 * 2160 and settings.min_audio_s == 0.5


def test_a_form_with_too_many_parts_or_a_huge_field_is_413_naming_the_body(lipsync_stack, tmp_path):
    from harness.media import face_video, tone

    video, audio = face_video(tmp_path / "v.mp4", 1.0, size=192), tone(tmp_path / "a.wav", 1.0)
    with open(video, "rb") as v, open(audio, "rb") as a:
        data = {"video": (v, video.name), "audio": (a, audio.name), **{f"x{i}": "1" for i in range(40)}}
        many = lipsync_stack.client.post("/api/v1/lipsync", headers=AUTH, content_type="multipart/form-data", data=data)
    assert many.status_code == 413 and many.get_json()["field"] == "body", many.get_json()
    assert "at most 16 form parts" in many.get_json()["error"]
    with open(video, "rb") as v, open(audio, "rb") as a:
        huge = lipsync_stack.client.post(
            "/api/v1/lipsync",
            headers=AUTH,
            content_type="multipart/form-data",
            data={"video": (v, video.name), "audio": (a, audio.name), "fps": "2" * 600_000},
        )
    assert huge.status_code == 413 and huge.get_json()["field"] == "body", huge.get_json()
    _nothing_queued(lipsync_stack)
