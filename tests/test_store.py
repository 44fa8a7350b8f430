"""Job records and the artifact store against a real redis-server."""

from __future__ import annotations


import itertools
import json
import time

import pytest
import redis

from app.adapters.artifacts import CHUNK_BYTES, READ_BATCH_CHUNKS, DirectoryStore, RedisStore
from app.control.jobs import JobStore
from app.control.lifecycle import lua_stages
from app.control.scripts import lua_source
from harness.processes import wait_until
from harness.records import expected_overall


@pytest.fixture
def client(redis_base_url):
    text = redis.Redis.from_url(f"{redis_base_url}/510", decode_responses=True)
    text.flushdb()
    yield text
    text.flushdb()


@pytest.fixture
def binary(redis_base_url):
    return redis.Redis.from_url(f"{redis_base_url}/510")


OWNER = "gpu0@a|t0|1"


def _start(jobs: JobStore, job_id: str, track: int = 0, queue: str = "gpu0") -> None:
    """Route a parked track and start its first stage as OWNER (the transitions a worker makes)."""
    assert jobs.route(job_id, track, queue, ["t0", "t1", "t2", "t3"])
    assert jobs.transition(
        "start", job_id, track, stage="backbone", owner=OWNER, task_id="t0", worker="gpu0@a", lease_ms=60_000
    )


def test_terminal_track_refuses_late_writes(client):
    jobs = JobStore(client, "t", ttl_s=60)
    job_id = jobs.create("music", {"duration_s": 2}, [{"seed": 1}], cost=2.0)
    _start(jobs, job_id)
    assert jobs.report(job_id, 0, OWNER, progress=0.5)
    assert jobs.cancel(job_id, 0, "canceled", owner=OWNER)
    assert not jobs.report(job_id, 0, OWNER, progress=0.9)
    track = jobs.track(job_id, 0)
    assert track["state"] == "canceled" and track["progress"] == 0.5


def test_record_expires_with_ttl(client):
    jobs = JobStore(client, "t", ttl_s=1)
    job_id = jobs.create("music", {}, [{"seed": 1}, {"seed": 2}], cost=1.0)
    assert jobs.record(job_id)["tracks"][1]["params"] == {"seed": 2}
    wait_until(lambda: jobs.record(job_id) is None, 5, what="job record expiry")
    assert client.exists(jobs.track_key(job_id, 0)) == 0


def test_queue_positions_follow_submission_order(client):
    jobs = JobStore(client, "t", ttl_s=60)
    ids = [jobs.create("music", {}, [{"seed": 1}], cost=1.0) for _ in range(3)]
    for job_id in ids[:2]:
        assert jobs.transition("park", job_id, 0)
    assert [jobs.record(j)["queue_position"] for j in ids] == [1, 2, 0]  # parked: place among parked
    for job_id in ids:
        assert jobs.route(job_id, 0, "gpu0", ["t0"])
    assert [jobs.record(j)["queue_position"] for j in ids] == [1, 2, 3]
    assert jobs.transition(
        "start", ids[0], 0, stage="backbone", owner=OWNER, task_id="t0", worker="gpu0@a", lease_ms=60_000
    )
    assert [jobs.record(j)["queue_position"] for j in ids] == [0, 1, 2]


def _positions(jobs: JobStore, ids: list[str]) -> list[list[int]]:
    return [[t["queue_position"] for t in jobs.record(j)["tracks"]] for j in ids]


def _song(jobs: JobStore, tenant: str, priority: str = "normal") -> str:
    """A 2-track song of `tenant`, routed to gpu0 (each track's message ids its own)."""
    job_id = jobs.create("music", {}, [{"seed": 1}, {"seed": 2}], cost=1.0, priority=priority, tenant=tenant)
    for track in range(2):
        assert jobs.route(job_id, track, "gpu0", [f"{job_id}-{track}"])
    return job_id


def _start_first(jobs: JobStore, n: int) -> None:
    """Start the first `n` waiting tracks of gpu0 in queue order, as the engine admits them."""
    for value in jobs.redis.zrange(jobs.keys.waiting("gpu0"), 0, n - 1):
        job_id, _, track = value.rpartition(":")
        assert jobs.transition(
            "start",
            job_id,
            int(track),
            stage="backbone",
            owner=OWNER,
            task_id=f"{job_id}-{track}",
            worker="gpu0@a",
            lease_ms=60_000,
        )


