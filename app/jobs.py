"""Job records in Redis: the client-facing truth about every job (Celery's PENDING also means "unknown id").

Layout (prefix `encore` by default, every key expires with the job):
  {p}:job:{id}              hash: kind, params (JSON), num_tracks, created_at, expires_at
  {p}:job:{id}:track:{i}    hash: state, stage, progress, detail, queue, worker, error, artifacts, stages, ...
  {p}:cancel:{id}           set once the job was canceled; stages poll it
  {p}:jobs                  zset of job ids by creation time (pruned lazily)
  {p}:queue:{q}:waiting     zset of "job:track" not started yet, by submission order (queue positions)
  {p}:queue:{q}:load        zset of "job:track" not finished yet, scored by estimated cost (routing)
  {p}:queues                set of every queue a track was ever assigned to
  {p}:events:{id}           pub/sub channel: every state/progress change of the job

Workers and the web both write track hashes; a Lua script refuses any write to a track that already
reached a terminal state, so a cancel can never be overwritten by a late progress report.
"""
from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any, Callable

import redis

from app.kinds import CANCELED, FAILED, QUEUED, TERMINAL_STATES

JOB_ID_PATTERN = re.compile(r"^[0-9a-f]{32}$")

_WRITE_IF_LIVE = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if state == 'done' or state == 'failed' or state == 'canceled' then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""


def is_job_id(value: str) -> bool:
    return bool(JOB_ID_PATTERN.match(value))


def _encode(fields: dict[str, Any]) -> dict[str, str]:
    """Hash values are strings; anything else is stored as JSON."""
    return {key: value if isinstance(value, str) else json.dumps(value) for key, value in fields.items()}


