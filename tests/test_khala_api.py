"""Contract tests of the Khala reference backend's HTTP API, served by Encore over its own job machinery."""

from __future__ import annotations

import re

import pytest
import requests

from harness.processes import LONGEST_WAIT_S, wait_until
from harness.stack import REFERENCE_ENGINE

pytestmark = pytest.mark.slow  # whole Khala-style jobs, one to the song's end (~155 s here)

SONG = {
    "mode": "vocal",
    "prompt_mode": "tags",
    "tags": "synthpop, female vocal",
    "prompt": "",
    "lyrics": "[verse]\nＨｅｌｌｏ｜world\n",
    "duration": 1,
    "top_k_bb": 50,
    "temperature": 1,
}
# Facts of the reference (github.com/Khala-Music-AI/Khala): backend/tags.json's groups, their labels and sizes;
# the selection frontend/src/App.tsx starts with (its `selectedTags` state, by group: TAG_KEY_TO_CATEGORY), which
# it sends joined with ", " in group order; and its MAX_TAGS_PER_CATEGORY.
REFERENCE_GROUPS = {
    "genre_style": ("流派/风格 (Genre/Style)", 69),
    "vocal_instrument": ("人声/乐器 (Vocals/Instruments)", 56),
    "emotion_mood": ("情感/氛围 (Emotion/Mood)", 33),
    "production_other": ("节奏/制作/其他 (Rhythm/Production/Other)", 39),
}
FRONTEND_DEFAULT_SELECTION = {
    "genre_style": ["Mandopop"],
    "vocal_instrument": ["Female Vocals", "Acoustic Guitar", "Piano"],
    "emotion_mood": ["Atmospheric"],
    "production_other": ["Modern Production"],
}
FRONTEND_MAX_TAGS_PER_GROUP = 10
TRACK_STATUSES = {"queued", "generating", "superres", "decoding", "done", "error"}
WORKER_PHASES = {"idle", "loading_backbone", "backbone", "loading_superres", "superres", "loading_decoder", "decoding"}
PHASE_DISPLAY = re.compile(
    r"^(Queued|Loading backbone model\.\.\.|Loading super-resolution model\.\.\."
    r"|Loading decoder model\.\.\.|Backbone generating · \d+%( · \d+ tok/s · \d+ tokens)?"
    r"|Super-Resolution Generating · \d+%|Decoding audio\.\.\.|Done|Error)$"
)


def _check_job_shape(body: dict) -> None:
    assert set(body) == {"job_id", "status", "queue_position", "cleaned_lyrics", "created_at", "tracks"}
    assert body["status"] in {"queued", "pending", "generating", "completed", "partial"}
    assert isinstance(body["queue_position"], int) and len(body["tracks"]) == 2
    for index, track in enumerate(body["tracks"]):
        assert set(track) == {
            "index",
            "status",
            "progress",
            "phase_display",
            "worker_id",
            "worker_phase",
            "duration_sec",
            "error",
        }
        assert track["index"] == index and track["status"] in TRACK_STATUSES
        assert isinstance(track["progress"], int) and 0 <= track["progress"] <= 100
        assert track["worker_phase"] in WORKER_PHASES and PHASE_DISPLAY.match(track["phase_display"]), track
        assert track["duration_sec"] in (0, 60)  # 0 until the backbone has written the song (as the reference)


