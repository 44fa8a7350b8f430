"""The in-flight backbone engine (app/tasks/engine.py): tracks of any jobs join a worker's running engine, leave it
alone, and go on at once; with real workers, Redis and the tiny models (issue 35)."""

from __future__ import annotations

import re
import time
from collections import Counter

import pytest

from harness.processes import wait_until


def _wav(stack, job_id: str, track: int = 0) -> bytes:
    reply = stack.client.get(f"/api/v1/jobs/{job_id}/tracks/{track}.wav", headers=stack.auth)
    assert reply.status_code == 200, reply.get_json()
    return reply.data


def _in_backbone(stack, job_id: str, track: int = 0, above: float = 0.0) -> bool:
    record = stack.job(job_id)["tracks"][track]
    return record["state"] == "backbone" and record["progress"] > above


def _events(stack, name: str, *fields: str) -> list[str]:
    """Worker 0's log lines of one event (with these `key=value` fields), in order."""
    wanted = [f"event={name}", *fields]
    return [line for line in stack.worker_log(0).splitlines() if all(part in line.split() for part in wanted)]


@pytest.mark.slow
def test_a_job_submitted_while_the_engine_runs_joins_it_and_finishes_first(make_stack):
    stack = make_stack()
    stack.start_worker(0)
    long = stack.submit_music(duration_s=150.0, seed=1)
    wait_until(lambda: _in_backbone(stack, long, above=0.05), 90, 0.05, "the long song's backbone")
    short = stack.submit_music(duration_s=2.0, seed=2)
    done = stack.wait_job(short, timeout=90, interval=0.05)
    assert done["state"] == "done", done
    assert _in_backbone(stack, long)  # the short song was written, decoded and exported while the long one ran
    backbone = done["tracks"][0]["stages"]["backbone"]
    assert backbone["in_engine"] and backbone["info"]["in_engine"]
    assert _events(stack, "engine_joined", f"job={short}", "tracks=2")
    assert stack.wait_job(long, timeout=180)["state"] == "done"
    deliveries = [line for line in _events(stack, "stage_started", "stage=backbone") if "in_engine=1" not in line]
    assert len(deliveries) == 1  # one engine run (one backbone delivery) served both songs
    # its tally is added up in the worker's heartbeat hash: it stepped the long song's every frame, with one or two
    # tracks in the slots (the short song's track joined the long one's for part of it)
    key = f"encore:worker:{stack.worker_status(0)['name']}"
    # the engine writes it as it stops, after its last hand-off (which the long song's export may outrun)
    wait_until(lambda: stack.redis.hexists(key, "engine_runs"), 30, 0.05, "the engine's tally")
    tally = {k: float(v) for k, v in stack.redis.hgetall(key).items() if k.startswith("engine_")}
    frames = stack.job(long)["tracks"][0]["stages"]["backbone"]["info"]["frames"]
    assert tally["engine_runs"] == 1 and tally["engine_blocks"] >= 2
    # every frame of the long song, which ran first and last; a block runs on to its end (32 frames at most) after
    # the model ends a song
    assert frames <= tally["engine_frames"] <= frames + 32
    assert tally["engine_rows"] == tally["engine_frames"] * tally["engine_slots"]  # exact mode: every slot's row
    assert tally["engine_block_s"] < tally["engine_slot_s"] < 2 * tally["engine_block_s"]
    assert tally["engine_slots"] >= 2 and tally["engine_boundary_s"] > 0 and tally["engine_list_s"] > 0


@pytest.mark.slow
def test_a_seed_means_a_song_alone_and_amid_fifteen_others_joining_and_leaving(make_stack):
    stack = make_stack()
    stack.start_worker(0, ENCORE_BACKBONE_SLOTS="1")  # no engine: the song alone, as before the engine
    alone = stack.wait_job(stack.submit_music(duration_s=20.0, seed=42), timeout=120)
    assert alone["state"] == "done" and "in_engine" not in alone["tracks"][0]["stages"]["backbone"]
    stack.stop_worker(0)

    stack.start_worker(0, ENCORE_BACKBONE_SLOTS="16")
    before = [stack.submit_music(duration_s=2.0 + 3 * i, seed=100 + i) for i in range(8)]
    wait_until(lambda: _in_backbone(stack, before[-1]), 60, 0.02, "the engine running")
    target = stack.submit_music(duration_s=20.0, seed=42)
    wait_until(lambda: _in_backbone(stack, target), 60, 0.02, "the song in the engine")
    after = [stack.submit_music(duration_s=2.0 + 2 * i, seed=200 + i) for i in range(7)]
    for job_id in [*before, target, *after]:
        assert stack.wait_job(job_id, timeout=300)["state"] == "done"
    assert _wav(stack, target) == _wav(stack, alone["job_id"])

    log = [
        line for line in stack.worker_log(0).splitlines() if "event=engine_joined" in line or "stage=backbone" in line
    ]
    joined = next(i for i, line in enumerate(log) if f"job={target}" in line and "event=engine_joined" in line)
    left = next(i for i, line in enumerate(log) if f"job={target}" in line and "event=stage_finished" in line)
    around = log[joined + 1 : left]
    assert any("event=engine_joined" in line for line in around), "no track joined while the song ran"
    assert any("event=stage_finished" in line for line in around), "no track left while the song ran"


