"""The stage's lease thread (app/tasks/lease_watch.CancelWatch), run for real against real redis-servers: it rides out
a Redis outage while its lease lasts, gives the track up once the lease has gone unrenewed for its whole length,
and on any other error stops the stage loudly instead of letting it run on with a lease nobody renews (the
reaper would then start the same stage a second time elsewhere). Also its progress throttle, which writes what the
lease thread guards."""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import redis

from app.core.config import Settings
from app.pipeline.control import Canceled, StageControl
from app.control.services import Services, build_services
from app.tasks.lease_watch import CancelWatch, LeaseWatchBroken  # not app.tasks.music: see conftest
from app.tasks.progress import ThrottledProgress
from harness.processes import PYTHON, REPO, RedisServer, wait_until

OWNER = "gpu0@host|task-1|4242"


def leased_track(svc: Services) -> str:
    """A one-track music job whose backbone stage `OWNER` started (so holds the track's lease), through the
    transitions themselves."""
    job_id = svc.jobs.create("music", {}, [{"seed": 1}], cost=1.0)
    assert svc.jobs.transition("route", job_id, 0, queue="gpu0", task_ids=json.dumps(["task-1"]), cost=1.0)
    assert svc.jobs.transition(
        "start",
        job_id,
        0,
        stage="backbone",
        owner=OWNER,
        worker="gpu0@host",
        task_id="task-1",
        pid="4242",
        lease_ms=int(svc.settings.lease_s * 1000),
    )
    assert svc.jobs.lease(job_id, 0) == OWNER
    return job_id


def break_lease_key(svc: Services, job_id: str) -> None:
    """The lease key turned into a list: the renewal's GET answers WRONGTYPE, an error that is no outage."""
    key = svc.jobs.lease_key(job_id, 0)
    svc.redis.delete(key)
    svc.redis.rpush(key, "not a lease")


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server of the test's own, killed (-9) and started again on the same port with its data (its
    append-only file), as a restarted Redis comes back."""
    server = RedisServer(tmp_path / "redis", aof=True)
    yield server
    server.stop()


def services_on(url: str, root: Path, lease_s: float) -> Services:
    svc = build_services(
        Settings(redis_url=url, artifact_dir=root / "artifacts", worker_cache_dir=root / "cache", lease_s=lease_s)
    )
    svc.redis.flushdb()
    return svc


def test_an_error_that_is_no_outage_stops_the_stage_at_its_next_cancel_check(redis_base_url, tmp_path):
    svc = services_on(f"{redis_base_url}/507", tmp_path, lease_s=1.5)
    job_id = leased_track(svc)
    with CancelWatch(svc, job_id, 0, grace_s=60, lease_owner=OWNER, stage="backbone") as watch:
        control = StageControl(cancel_requested=watch.canceled.is_set)
        break_lease_key(svc, job_id)
        with pytest.raises(Canceled):  # the work's own loop, checking once per step as every stage does
            wait_until(control.check, 10, 0.05, "the stage to be told to stop")
        assert isinstance(watch.broken, redis.ResponseError) and "WRONGTYPE" in str(watch.broken)
        assert not watch.lost.is_set()  # not taken: broken, which the stage must say
        with pytest.raises(LeaseWatchBroken, match="lease thread failed .*ResponseError.*WRONGTYPE"):
            watch.raise_if_broken()


def test_an_outage_shorter_than_the_lease_is_ridden_out(private_redis, tmp_path):
    svc = services_on(f"{private_redis.url}/0", tmp_path, lease_s=4.0)  # renewed every 1.33 s
    job_id = leased_track(svc)
    with CancelWatch(svc, job_id, 0, grace_s=60, lease_owner=OWNER, stage="backbone") as watch:
        wait_until(lambda: time.monotonic() - watch.renewed_at < 0.5, 5, what="a first renewal")
        private_redis.kill()
        down_since = time.monotonic()
        wait_until(lambda: time.monotonic() - watch.renewed_at > 2.0, 10, what="a renewal due while Redis is down")
        private_redis.start()
        wait_until(lambda: watch.renewed_at > down_since, 10, what="a renewal once Redis is back")
        assert not watch.canceled.is_set() and not watch.lost.is_set() and watch.broken is None
        assert svc.jobs.lease(job_id, 0) == OWNER
        assert svc.redis.pttl(svc.jobs.lease_key(job_id, 0)) > 2000  # renewed, not merely left over


def test_an_outage_as_long_as_the_lease_gives_the_track_up(private_redis, tmp_path):
    svc = services_on(f"{private_redis.url}/0", tmp_path, lease_s=1.5)
    job_id = leased_track(svc)
    with CancelWatch(svc, job_id, 0, grace_s=60, lease_owner=OWNER, stage="backbone") as watch:
        private_redis.kill()
        wait_until(watch.lost.is_set, 15, what="the stage to give its unrenewed track up")
        assert watch.canceled.is_set() and watch.broken is None
        assert time.monotonic() - watch.renewed_at >= 1.5  # not before the lease could have run out


WORK_THAT_IGNORES_THE_STOP = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tests.test_lease_watch import OWNER, break_lease_key, leased_track, services_on
    from app.tasks.lease_watch import CancelWatch

    svc = services_on(sys.argv[1], Path(sys.argv[2]), lease_s=1.5)
    job_id = leased_track(svc)
    print(job_id, flush=True)
    with CancelWatch(svc, job_id, 0, grace_s=1.0, lease_owner=OWNER, stage="backbone") as watch:
        break_lease_key(svc, job_id)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # a stage that never looks at its control
            if watch.broken is not None and svc.redis.type(svc.jobs.lease_key(job_id, 0)) == "list":
                svc.redis.delete(svc.jobs.lease_key(job_id, 0))  # the lease as it was, so the failure can be
                svc.redis.set(svc.jobs.lease_key(job_id, 0), OWNER, px=60_000)  # written in the owner's name
            time.sleep(0.05)
    print("ran to the end without a renewed lease", flush=True)
""")


