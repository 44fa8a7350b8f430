"""The reaper (app/control/recovery.py) against a real Redis broker and kombu channel: expired leases, dead queues,
lost messages; no worker runs here, so a track it restarts stays parked."""

from __future__ import annotations

import json
import os
import time

import pytest

from app.control.recovery import reap, restart_track
from app.core.priority import FIRST_STAGE_PRIORITY
from app.control.routing import enqueue_track, rebalance, unroute_waiting
from app.control.workers import pid_alive
from harness.stack import project_celery_config, unit_services

FIRST = FIRST_STAGE_PRIORITY["normal"]  # the broker list a normal job's first stage waits in: gpu<n>:<FIRST>


@pytest.fixture
def svc(redis_base_url, tmp_path):
    return unit_services(redis_base_url, 509, tmp_path)


@pytest.fixture
def celery_config(svc):
    """pytest-celery's `celery_app` is the project's Celery app on this module's Redis database."""
    return project_celery_config(svc.settings)


def _deliver_without_ack(app, queue: str, ref: dict) -> tuple[object, object]:
    """Publish a stage message the way the web does, then take it like a worker that never acks."""
    app.signature("encore.music.backbone", args=(ref,)).set(queue=queue, priority=0).apply_async()
    connection = app.connection_for_write()
    channel = connection.default_channel
    message = channel.basic_get(queue, no_ack=False)
    assert message is not None
    return connection, channel


OWNER = "gpu4@x|{}|1"


def _running(svc, job_id: str, stage: str = "superres", worker: str = "gpu4@x", queue: str = "gpu4") -> str:
    """Route and start the track's stages up to `stage` (running), as a worker would; returns its owner."""
    kind = svc.jobs.job(job_id)["kind"]
    names = {"music": ["backbone", "superres", "decode", "export"], "lipsync": ["prepare", "lipsync", "mux"]}[kind]
    ids = [f"{job_id[:6]}-{i}" for i in range(len(names))]
    assert svc.jobs.route(job_id, 0, queue, ids)
    for index, name in enumerate(names[: names.index(stage) + 1]):
        owner = f"{worker}|{ids[index]}|1"
        assert svc.jobs.transition(
            "start", job_id, 0, stage=name, owner=owner, task_id=ids[index], worker=worker, lease_ms=60_000
        )
        if name != stage:
            stages = {n: {"started_at": 1.0, "finished_at": 2.0} for n in names[: index + 1]}
            assert svc.jobs.transition("finish", job_id, 0, {"stages": stages}, stage=name, owner=owner)
    return owner


def test_queued_tracks_leave_a_queue_only_while_their_message_is_still_there(svc, celery_app):
    options = dict(celery_app.conf.broker_transport_options)
    first, second = (svc.jobs.create("music", {}, [{"seed": s}], cost=1.0) for s in (1, 2))
    for job_id in (first, second):
        enqueue_track(svc, celery_app, job_id, 0, "gpu5")
    taken = svc.redis.rpop(f"gpu5:{FIRST}")  # a worker took the first job's message (kombu pops from the right)
    assert taken is not None
    assert unroute_waiting(svc, "gpu5", options) == [f"{second}:0"]
    assert svc.redis.zrange(svc.jobs.keys.unrouted, 0, -1) == [f"{second}:0"]
    assert svc.redis.llen(f"gpu5:{FIRST}") == 0
    moved = svc.jobs.track(second, 0)
    assert (moved["status"], moved["queue"], moved["task_ids"]) == ("parked", "", [])
    assert svc.jobs.track(first, 0)["queue"] == "gpu5"  # its message was taken: it stays
    assert svc.redis.zrange(svc.jobs.waiting_key("gpu5"), 0, -1) == [f"{first}:0"]
    assert unroute_waiting(svc, "gpu5", options) == []  # idempotent