@pytest.mark.parametrize("prefix", ["", "/api"])
def test_tags_status_and_a_whole_job(make_stack, prefix):
    stack = make_stack()
    stack.start_worker(0)
    base = stack.base_url + prefix
    tags = requests.get(f"{base}/tags", timeout=5).json()
    assert set(tags) == {"genre_style", "vocal_instrument", "emotion_mood", "production_other"}
    assert all(
        isinstance(g["label"], str) and g["tags"] and all(isinstance(t, str) for t in g["tags"]) for g in tags.values()
    )
    status = requests.get(f"{base}/status", timeout=5).json()
    assert status == {
        "total_gpus": 1,
        "idle_gpus": 1,
        "active_jobs": 0,
        "queued_jobs": 0,
        "workers": [{"worker_id": status["workers"][0]["worker_id"], "status": "idle", "phase": "idle", "gpu_id": 0}],
    }

    reply = requests.post(f"{base}/generate", json={**SONG, "unknown_field": True}, timeout=10)
    assert reply.status_code == 200, reply.text
    accepted = reply.json()
    assert accepted["status"] == "accepted" and accepted["num_tracks"] == 2
    assert set(accepted) == {"status", "job_id", "num_tracks", "queue_position"}
    job_id = accepted["job_id"]

    seen: list[dict] = []

    def finished():
        body = requests.get(f"{base}/job/{job_id}", timeout=5).json()
        _check_job_shape(body)
        seen.append(body)
        return body if body["status"] in ("completed", "partial") else None

    final = wait_until(finished, 240, 0.05, "job to complete")
    assert final["status"] == "completed" and final["cleaned_lyrics"] == "[verse]\nHello｜world"  # the reference's
    assert [t["duration_sec"] for t in final["tracks"]] == [60, 60]
    assert [t["status"] for t in final["tracks"]] == ["done", "done"]
    assert all(t["progress"] == 100 and t["phase_display"] == "Done" and t["error"] is None for t in final["tracks"])
    observed = {t["status"] for body in seen for t in body["tracks"]}
    assert "generating" in observed and any(body["status"] == "generating" for body in seen)
    running = [t for body in seen for t in body["tracks"] if t["status"] == "generating"]
    assert all(t["worker_id"] and t["worker_id"].startswith("gpu0@") for t in running)

    mp3 = requests.get(f"{base}/job/{job_id}/track/1/mp3", headers={"Range": "bytes=10-109"}, timeout=10)
    assert mp3.status_code == 206 and len(mp3.content) == 100
    assert mp3.headers["Content-Type"] == "audio/mpeg" and mp3.headers["Content-Disposition"].startswith("inline")
    wav = requests.get(f"{base}/job/{job_id}/track/0/wav", timeout=10)
    assert wav.status_code == 200 and wav.headers["Content-Type"] == "audio/wav" and wav.content[:4] == b"RIFF"
    assert re.match(r'attachment; filename="?[\w.-]+\.wav"?$', wav.headers["Content-Disposition"])
    out_of_range = requests.get(f"{base}/job/{job_id}/track/2/mp3", timeout=5)
    assert out_of_range.status_code == 400 and "error" in out_of_range.json()
    native = stack.job(job_id)  # an ordinary Encore job
    assert native["kind"] == "music" and native["params"]["num_tracks"] == 2 and native["params"]["top_k"] == 50


def test_rejections_and_queued_jobs(make_stack):
    stack = make_stack()  # no worker: submitted jobs wait
    client = stack.client
    cases = [
        ({"mode": "opera"}, "mode"),
        ({"prompt_mode": "poem"}, "prompt_mode"),
        ({"duration": 2.5}, "duration"),
        ({"duration": "two"}, "duration"),
        ({"duration": True}, "duration"),
        ({"top_k_bb": [1]}, "top_k_bb"),
        ({"temperature": "hot"}, "temperature"),
        ({"lyrics": ""}, "lyrics"),
        ({"tags": ""}, "tags"),
        ({"prompt_mode": "natural", "prompt": ""}, "prompt"),
    ]
    for change, field in cases:
        reply = client.post("/generate", json={**SONG, **change})
        assert 400 <= reply.status_code < 500, (change, reply.get_json())
        body = reply.get_json()
        # the reference's shape (status, error), with the field named as Encore's own errors name it
        assert set(body) == {"status", "error", "field"} and body["status"] == "error", body
        assert body["field"] == field and body["error"].startswith(f"{field}: "), body
    for data in ("not json", "[1, 2]"):  # a body that is no JSON object names `body`, as the native routes do
        reply = client.post("/generate", data=data, content_type="application/json")
        body = reply.get_json()
        assert reply.status_code == 400 and body["status"] == "error" and body["field"] == "body", body
        assert body["error"].startswith("body: "), body
    assert client.get("/api/v1/jobs").get_json()["jobs"] == []

    accepted = client.post("/generate", json={**SONG, "mode": "instrumental", "lyrics": None}).get_json()
    assert accepted["status"] == "queued" and accepted["queue_position"] == 1
    body = client.get(f"/job/{accepted['job_id']}").get_json()
    _check_job_shape(body)
    assert body["status"] == "queued" and body["queue_position"] == 1 and body["cleaned_lyrics"] == ""
    assert [t["phase_display"] for t in body["tracks"]] == ["Queued", "Queued"]  # as the reference says it
    assert client.get(f"/job/{accepted['job_id']}/track/0/mp3").status_code == 404
    missing = client.get("/job/" + "0" * 32)
    assert missing.status_code == 404 and missing.get_json() == {
        "status": "error",
        "error": f"Job {'0' * 32} not found.",
        "field": "job_id",
    }

    longest = client.post("/generate", json={**SONG, "duration": 10}).get_json()
    assert longest["status"] == "queued"  # 10 minutes: the reference accepts it and stops at its token cap
    assert stack.job(longest["job_id"])["params"]["duration_s"] == 546.0 == stack.settings.music().max_duration_s

    assert client.delete(f"/api/v1/jobs/{accepted['job_id']}").status_code == 200
    canceled = client.get(f"/job/{accepted['job_id']}").get_json()
    assert [t["status"] for t in canceled["tracks"]] == ["error", "error"]
    assert all(t["phase_display"] == "Error" for t in canceled["tracks"]) and canceled["status"] == "partial"
    assert all("cancel" in t["error"] for t in canceled["tracks"]), canceled  # why it ended `error`, not null


