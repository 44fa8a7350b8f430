"""The track state machine: the one place that changes a track's state (and the Redis layout it keeps).

Every key Encore keeps in Redis is named in app/core/keys.py and built by its `Layout` (the Lua's `keys_under`).
Every change of a track's state goes through `Lifecycle.apply`, one Lua script (app/control/lua/transition.lua,
after the tables below generated as Lua locals by `lua_tables`, and the chunks lua/tracks.lua and
lua/backlog_write.lua) that, atomically: checks the track's current status against the
transition table below, checks who may make it (the holder of the running stage's lease, or anyone when no
lease is live), honours a pending cancel, moves the track between the bookkeeping sets its status implies
(its queue's backlog index among them, app/control/backlog.py), keeps the job-level gauges, bumps the track's
version, renders the track's part of the job's view (what a poll answers, app/control/views.py), appends the
change to the job's event stream and publishes it on the job's events channel.

Statuses (the `status` field of a track hash; clients see `state`, derived from it, as before):
  created       written, not routed yet (the submitter routes it once its inputs exist): in {p}:created
  parked        routed nowhere yet (no live worker, or moved off a queue): member of {p}:unrouted
  queued        on a queue, its first stage's message in the broker: in the queue's waiting and load sets
  running:S     stage S runs under a lease {p}:lease:{job}:{track}: in the queue's load set; the worker's
                current stage names it
  waiting:S     the stage before S finished; S's message is on the queue: in the queue's load set
  done | failed | canceled   terminal: in no set; only a `retry` (failed, canceled) changes them again

Layout (prefix `encore` by default; job keys expire with the job):
  {p}:job:{id}                 hash: kind, params, num_tracks, created_at, expires_at, priority (app/core/priority.py),
                               n_waiting/n_active/n_done/n_failed/n_canceled (tracks per category, kept by the
                               transition)
  {p}:job:{id}:track:{i}       hash: status, state, stage, queue, worker, progress, detail, error, task_ids,
                               stages, artifacts, seq, cost, attempts, restarts, deaths, version, updated_at, ...
  {p}:job:{id}:view            hash: what a poll answers of the job, rendered by the transitions, and its
                               cached ETA inputs (app/control/views.py, lua/job_view.lua)
  {p}:cancel:{id}              set once the job was canceled
  {p}:lease:{id}:{i}           the running stage's owner "worker|delivery|pid", expiring unless renewed
  {p}:deliveries:{task id}     how many times a stage message was delivered
  {p}:jobs                     zset of job ids by creation time
  {p}:jobs:{kind}:{state}      zset of job ids in that overall state, scored by expiry (gauges: ZCOUNT)
  {p}:created                  zset of created "job:track" by creation time (the reaper parks any the
                               submitter never routed: it died in between)
  {p}:unrouted                 zset of parked "job:track" by priority, then fair tag (the order they are
                               dispatched in)
  {p}:queue:{q}:waiting        zset of queued "job:track" by priority, then fair tag (queue positions)
  {p}:queue:{q}:load           zset of "job:track" not finished on q, scored by estimated cost
  {p}:queue:{q}:cost           the sum of that set's scores, in thousandths (the status page's estimated_load)
  {p}:queue:{q}:backlog*       the backlog index: per class and group the cost still to run, and the sums ahead
                               of each track (app/control/backlog.py), kept by the transition: what ETAs and routing read
  {p}:queue:{q}:running        zset of running "job:track" by seq (app/control/backlog.py)
  {p}:queues                   set of every queue a track was assigned to
  {p}:draining                 set of queues an operator drained
  {p}:seq                      submission counter
  {p}:fair:last, {p}:fair:now  each tenant's latest fair round, and the round of the latest track that started:
                               a new track's fair tag, its `seq` (app/core/priority.py)
  {p}:events:{id}              pub/sub channel: every transition of the job's tracks
  {p}:job:{id}:events          stream of the same events (the newest ENCORE_EVENTS_MAXLEN), expiring with the
                               job: its entry ids are the SSE event ids a client resumes from
  {p}:idempotency:{scope}:{h}  "body hash|job id" of a submission made with an Idempotency-Key (app/control/idempotency.py)
  {p}:webhooks:outbox          webhook messages written by the transitions (a transactional outbox), and
  {p}:webhooks:in-flight:{w}   those webhook worker w took; {p}:webhooks:seq their counter;
  {p}:job:{id}:webhooks        the job's delivery attempts (app/adapters/webhooks.py)
  {p}:workers, {p}:worker:{name}, {p}:worker:{name}:current, {p}:queue:{q}:live_at   worker registry
  {p}:queue:{q}:slots          how many tracks q's backbone engine runs at once (app/control/eta.announce_slots)
  {p}:metrics:*                stage-duration histograms, submission counters
  {p}:throughput               hash "queue|kind|stage" -> learned seconds per cost unit (+ "|n" samples, "|cold"
                               when it came from a stage that loaded models): the ETA and routing (app/control/eta.py)
  {p}:estimate:versions        hash: a counter per queue of its backlog's member changes, and one of learned
                               rates: a poll's cached ETA holds while they stay (lua/estimate.lua)
  {p}:ratelimit*               the submit routes' per-token rate-limit windows (the limits package, app/http/ratelimit.py)
  {p}:artifact(s):*            artifacts in the Redis store (app/adapters/artifacts.py)
  {p}:lock:*                   short locks (the reaper; admission under the open-track caps, app/control/quotas.py)

The script builds the keys of the queue a track is on from its hash, so it runs on a standalone Redis or a
Sentinel-managed primary, not on Redis Cluster.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Iterable

import redis

from app.control.backlog import lua_backlog
from app.control.scripts import script
from app.control.views import lua_view
from app.core.tenants import DEFAULT_TENANT
from app.core.keys import Layout
from app.core.kinds import KINDS, TERMINAL_STATES
from app.core.priority import DEFAULT_PRIORITY, FAIR_SPAN, RANK, RANK_SPAN

CREATED, PARKED, QUEUED, DONE, FAILED, CANCELED = "created", "parked", "queued", "done", "failed", "canceled"
RUNNING, WAITING = "running", "waiting"


def member(job_id: str, track: int) -> str:
    """How a track is named in the bookkeeping sets."""
    return f"{job_id}:{track}"


def parse_member(value: str) -> tuple[str, int]:
    job_id, _, track = value.rpartition(":")
    return job_id, int(track)


def running(stage: str) -> str:
    return f"{RUNNING}:{stage}"


def waiting(stage: str) -> str:
    return f"{WAITING}:{stage}"


def is_open(status: str | None) -> bool:
    return bool(status) and status not in TERMINAL_STATES


@dataclass(frozen=True)
class Transition:
    """One event of the table. Sources and target are patterns:
    `S` is the stage the event names; `*` any stage; `queued@first` queued when S is the first stage its
    chain runs (the kind's first, or the first unfinished one of a resumed track); `open` any non-terminal status; target `next` is waiting:<stage after S>, or done after the last;
    `same` keeps the status (a report). Holder: `lease` = the caller holds the lease; `free` = no live lease
    or the caller holds it (or names the dead one it replaces)."""

    sources: tuple[str, ...]
    target: str
    holder: str
    cancel: bool  # a pending cancel turns it into `canceled` (when the target is not terminal)
    does: str  # what it means, for the README


TRANSITIONS: dict[str, Transition] = {
    "submit": Transition(("new",), CREATED, "free", False, "a new track, routed by its submitter next"),
    "park": Transition(
        (CREATED,), PARKED, "free", True, "no live worker (or its submitter died before routing it): waits for one"
    ),
    "route": Transition((CREATED, PARKED), QUEUED, "free", True, "put on a live queue, its chain's first message sent"),
    "unroute": Transition(
        (QUEUED,), PARKED, "free", True, "taken off a dead or drained queue with its message, before any worker took it"
    ),
    "start": Transition(
        ("queued@first", "waiting:S", "running:S"),
        "running:S",
        "free",
        True,
        "a delivery of the track's current chain starts stage S and takes the lease "
        "(from running:S only when the lease is gone or was its own dead child's)",
    ),
    "adopt": Transition(
        ("queued@first", "waiting:S"),
        "running:S",
        "free",
        True,
        "a running stage takes a waiting track (of any job, on its queue) into its batch or its backbone engine, "
        "under its lease; the engine also takes the next stage of a track it finished (app/tasks/engine.py)",
    ),
    "report": Transition(("running:*",), "same", "lease", False, "progress, detail, artifacts of the running stage"),
    "finish": Transition(("running:S",), "next", "lease", True, "stage S is done: wait for the next, or done"),
    "release": Transition(
        ("running:S",),
        QUEUED,
        "lease",
        True,
        "an adopted track goes back to wait for its own message (its batch failed)",
    ),
    "restart": Transition(
        (QUEUED, "waiting:*", "running:*"),
        PARKED,
        "free",
        True,
        "its stage died (lease expired) or its queue has no consumer: parked to run again "
        "from its first unfinished stage; failed after ENCORE_MAX_DELIVERIES restarts",
    ),
    "resend": Transition(
        (QUEUED, "waiting:*"),
        "same",
        "free",
        False,
        "the message it waits for was lost: sent again (a new chain from that stage)",
    ),
    "fail": Transition(("open",), FAILED, "free", False, "its stage failed, timed out, or gave up"),
    "cancel": Transition(
        ("open",),
        CANCELED,
        "free",
        False,
        "the job was canceled and no live stage will see the flag (or the stage itself stops)",
    ),
    "retry": Transition(
        (FAILED, CANCELED),
        PARKED,
        "free",
        False,
        "a client re-runs a failed or canceled track (POST /api/v1/jobs/<id>/retry) from its first "
        "unfinished stage: counted in `retries`, its restart budget fresh, the job's cancel flag "
        "cleared (refused while a sibling is still being canceled)",
    ),
}

# Track fields stored as JSON (everything else is a plain string). Never decoded by Lua's cjson, which would turn
# every empty list, however deep, into {}: Python parses them, and the read script splices them in raw.
JSON_FIELDS = (
    "progress",
    "artifacts",
    "stages",
    "task_ids",
    "seq",
    "fifo",
    "attempts",
    "track",
    "cost",
    "restarts",
    "deaths",
    "retries",
    "song",
    "version",
    "params",
    "updated_at",
)

# Fields only the script writes; others (detail, progress, error, stages, artifacts, song, attempts) are
# passed by the caller and written with the transition.
STRUCTURAL = (
    "status",
    "state",
    "stage",
    "queue",
    "task_ids",
    "version",
    "restarts",
    "deaths",
    "retries",
    "seq",
    "fifo",
    "updated_at",
    "worker",
    "cost",
)


def _lua_table(value: Any) -> str:
    """A Python value as a Lua table literal (strings, bools, lists, dicts)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "{" + ", ".join(_lua_table(item) for item in value) + "}"
    return "{" + ", ".join(f"[{json.dumps(k)}] = {_lua_table(v)}" for k, v in value.items()) + "}"


READ_JOB_LIBRARIES = ("tracks", "estimate", "job_view")


def read_job_preludes() -> tuple[str, ...]:
    """What lua/read_job.lua is composed with (also bound to the events server's asyncio client)."""
    return (lua_stages(), lua_backlog(), lua_view(JSON_FIELDS))


def read_job_args(prefix: str, job_id: str) -> list[str]:
    """read_job's arguments for the plain record (no ETA)."""
    return [prefix, job_id, ",".join(JSON_FIELDS)]


def lua_stages() -> str:
    """Each kind's stage names as the Lua local STAGES and the terminal states as the set TERMINAL
    (app/core/kinds.TERMINAL_STATES; lua/tracks.lua's is_terminal reads it): all an estimate needs
    (app/control/backlog.py)."""
    stages = {kind.name: [stage.name for stage in kind.stages] for kind in KINDS.values()}
    terminal = {state: True for state in sorted(TERMINAL_STATES)}
    return f"local STAGES = {_lua_table(stages)}\nlocal TERMINAL = {_lua_table(terminal)}\n"


def lua_tables() -> str:
    """The transition table, stages, display states and priority ranks as Lua locals (T, STAGES, DISPLAY,
    STRUCTURAL, RANK, ...), for the scripts that change a track."""
    table = {
        name: {"sources": list(t.sources), "target": t.target, "holder": t.holder, "cancel": t.cancel}
        for name, t in TRANSITIONS.items()
    }
    display = {kind.name: {stage.name: stage.state for stage in kind.stages} for kind in KINDS.values()}
    ranks = {level: str(rank) for level, rank in RANK.items()}
    return (
        f"local T = {_lua_table(table)}\n{lua_stages()}"
        f"local DISPLAY = {_lua_table(display)}\nlocal STRUCTURAL = {_lua_table({f: True for f in STRUCTURAL})}\n"
        f"local RANK = {_lua_table(ranks)}\nlocal RANK_SPAN = {RANK_SPAN}\nlocal FAIR_SPAN = {FAIR_SPAN}\n"
        f"local DEFAULT_RANK = {RANK[DEFAULT_PRIORITY]}\n"
        f"local DEFAULT_TENANT = '{DEFAULT_TENANT}'\n"
    )


@dataclass(frozen=True)
class Outcome:
    """What a transition did: applied, turned into a cancel (a pending cancel won), or refused (why)."""

    applied: bool
    canceled: bool
    status: str
    reason: str = ""

    def __bool__(self) -> bool:
        return self.applied


class Lifecycle:
    """Runs the transition table against one Redis."""

    def __init__(self, client: redis.Redis, layout: Layout, events_maxlen: int = 1000, webhook_progress_s: float = 5.0):
        self.redis = client
        self.layout = layout
        self.events_maxlen = events_maxlen
        self.webhook_progress_s = webhook_progress_s
        writes = (lua_tables(), lua_backlog())
        self._script = script(
            client, "transition", *writes, lua_view(JSON_FIELDS), libraries=("tracks", "backlog_write", "job_view")
        )
        self._read_job = script(client, "read_job", *read_job_preludes(), libraries=READ_JOB_LIBRARIES)
        self._forget = script(client, "forget", *writes, libraries=("tracks", "backlog_write"))
        self._snapshot = script(client, "snapshot")

    def apply(
        self,
        event: str,
        job_id: str,
        track: int,
        args: dict[str, Any] | None = None,
        fields: dict[str, Any] | None = None,
        client: Any = None,
    ) -> Outcome:
        """Make one transition (see TRANSITIONS); `fields` are written with it (non-strings as JSON)."""
        encoded = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (fields or {}).items()}
        argv = [
            self.layout.prefix,
            event,
            job_id,
            str(track),
            repr(time.time()),
            json.dumps(args or {}),
            json.dumps(encoded) if encoded else "{}",
            str(self.events_maxlen),
            repr(self.webhook_progress_s),
        ]
        reply = self._script(keys=[], args=argv, client=client or self.redis)
        if client is not None and client is not self.redis:
            return Outcome(True, False, "")  # queued in a pipeline: its reply comes with the pipeline's
        code, status, reason = reply
        return Outcome(code > 0, code == 2, _text(status), _text(reason))

    def read_job(
        self, job_id: str, eta_at: float | None = None, heads: int = 0, offline_after_s: float = 7.0, tenant: str = ""
    ) -> dict[str, Any] | None:
        """The raw job hash, its track hashes (JSON fields decoded; with queue_position, and worker_status for
        open tracks with a worker) and the cancel flag, in one round trip and one parse. With `eta_at` (a time),
        also `eta_s`: the job's ETA then, reading `heads` running tracks per queue (app/control/backlog.py); null
        while an open track's queue has had no live worker for `offline_after_s`. With a `tenant`, None (as for an
        unknown job, and after the same work) when another tenant owns the job."""
        args = read_job_args(self.layout.prefix, job_id)
        if eta_at is not None or tenant:
            eta = ["", ""] if eta_at is None else [str(heads), repr(eta_at)]
            args += [*eta, "", tenant, DEFAULT_TENANT, repr(offline_after_s)]
        reply = self._read_job(keys=[], args=args)
        return json.loads(reply) if reply else None

    def read_public(
        self, job_id: str, eta_at: float, heads: int, tenant: str = "", offline_after_s: float = 7.0
    ) -> str | None:
        """The job's record exactly as a client's poll answers it, as JSON text (app/control/views.py): its tracks
        without the fields clients never see, each with its seed and download links, the overall state, queue
        position, cancel flag, webhook deliveries and `eta_s` at `eta_at` (rounded to 0.1 s; null while an open
        track's queue has had no live worker for `offline_after_s`). One round trip and
        no parse: the web serves the text as it is (harness/records.public_record is the reference it is tested
        against). With a `tenant`, None (as for an unknown job) when another tenant owns the job."""
        args = [self.layout.prefix, job_id, "", str(heads), repr(eta_at), "1", tenant, DEFAULT_TENANT]
        args.append(repr(offline_after_s))
        reply = self._read_job(keys=[], args=args)
        return _text(reply) if reply else None

    def forget(self, queue: str, value: str) -> bool:
        """Take a track whose job expired off `queue`: its load set (and cost counter), its waiting set and
        its backlog (app/control/backlog.py). False when the load set did not hold it."""
        return self._forget(keys=[], args=[self.layout.prefix, queue, value]) == 1

    def snapshot(
        self,
        parts: Iterable[str],
        states: list[tuple[str, str]],
        stages: list[tuple[str, str]],
        list_suffixes: list[str],
    ) -> dict[str, Any]:
        """Of `parts` (workers, queues, jobs, submitted, stages, rates): workers (with their current stage),
        queues (depths, load, broker messages, drained) and parked tracks, jobs per (kind, state) in `states`
        order, submission counters, the stage histograms of `stages` and the learned rates, in one round trip
        (see app/control/snapshot.py)."""
        spec = {"parts": sorted(parts), "states": states, "stages": stages, "lists": list_suffixes}
        return json.loads(self._snapshot(keys=[], args=[self.layout.prefix, repr(time.time()), json.dumps(spec)]))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