def test_a_second_tenants_song_waits_behind_one_track_per_tenant_not_behind_a_backlog(client):
    jobs = JobStore(client, "t", ttl_s=60)
    client.set(jobs.keys.queue_slots("gpu0"), "16")  # gpu0's worker runs the engine, which admits in fair order
    backlog = [_song(jobs, "alpha") for _ in range(40)]  # 80 tracks: more than one engine's slots and scan
    _start_first(jobs, 2)  # alpha's first song fills two slots
    assert _positions(jobs, backlog[:3]) == [[0, 0], [1, 2], [3, 4]]
    newcomer = _song(jobs, "beta")
    # beta's tracks join the round that runs now: its first is next for a slot, its second one round later
    assert _positions(jobs, [newcomer]) == [[1, 3]]
    assert _positions(jobs, backlog[1:3]) == [[2, 4], [5, 6]]  # alpha's own order holds
    _start_first(jobs, 1)
    assert jobs.track(newcomer, 0)["state"] == "backbone"
    # a third tenant arriving later is again not behind either backlog
    third = _song(jobs, "gamma")
    assert _positions(jobs, [third]) == [[1, 4]]


def test_priority_comes_before_fair_share_and_one_tenant_alone_is_fifo(client):
    jobs = JobStore(client, "t", ttl_s=60)
    client.set(jobs.keys.queue_slots("gpu0"), "16")
    alone = [_song(jobs, "alpha") for _ in range(3)]
    assert _positions(jobs, alone) == [[1, 2], [3, 4], [5, 6]]
    urgent = _song(jobs, "alpha", priority="high")  # alpha's own later job, but of a higher priority
    low = _song(jobs, "beta", priority="low")
    assert _positions(jobs, [urgent]) == [[1, 2]]
    assert _positions(jobs, [low]) == [[9, 10]]  # a low priority waits behind every normal track
    assert _positions(jobs, alone) == [[3, 4], [5, 6], [7, 8]]


def test_without_an_engine_a_queue_position_is_the_submission_order_its_worker_takes(client):
    """A worker without the engine (ENCORE_BACKBONE_SLOTS=1, the megatron engine) takes first stages in the
    broker's order, by submission: there a position counts every track submitted before, of any tenant."""
    jobs = JobStore(client, "t", ttl_s=60)
    client.set(jobs.keys.queue_slots("gpu0"), "1")
    backlog = [_song(jobs, "alpha") for _ in range(3)]
    newcomer = _song(jobs, "beta")
    assert _positions(jobs, [*backlog, newcomer]) == [[1, 2], [3, 4], [5, 6], [7, 8]]
    _start_first(jobs, 2)
    assert _positions(jobs, [newcomer]) == [[5, 6]]


def test_record_is_one_round_trip_with_positions_cancel_flag_and_worker_status(client):
    jobs = JobStore(client, "t", ttl_s=60)
    job_id = jobs.create("music", {}, [{"seed": 1}, {"seed": 2}], cost=1.0)
    _start(jobs, job_id, 0)
    jobs.route(job_id, 1, "gpu0", ["u0"])
    client.hset("t:worker:gpu0@a", "queue", "gpu0")
    calls = []
    original = client.execute_command
    client.execute_command = lambda *a, **k: calls.append(a[0]) or original(*a, **k)
    try:
        record = jobs.record(job_id)
    finally:
        client.execute_command = original
    assert len(calls) == 1, calls
    first, second = record["tracks"]
    assert (first["state"], first["status"], first["worker_status"], first["queue_position"]) == (
        "backbone",
        "running:backbone",
        "busy",
        0,
    )
    assert (second["state"], second["queue_position"], "worker_status" in second) == ("queued", 1, False)
    assert (record["state"], record["queue_position"], record["cancel_requested"]) == ("running", 1, False)
    client.delete("t:worker:gpu0@a")
    assert jobs.record(job_id)["tracks"][0]["worker_status"] == "offline"
    stages = {"backbone": {"finished_at": 1.0, "loaded": [], "info": {"with_tracks": []}}}
    assert jobs.transition("finish", job_id, 0, {"stages": stages}, stage="backbone", owner=OWNER)
    assert jobs.record(job_id)["tracks"][0]["stages"] == stages  # empty lists stay lists, however deep
    odd = 'a "quote", a \\ backslash, a/slash\nnew line, tab\t, 流行 🎸, \u00e9'
    assert jobs.transition("fail", job_id, 1, fields={"error": odd, "detail": ""})
    track = jobs.record(job_id)["tracks"][1]
    assert (track["error"], track["detail"], track["artifacts"]) == (odd, "", [])
    assert {name: type(track[name]) for name in ("updated_at", "version", "progress")} == {
        "updated_at": float,
        "version": int,
        "progress": float,
    }
    assert [k for k in track if k not in ("queue_position", "worker_status")] == list(
        client.hgetall(jobs.track_key(job_id, 1))
    )  # the hash's field order