def test_numbers_are_clamped_to_the_reference_ranges_not_refused(make_stack):
    stack = make_stack()
    cases = [
        ({"duration": 0}, 60.0, 80, 1.0),
        ({"duration": 11, "top_k_bb": 0}, 546.0, 1, 1.0),
        ({"duration": "2", "top_k_bb": 999, "temperature": 0.1}, 120.0, 200, 0.6),
        ({"duration": 3.0, "temperature": 7}, 180.0, 80, 1.4),
        ({}, 180.0, 80, 1.0),
    ]  # the default: 3 min
    for change, duration_s, top_k, temperature in cases:
        base = {k: v for k, v in SONG.items() if k not in ("duration", "top_k_bb", "temperature")}
        reply = stack.client.post("/generate", json={**base, **change})
        assert reply.status_code == 200, (change, reply.get_json())
        params = stack.job(reply.get_json()["job_id"])["params"]
        assert (params["duration_s"], params["top_k"], params["temperature"]) == (duration_s, top_k, temperature)


def test_khala_errors_say_status_error_even_401(make_stack):
    stack = make_stack(API_TOKEN="tok")
    for path in ("/generate", "/api/generate"):
        reply = stack.client.post(path, json=SONG)
        assert reply.status_code == 401 and reply.get_json()["status"] == "error", reply.get_json()
    assert "status" not in stack.client.get("/api/v1/status").get_json()  # the native API's shape is its own


def test_a_track_whose_worker_is_offline_says_so():
    from app.http.khala import job_reply

    track = {
        "track": 0,
        "state": "backbone",
        "stage": "backbone",
        "detail": "12/100 tokens · 30 tok/s",
        "progress": 0.12,
        "worker": "gpu0@a",
        "worker_status": "offline",
        "stages": {},
        "queue_position": 0,
        "error": "",
    }
    record = {
        "job_id": "a" * 32,
        "params": {"lyrics": ""},
        "created_at": 0.0,
        "queue_position": 0,
        "tracks": [track, {**track, "track": 1, "worker_status": "busy"}],
    }
    offline, live = job_reply(record)["tracks"]
    # 12 % of the backbone, three quarters of the whole track (khala.STAGE_SHARES): 9 %
    assert offline["phase_display"].startswith("Worker gpu0@a offline") and offline["progress"] == 9
    assert live["phase_display"] == "Backbone generating · 9% · 30 tok/s · 12 tokens"
    # No live worker serves the job's queues (the record's `worker_offline`): a running track says so, and so
    # does a queued one, instead of a plain "Queued" or a frozen rate (issue 24 item 3).
    queued = {**track, "track": 1, "state": "queued", "stage": "", "worker": "", "worker_status": None}
    offline, waiting = job_reply({**record, "tracks": [track, queued]}, worker_offline=True)["tracks"]
    assert offline["phase_display"].startswith("Worker gpu0@a offline")
    assert waiting["phase_display"] == "Queued · no worker is online: it starts when one is back"
    running = job_reply({**record, "tracks": [{**track, "worker_status": "busy"}]}, worker_offline=True)["tracks"]
    assert running[0]["phase_display"] == "No worker is online · backbone resumes when one is back"
    assert job_reply({**record, "tracks": [queued]})["tracks"][0]["phase_display"] == "Queued"