def _flatten(fields: dict[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]


_JSON_FIELDS = ("progress", "artifacts", "stages", "task_ids", "seq", "attempts", "track", "cost", "restarts", "song")


def _decode_track(raw: dict[str, str]) -> dict[str, Any]:
    track: dict[str, Any] = dict(raw)
    for key in _JSON_FIELDS:
        if key in track:
            track[key] = json.loads(track[key])
    return track


# A sibling track taken over by a running first stage: still waiting, on the same queue, with a chain.
_CLAIM_WAITING = """
if redis.call('HGET', KEYS[1], 'state') ~= 'queued' then return 0 end
if redis.call('HGET', KEYS[1], 'queue') ~= ARGV[2] then return 0 end
if redis.call('HGET', KEYS[1], 'task_ids') == '[]' then return 0 end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'stage', ARGV[4], 'running', '1', 'worker', ARGV[5], 'detail', ARGV[6],
           'progress', '0.0', 'updated_at', ARGV[7])
if ARGV[8] ~= '' then redis.call('SET', KEYS[3], ARGV[8], 'PX', ARGV[9]) end
return 1
"""

# Leases: a running stage holds {p}:lease:{job}:{track} (its owner: worker, delivery, pid) and renews it every
# few seconds; a track marked running with no lease is one whose stage died (app/routing.reap_dead_stages).
# Taking one is atomic with checking that the track is open and the delivery is of its current chain, and
# restarting a track (recovery._RESTART_STARTED) is atomic with checking that nobody holds its lease: so a
# stage never starts on a track that was just moved, and a track is never moved under a live stage.
_TAKE_LEASE = """
local state = redis.call('HGET', KEYS[1], 'state')
if (not state) or state == 'done' or state == 'failed' or state == 'canceled' then return 0 end
local ids = redis.call('HGET', KEYS[1], 'task_ids')
if (not ids) or not string.find(ids, '"' .. ARGV[2] .. '"', 1, true) then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
return 1
"""
_RENEW_LEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
_RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


class JobStore:
    """Create, read and update job records; the only code that knows their Redis layout."""

    def __init__(self, client: redis.Redis, prefix: str = "encore", ttl_s: int = 24 * 3600):
        self.redis = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._write_if_live = client.register_script(_WRITE_IF_LIVE)
        self._claim_waiting = client.register_script(_CLAIM_WAITING)
        self._take_lease = client.register_script(_TAKE_LEASE)
        self._renew_lease = client.register_script(_RENEW_LEASE)
        self._release_lease = client.register_script(_RELEASE_LEASE)

    # -- keys ---------------------------------------------------------------------------------------
    def job_key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def track_key(self, job_id: str, track: int) -> str:
        return f"{self.prefix}:job:{job_id}:track:{track}"

    def cancel_key(self, job_id: str) -> str:
        return f"{self.prefix}:cancel:{job_id}"

    def waiting_key(self, queue: str) -> str:
        return f"{self.prefix}:queue:{queue}:waiting"

    def load_key(self, queue: str) -> str:
        return f"{self.prefix}:queue:{queue}:load"

    def events_channel(self, job_id: str) -> str:
        """Pub/sub channel carrying every state and progress change of a job (live views, tests)."""
        return f"{self.prefix}:events:{job_id}"

    @property
    def queues_key(self) -> str:
        return f"{self.prefix}:queues"

    def queues(self) -> set[str]:
        """Every queue a track was ever assigned to."""
        return set(self.redis.smembers(self.queues_key))

    @property
    def jobs_key(self) -> str:
        return f"{self.prefix}:jobs"

    # -- create -------------------------------------------------------------------------------------
    def create(self, kind: str, params: dict[str, Any], track_params: list[dict[str, Any]],
               cost: float) -> str:
        """Write a job with one queued track per entry of `track_params`; returns its unguessable id."""
        job_id = secrets.token_hex(16)
        now = time.time()
        pipe = self.redis.pipeline()
        pipe.hset(self.job_key(job_id), mapping={
            "kind": kind, "params": json.dumps(params), "num_tracks": len(track_params),
            "created_at": now, "expires_at": now + self.ttl_s,
        })
        pipe.expire(self.job_key(job_id), self.ttl_s)
        for index, extra in enumerate(track_params):
            key = self.track_key(job_id, index)
            pipe.hset(key, mapping=_encode({
                "track": index, "state": QUEUED, "stage": "", "progress": 0.0,
                "detail": "waiting for a worker", "queue": "", "worker": "", "error": "",
                "artifacts": [], "stages": {}, "task_ids": [], "cost": cost, "attempts": 0, "restarts": 0,
                "params": json.dumps(extra), "updated_at": str(now),
            }))
            pipe.expire(key, self.ttl_s)
        pipe.zadd(self.jobs_key, {job_id: now})
        pipe.execute()
        return job_id

    # -- read ---------------------------------------------------------------------------------------
    def job(self, job_id: str) -> dict[str, Any] | None:
        raw = self.redis.hgetall(self.job_key(job_id)) if is_job_id(job_id) else {}
        if not raw:
            return None
        return {
            "job_id": job_id, "kind": raw["kind"], "params": json.loads(raw["params"]),
            "num_tracks": int(raw["num_tracks"]), "created_at": float(raw["created_at"]),
            "expires_at": float(raw["expires_at"]),
        }

    def track(self, job_id: str, index: int) -> dict[str, Any] | None:
        raw = self.redis.hgetall(self.track_key(job_id, index))
        if not raw:
            return None
        track = _decode_track(raw)
        track["params"] = json.loads(track["params"])
        return track

    def tracks(self, job_id: str, num_tracks: int) -> list[dict[str, Any]]:
        return [t for t in (self.track(job_id, i) for i in range(num_tracks)) if t is not None]

    def queue_position(self, queue: str, job_id: str, track: int) -> int:
        """1 for the next track to start on `queue`, 0 once started (or when not waiting)."""
        rank = self.redis.zrank(self.waiting_key(queue), f"{job_id}:{track}") if queue else None
        return 0 if rank is None else rank + 1

    def record(self, job_id: str) -> dict[str, Any] | None:
        """The whole client-facing record: job fields, tracks with queue positions, overall state."""
        job = self.job(job_id)
        if job is None:
            return None
        tracks = self.tracks(job_id, job["num_tracks"])
        for track in tracks:
            track["queue_position"] = (
                self.queue_position(track["queue"], job_id, track["track"]) if track["state"] == QUEUED else 0)
            if track["state"] == QUEUED and not track["queue"]:
                parked = self.redis.lpos(f"{self.prefix}:unrouted", f"{job_id}:{track['track']}")
                track["queue_position"] = 0 if parked is None else parked + 1
        job["tracks"] = tracks
        job["state"] = overall_state([t["state"] for t in tracks])
        waiting = [t["queue_position"] for t in tracks if t["state"] == QUEUED]
        job["queue_position"] = min(waiting) if waiting else 0
        job["cancel_requested"] = bool(self.redis.exists(self.cancel_key(job_id)))
        return job

    def recent_job_ids(self, limit: int = 100) -> list[str]:
        """Newest first; ids whose record expired are dropped from the index on the way."""
        ids = self.redis.zrevrange(self.jobs_key, 0, limit - 1)
        alive = []
        for chunk in _chunks(ids, PIPELINE_CHUNK):
            pipe = self.redis.pipeline(transaction=False)
            for job_id in chunk:
                pipe.exists(self.job_key(job_id))
            alive += [job_id for job_id, exists in zip(chunk, pipe.execute()) if exists]
        gone = set(ids) - set(alive)
        if gone:
            self.redis.zrem(self.jobs_key, *gone)
        return alive

    def track_states(self, job_ids: list[str]) -> dict[str, tuple[str, list[str]]]:
        """{job id: (kind, track states)} in two pipelined round trips per chunk of jobs, for gauges that
        look at every job (a record per job would cost 2 + tracks round trips each)."""
        result: dict[str, tuple[str, list[str]]] = {}
        for chunk in _chunks(job_ids, PIPELINE_CHUNK):
            pipe = self.redis.pipeline(transaction=False)
            for job_id in chunk:
                pipe.hmget(self.job_key(job_id), "kind", "num_tracks")
            heads = [(job_id, kind, int(count)) for job_id, (kind, count) in zip(chunk, pipe.execute())
                     if kind is not None and count is not None]
            pipe = self.redis.pipeline(transaction=False)
            for job_id, _, count in heads:
                for index in range(count):
                    pipe.hget(self.track_key(job_id, index), "state")
            states = iter(pipe.execute())
            for job_id, kind, count in heads:
                found = [state for state in (next(states) for _ in range(count)) if state is not None]
                result[job_id] = (kind, found)
        return result

    # -- update -------------------------------------------------------------------------------------
    def update(self, job_id: str, track: int, **fields: Any) -> bool:
        """Write fields unless the track already ended (then nothing changes and False is returned)."""
        fields["updated_at"] = str(time.time())
        written = self._write_if_live(keys=[self.track_key(job_id, track)], args=_flatten(_encode(fields))) == 1
        if written and ("state" in fields or "progress" in fields):
            event = {k: fields[k] for k in ("state", "stage", "progress", "detail", "error") if k in fields}
            self.redis.publish(self.events_channel(job_id), json.dumps({"job_id": job_id, "track": track, **event}))
        return written

    def assign_queue(self, job_id: str, track: int, queue: str, task_ids: list[str], cost: float) -> None:
        member = f"{job_id}:{track}"
        seq = self.redis.incr(f"{self.prefix}:seq")
        pipe = self.redis.pipeline()
        pipe.zadd(self.waiting_key(queue), {member: seq})
        pipe.zadd(self.load_key(queue), {member: cost})
        pipe.sadd(self.queues_key, queue)
        pipe.execute()
        self.update(job_id, track, queue=queue, task_ids=task_ids, seq=seq, detail="queued")

    def claim_waiting(self, job_id: str, track: int, queue: str, *, state: str, stage: str, worker: str,
                      detail: str, lease_owner: str = "", lease_s: float = 0.0) -> bool:
        """Take a track that waits on `queue` into a stage another track of its job is running (batching),
        with that run's lease on it when `lease_owner` is given."""
        keys = [self.track_key(job_id, track), self.waiting_key(queue), self.lease_key(job_id, track)]
        args = [f"{job_id}:{track}", queue, state, stage, worker, detail, str(time.time()), lease_owner,
                str(int(lease_s * 1000))]
        return self._claim_waiting(keys=keys, args=args) == 1

    # -- leases ---------------------------------------------------------------------------------------
    def lease_key(self, job_id: str, track: int) -> str:
        return f"{self.prefix}:lease:{job_id}:{track}"

    def take_lease(self, job_id: str, track: int, owner: str, task_id: str, lease_s: float) -> bool:
        """The delivery `task_id` starts a stage of the track: True (and the lease is its) unless the track
        ended or the delivery is not of its current chain."""
        keys = [self.track_key(job_id, track), self.lease_key(job_id, track)]
        return self._take_lease(keys=keys, args=[owner, task_id, int(lease_s * 1000)]) == 1

    def renew_lease(self, job_id: str, track: int, owner: str, lease_s: float) -> bool:
        """False when the lease is gone or another's: the track was taken from this stage, which must stop."""
        return self._renew_lease(keys=[self.lease_key(job_id, track)], args=[owner, int(lease_s * 1000)]) == 1

    def release_lease(self, job_id: str, track: int, owner: str) -> None:
        self._release_lease(keys=[self.lease_key(job_id, track)], args=[owner])

    def has_lease(self, job_id: str, track: int) -> bool:
        return bool(self.redis.exists(self.lease_key(job_id, track)))

    def mark_started(self, job_id: str, track: int, queue: str) -> None:
        self.redis.zrem(self.waiting_key(queue), f"{job_id}:{track}")

    def finish(self, job_id: str, track: int, state: str, **fields: Any) -> bool:
        """Move a track to a terminal state and drop it from its queue's bookkeeping."""
        assert state in TERMINAL_STATES
        changed = self.update(job_id, track, state=state, **fields)
        record = self.track(job_id, track)
        if record and record["queue"]:
            member = f"{job_id}:{track}"
            pipe = self.redis.pipeline()
            pipe.zrem(self.waiting_key(record["queue"]), member)
            pipe.zrem(self.load_key(record["queue"]), member)
            pipe.execute()
        return changed

    # -- cancel -------------------------------------------------------------------------------------
    def request_cancel(self, job_id: str, worker_live: Callable[[str], bool] = lambda name: True) -> list[str]:
        """Flag the job canceled; tracks not started yet end at once, and so do running ones whose worker is
        not live (`worker_live(name)`): nothing would ever see the flag. Returns Celery ids to revoke."""
        job = self.job(job_id)
        if job is None:
            return []
        self.redis.set(self.cancel_key(job_id), "1", ex=self.ttl_s)
        task_ids: list[str] = []
        for track in self.tracks(job_id, job["num_tracks"]):
            task_ids.extend(track["task_ids"])
            if track["state"] in TERMINAL_STATES:
                continue
            if track.get("running") == "1":
                if worker_live(track["worker"]):
                    continue  # a running stage sees the flag and ends the track itself
                self.finish(job_id, track["track"], CANCELED, progress=track["progress"],
                            detail=f"canceled during {track['stage']} (its worker {track['worker']} is offline)")
                continue
            # Not started, or between two stages: the revoked next stage would never run, so end it here.
            detail = "canceled before it started" if track["state"] == QUEUED else \
                f"canceled before {track['stage']}"
            self.finish(job_id, track["track"], CANCELED, detail=detail, progress=track["progress"])
        return task_ids

    def cancel_requested(self, job_id: str) -> bool:
        return bool(self.redis.exists(self.cancel_key(job_id)))

    def count_delivery(self, task_id: str) -> int:
        """How many times this Celery task id was delivered to a worker (redeliveries after a crash)."""
        key = f"{self.prefix}:deliveries:{task_id}"
        count = self.redis.incr(key)
        self.redis.expire(key, self.ttl_s)
        return int(count)

    def fail(self, job_id: str, track: int, message: str) -> bool:
        return self.finish(job_id, track, FAILED, error=message, detail="failed")


PIPELINE_CHUNK = 500


def _chunks(items: list[str], size: int) -> list[list[str]]:
    return [items[start:start + size] for start in range(0, len(items), size)]


def overall_state(states: list[str]) -> str:
    """queued | running | done | failed | canceled | partial (some tracks done, others not)."""
    if not states:
        return "failed"
    if all(s == QUEUED for s in states):
        return QUEUED
    if any(s not in TERMINAL_STATES for s in states):
        return "running"
    unique = set(states)
    if len(unique) == 1:
        return states[0]
    return "partial" if "done" in unique else (CANCELED if CANCELED in unique else FAILED)

