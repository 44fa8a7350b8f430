"""Retry (issue 14, item 8): POST /api/v1/jobs/<id>/retry re-runs a job's failed or canceled tracks from their
first unfinished stage, with the same seed, counted in the record; real Redis, real workers."""

from __future__ import annotations

import pytest

from harness.cli import cli

pytestmark = pytest.mark.slow  # failed and canceled jobs run again on workers (~30 s here)


def test_a_failed_track_runs_again_from_its_first_unfinished_stage(make_stack):
    """The export stage fails (the worker's ffmpeg is missing); after a retry on a worker that has one, only
    export runs again: the earlier stages keep their times, and the track is done with `retries` 1."""
    stack = make_stack()
    stack.start_worker(0, ENCORE_FFMPEG="/nonexistent/ffmpeg")
    job_id = stack.submit_music(duration_s=2.0, seed=11)
    failed = stack.wait_job(job_id, timeout=120)
    track = failed["tracks"][0]
    assert failed["state"] == "failed" and "ffmpeg" in track["error"] and track["retries"] == 0
    assert [name for name, s in track["stages"].items() if s.get("finished_at")] == ["backbone", "superres", "decode"]
    early = {name: track["stages"][name]["started_at"] for name in ("backbone", "superres", "decode")}
    stack.stop_worker(0)

    refused = stack.client.post(f"/api/v1/jobs/{job_id}x/retry", headers=stack.auth)
    assert refused.status_code == 404
    reply = stack.client.post(f"/api/v1/jobs/{job_id}/retry", headers=stack.auth)
    assert reply.status_code == 200, reply.get_json()
    body = reply.get_json()
    assert body["retried"] == [0] and body["tracks"][0]["retries"] == 1 and body["state"] == "queued"
    assert body["tracks"][0]["error"] == "" and body["tracks"][0]["stages"].keys() == early.keys()
    again = stack.client.post(f"/api/v1/jobs/{job_id}/retry", headers=stack.auth)
    assert again.status_code == 409 and again.get_json()["field"] == "job"  # still open: not twice

    stack.start_worker(0)  # parked until a worker is live, then routed
    done = stack.wait_job(job_id, timeout=120)
    track = done["tracks"][0]
    assert done["state"] == "done" and track["retries"] == 1 and track["seed"] == 11
    assert {name: track["stages"][name]["started_at"] for name in early} == early  # not run again
    assert track["stages"]["export"]["finished_at"] > max(early.values())
    assert stack.client.get(f"/api/v1/jobs/{job_id}/tracks/0.mp3", headers=stack.auth).status_code == 200
    nothing = stack.client.post(f"/api/v1/jobs/{job_id}/retry", headers=stack.auth)
    assert nothing.status_code == 409 and "every track is done" in nothing.get_json()["error"]


def test_a_canceled_job_is_retried_and_its_cancel_flag_cleared(make_stack):
    stack = make_stack()
    job_id = stack.submit_music(duration_s=2.0, num_tracks=2)  # no worker: both tracks wait
    assert stack.client.delete(f"/api/v1/jobs/{job_id}", headers=stack.auth).status_code == 200
    canceled = stack.wait_job(job_id, timeout=30)
    assert canceled["state"] == "canceled" and canceled["cancel_requested"] is True
    run = cli(stack, "retry", job_id)  # the CLI, over HTTP
    assert run.returncode == 0 and f"job {job_id}: retrying track(s) 0, 1" in run.stdout, run.stderr
    record = stack.job(job_id)
    assert record["cancel_requested"] is False and [t["status"] for t in record["tracks"]] == ["parked", "parked"]
    stack.start_worker(0)
    done = stack.wait_job(job_id, timeout=180)
    assert done["state"] == "done" and [t["retries"] for t in done["tracks"]] == [1, 1]


def test_retries_of_a_track_stop_at_the_servers_limit(make_stack):
    """55 of 55 retries were accepted: each costs GPU time again. Past ENCORE_MAX_RETRIES the retry is refused
    (403 naming `retries`) and nothing is queued; the earlier ones went through."""
    stack = make_stack(ENCORE_MAX_RETRIES="2")
    job_id = stack.submit_music(duration_s=2.0)  # no worker: the track waits, and is canceled each round
    for attempt in (1, 2):
        assert stack.client.delete(f"/api/v1/jobs/{job_id}", headers=stack.auth).status_code == 200
        assert stack.wait_job(job_id, timeout=30)["state"] == "canceled"
        reply = stack.client.post(f"/api/v1/jobs/{job_id}/retry", headers=stack.auth)
        assert reply.status_code == 200 and reply.get_json()["tracks"][0]["retries"] == attempt, reply.get_json()
    assert stack.client.delete(f"/api/v1/jobs/{job_id}", headers=stack.auth).status_code == 200
    assert stack.wait_job(job_id, timeout=30)["state"] == "canceled"
    refused = stack.client.post(f"/api/v1/jobs/{job_id}/retry", headers=stack.auth)
    assert refused.status_code == 403 and refused.get_json()["field"] == "retries", refused.get_json()
    assert "retried 2 times" in refused.get_json()["error"]
    record = stack.job(job_id)
    assert record["state"] == "canceled" and record["tracks"][0]["retries"] == 2
