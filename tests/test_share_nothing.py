"""Hosts that share nothing (issue 15, item 3): two workers, each with its own local directories, that see
only Redis and an S3 bucket (the real SeaweedFS server of the `s3_endpoint` fixture). A job whose tracks land
on both completes and the web serves it from the bucket; killing one worker host mid-stage moves its track to
the other, which resumes it from the bucket."""

from __future__ import annotations

import uuid

import pytest

from harness.processes import wait_until
from harness.stack import REFERENCE_ENGINE, S3_ENV

pytestmark = pytest.mark.slow  # two hosts' workers, one killed (~27 s here)


def host(stack, gpu: int) -> dict[str, str]:
    """One host's own directories: nothing under them is visible to the other worker or to the web."""
    root = stack.root / f"host{gpu}"
    return {
        "ENCORE_WORKER_CACHE_DIR": str(root / "cache"),
        "ENCORE_ARTIFACT_DIR": str(root / "unused"),
        "ENCORE_UPLOAD_DIR": str(root / "uploads"),
        "ENCORE_LOG_DIR": str(stack.root / "logs"),
    }


def test_a_job_across_two_hosts_completes_and_a_dead_hosts_track_moves(make_stack, s3_endpoint):
    stack = make_stack(
        **S3_ENV,
        ENCORE_S3_ENDPOINT=s3_endpoint,
        ENCORE_S3_PREFIX=f"nothing-{uuid.uuid4().hex[:8]}/",
        ENCORE_LEASE_S="3",
        ENCORE_REROUTE_AFTER_S="1",
        ENCORE_PRELOAD="1",
        **REFERENCE_ENGINE,
    )
    for gpu in (0, 1):
        stack.start_worker(gpu, **host(stack, gpu))
    job_id = stack.submit_music(duration_s=2.0, num_tracks=2)
    record = stack.wait_job(job_id, timeout=180)
    assert record["state"] == "done", record
    assert {t["queue"] for t in record["tracks"]} == {"gpu0", "gpu1"}  # one track on each host
    for track in record["tracks"]:
        assert stack.client.get(f"/api/v1/jobs/{job_id}/tracks/{track['track']}.mp3").status_code == 200
    assert not any((stack.root / f"host{gpu}" / "unused").exists() for gpu in (0, 1))  # no shared directory used

    long_job = stack.submit_music(duration_s=40.0)
    running = wait_until(
        lambda: (lambda t: t if t["state"] == "backbone" and t["progress"] > 0 else None)(
            stack.job(long_job)["tracks"][0]
        ),
        60,
        0.1,
        "the long job's backbone",
    )
    doomed = int(running["queue"].removeprefix("gpu"))
    stack.stop_worker(doomed)  # the whole host: kill -9 of its worker's process group
    record = stack.wait_job(long_job, timeout=240)
    track = record["tracks"][0]
    assert record["state"] == "done" and track["queue"] == f"gpu{1 - doomed}" and track["restarts"] == 1, record
    assert track["stages"]["export"]["worker"].startswith(f"gpu{1 - doomed}@")
    assert stack.client.get(f"/api/v1/jobs/{long_job}/tracks/0.wav").status_code == 200