def test_a_track_restarted_too_often_fails_instead_of_moving_again(svc, celery_app):
    job_id = svc.jobs.create("lipsync", {}, [{}], cost=1.0)
    for restart in range(1, svc.settings.max_deliveries + 1):
        _running(svc, job_id, "lipsync", worker="gpu3@dead", queue="gpu3")
        svc.redis.delete(svc.jobs.lease_key(job_id, 0))
        record = svc.jobs.track(job_id, 0)
        assert restart_track(svc, celery_app, job_id, 0, record, "gpu3@dead went offline") == "restarted"
        track = svc.jobs.track(job_id, 0)
        assert (track["status"], track["queue"], track["task_ids"], track["restarts"]) == ("parked", "", [], restart)
        assert track["detail"] == "restarting from its first stage: gpu3@dead went offline during lipsync"
    _running(svc, job_id, "prepare", worker="gpu3@dead", queue="gpu3")
    svc.redis.delete(svc.jobs.lease_key(job_id, 0))
    record = svc.jobs.track(job_id, 0)
    assert restart_track(svc, celery_app, job_id, 0, record, "gpu3@dead went offline") == "failed"
    track = svc.jobs.track(job_id, 0)
    assert track["state"] == "failed" and "its stage died 4 times (gpu3@dead went offline" in track["error"]
    assert svc.redis.zcard(svc.jobs.load_key("gpu3")) == 0


def test_every_death_counts_whoever_notices_it_in_the_limit_and_the_message(svc, celery_app):
    """Issue 36, item 4: a stage's deaths are noticed either by the next delivery of its message (a replacement child
    takes it over) or by the reaper (its lease expired first: a restart, a new message). Both add up: in the
    give-up message (5 kills were reported as 4 when counted per message or per restart) and in the limit."""
    job_id = svc.jobs.create("lipsync", {}, [{}], cost=1.0)
    most = svc.settings.max_deliveries

    def redelivered() -> None:
        """The killed delivery's lease runs out and the same message's next delivery starts (it died: counted)."""
        svc.redis.delete(svc.jobs.lease_key(job_id, 0))
        task_id = svc.jobs.track(job_id, 0)["task_ids"][1]
        owner = f"gpu3@w|{task_id}|2"
        assert svc.jobs.transition(
            "start",
            job_id,
            0,
            stage="lipsync",
            owner=owner,
            task_id=task_id,
            worker="gpu3@w",
            lease_ms=60_000,
            died=True,
        )

    def reaped() -> str:
        svc.redis.delete(svc.jobs.lease_key(job_id, 0))
        return restart_track(svc, celery_app, job_id, 0, svc.jobs.track(job_id, 0), "gpu3@w went offline")

    deaths = 0
    while deaths < most - 1:  # in turn: a redelivery, then a restart, each one death
        _running(svc, job_id, "lipsync", worker="gpu3@w", queue="gpu3")
        redelivered()
        assert reaped() == "restarted"
        deaths += 2
        assert svc.jobs.track(job_id, 0)["restarts"] == deaths // 2  # restarts alone would allow `most` of them
    _running(svc, job_id, "lipsync", worker="gpu3@w", queue="gpu3")
    redelivered()
    deaths += 1
    assert deaths >= most
    assert reaped() == "failed"  # the death past the limit, counted across both kinds
    track = svc.jobs.track(job_id, 0)
    assert track["state"] == "failed" and f"its stage died {deaths + 1} times (gpu3@w went offline" in track["error"]


def test_a_music_track_resumes_after_its_finished_stages_a_lipsync_one_starts_over(svc, celery_app):
    """Music intermediates are in the shared artifact store: a moved track keeps its finished stages (its new
    chain starts after them). Lip-sync's are in the dead worker's scratch."""
    ids = {kind: svc.jobs.create(kind, {}, [{"seed": 1}], cost=1.0) for kind in ("music", "lipsync")}
    _running(svc, ids["music"], "superres")
    _running(svc, ids["lipsync"], "lipsync")
    for job_id in ids.values():
        svc.redis.delete(svc.jobs.lease_key(job_id, 0))
        record = svc.jobs.track(job_id, 0)
        assert restart_track(svc, celery_app, job_id, 0, record, "gpu4@x went offline") == "restarted"
    music, lipsync = svc.jobs.track(ids["music"], 0), svc.jobs.track(ids["lipsync"], 0)
    assert list(music["stages"]) == ["backbone"] and music["state"] == "queued"
    assert music["detail"] == "restarting after backbone: gpu4@x went offline during superres"
    assert lipsync["stages"] == {} and lipsync["detail"].startswith("restarting from its first stage")
    svc.workers.heartbeat("gpu6@y", {"queue": "gpu6"})  # a live worker: the music track's chain starts at superres
    assert enqueue_track(svc, celery_app, ids["music"], 0, "gpu6")
    assert len(svc.jobs.track(ids["music"], 0)["task_ids"]) == 3
    assert svc.redis.llen("gpu6") == 1 and svc.redis.llen(f"gpu6:{FIRST}") == 0  # a later stage: priority 0