def test_index_drops_expired_jobs_and_gauges_agree_with_records(client):
    jobs = JobStore(client, "t", ttl_s=60)
    music = jobs.create("music", {}, [{"seed": 1}, {"seed": 2}], cost=1.0)
    lipsync = jobs.create("lipsync", {}, [{}], cost=1.0)
    gone = jobs.create("music", {}, [{"seed": 3}], cost=1.0)
    newest = jobs.create("music", {}, [{"seed": 4}], cost=1.0)
    _start(jobs, music, 0)
    jobs.route(music, 1, "gpu0", ["x"])
    jobs.cancel(music, 1, "canceled")
    jobs.fail(lipsync, 0, "no face detected")
    client.delete(jobs.job_key(gone))  # expired
    assert jobs.recent_job_ids(limit=10) == [newest, lipsync, music]
    assert client.zrange(jobs.jobs_key, 0, -1) == [music, lipsync, newest]
    counts = {key: n for key, n in jobs.job_counts().items() if n}
    # the expired job's id stays in its gauge set until its expiry time passes (scored by expiry)
    assert counts == {("music", "running"): 1, ("lipsync", "failed"): 1, ("music", "queued"): 2}
    client.zadd(jobs.keys.jobs_in_state("music", "queued"), {gone: time.time() - 1})  # as when it expires
    assert {key: n for key, n in jobs.job_counts().items() if n}[("music", "queued")] == 1
    for job_id, state in ((music, "running"), (lipsync, "failed"), (newest, "queued")):
        assert jobs.record(job_id)["state"] == state


def test_the_overall_state_has_one_rule_the_reads_and_the_writes_share(client):
    """lua/tracks.lua's overall_of (what reads answer) on every mix of up to three tracks, and the state the
    transitions keep (the job indexes) and a read answer for real jobs (test_job_counts_... above)."""
    names = ["queued", "backbone", "decoding", "done", "failed", "canceled"]
    mixes = [list(m) for n in range(4) for m in itertools.product(names, repeat=n)]
    code = (
        lua_source("tracks", lua_stages())
        + """
local out = {}
for n, states in ipairs(cjson.decode(ARGV[1])) do out[n] = overall_of(states) end
return cjson.encode(out)"""
    )
    got = json.loads(client.eval(code, 0, json.dumps(mixes)))
    assert got == [expected_overall(mix) for mix in mixes]
    assert got[:2] == ["failed", "queued"]


@pytest.fixture(params=["dir", "redis"])
def store(request, tmp_path, binary):
    binary.flushdb()
    if request.param == "dir":
        return DirectoryStore(tmp_path / "store")
    return RedisStore(binary, "t", tmp_path / "cache")


JOB = "ab" * 16


def test_store_round_trip_large_file(store, tmp_path):
    source = tmp_path / "big.bin"
    payload = bytes(range(256)) * (3 * 4096 + 17)  # > 3 chunks of 1 MiB
    source.write_bytes(payload)
    store.put(JOB, "track0.wav", source, ttl_s=60)
    assert store.exists(JOB, "track0.wav")
    assert store.local_path(JOB, "track0.wav").read_bytes() == payload
    assert not store.exists(JOB, "track1.wav")
    with pytest.raises(FileNotFoundError):
        store.local_path(JOB, "track1.wav")


def commands_on(monitored: redis.Redis, key: str, action) -> list[list[str]]:
    """The commands the server ran on `key` while `action()` ran, as MONITOR shows them (one per round trip
    here: the store pipelines nothing on its read path), each split into words."""
    marker = f"end-of-{key}"
    with monitored.monitor() as monitor:
        action()
        monitored.echo(marker)  # from another connection: MONITOR shows it after everything `action` sent
        seen: list[list[str]] = []
        while True:
            command = monitor.next_command()["command"]
            if marker in command:
                return seen
            if key in command:
                seen.append(command.split())


