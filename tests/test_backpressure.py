"""Back-pressure and quotas (issue 14, item 4), against a real Redis and real workers: a submit that would pass a
cap on open tracks is 429 with a Retry-After from the ETA and creates nothing, on the native routes and the
Khala-compatible one; the per-token submit rate limit is 429 with the standard headers, per token, shared by
the submit routes."""

from __future__ import annotations

import math

import pytest

from harness import media
from harness.processes import wait_until
from harness.stack import REFERENCE_ENGINE

MUSIC = {"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0, "num_tracks": 1, "seed": 3}
KHALA = {"mode": "instrumental", "prompt_mode": "tags", "tags": "lo-fi", "duration": 1}
LONG_S = 120.0  # long enough on the reference engine that the first job is still open while the test acts


def job_count(stack) -> int:
    return stack.redis.zcard("encore:jobs")


def retry_after(reply) -> int:
    value = reply.headers["Retry-After"]
    assert value.isdigit() and int(value) >= 1, value  # a positive whole number of seconds
    return int(value)


@pytest.mark.slow  # jobs on a worker (~6 s here)
def test_a_submit_past_the_total_cap_is_429_with_a_retry_after_from_the_eta(make_stack, tmp_path):
    stack = make_stack(ENCORE_MAX_QUEUED_TRACKS="2", ENCORE_MIN_VIDEO_S="0.5", **REFERENCE_ENGINE)
    stack.start_worker(0)
    first = stack.client.post("/api/v1/music", json={**MUSIC, "num_tracks": 2, "duration_s": LONG_S})
    assert first.status_code == 202, first.get_json()
    job_id = first.get_json()["job_id"]
    wait_until(lambda: stack.job(job_id)["state"] == "running", 60, what="the first job to start")

    refused = stack.client.post("/api/v1/music", json=MUSIC)
    assert refused.status_code == 429, refused.get_json()
    body = refused.get_json()
    assert body["field"] == "queue" and "2 tracks are open" in body["error"] and "at most 2" in body["error"]
    eta = stack.job(job_id)["eta_s"]
    wait = retry_after(refused)
    # One track must end first: the first of the job's two, which the schedule puts at about half its ETA.
    assert eta > 0 and eta / 4 <= wait <= math.ceil(eta) + 1, (wait, eta)

    khala = stack.client.post("/generate", json=KHALA)
    assert khala.status_code == 429 and khala.get_json()["status"] == "error", khala.get_json()
    retry_after(khala)
    video = media.face_video(tmp_path / "v.mp4", 1.0, size=192)
    audio = media.tone(tmp_path / "a.wav", 1.0)
    lipsync = media.upload(stack.client, video, audio)
    assert lipsync.status_code == 429, lipsync.get_json()
    retry_after(lipsync)
    assert job_count(stack) == 1  # no refused job was created
    assert [p for p in (stack.root / "uploads").rglob("*") if p.is_file()] == []  # nor did its upload stay

    assert stack.client.delete(f"/api/v1/jobs/{job_id}").status_code == 200
    stack.wait_job(job_id, timeout=30)
    assert stack.client.post("/api/v1/music", json=MUSIC).status_code == 202  # room again


def test_the_per_queue_cap_refuses_when_every_live_queue_is_full(make_stack):
    stack = make_stack(ENCORE_MAX_QUEUED_TRACKS_PER_QUEUE="1", **REFERENCE_ENGINE)
    parked = stack.client.post("/api/v1/music", json=MUSIC)  # no live queue: the cap does not apply, it parks
    assert parked.status_code == 202 and parked.get_json()["eta_s"] is None
    assert stack.client.delete(f"/api/v1/jobs/{parked.get_json()['job_id']}").status_code == 200
    stack.start_worker(0)
    first = stack.client.post("/api/v1/music", json={**MUSIC, "duration_s": LONG_S})
    assert first.status_code == 202 and first.get_json()["eta_s"] > 0, first.get_json()
    refused = stack.client.post("/api/v1/music", json=MUSIC)
    assert refused.status_code == 429 and "every GPU queue holds its 1 open tracks" in refused.get_json()["error"]
    assert 1 <= retry_after(refused) <= math.ceil(stack.job(first.get_json()["job_id"])["eta_s"]) + 1
    assert job_count(stack) == 2
    stack.client.delete(f"/api/v1/jobs/{first.get_json()['job_id']}")
    stack.wait_job(first.get_json()["job_id"], timeout=30)
    assert stack.client.post("/api/v1/music", json=MUSIC).status_code == 202


@pytest.fixture
def limited(make_stack):
    """Two tokens, two submits a minute each (a moving window: no window edge can reset it mid-test)."""
    return make_stack(
        API_TOKEN="alpha,beta", ENCORE_SUBMIT_RATE_LIMIT="2/minute", ENCORE_RATE_LIMIT_STRATEGY="moving-window"
    )


def test_the_rate_limit_is_429_with_its_headers_per_token_across_the_submit_routes(limited):
    alpha, beta = {"Authorization": "Bearer alpha"}, {"Authorization": "Bearer beta"}
    replies = [limited.client.post("/api/v1/music", json=MUSIC, headers=alpha) for _ in range(2)]
    assert [r.status_code for r in replies] == [202, 202]
    assert [r.headers["X-RateLimit-Remaining"] for r in replies] == ["1", "0"]
    assert all(r.headers["X-RateLimit-Limit"] == "2" for r in replies)

    refused = limited.client.post("/generate", json=KHALA, headers=alpha)  # the limit is shared by the routes
    assert refused.status_code == 429, refused.get_json()
    assert refused.get_json()["status"] == "error" and "rate limit" in refused.get_json()["error"]
    assert 1 <= retry_after(refused) <= 60
    assert refused.headers["X-RateLimit-Limit"] == "2" and refused.headers["X-RateLimit-Remaining"] == "0"
    assert int(refused.headers["X-RateLimit-Reset"]) > 0
    native = limited.client.post("/api/v1/music", json=MUSIC, headers=alpha)
    assert native.status_code == 429 and native.get_json()["field"] == "authorization"
    assert job_count(limited) == 2

    assert limited.client.post("/api/v1/music", json=MUSIC, headers=beta).status_code == 202  # its own window
    assert limited.client.post("/api/v1/music", json=MUSIC, headers={"Authorization": "Bearer x"}).status_code == 401
    status = limited.client.get("/api/v1/jobs", headers=alpha)
    assert status.status_code == 200 and "X-RateLimit-Limit" not in status.headers  # only submits are limited
    assert list(limited.redis.scan_iter("encore:ratelimit:*"))  # its windows live in Redis, under the prefix


def test_a_submit_past_the_rate_is_refused_before_its_body_is_read(limited):
    """The limit is the submit views' first step: a spent window refuses a body that would be 400, unread."""
    alpha = {"Authorization": "Bearer alpha"}
    assert [limited.client.post("/api/v1/music", json=MUSIC, headers=alpha).status_code for _ in range(2)] == [202] * 2
    garbled = {"content_type": "multipart/form-data; boundary=x", "data": b"not a form", "headers": alpha}
    lipsync = limited.client.post("/api/v1/lipsync", **garbled)
    music = limited.client.post("/api/v1/music", data=b"{not json", content_type="application/json", headers=alpha)
    for refused in (lipsync, music):
        assert refused.status_code == 429 and refused.get_json()["field"] == "authorization", refused.get_json()
        assert refused.get_json()["error"].startswith("rate limit: this tenant's submissions are limited to 2 per")
        assert refused.headers["X-RateLimit-Remaining"] == "0" and 1 <= retry_after(refused) <= 60


def test_the_openapi_document_lists_the_429s_and_their_headers(make_stack):
    spec = make_stack().client.get("/api/v1/openapi.json").get_json()
    for path in ("/api/v1/music", "/api/v1/lipsync", "/generate", "/api/generate"):
        headers = spec["paths"][path]["post"]["responses"]["429"]["headers"]
        assert headers["Retry-After"]["required"] is True and "X-RateLimit-Remaining" in headers, path
    assert "429" not in spec["paths"]["/api/v1/jobs/{job_id}"]["get"]["responses"]  # only the submits
