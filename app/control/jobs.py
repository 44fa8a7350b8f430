"""Job records in Redis: the client-facing truth about every job (Celery's PENDING also means "unknown id").

The layout and every change of a track's state belong to app/control/lifecycle.py; this module creates jobs, reads
them in the shape clients see, and names the transitions the web, the router, the reaper and the stages
make (each one is `Lifecycle.apply`, one atomic step).
"""

from __future__ import annotations

import json
import time
from typing import Any, cast

import redis

from app.adapters.redis_conn import decoded, decoded_members
from app.control.backlog import Estimates
from app.core.ids import is_job_id, new_job_id
from app.core.kinds import KINDS, QUEUED
from app.control.lifecycle import JSON_FIELDS, Lifecycle, Outcome, is_open, lua_stages
from app.control.scripts import script
from app.core.keys import Layout
from app.core.priority import DEFAULT_PRIORITY
from app.core.tenants import DEFAULT_TENANT, Tenant

JOB_STATES = ("queued", "running", "done", "failed", "canceled", "partial")
_INTERNAL_JOB_FIELDS = ("n_waiting", "n_active", "n_done", "n_failed", "n_canceled")


def _decode_track(raw: dict[str, str]) -> dict[str, Any]:
    track: dict[str, Any] = dict(raw)
    for key in JSON_FIELDS:
        if key in track:
            track[key] = json.loads(track[key])
    return track


def _decode_job(job_id: str, raw: dict[str, str]) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "kind": raw["kind"],
        "params": json.loads(raw["params"]),
        "num_tracks": int(raw["num_tracks"]),
        "created_at": float(raw["created_at"]),
        "expires_at": float(raw["expires_at"]),
    }