@pytest.mark.slow
def test_a_track_canceled_in_the_engine_leaves_within_a_block_and_the_others_sound_as_alone(make_stack):
    stack = make_stack()
    stack.start_worker(0)
    alone = [stack.wait_job(stack.submit_music(duration_s=12.0, seed=seed), timeout=120) for seed in (3, 4)]
    doomed = stack.submit_music(duration_s=150.0, seed=5)
    wait_until(lambda: _in_backbone(stack, doomed, above=0.01), 60, 0.02, "the doomed song in the engine")
    kept = [stack.submit_music(duration_s=12.0, seed=seed) for seed in (3, 4)]
    wait_until(lambda: all(_in_backbone(stack, job_id) for job_id in kept), 60, 0.02, "both songs in the engine")
    asked = time.monotonic()
    assert stack.client.delete(f"/api/v1/jobs/{doomed}", headers=stack.auth).status_code == 200
    ended = stack.wait_job(doomed, timeout=20, interval=0.02)
    assert ended["tracks"][0]["state"] == "canceled" and time.monotonic() - asked < 5
    assert all(_in_backbone(stack, job_id) or stack.job(job_id)["state"] != "canceled" for job_id in kept)
    for job_id, reference in zip(kept, alone, strict=True):
        assert stack.wait_job(job_id, timeout=120)["state"] == "done"
        assert _wav(stack, job_id) == _wav(stack, reference["job_id"])
    assert _events(stack, "canceled", f"job={doomed}", "stage=backbone")


@pytest.mark.slow
def test_kill_9_of_a_worker_with_tracks_of_three_jobs_in_its_engine_restarts_each_once(make_stack):
    from harness import faults

    stack = make_stack(ENCORE_LEASE_S="4")
    stack.start_worker(0, ENCORE_BACKBONE_SLOTS="16")
    jobs = [stack.submit_music(duration_s=60.0, num_tracks=3, seed=10 * (i + 1)) for i in range(3)]

    def in_engine() -> list[tuple[str, int]]:
        return [
            (job_id, track["track"])
            for job_id in jobs
            for track in stack.job(job_id)["tracks"]
            if track["state"] == "backbone" and track["progress"] > 0
        ]

    wait_until(lambda: len(in_engine()) >= 8, 120, 0.05, "eight tracks in the engine")
    held = set(in_engine())
    stack.stop_worker(0)  # kill -9 of master and child
    stack.start_worker(0, ENCORE_BACKBONE_SLOTS="16")
    for job_id in jobs:
        record = stack.wait_job(job_id, timeout=400)
        assert record["state"] == "done", record
        for track in record["tracks"]:
            expected = 1 if (job_id, track["track"]) in held else 0
            assert track["restarts"] == expected, (job_id, track["track"], track["restarts"])
    finished = Counter(
        (match.group(1), match.group(2))
        for line in _events(stack, "stage_finished", "stage=backbone")
        if (match := re.search(r"job=(\w+) track=(\d+) ", line))
    )
    assert sorted(finished) == sorted((job_id, str(t)) for job_id in jobs for t in range(3))
    assert set(finished.values()) == {1}, finished  # none ran twice
    faults.assert_nothing_left(stack)