def test_leases_are_renewed_only_by_their_owner(svc):
    job_id = svc.jobs.create("music", {}, [{"seed": 1}], cost=1.0)
    owner = _running(svc, job_id, "backbone")
    assert svc.jobs.renew_lease(job_id, 0, owner, 5)
    assert not svc.jobs.renew_lease(job_id, 0, "gpu3@b|t1|2", 5)  # someone else's
    svc.jobs.fail(job_id, 0, "x", owner=owner)
    assert svc.jobs.lease(job_id, 0) is None and not svc.jobs.renew_lease(job_id, 0, owner, 5)


def test_the_reaper_restarts_running_tracks_without_a_lease_cancels_canceled_ones_and_spares_live_ones(svc, celery_app):
    """A restarted track is parked (no worker is live here), with its old chain's messages gone from the
    broker list and from kombu's unacked hash."""
    jobs = {name: svc.jobs.create("music", {}, [{"seed": 1}], cost=1.0) for name in ("dead", "live", "canceled")}
    for name, job_id in jobs.items():
        _running(svc, job_id, "superres")
        if name != "live":
            svc.redis.delete(svc.jobs.lease_key(job_id, 0))
    svc.redis.set(svc.jobs.keys.cancel(jobs["canceled"]), "1")
    connection, channel = _deliver_without_ack(celery_app, "gpu4", {"job_id": jobs["dead"], "track": 0})
    unacked = svc.redis.hgetall("unacked")
    tag = next(iter(unacked))
    svc.redis.hset(
        "unacked",
        tag,
        unacked[tag].replace(
            json.loads(unacked[tag])[0]["headers"]["id"], svc.jobs.track(jobs["dead"], 0)["task_ids"][1]
        ),
    )
    try:
        assert reap(svc, celery_app) == 2
    finally:
        connection.release()
    dead, live, canceled = (svc.jobs.track(jobs[name], 0) for name in ("dead", "live", "canceled"))
    assert (dead["status"], dead["queue"], dead["restarts"], list(dead["stages"])) == ("parked", "", 1, ["backbone"])
    assert dead["detail"] == "restarting after backbone: the lease of gpu4@x expired during superres"
    assert svc.redis.zrange(svc.jobs.keys.unrouted, 0, -1) == [f"{jobs['dead']}:0"]
    assert svc.redis.hlen("unacked") == 0
    assert live["status"] == "running:superres"
    assert canceled["state"] == "canceled" and "its stage had stopped" in canceled["detail"]
    assert svc.redis.zrange(svc.jobs.load_key("gpu4"), 0, -1) == [f"{jobs['live']}:0"]
    assert reap(svc, celery_app) == 0  # nothing left to do


def test_a_stage_that_finishes_while_the_reaper_looks_is_not_taken_for_dead(svc, celery_app, monkeypatch):
    """The reaper reads a running track's record, then its lease. A stage that finishes in between (on a busy
    machine the reaper's thread may wait for a CPU between the two reads) released its lease with its finish:
    it did not die. Taken for dead, the healthy track was restarted, its next message dropped from the broker
    and its stage run again, and other jobs' first stages overtook it (tests/test_priority.py failed so).
    The interleaving is forced here: the stage's real `finish` transition runs just before the lease is read."""
    svc.workers.heartbeat("gpu4@x", {"queue": "gpu4"})
    job_id = svc.jobs.create("music", {}, [{"seed": 1}], cost=1.0)
    owner = _running(svc, job_id, "decode")
    export_id = svc.jobs.track(job_id, 0)["task_ids"][3]
    celery_app.signature("encore.music.export").set(queue="gpu4", priority=0, task_id=export_id).apply_async()
    read_lease, finished = svc.jobs.lease, []

    def lease_once_the_stage_has_finished(job: str, track: int):
        if job == job_id and not finished:
            stages = {n: {"started_at": 1.0, "finished_at": 2.0} for n in ("backbone", "superres", "decode")}
            finished.append(svc.jobs.transition("finish", job_id, 0, {"stages": stages}, stage="decode", owner=owner))
        return read_lease(job, track)

    monkeypatch.setattr(svc.jobs, "lease", lease_once_the_stage_has_finished)
    assert reap(svc, celery_app) == 0
    assert finished == [finished[0]] and finished[0]
    track = svc.jobs.track(job_id, 0)
    assert (track["status"], track["restarts"], track["task_ids"][3]) == ("waiting:export", 0, export_id)
    assert [json.loads(p)["headers"]["id"] for p in svc.redis.lrange("gpu4", 0, -1)] == [export_id]  # still there