def test_a_stage_that_ignores_the_stop_is_ended_and_its_track_failed(redis_base_url, tmp_path):
    url = f"{redis_base_url}/508"
    proc = subprocess.run(
        [PYTHON, "-c", WORK_THAT_IGNORES_THE_STOP, url, str(tmp_path)],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    job_id = proc.stdout.split()[0]
    assert proc.returncode == 75, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert "lease_watch_broken" in proc.stderr
    track = build_services(Settings(redis_url=url, artifact_dir=tmp_path / "artifacts")).jobs.track(job_id, 0)
    assert track["status"] == "failed"
    assert "lease thread failed" in track["error"] and "WRONGTYPE" in track["error"]


def test_progress_writes_are_throttled_but_a_stages_first_move_always_goes_out(redis_base_url, tmp_path):
    """A stage that says "Loading ... model" at 0 and then runs for less than the throttle's window still
    publishes one progress between 0 and 1 (a CI run once showed a whole song's stages with none); later reports
    inside the window are held back, the final 1.0 never is."""
    svc = services_on(f"{redis_base_url}/508", tmp_path, lease_s=60)
    job_id = leased_track(svc)
    # A window no slow machine outlasts, on a clock as a machine booted 20 s ago reads it (monotonic() counts from
    # boot: a first report compared with a "last" of 0.0 would look 20 s after one, inside the window, and be lost).
    report = ThrottledProgress(svc, job_id, 0, OWNER, every_s=3600, clock=lambda: 20.0)

    def written() -> tuple[float, str]:
        track = svc.jobs.track(job_id, 0)
        return track["progress"], track["detail"]

    report(0.0, "Loading backbone model...")
    assert written() == (0.0, "Loading backbone model...")
    report(0.2, "64/320 tokens")  # at once: the first move, written
    assert written() == (0.2, "64/320 tokens")
    report(0.4, "128/320 tokens")  # inside the window: held back
    assert written() == (0.2, "64/320 tokens")
    report(1.0, "320/320 tokens")
    assert written() == (1.0, "320/320 tokens")