@pytest.mark.slow
def test_a_second_tenant_starts_at_the_next_block_a_first_tenants_track_paused_and_resumed_as_alone(
    make_stack, tmp_path
):
    """Tenant A's songs fill both slots with more waiting; tenant B's song starts at the next block boundary (one of
    A's tracks in the slots is paused for it), before any of A's songs in the slots ends and before A's backlog;
    the paused song resumes and sounds as it does alone."""
    from harness.tenants import bearer, write_tenants_file

    tokens = {"token-a": "alpha", "token-b": "beta", "token-ops": "ops"}
    stack = make_stack(ENCORE_TENANTS_FILE=str(write_tenants_file(tmp_path / "tenants.json", tokens)))
    stack.auth = bearer("token-ops")  # the helpers' status reads are an admin's
    stack.start_worker(0, ENCORE_BACKBONE_SLOTS="2")

    def submit(token: str, seed: int, duration_s: float) -> str:
        body = {"mode": "instrumental", "tags": "lo-fi", "duration_s": duration_s, "num_tracks": 1, "seed": seed}
        reply = stack.client.post("/api/v1/music", json=body, headers=bearer(token))
        assert reply.status_code == 202, reply.get_json()
        return reply.get_json()["job_id"]

    def state(token: str, job_id: str) -> dict:
        return stack.client.get(f"/api/v1/jobs/{job_id}", headers=bearer(token)).get_json()["tracks"][0]

    def done(token: str, job_id: str) -> dict:
        return wait_until(
            lambda: (lambda t: t if t["state"] == "done" else None)(state(token, job_id)), 240, 0.05, job_id
        )

    backlog = [submit("token-a", seed, 60.0) for seed in range(5)]
    in_slots = backlog[:2]
    wait_until(lambda: all(state("token-a", j)["state"] == "backbone" for j in in_slots), 60, 0.02, "A in both slots")
    newcomer = submit("token-b", 99, 2.0)
    started = done("token-b", newcomer)["stages"]["backbone"]["started_at"]
    a_tracks = {job_id: done("token-a", job_id) for job_id in backlog}
    # B did not wait for a slot to free: it started before either of A's songs in the slots ended its backbone
    assert started < min(a_tracks[j]["stages"]["backbone"]["finished_at"] for j in in_slots)
    # nor behind A's backlog: none of the songs that were waiting started before it
    assert all(a_tracks[j]["stages"]["backbone"]["started_at"] > started for j in backlog[2:])
    paused = [line for line in _events(stack, "engine_paused") if f"for_job={newcomer}" in line.split()]
    assert len(paused) == 1, paused
    victim = re.search(r"job=(\w+)", paused[0])
    assert victim is not None and victim.group(1) in in_slots
    assert len(_events(stack, "engine_resumed", f"job={victim.group(1)}")) == 1
    # the paused song sounds as it does alone (the same seed again, by itself in the engine)
    seed = backlog.index(victim.group(1))
    again = submit("token-a", seed, 60.0)
    done("token-a", again)
    wav = {
        job_id: stack.client.get(f"/api/v1/jobs/{job_id}/tracks/0.wav", headers=bearer("token-a")).data
        for job_id in (victim.group(1), again)
    }
    assert len(wav[again]) > 1000 and wav[victim.group(1)] == wav[again]


@pytest.mark.slow
def test_a_lipsync_waiting_on_the_queue_runs_between_blocks_not_after_the_engine_empties(make_stack, tmp_path):
    """Item 2: the engine runs another GPU stage waiting on its queue (a lip-sync) between two blocks, in its own
    child, instead of draining: the video's GPU stage runs before the last of sixteen songs on two slots has finished
    its backbone, and one engine run serves every song (a drain ended the engine for the video and started another
    after it)."""
    from harness.media import face_video, tone, upload

    stack = make_stack(ENCORE_WORKER_ROLE="both")  # as worker_entrypoint.sh deploys: prepare and mux on the CPU
    stack.start_worker(0, ENCORE_BACKBONE_SLOTS="2")
    # the tiny backbone is quick (a 60 s song's is ~3 s here, its superres and decode ~2 s): enough songs that
    # their backbones outlast the video's prepare on the CPU worker and the follow-ups listed before its lip-sync
    songs = [stack.submit_music(duration_s=60.0, seed=seed) for seed in range(16)]
    reply = upload(stack.client, face_video(tmp_path / "face.mp4", 3.0), tone(tmp_path / "voice.wav", 2.0))
    assert reply.status_code == 202, reply.get_json()
    video = reply.get_json()["job_id"]
    done = stack.wait_job(video, timeout=180, interval=0.05)
    assert done["state"] == "done", done
    stages = done["tracks"][0]["stages"]
    last_backbone = max(
        stack.wait_job(job_id, timeout=300)["tracks"][0]["stages"]["backbone"]["finished_at"] for job_id in songs
    )
    assert stages["lipsync"]["started_at"] < last_backbone, (
        "the songs were through before the video: the test shows nothing"
    )
    assert stages["lipsync"]["in_engine"] and stages["lipsync"]["worker"].startswith("gpu0@")
    assert all(stages[name]["worker"].startswith("cpu0@") for name in ("prepare", "mux"))
    assert _events(stack, "engine_took_stage", f"job={video}", "stage=lipsync")
    for job_id in songs:
        assert stack.wait_job(job_id, timeout=300)["state"] == "done"
    deliveries = [line for line in _events(stack, "stage_started", "stage=backbone") if "in_engine=1" not in line]
    assert len(deliveries) == 1  # one engine run served every song: it never drained for the video