def test_the_reaper_moves_the_tracks_of_a_queue_offline_too_long(svc, celery_app, monkeypatch):
    queued, between = (svc.jobs.create("music", {}, [{"seed": s}], cost=1.0) for s in (1, 2))
    owner = _running(svc, between, "backbone", queue="gpu7", worker="gpu7@gone")
    assert svc.jobs.transition(
        "finish", between, 0, {"stages": {"backbone": {"finished_at": 1.0}}}, stage="backbone", owner=owner
    )
    enqueue_track(svc, celery_app, queued, 0, "gpu7")
    svc.workers.heartbeat("gpu7@gone", {"queue": "gpu7"})
    assert reap(svc, celery_app) == 0  # its worker is live
    svc.workers.forget("gpu7@gone")
    assert reap(svc, celery_app) == 0  # offline for less than ENCORE_REROUTE_AFTER_S
    svc.redis.set(svc.jobs.keys.queue_live_at("gpu7"), time.time() - svc.settings.reroute_after_s - 1)
    assert reap(svc, celery_app) == 2
    for job_id in (queued, between):
        assert svc.jobs.track(job_id, 0)["status"] == "parked"
    assert svc.jobs.track(between, 0)["detail"].startswith("restarting after backbone: gpu7 has no live worker")
    assert svc.redis.llen(f"gpu7:{FIRST}") == 0 and svc.redis.zcard(svc.jobs.load_key("gpu7")) == 0


def test_the_reaper_sends_a_lost_message_again(svc, celery_app, monkeypatch):
    """A track queued (or between stages) whose message is in no broker list and not delivered: sent again as
    a new chain, once it has waited ENCORE_STALL_AFTER_S."""
    svc.workers.heartbeat("gpu8@a", {"queue": "gpu8"})
    lost, kept = (svc.jobs.create("music", {}, [{"seed": s}], cost=1.0) for s in (1, 2))
    for job_id in (lost, kept):
        enqueue_track(svc, celery_app, job_id, 0, "gpu8")
    old_ids, kept_ids = (svc.jobs.track(job_id, 0)["task_ids"] for job_id in (lost, kept))
    svc.redis.lrem(f"gpu8:{FIRST}", 1, next(p for p in svc.redis.lrange(f"gpu8:{FIRST}", 0, -1) if old_ids[0] in p))
    assert reap(svc, celery_app) == 0  # not waited long enough
    for job_id in (lost, kept):
        svc.redis.hset(svc.jobs.track_key(job_id, 0), "updated_at", time.time() - svc.settings.stall_after_s - 1)
    svc.redis.delete(svc.jobs.keys.lock("stall-check"))
    assert reap(svc, celery_app) == 1
    track = svc.jobs.track(lost, 0)
    assert track["status"] == "queued" and track["task_ids"] != old_ids and len(track["task_ids"]) == 4
    payloads = svc.redis.lrange(f"gpu8:{FIRST}", 0, -1)
    assert len(payloads) == 2 and any(track["task_ids"][0] in p for p in payloads)
    assert svc.jobs.track(kept, 0)["task_ids"] == kept_ids  # its message was there: left alone
    assert any(kept_ids[0] in p for p in payloads)