class JobStore:
    """Create and read job records; every state change is a named transition (app/control/lifecycle.py)."""

    def __init__(
        self,
        client: redis.Redis,
        prefix: str = "encore",
        ttl_s: int = 24 * 3600,
        events_maxlen: int = 1000,
        webhook_progress_s: float = 5.0,
        offline_after_s: float = 7.0,
    ):
        self.redis = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.offline_after_s = offline_after_s  # a queue unseen this long has no live worker: its tracks' ETA is null
        self.keys = Layout(prefix)
        self.lifecycle = Lifecycle(client, self.keys, events_maxlen, webhook_progress_s)
        self.estimates = Estimates(client, prefix, lua_stages())
        self._renew_lease = script(client, "renew_lease")

    # -- keys (the layout is app/core/keys.py) ------------------------------------------------
    def job_key(self, job_id: str) -> str:
        return self.keys.job(job_id)

    def track_key(self, job_id: str, track: int) -> str:
        return self.keys.track(job_id, track)

    def waiting_key(self, queue: str) -> str:
        return self.keys.waiting(queue)

    def load_key(self, queue: str) -> str:
        return self.keys.load(queue)

    def lease_key(self, job_id: str, track: int) -> str:
        return self.keys.lease(job_id, track)

    def events_channel(self, job_id: str) -> str:
        """Pub/sub channel carrying every transition of a job's tracks (live views, tests)."""
        return self.keys.events(job_id)

    @property
    def jobs_key(self) -> str:
        return self.keys.jobs

    def queues(self) -> set[str]:
        """Every queue a track was ever assigned to."""
        return decoded(self.redis.smembers(self.keys.queues))

    # -- create -------------------------------------------------------------------------------------
    def create(
        self,
        kind: str,
        params: dict[str, Any],
        track_params: list[dict[str, Any]],
        cost: float,
        job_id: str | None = None,
        webhook: dict[str, Any] | None = None,
        priority: str = DEFAULT_PRIORITY,
        tenant: str = DEFAULT_TENANT,
        trace: dict[str, str] | None = None,
    ) -> str:
        """Write a job owned by `tenant` with one parked track per entry of `track_params` (one round trip); returns its
        unguessable id (`job_id` when the caller drew it first: an idempotent submit claims it before). The
        caller routes it. `webhook` ({"url", "events"}, app/adapters/webhooks.check_target) is kept in the job hash,
        where the transitions read which events to send; so is `priority` (app/core/priority.py), which orders its
        tracks while they are parked or queued, and `trace` (the submit's trace context: the parent of the spans
        of stages run outside the job's own deliveries, app/adapters/tracing.TrackSpan)."""
        job_id = job_id or new_job_id()
        now = time.time()
        pipe = self.redis.pipeline()
        pipe.hset(
            self.job_key(job_id),
            mapping={
                "kind": kind,
                "params": json.dumps(params),
                "num_tracks": len(track_params),
                "created_at": now,
                "expires_at": now + self.ttl_s,
                "priority": priority,
                "tenant": tenant,
                **{name: 0 for name in _INTERNAL_JOB_FIELDS},
                **({"webhook": webhook["url"], "webhook_events": ",".join(webhook["events"])} if webhook else {}),
                **({"trace": json.dumps(trace)} if trace else {}),
            },
        )
        pipe.expire(self.job_key(job_id), self.ttl_s)
        for index, extra in enumerate(track_params):
            self.lifecycle.apply(
                "submit",
                job_id,
                index,
                {"cost": cost},
                {"params": extra, "detail": "waiting for a worker"},
                client=pipe,
            )
        pipe.zadd(self.jobs_key, {job_id: now})
        pipe.zremrangebyscore(self.jobs_key, "-inf", now - self.ttl_s)  # expired jobs: the index holds what exists
        pipe.zadd(self.keys.tenant_jobs(tenant), {job_id: now})
        pipe.zremrangebyscore(self.keys.tenant_jobs(tenant), "-inf", now - self.ttl_s)  # its expired jobs
        pipe.hincrby(self.keys.tenant_usage(tenant), "jobs", 1)
        pipe.hincrby(self.keys.tenant_usage(tenant), "tracks", len(track_params))
        for state in JOB_STATES:  # the gauges' sets lose the ids of expired jobs here
            pipe.zremrangebyscore(self.keys.jobs_in_state(kind, state), "-inf", now)
        replies = pipe.execute()
        refused = [r for r in replies[2 : 2 + len(track_params)] if not r[0]]
        if refused:
            raise RuntimeError(f"job {job_id}: a track could not be created: {refused}")
        return job_id

    # -- read ---------------------------------------------------------------------------------------
    def job(self, job_id: str) -> dict[str, Any] | None:
        raw = decoded(self.redis.hgetall(self.job_key(job_id))) if is_job_id(job_id) else {}
        return _decode_job(job_id, raw) if raw else None

    def held_track(self, job_id: str, index: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]] | None:
        """A track's record, its job's and the job's trace context (`trace`) in one round trip: what a worker
        needs of a track it takes (None when either record is gone)."""
        if not is_job_id(job_id):
            return None
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.track_key(job_id, index))
        pipe.hgetall(self.job_key(job_id))
        track_raw, job_raw = (decoded(raw) for raw in pipe.execute())
        if not track_raw or not job_raw:
            return None
        trace = job_raw.get("trace")
        return _decode_track(track_raw), _decode_job(job_id, job_raw), dict(json.loads(trace)) if trace else {}

    def track(self, job_id: str, index: int) -> dict[str, Any] | None:
        raw = decoded(self.redis.hgetall(self.track_key(job_id, index)))
        return _decode_track(raw) if raw else None

    def tracks(self, job_id: str, num_tracks: int) -> list[dict[str, Any]]:
        pipe = self.redis.pipeline(transaction=False)
        for index in range(num_tracks):
            pipe.hgetall(self.track_key(job_id, index))
        return [_decode_track(raw) for raw in pipe.execute() if raw]

    def record(self, job_id: str, viewer: Tenant | None = None) -> dict[str, Any] | None:
        """The whole client-facing record in one round trip: job fields, tracks with queue positions (and
        their worker's status while open), overall state, cancel flag. With a `viewer`: None, as for an unknown
        job, when that tenant may not see the job (app/core/tenants.py): the read finds that out first, with the
        same work for another tenant's job as for none (reading the record first took another tenant ~0.13 ms
        longer for a real id than for an unknown one: a way to learn which ids exist)."""
        tenant = "" if viewer is None or viewer.is_admin else viewer.name
        raw = self.lifecycle.read_job(job_id, tenant=tenant) if is_job_id(job_id) else None
        if raw is None:
            return None
        return self._record(job_id, raw)

    def owner(self, job_id: str) -> str | None:
        """The tenant that owns the job (`default` for a job older than tenants), or None for an unknown job."""
        if not is_job_id(job_id):
            return None
        tenant, kind = self.redis.hmget(self.job_key(job_id), OWNER_FIELDS)
        return owner_of(tenant, kind)

    def visible(self, job_id: str, viewer: Tenant) -> bool:
        """Whether the job exists and `viewer` may see it: what every route on a job id checks first, so that
        another tenant's job answers exactly as one that does not exist."""
        owner = self.owner(job_id)
        return owner is not None and viewer.may_see(owner)

    def existing_record(self, job_id: str) -> dict[str, Any]:
        """The record of a job this request has just written or found; KeyError when it is gone after all
        (expired or forgotten in between), which the HTTP layer answers as an unknown job."""
        record = self.record(job_id)
        if record is None:
            raise KeyError(job_id)
        return record

    def record_with_eta(self, job_id: str, now: float, heads: int) -> tuple[dict[str, Any] | None, float | None]:
        """The record and, in the same round trip, its job's ETA at `now` in seconds (None while a track waits
        for a live worker, or its queue has had none for `offline_after_s`; app/control/backlog.py, app/control/eta.record_with_eta)."""
        raw = (
            self.lifecycle.read_job(job_id, eta_at=now, heads=heads, offline_after_s=self.offline_after_s)
            if is_job_id(job_id)
            else None
        )
        return (None, None) if raw is None else (self._record(job_id, raw), raw.get("eta_s"))

    def public_record_text(self, job_id: str, now: float, heads: int, viewer: Tenant) -> str | None:
        """The record as a client's poll answers it, with its ETA at `now`, as JSON text (Lifecycle.read_public);
        None for an unknown job, or one `viewer` may not see."""
        if not is_job_id(job_id):
            return None
        tenant = "" if viewer.is_admin else viewer.name
        return self.lifecycle.read_public(job_id, now, heads, tenant, self.offline_after_s)

    def _record(self, job_id: str, raw: dict[str, Any]) -> dict[str, Any]:
        job = _decode_job(job_id, raw["job"])
        tracks = raw["tracks"]  # decoded by the read
        job["tracks"] = tracks
        job["state"] = raw["state"]  # by the read, with the rule the transitions keep (lua/tracks.lua)
        waiting = [t["queue_position"] for t in tracks if t["state"] == QUEUED]
        job["queue_position"] = min(waiting) if waiting else 0
        job["cancel_requested"] = bool(raw["cancel"])
        if raw["job"].get("webhook"):  # one more read, only for the jobs that asked for webhooks
            job["webhook"] = {
                "url": raw["job"]["webhook"],
                "events": raw["job"]["webhook_events"].split(","),
                "deliveries": [
                    json.loads(item) for item in self.redis.lrange(self.keys.webhook_deliveries(job_id), 0, -1)
                ],
            }
        return job

    def events_after(
        self, job_id: str, after: str, block_ms: int | None = None, count: int = 500, client: redis.Redis | None = None
    ) -> list[tuple[str, dict[str, Any]]]:
        """The job's events after stream id `after` ("0-0": from the first kept), oldest first: at most
        `count`, waiting up to `block_ms` for one when there are none (None: do not wait), read with `client` (one
        whose read timeout outlasts the wait) or the store's own."""
        reply = (client or self.redis).xread({self.keys.event_stream(job_id): after}, count=count, block=block_ms)
        return stream_entries(reply)

    def recent_job_ids(self, limit: int = 100, tenant: str | None = None) -> list[str]:
        """Newest first, of every tenant or of `tenant` only; ids whose record expired are dropped from the index
        on the way."""
        index = self.jobs_key if tenant is None else self.keys.tenant_jobs(tenant)
        ids = decoded_members(self.redis.zrevrange(index, 0, limit - 1))
        alive = []
        for chunk in _chunks(ids, PIPELINE_CHUNK):
            pipe = self.redis.pipeline(transaction=False)
            for job_id in chunk:
                pipe.exists(self.job_key(job_id))
            alive += [job_id for job_id, exists in zip(chunk, pipe.execute(), strict=True) if exists]
        gone = set(ids) - set(alive)
        if gone:
            self.redis.zrem(index, *gone)
        return alive

    def job_counts(self) -> dict[tuple[str, str], int]:
        """{(kind, overall state): jobs held in Redis}, kept by the transitions: one round trip, whatever
        the number of jobs."""
        now = time.time()
        pairs = [(kind, state) for kind in sorted(KINDS) for state in JOB_STATES]
        pipe = self.redis.pipeline(transaction=False)
        for kind, state in pairs:
            pipe.zcount(self.keys.jobs_in_state(kind, state), f"({now}", "+inf")
        return dict(zip(pairs, pipe.execute(), strict=True))

    # -- transitions (app/control/lifecycle.TRANSITIONS) ----------------------------------------------
    def transition(
        self, event: str, job_id: str, track: int, fields: dict[str, Any] | None = None, **args: Any
    ) -> Outcome:
        return self.lifecycle.apply(event, job_id, track, args, fields)

    def report(self, job_id: str, track: int, owner: str, **fields: Any) -> bool:
        """The running stage's progress, detail, artifacts...: written only while `owner` holds the lease."""
        return bool(self.transition("report", job_id, track, fields, owner=owner))

    def route(self, job_id: str, track: int, queue: str, task_ids: list[str]) -> Outcome:
        return self.transition(
            "route",
            job_id,
            track,
            {"detail": "queued"},
            queue=queue,
            task_ids=json.dumps(task_ids),
            cancel_detail="canceled before it started",
        )

    def fail(self, job_id: str, track: int, message: str, owner: str = "", steal: str = "", died: bool = False) -> bool:
        """End the track failed; `died`: because the stage's delivery before this one died (a death to count)."""
        fields = {"error": message, "detail": "failed"}
        return bool(self.transition("fail", job_id, track, fields, owner=owner, steal=steal, died=died))

    def cancel(self, job_id: str, track: int, detail: str, owner: str = "", steal: str = "") -> bool:
        return bool(self.transition("cancel", job_id, track, {"detail": detail}, owner=owner, steal=steal))

    # -- leases -------------------------------------------------------------------------------------
    def renew_lease(self, job_id: str, track: int, owner: str, lease_s: float) -> bool:
        """False when the lease is gone or another's: the track was taken from this stage, which must stop."""
        return self._renew_lease(keys=[self.lease_key(job_id, track)], args=[owner, int(lease_s * 1000)]) == 1

    def lease(self, job_id: str, track: int) -> str | None:
        return decoded(self.redis.get(self.lease_key(job_id, track)))

    # -- cancel -------------------------------------------------------------------------------------
    def request_cancel(self, job_id: str) -> list[str]:
        """Flag the job canceled; every track no live stage holds ends at once (a running stage sees the
        flag and ends its own; one whose lease then expires unrenewed is the reaper's). Returns the Celery
        ids to revoke."""
        job = self.job(job_id)
        if job is None:
            return []
        self.redis.set(self.keys.cancel(job_id), "1", ex=self.ttl_s)
        task_ids: list[str] = []
        held = False
        for track in self.tracks(job_id, job["num_tracks"]):
            task_ids.extend(track["task_ids"])
            if is_open(track["status"]) and not self.cancel(job_id, track["track"], _cancel_detail(track)):
                held = True
        if held:  # a stage held it: should that stage be dead, any process ends the track once its lease expires
            self.redis.zadd(self.keys.cancels, {job_id: time.time()})
        return task_ids

    def end_unheld_tracks(self, job_id: str) -> tuple[list[dict[str, Any]], bool]:
        """The cancel's rule again, for a job in the pending-cancel set: each open track no lease holds now ends
        canceled. Returns (the records of the tracks it ended, whether the job is settled: no track open, no
        cancel pending, or no job), and takes a settled job out of the set."""
        job = self.job(job_id)
        if job is None or not self.cancel_requested(job_id):
            self.redis.zrem(self.keys.cancels, job_id)
            return [], True
        ended, still_open = [], False
        for track in self.tracks(job_id, job["num_tracks"]):
            if not is_open(track["status"]):
                continue
            if self.cancel(job_id, track["track"], _cancel_detail(track)):
                ended.append(track)
            else:
                still_open = True
        if not still_open:
            self.redis.zrem(self.keys.cancels, job_id)
        return ended, not still_open

    def cancel_requested(self, job_id: str) -> bool:
        return bool(self.redis.exists(self.keys.cancel(job_id)))

    def count_delivery(self, task_id: str) -> int:
        """How many times this Celery task id was delivered to a worker (redeliveries after a crash)."""
        key = self.keys.deliveries(task_id)
        pipe = self.redis.pipeline()
        pipe.incr(key)
        pipe.expire(key, self.ttl_s)
        return int(pipe.execute()[0])