def _share_timeline(stage_s: float, stages: int, block_s: float = 1.0, blocks_alone: int = 0) -> list[str]:
    """The engine's loop under GpuShare: the list runs while it may, then a block; what ran, in order."""
    from app.tasks.engine import GpuShare

    share, timeline = GpuShare(), []
    for _ in range(blocks_alone):  # the slots ran alone: nothing was listed
        share.ran_block(block_s)
    while stages:
        while stages and share.list_may_run():
            share.ran_list(stage_s)
            stages -= 1
            timeline.append("stage")
        share.ran_block(block_s)
        timeline.append("block")
    return timeline


def _runs(timeline: list[str], what: str) -> list[int]:
    """Lengths of the runs of `what` between the other kind of entry."""
    return [
        len(run)
        for run in "".join("s" if e == "stage" else "b" for e in timeline).split("b" if what == "stage" else "s")
        if run
    ]


def test_the_slots_and_the_list_of_other_stages_share_the_gpu_about_half_each():
    """Item 2: while tracks are in the slots, the other stages (follow-ups, lip-syncs) get about half the GPU,
    counted in seconds: a lip-sync of 3.5 s runs, then about four 1 s blocks before the next one; follow-ups of
    0.25 s run four or five between two blocks; and time the slots ran alone is not owed to the list later."""
    lipsyncs = _share_timeline(3.5, 6)
    assert _runs(lipsyncs, "stage") == [1] * 6
    assert all(blocks in (3, 4) for blocks in _runs(lipsyncs, "block")[:-1])  # 3.5 s of list, then ~3.5 s of blocks
    follow_ups = _share_timeline(0.25, 40)
    assert all(count in (4, 5) for count in _runs(follow_ups, "stage")[1:-1])  # the last: what was left
    after_a_long_run_alone = _share_timeline(0.25, 40, blocks_alone=60)
    assert _runs(after_a_long_run_alone, "stage")[0] <= 5  # a block's credit at most, not sixty


def test_the_list_waits_for_a_tenant_in_the_slots_that_has_had_less_gpu_time():
    """Item 4 in the engine: tenant A's listed follow-ups wait while tenant B, whose song shares the slots with A's,
    has had less GPU time in this engine than A (a block serves both, charged half to each); with one tenant the
    list never waits for it; a tenant that appears starts at the least charge of those present, not at zero."""
    from app.tasks.engine import TenantCharges

    charges = TenantCharges()
    charges.join({"a"})
    for _ in range(3):
        charges.charge_block({"a"}, 1.0)  # A alone in the slots
        assert charges.may_run("a", {"a"})
        charges.charge("a", 0.25)  # one of A's follow-ups
    charges.join({"a", "b"})
    assert charges.of("b") == charges.of("a") == 3.75  # no credit for the time B was away
    charges.charge("a", 0.25)  # A's follow-up ran: A is ahead of B now
    for _ in range(5):
        charges.charge_block({"a", "b"}, 1.0)
        assert not charges.may_run("a", {"a", "b"})  # B's song in the slots goes first
    assert charges.may_run("b", {"a", "b"})  # B's own follow-up, once listed, goes first
    charges.charge_block({"a"}, 1.0)  # B's song left the slots
    assert charges.may_run("a", {"a"})
    charges.join({"a", "c"})
    assert charges.of("c") == charges.of("a")


def test_a_redis_outage_as_the_engine_stops_costs_its_tally_only(caplog):
    """The tally is a view for operators: a Redis that cannot be reached when the engine stops (a real client
    against a closed port) is logged, and the run's outcome is not turned into a failure by it."""
    import socket
    from types import SimpleNamespace

    import redis

    from app.control.workers import WorkerRegistry
    from app.tasks.engine import BackboneEngine, EngineTally

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed once the block ends: nothing listens there
    unreachable = WorkerRegistry(redis.Redis(port=port, socket_connect_timeout=0.5))
    engine = BackboneEngine.__new__(BackboneEngine)  # only what stopping reads: no model, no worker
    engine.svc = SimpleNamespace(workers=unreachable)
    engine.run = SimpleNamespace(worker="gpu0@host")
    engine.runner = SimpleNamespace(slots=16)
    engine.tally = EngineTally(blocks=3, frames=96, block_s=1.5, slot_s=4.5)
    with pytest.raises(redis.exceptions.ConnectionError):
        unreachable.add_up("gpu0@host", engine.tally.amounts())  # the outage is real
    engine._add_up_tally()
    assert any("engine tally not recorded" in record.getMessage() for record in caplog.records)