def test_a_message_taken_while_the_reaper_looks_is_not_sent_again(svc, celery_app, monkeypatch):
    """The reaper reads a waiting track's record, then which messages the broker holds. A worker that took the
    message and ran the stage in between left nothing in the broker, yet nothing was lost: the track moved on.
    Resent from the stale record, it got a new chain from its first stage, and its real next message was
    stale. The interleaving is forced: the stage is taken and run just before the broker is read."""
    import app.control.recovery

    svc.workers.heartbeat("gpu8@a", {"queue": "gpu8"})
    job_id = svc.jobs.create("music", {}, [{"seed": 1}], cost=1.0)
    enqueue_track(svc, celery_app, job_id, 0, "gpu8")
    svc.redis.hset(svc.jobs.track_key(job_id, 0), "updated_at", time.time() - svc.settings.stall_after_s - 1)
    ids = svc.jobs.track(job_id, 0)["task_ids"]
    read_broker = app.control.recovery.messages_present

    def broker_once_the_stage_ran(*args, **kwargs):
        assert svc.redis.rpop(f"gpu8:{FIRST}") is not None  # a worker takes the message...
        owner = f"gpu8@a|{ids[0]}|1"
        assert svc.jobs.transition(
            "start", job_id, 0, stage="backbone", owner=owner, task_id=ids[0], worker="gpu8@a", lease_ms=60_000
        )
        assert svc.jobs.transition(
            "finish", job_id, 0, {"stages": {"backbone": {"finished_at": 2.0}}}, stage="backbone", owner=owner
        )  # ...runs the stage, and acks it
        return read_broker(*args, **kwargs)

    monkeypatch.setattr(app.control.recovery, "messages_present", broker_once_the_stage_ran)
    svc.redis.delete(svc.jobs.keys.lock("stall-check"))
    assert reap(svc, celery_app) == 0
    track = svc.jobs.track(job_id, 0)
    assert (track["status"], track["task_ids"]) == ("waiting:superres", ids)


def test_the_reaper_parks_tracks_their_submitter_never_routed(svc, celery_app):
    fresh, abandoned = (svc.jobs.create("music", {}, [{"seed": s}], cost=1.0) for s in (1, 2))
    svc.redis.zadd(svc.jobs.keys.created, {f"{abandoned}:0": time.time() - svc.settings.stall_after_s - 1})
    assert reap(svc, celery_app) == 1
    assert svc.jobs.track(abandoned, 0)["status"] == "parked"
    assert svc.jobs.track(fresh, 0)["status"] == "created"  # its submitter is still about to route it
    assert svc.redis.zrange(svc.jobs.keys.unrouted, 0, -1) == [f"{abandoned}:0"]


def test_an_idle_queue_takes_the_first_track_waiting_behind_a_running_one(svc, celery_app):
    """rebalance (app/control/routing.py): gpu5 runs A and has B queued behind it; gpu6 is live, idle and ready.
    B moves to gpu6 with its message (out of gpu5's broker list, onto gpu6's); A stays. A queue whose worker is
    still loading its models, or is busy, takes nothing."""
    for name, queue, extra in (("gpu5@x", "gpu5", {}), ("gpu6@x", "gpu6", {"preload": 1})):
        svc.workers.heartbeat(name, {"queue": queue, "pid": 1, "kinds": "lipsync,music", **extra})
    first = svc.jobs.create("music", {}, [{"seed": 1}], cost=30.0)
    _running(svc, first, stage="backbone", worker="gpu5@x", queue="gpu5")
    second = svc.jobs.create("music", {}, [{"seed": 2}], cost=2.0)
    assert enqueue_track(svc, celery_app, second, 0, "gpu5")
    assert svc.redis.llen(f"gpu5:{FIRST}") == 1

    assert rebalance(svc, celery_app) == 0  # gpu6 has not loaded its models yet
    svc.workers.record_models("gpu6@x", ["lipsync", "music"], 1)
    assert rebalance(svc, celery_app) == 1
    moved = svc.jobs.track(second, 0)
    assert (moved["queue"], moved["status"]) == ("gpu6", "queued")
    assert svc.redis.llen(f"gpu5:{FIRST}") == 0 and svc.redis.llen(f"gpu6:{FIRST}") == 1
    assert svc.jobs.track(first, 0)["queue"] == "gpu5"
    assert rebalance(svc, celery_app) == 0  # gpu6 is no longer idle, and nothing else waits


def test_a_zombie_process_is_not_alive():
    """A killed worker's orphaned child can stay a zombie (an init that does not reap it): its pid still
    answers kill(0), but it runs nothing, so its leases are dead (app/control/recovery.py release_dead_leases)."""
    import subprocess

    from harness.processes import wait_until

    child = subprocess.Popen(["sleep", "0"])
    try:
        stat = f"/proc/{child.pid}/stat"
        wait_until(lambda: open(stat).read().rpartition(")")[2].split()[0] == "Z", 10, 0.01, "a zombie")
        os.kill(child.pid, 0)  # the pid answers ...
        assert not pid_alive(child.pid)  # ... but nothing runs there
    finally:
        child.wait()
    assert pid_alive(os.getpid()) and not pid_alive(child.pid)


