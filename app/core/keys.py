"""Every Redis key Encore keeps, named once.

`KEYS` is the layout: a pattern per key, under one prefix (`encore` by default; ENCORE_KEY_PREFIX). Python
builds keys through `Layout`; the Lua scripts (app/control/lua/) build them through `K`, a table of functions
generated from the same patterns (`lua_keys`), so a key's shape lives in this table and nowhere else. Job keys
expire with the job; the rest live as long as the deployment.
"""

from __future__ import annotations

import re
import string
from typing import Iterable

KEYS: dict[str, str] = {
    # a job and its tracks
    "job": "job:{job_id}",  # hash: the job record
    "track": "job:{job_id}:track:{track}",  # hash: one track's record
    "event_stream": "job:{job_id}:events",  # stream: the job's events, replayed to a client
    "job_view": "job:{job_id}:view",  # hash: the poll's reply, rendered by the writes (app/control/lua/job_view.lua)
    "webhook_deliveries": "job:{job_id}:webhooks",  # list: its webhook delivery attempts (JSON each)
    "events": "events:{job_id}",  # pub/sub channel: the same events, live
    "cancel": "cancel:{job_id}",  # flag: a cancel was asked for
    "lease": "lease:{job_id}:{track}",  # string: who runs the track's stage, with an expiry
    "deliveries": "deliveries:{task_id}",  # counter: how often a stage message was delivered
    "artifact": "artifact:{job_id}:{name}",  # list: a file's chunks (the Redis artifact store)
    "artifact_index": "artifacts:{job_id}",  # set: the job's stored file names
    # indexes over jobs and tracks
    "jobs": "jobs",  # zset: every job by creation time
    "jobs_in_state": "jobs:{kind}:{state}",  # zset: a kind's jobs in one client-facing state
    "tenant_jobs": "tenant:{tenant}:jobs",  # zset: one tenant's jobs by creation time (app/core/tenants.py)
    "tenant_open": "tenant:{tenant}:open",  # zset: its open tracks (job:track) by their job's expiry
    "tenant_usage": "tenant:{tenant}:usage",  # hash: its jobs, tracks and GPU-seconds, counted since Redis began
    "tenant_streams": "tenant:{tenant}:streams",  # zset: one tenant's open event streams by expiry (app/control/streams.py)
    "created": "created",  # zset: tracks written, not routed yet
    "cancels": "cancels",  # zset: canceled jobs a live stage still held, by when (app/control/recovery.py)
    "unrouted": "unrouted",  # zset: parked tracks by priority, then fair tag
    "seq": "seq",  # counter: submissions (the low part of a track's fair tag, app/core/priority.py)
    "fair_last": "fair:last",  # hash: tenant -> the fair round of its latest track (app/core/priority.py)
    "fair_now": "fair:now",  # string: the fair round of the latest track that started
    # queues
    "queues": "queues",  # set: every queue a track was assigned to
    "draining": "draining",  # set: queues an operator drained
    "waiting": "queue:{queue}:waiting",  # zset: queued tracks by priority, then fair tag
    "load": "queue:{queue}:load",  # zset: tracks not finished on the queue, by cost
    "cost": "queue:{queue}:cost",  # counter: that set's scores summed, in thousandths
    "queue_live_at": "queue:{queue}:live_at",  # string: when a consumer was last seen
    "queue_slots": "queue:{queue}:slots",  # string: how many tracks its worker's backbone engine runs at once
    "backlog": "queue:{queue}:backlog",  # hash: the backlog index (app/control/backlog.py)
    "backlog_sums": "queue:{queue}:backlog:sums",  # hash: its totals per group and class
    "backlog_tree": "queue:{queue}:backlog:tree",  # hash: its Fenwick trees over submission order
    "running": "queue:{queue}:running",  # zset: running tracks by fair tag
    # workers
    "workers": "workers",  # set: registered worker names
    "worker": "worker:{name}",  # hash: a worker's heartbeat, with an expiry
    "worker_current": "worker:{name}:current",  # hash: the stage it runs now
    # control-plane state
    "lock": "lock:{name}",  # string: a short mutual-exclusion lock
    "idempotency": "idempotency:{scope}:{key_hash}",  # hash: a submit's Idempotency-Key claim
    "throughput": "throughput",  # hash: learned seconds per cost unit per stage
    "estimate_versions": "estimate:versions",  # hash: a counter per queue's backlog members, one for the rates
    "rate_limits": "ratelimit",  # prefix of the submit routes' rate-limit counters
    "webhook_outbox": "webhooks:outbox",  # list: webhook messages not yet handed out
    "webhook_seq": "webhooks:seq",  # counter: webhook message ids
    "webhook_in_flight": "webhooks:in-flight:{worker}",  # list: messages a webhook worker is handing out
    "webhook_pending": "webhooks:pending",  # zset: messages handed out, not settled, by their lease's deadline
    "webhook_pending_data": "webhooks:pending:data",  # hash: each one's message, attempt and current task id
    "stage_seconds": "metrics:stage_seconds:{kind}:{stage}",  # hash: a stage's run-time histogram (app/control/metrics.py)
    "submitted": "metrics:submitted",  # hash: submissions counted per kind
    "ticket_secret": "events:ticket-secret",  # string: the key of the event streams' tickets (app/control/streams.py)
}