@pytest.mark.parametrize("chunks", [1, READ_BATCH_CHUNKS, 21])
def test_a_read_fetches_several_chunks_per_round_trip(binary, redis_base_url, tmp_path, chunks):
    """A file of n chunks comes back in n // READ_BATCH_CHUNKS + 1 LRANGEs of at most READ_BATCH_CHUNKS chunks
    each (bounded memory), where it took one LINDEX per chunk (plus EXISTS and LLEN)."""
    store = RedisStore(binary, "t", tmp_path / "cache")
    payload = bytes(range(256)) * (CHUNK_BYTES // 256) * (chunks - 1) + b"tail" * 100
    source = tmp_path / "big.bin"
    source.write_bytes(payload)
    store.put(JOB, "big.bin", source, ttl_s=60)
    key = store._key(JOB, "big.bin")
    assert binary.llen(key) == chunks
    monitored = redis.Redis.from_url(f"{redis_base_url}/510", decode_responses=True)
    reads = commands_on(monitored, key, lambda: store.local_path(JOB, "big.bin"))
    assert len(reads) == chunks // READ_BATCH_CHUNKS + 1, reads
    spans = [(int(start), int(stop)) for verb, _, start, stop in reads if verb.upper() == "LRANGE"]
    assert len(spans) == len(reads) and all(stop - start + 1 <= READ_BATCH_CHUNKS for start, stop in spans), reads
    assert store.local_path(JOB, "big.bin").read_bytes() == payload
    assert not list((tmp_path / "cache" / JOB).glob(".*partial"))


def test_an_empty_file_round_trips_and_a_missing_one_leaves_nothing_behind(store, tmp_path):
    source = tmp_path / "empty.txt"
    source.write_bytes(b"")
    store.put(JOB, "empty.txt", source, ttl_s=60)
    assert store.local_path(JOB, "empty.txt").read_bytes() == b""
    with pytest.raises(FileNotFoundError):
        store.local_path(JOB, "missing.txt")
    assert not list(tmp_path.rglob("*missing*")) and not list(tmp_path.rglob("*.partial"))


@pytest.mark.parametrize(
    "job_id,name", [("../" * 5, "x"), (JOB, "../etc/passwd"), (JOB, ".hidden"), (JOB, "a/b"), ("zz" * 16, "x")]
)
def test_store_rejects_escaping_names(store, tmp_path, job_id, name):
    source = tmp_path / "f"
    source.write_bytes(b"x")
    with pytest.raises(ValueError):
        store.put(job_id, name, source, ttl_s=60)


def test_store_delete_job(store, tmp_path):
    source = tmp_path / "f"
    source.write_bytes(b"data")
    store.put(JOB, "a.mp3", source, ttl_s=60)
    store.local_path(JOB, "a.mp3")
    store.delete_job(JOB)
    assert not store.exists(JOB, "a.mp3")


def test_redis_store_expires_with_job_ttl(binary, tmp_path):
    store = RedisStore(binary, "t", tmp_path / "cache")
    source = tmp_path / "f"
    source.write_bytes(b"x" * 10)
    store.put(JOB, "a.mp3", source, ttl_s=1)
    assert store.exists(JOB, "a.mp3")
    wait_until(lambda: not store.exists(JOB, "a.mp3"), 5, what="artifact expiry")


def test_directory_store_sweep_removes_expired_jobs(client, tmp_path):
    jobs = JobStore(client, "t", ttl_s=1)
    alive = JobStore(client, "t", ttl_s=60).create("music", {}, [{"seed": 1}], cost=1.0)
    expiring = jobs.create("music", {}, [{"seed": 1}], cost=1.0)
    store = DirectoryStore(tmp_path / "store")
    source = tmp_path / "f"
    source.write_bytes(b"x")
    for job_id in (alive, expiring):
        store.put(job_id, "track0.mp3", source)
    wait_until(lambda: jobs.job(expiring) is None, 5, what="job expiry")
    removed = store.sweep(lambda job_id: jobs.job(job_id) is not None)
    assert removed == [expiring]
    assert store.exists(alive, "track0.mp3") and not store.exists(expiring, "track0.mp3")


def test_cancel_ends_every_track_no_live_stage_holds(client):
    jobs = JobStore(client, "t", ttl_s=60)
    job_id = jobs.create("music", {}, [{"seed": 1}, {"seed": 2}, {"seed": 3}, {"seed": 4}], cost=1.0)
    _start(jobs, job_id, 0)
    assert jobs.transition("finish", job_id, 0, stage="backbone", owner=OWNER)  # backbone done, next not started
    _start(jobs, job_id, 1)  # a stage is running, its lease live
    _start(jobs, job_id, 2)
    client.delete(jobs.lease_key(job_id, 2))  # a stage whose lease expired: nobody will see the flag
    assert sorted(jobs.request_cancel(job_id)) == sorted(["t0", "t1", "t2", "t3"] * 3)
    states = [(t["state"], t["detail"]) for t in jobs.tracks(job_id, 4)]
    assert states == [
        ("canceled", "canceled before superres"),
        ("backbone", "queued"),
        ("canceled", "canceled during backbone (its stage had stopped)"),
        ("canceled", "canceled before it started"),
    ]
    assert jobs.cancel_requested(job_id)