def test_the_heartbeats_sweep_takes_an_ended_tracks_scratch_and_a_dead_stages_workdir(svc, tmp_path):
    """Issue 36, items 1 and 3: a lip-sync track canceled while its worker was dead kept its scratch folder (only
    expired jobs' went), and a killed child's workdir waited for the 300 s sweep. The heartbeat's sweep takes
    both; an open track's scratch and a live process's workdir stay."""
    import dataclasses
    import subprocess
    import sys

    from app.tasks.scratch import sweep_scratch, sweep_workdirs

    svc.settings = dataclasses.replace(svc.settings, worker_cache_dir=tmp_path / "cache")
    canceled = svc.jobs.create("lipsync", {}, [{}], cost=2.0)
    running = svc.jobs.create("lipsync", {}, [{}], cost=2.0)
    assert svc.jobs.route(canceled, 0, "gpu0", ["c0"]) and svc.jobs.route(running, 0, "gpu0", ["r0"])
    assert svc.jobs.cancel(canceled, 0, "canceled while its worker was dead")
    folders = {job_id: tmp_path / "cache" / "tracks" / f"{job_id}-0" for job_id in (canceled, running, "0" * 32)}
    for folder in folders.values():
        folder.mkdir(parents=True)
        (folder / "frames.bin").write_bytes(b"x" * 1024)
    assert sorted(sweep_scratch(svc)) == sorted([f"{canceled}-0", f"{'0' * 32}-0"])  # ended, and expired
    assert [f.exists() for f in folders.values()] == [False, True, False]

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True, text=True
    )
    work = tmp_path / "cache" / "work"
    gone = work / f"{running}-0-lipsync-{int(dead.stdout)}-abc"
    kept = work / f"{running}-0-lipsync-{os.getpid()}-def"
    gone.mkdir(parents=True)
    kept.mkdir()
    assert sweep_workdirs(svc) == [gone.name] and kept.exists()


def test_a_restart_compares_the_version_it_read_and_leaves_a_track_that_moved_on(svc, celery_app):
    """Issue 36, item 16: the reaper reads a record, then restarts the track in a second call; a stage that
    finished in between was restarted anyway. The restart now names the version it read (compare and set)."""
    job_id = svc.jobs.create("music", {}, [{"seed": 1}], cost=1.0)
    owner = _running(svc, job_id, "backbone")
    read = svc.jobs.track(job_id, 0)
    stages = {"backbone": {"started_at": 1.0, "finished_at": 2.0}}
    assert svc.jobs.transition("finish", job_id, 0, {"stages": stages}, stage="backbone", owner=owner)
    assert restart_track(svc, celery_app, job_id, 0, read, "its lease expired") == ""  # stale: left alone
    track = svc.jobs.track(job_id, 0)
    assert (track["status"], track["restarts"]) == ("waiting:superres", 0)
    assert restart_track(svc, celery_app, job_id, 0, track, "its worker went away") == "restarted"  # current
    assert svc.jobs.track(job_id, 0)["restarts"] == 1


def test_the_reaper_and_rebalance_never_free_a_lock_they_no_longer_hold(svc, celery_app, monkeypatch):
    """Issue 36, item 16: both freed their lock with a bare DEL; one whose lock expired while it ran (and was
    taken by another process) freed the other's. They hold redis-py Locks now, released by token."""
    import app.control.recovery as recovery
    import app.control.routing as routing

    for name, module, step, run in (
        ("reap", recovery, "_park_abandoned", reap),
        ("rebalance", routing, "routable_queues", rebalance),
    ):
        key = svc.jobs.keys.lock(name)
        original = getattr(module, step)

        def taken_meanwhile(*args, key=key, original=original, **kwargs):
            svc.redis.set(key, "another-process")  # the lock expired and another process took it
            return original(*args, **kwargs)

        monkeypatch.setattr(module, step, taken_meanwhile)
        run(svc, celery_app)
        assert svc.redis.get(key) == "another-process", name
        svc.redis.delete(key)
        monkeypatch.setattr(module, step, original)
        run(svc, celery_app)  # a lock it holds it frees
        assert svc.redis.get(key) is None, name
