"""Job records and the artifact store against a real redis-server."""
from __future__ import annotations


import pytest
import redis

from app.artifacts import DirectoryStore, RedisStore
from app.jobs import JobStore, overall_state
from tests.conftest import wait_until


@pytest.fixture
def client(redis_base_url):
    text = redis.Redis.from_url(f"{redis_base_url}/510", decode_responses=True)
    text.flushdb()
    yield text
    text.flushdb()


@pytest.fixture
def binary(redis_base_url):
    return redis.Redis.from_url(f"{redis_base_url}/510")


def test_terminal_track_refuses_late_writes(client):
    jobs = JobStore(client, "t", ttl_s=60)
    job_id = jobs.create("music", {"duration_s": 2}, [{"seed": 1}], cost=2.0)
    assert jobs.update(job_id, 0, state="backbone", progress=0.5)
    assert jobs.finish(job_id, 0, "canceled", detail="canceled")
    assert not jobs.update(job_id, 0, state="superres", progress=0.9)
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
    for job_id in ids:
        jobs.assign_queue(job_id, 0, "gpu0", [], 1.0)
    assert [jobs.record(j)["queue_position"] for j in ids] == [1, 2, 3]
    jobs.mark_started(ids[0], 0, "gpu0")
    jobs.update(ids[0], 0, state="backbone")
    assert [jobs.record(j)["queue_position"] for j in ids] == [0, 1, 2]


def test_index_drops_expired_jobs_and_states_agree_with_records(client, monkeypatch):
    monkeypatch.setattr("app.jobs.PIPELINE_CHUNK", 2)  # several chunks with a handful of jobs
    jobs = JobStore(client, "t", ttl_s=60)
    music = jobs.create("music", {}, [{"seed": 1}, {"seed": 2}], cost=1.0)
    lipsync = jobs.create("lipsync", {}, [{}], cost=1.0)
    gone = jobs.create("music", {}, [{"seed": 3}], cost=1.0)
    newest = jobs.create("music", {}, [{"seed": 4}], cost=1.0)
    jobs.update(music, 0, state="backbone")
    jobs.finish(music, 1, "done")
    jobs.fail(lipsync, 0, "no face detected")
    client.delete(jobs.job_key(gone))  # expired
    assert jobs.recent_job_ids(limit=10) == [newest, lipsync, music]
    assert client.zrange(jobs.jobs_key, 0, -1) == [music, lipsync, newest]
    states = jobs.track_states([music, lipsync, gone, newest])
    assert states == {music: ("music", ["backbone", "done"]), lipsync: ("lipsync", ["failed"]),
                      newest: ("music", ["queued"])}
    for job_id, (kind, track_states) in states.items():
        record = jobs.record(job_id)
        assert (record["kind"], [t["state"] for t in record["tracks"]]) == (kind, track_states)


def test_overall_state():
    assert overall_state(["queued", "queued"]) == "queued"
    assert overall_state(["backbone", "queued"]) == "running"
    assert overall_state(["done", "done"]) == "done"
    assert overall_state(["done", "failed"]) == "partial"
    assert overall_state(["canceled", "failed"]) == "canceled"


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


@pytest.mark.parametrize("job_id,name", [("../" * 5, "x"), (JOB, "../etc/passwd"), (JOB, ".hidden"),
                                          (JOB, "a/b"), ("zz" * 16, "x")])
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


def test_cancel_ends_tracks_waiting_between_stages_but_not_running_ones(client):
    jobs = JobStore(client, "t", ttl_s=60)
    job_id = jobs.create("music", {}, [{"seed": 1}, {"seed": 2}, {"seed": 3}], cost=1.0)
    jobs.update(job_id, 0, state="superres", stage="superres", running="0")  # backbone done, next not started
    jobs.update(job_id, 1, state="backbone", stage="backbone", running="1")  # a stage is running
    assert jobs.request_cancel(job_id) == []
    assert jobs.track(job_id, 0)["state"] == "canceled"
    assert jobs.track(job_id, 0)["detail"] == "canceled before superres"
    assert jobs.track(job_id, 1)["state"] == "backbone"  # left to the stage, which polls the flag
    assert jobs.track(job_id, 2)["state"] == "canceled"
    assert jobs.cancel_requested(job_id)