_FIELD = re.compile(r"{(\w+)}")


def fields_of(name: str) -> list[str]:
    """The parts a key's pattern takes, in order."""
    return [field for _, field, _, _ in string.Formatter().parse(KEYS[name]) if field]


class Layout:
    """Redis keys under one prefix, built from `KEYS`."""

    def __init__(self, prefix: str = "encore"):
        self.prefix = prefix

    def key(self, key_name: str, /, **parts: object) -> str:
        """The key `key_name` of `KEYS` with its parts filled in; every part the pattern names is required."""
        if set(parts) != set(fields_of(key_name)):
            raise TypeError(f"key {key_name!r} takes {fields_of(key_name)}, not {sorted(parts)}")
        return f"{self.prefix}:{KEYS[key_name].format(**parts)}"

    def job(self, job_id: str) -> str:
        return self.key("job", job_id=job_id)

    def track(self, job_id: str, track: int) -> str:
        return self.key("track", job_id=job_id, track=track)

    def event_stream(self, job_id: str) -> str:
        return self.key("event_stream", job_id=job_id)

    def job_view(self, job_id: str) -> str:
        return self.key("job_view", job_id=job_id)

    def webhook_deliveries(self, job_id: str) -> str:
        return self.key("webhook_deliveries", job_id=job_id)

    def events(self, job_id: str) -> str:
        return self.key("events", job_id=job_id)

    def cancel(self, job_id: str) -> str:
        return self.key("cancel", job_id=job_id)

    def lease(self, job_id: str, track: int) -> str:
        return self.key("lease", job_id=job_id, track=track)

    def deliveries(self, task_id: str) -> str:
        return self.key("deliveries", task_id=task_id)

    def artifact(self, job_id: str, name: str) -> str:
        return self.key("artifact", job_id=job_id, name=name)

    def artifact_index(self, job_id: str) -> str:
        return self.key("artifact_index", job_id=job_id)

    @property
    def jobs(self) -> str:
        return self.key("jobs")

    def tenant_jobs(self, tenant: str) -> str:
        return self.key("tenant_jobs", tenant=tenant)

    def tenant_open(self, tenant: str) -> str:
        return self.key("tenant_open", tenant=tenant)

    def tenant_usage(self, tenant: str) -> str:
        return self.key("tenant_usage", tenant=tenant)

    def tenant_streams(self, tenant: str) -> str:
        return self.key("tenant_streams", tenant=tenant)

    def jobs_in_state(self, kind: str, state: str) -> str:
        return self.key("jobs_in_state", kind=kind, state=state)

    @property
    def created(self) -> str:
        return self.key("created")

    @property
    def cancels(self) -> str:
        return self.key("cancels")

    @property
    def unrouted(self) -> str:
        return self.key("unrouted")

    @property
    def seq(self) -> str:
        return self.key("seq")

    @property
    def fair_last(self) -> str:
        return self.key("fair_last")

    @property
    def fair_now(self) -> str:
        return self.key("fair_now")

    @property
    def queues(self) -> str:
        return self.key("queues")

    @property
    def draining(self) -> str:
        return self.key("draining")

    def waiting(self, queue: str) -> str:
        return self.key("waiting", queue=queue)

    def load(self, queue: str) -> str:
        return self.key("load", queue=queue)

    def cost(self, queue: str) -> str:
        return self.key("cost", queue=queue)

    def backlog(self, queue: str) -> str:
        """The queue's backlog index; its sums and trees hang off this key (app/control/backlog.py)."""
        return self.key("backlog", queue=queue)

    def backlog_sums(self, queue: str) -> str:
        return self.key("backlog_sums", queue=queue)

    def backlog_tree(self, queue: str) -> str:
        return self.key("backlog_tree", queue=queue)

    def running(self, queue: str) -> str:
        return self.key("running", queue=queue)

    def queue_live_at(self, queue: str) -> str:
        return self.key("queue_live_at", queue=queue)

    def queue_slots(self, queue: str) -> str:
        return self.key("queue_slots", queue=queue)

    @property
    def workers(self) -> str:
        return self.key("workers")

    def worker(self, name: str) -> str:
        return self.key("worker", name=name)

    def worker_current(self, name: str) -> str:
        return self.key("worker_current", name=name)

    def lock(self, name: str) -> str:
        return self.key("lock", name=name)

    def idempotency(self, scope: str, key_hash: str) -> str:
        return self.key("idempotency", scope=scope, key_hash=key_hash)

    @property
    def throughput(self) -> str:
        return self.key("throughput")

    @property
    def estimate_versions(self) -> str:
        return self.key("estimate_versions")

    @property
    def rate_limits(self) -> str:
        return self.key("rate_limits")

    @property
    def webhook_outbox(self) -> str:
        return self.key("webhook_outbox")

    @property
    def webhook_seq(self) -> str:
        return self.key("webhook_seq")

    def webhook_in_flight(self, worker: str) -> str:
        return self.key("webhook_in_flight", worker=worker)

    @property
    def webhook_pending(self) -> str:
        return self.key("webhook_pending")

    @property
    def webhook_pending_data(self) -> str:
        return self.key("webhook_pending_data")

    @property
    def ticket_secret(self) -> str:
        return self.key("ticket_secret")

    def stage_seconds(self, kind: str, stage: str) -> str:
        return self.key("stage_seconds", kind=kind, stage=stage)

    @property
    def submitted(self) -> str:
        return self.key("submitted")


def lua_keys(names: Iterable[str] | None = None) -> str:
    """Lua source defining `keys_under(P)`: a table of functions, one per `KEYS` entry (or per entry of `names`
    only: a script builds this table on every call), taking the pattern's parts in order (`K.track(job_id,
    track)`), each giving the same key `Layout` gives for prefix P."""
    wanted = KEYS if names is None else set(names)
    lines = ["local function keys_under(P)", "  local K = {}"]
    for name, pattern in KEYS.items():
        if name not in wanted:
            continue
        params = fields_of(name)
        pieces = [f"'{literal}'" if literal else "" for literal in _FIELD.split(pattern)[::2]]
        body = ["P", "':'"]
        for index, literal in enumerate(pieces):
            if literal:
                body.append(literal)
            if index < len(params):
                body.append(f"tostring({params[index]})")
        lines.append(f"  K.{name} = function({', '.join(params)}) return {' .. '.join(body)} end")
    lines += ["  return K", "end"]
    return "\n".join(lines) + "\n"