def test_failed_tracks_end_as_error(make_stack):
    stack = make_stack(ENCORE_TIME_LIMITS="backbone=/2", ENCORE_PRELOAD="1", **REFERENCE_ENGINE)
    stack.start_worker(0)
    job_id = stack.client.post("/generate", json=SONG).get_json()["job_id"]
    body = wait_until(
        lambda: (lambda b: b if b["status"] in ("completed", "partial") else None)(
            stack.client.get(f"/job/{job_id}").get_json()
        ),
        120,
        0.1,
        "job end",
    )
    assert [t["status"] for t in body["tracks"]] == ["error", "error"]
    assert all("time limit" in t["error"] for t in body["tracks"])
    # in `error`, where the reference backend puts a failed track's reason; the other fields as it says them
    assert all(t["phase_display"] == "Error" and t["progress"] == 0 for t in body["tracks"]), body
    assert [t["error"] for t in body["tracks"]] == [t["error"] for t in stack.job(job_id)["tracks"]]
    assert stack.client.get(f"/api/job/{job_id}").get_json()["tracks"] == body["tracks"]  # both mounts say it


def test_the_catalogue_is_the_references_and_holds_the_frontends_default_selection(make_stack):
    stack = make_stack()  # no worker: accepted jobs wait
    for path in ("/tags", "/api/tags"):
        catalogue = stack.client.get(path).get_json()
        assert {group: (g["label"], len(g["tags"])) for group, g in catalogue.items()} == REFERENCE_GROUPS
        for group, names in FRONTEND_DEFAULT_SELECTION.items():
            assert set(names) <= set(catalogue[group]["tags"]), (path, group, names)
    default = ", ".join(name for names in FRONTEND_DEFAULT_SELECTION.values() for name in names)
    longest = ", ".join(  # the longest selection the frontend lets a user make
        name for g in catalogue.values() for name in sorted(g["tags"], key=len)[-FRONTEND_MAX_TAGS_PER_GROUP:]
    )
    for tags in (default, longest, "sea shanty, kazoo"):  # listed or not, as the reference takes them
        reply = stack.client.post("/api/generate", json={**SONG, "tags": tags})
        assert reply.status_code == 200, (tags, reply.get_json())
        assert stack.job(reply.get_json()["job_id"])["params"]["tags"] == tags


FRONTEND_DEFAULT_LYRICS = "\n\n".join(
    f"[{section}]\n"
    + "\n".join(f"{word} in the rhythm, line {n} of the {section.lower()}, we keep the beat alive" for n in range(1, 5))
    for section, word in [
        ("Verse", "Drums"),
        ("Pre-Chorus", "Fire"),
        ("Chorus", "Peace"),
        ("Verse", "Sirens"),
        ("Pre-Chorus", "Ground"),
        ("Chorus", "Peace"),
        ("Bridge", "Torches"),
        ("Chorus", "Peace"),
    ]
)


def test_the_frontends_default_song_runs_to_the_end_on_the_tiny_profile(make_stack):
    """What the reference frontend sends untouched: vocal, a described song, ~1,900 characters of lyrics in
    eight sections, 3 minutes, top_k 40 (the lyrics are ours; the shape, lengths and numbers are the frontend's)."""
    stack = make_stack()
    stack.start_worker(0)
    body = {
        "mode": "vocal",
        "prompt_mode": "natural",
        "tags": "",
        "lyrics": FRONTEND_DEFAULT_LYRICS,
        "prompt": "A warm, mid-tempo groove with a deep bassline, offbeat guitar and a steady drum pattern; "
        "a smooth male vocal carries a message of resilience over the gentle sway.",
        "duration": 3,
        "top_k_bb": 40,
        "temperature": 1.0,
    }
    assert len(FRONTEND_DEFAULT_LYRICS) > 1500
    reply = requests.post(f"{stack.base_url}/api/generate", json=body, timeout=10)
    assert reply.status_code == 200 and reply.json()["status"] == "accepted", reply.text
    job_id = reply.json()["job_id"]

    def finished():
        job = requests.get(f"{stack.base_url}/api/job/{job_id}", timeout=5).json()
        return job if job["status"] in ("completed", "partial", "error", "failed") else None

    final = wait_until(finished, LONGEST_WAIT_S, 0.5, "the 3-minute song")
    assert final["status"] == "completed", final
    assert [t["status"] for t in final["tracks"]] == ["done", "done"]
    assert [t["duration_sec"] for t in final["tracks"]] == [180, 180]
    wav = requests.get(f"{stack.base_url}/api/job/{job_id}/track/0/wav", timeout=30)
    assert wav.status_code == 200 and wav.content[:4] == b"RIFF"
    seconds = (len(wav.content) - 44) / (44100 * 2 * 2)  # 16-bit stereo PCM after a 44-byte header
    assert abs(seconds - 180) < 1.0