def _cancel_detail(track: dict[str, Any]) -> str:
    status = track["status"]
    if status in ("created", "parked", QUEUED):
        return "canceled before it started"
    if status.startswith("waiting:"):
        return f"canceled before {track['stage']}"
    return f"canceled during {track['stage']} (its stage had stopped)"


PIPELINE_CHUNK = 500


def _chunks(items: list[str], size: int) -> list[list[str]]:
    return [items[start : start + size] for start in range(0, len(items), size)]


OWNER_FIELDS = ["tenant", "kind"]  # what JobStore.owner reads of the job hash (the events server too)


def owner_of(tenant: bytes | str | None, kind: bytes | str | None) -> str | None:
    """The owner from the job hash's `tenant` and `kind` fields: None when the job does not exist (no kind), and
    `default` for a job written before tenants existed."""
    if kind is None:
        return None
    if not tenant:
        return DEFAULT_TENANT
    return tenant.decode() if isinstance(tenant, bytes) else str(tenant)


def stream_entries(reply: Any) -> list[tuple[str, dict[str, Any]]]:
    """A text client's XREAD of one job's event stream, [[stream, [(entry id, {field: value}), ...]]] or empty, as
    (entry id, event) pairs."""
    entries = cast(list[list[Any]], reply)[0][1] if reply else []
    return [(entry_id, json.loads(fields["data"])) for entry_id, fields in entries]
