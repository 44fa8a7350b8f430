"""The track state machine (app/control/lifecycle.py) against a real redis-server: every event from every status,
allowed or refused as the table below says (written out here, independently of the module's table), the
lease rules, a pending cancel, and the bookkeeping it keeps, checked after every step of a random walk."""

from __future__ import annotations

import json
import random

import pytest
import redis

from app.control.jobs import JobStore
from app.control.lifecycle import TRANSITIONS
from app.core.keys import Layout
from harness.processes import wait_until
from harness.records import expected_overall

STATUSES = (
    "new",
    "created",
    "parked",
    "queued",
    "running:backbone",
    "running:superres",
    "waiting:superres",
    "waiting:decode",
    "done",
    "failed",
    "canceled",
)
OPEN = ("created", "parked", "queued", "running:backbone", "running:superres", "waiting:superres", "waiting:decode")
# (event, stage it names) -> the statuses it is allowed from. A fresh track's chain starts with backbone.
ALLOWED = {
    ("submit", ""): {"new"},
    ("park", ""): {"created"},
    ("route", ""): {"created", "parked"},
    ("unroute", ""): {"queued"},
    ("start", "backbone"): {"queued", "running:backbone"},
    ("start", "superres"): {"waiting:superres", "running:superres"},
    ("adopt", "backbone"): {"queued"},
    ("adopt", "superres"): {"waiting:superres"},  # the engine takes a track it finished on to its next stage
    ("report", ""): {"running:backbone", "running:superres"},
    ("finish", "backbone"): {"running:backbone"},
    ("finish", "superres"): {"running:superres"},
    ("release", "backbone"): {"running:backbone"},
    ("restart", ""): {"queued", "running:backbone", "running:superres", "waiting:superres", "waiting:decode"},
    ("resend", ""): {"queued", "waiting:superres", "waiting:decode"},
    ("fail", ""): set(OPEN),
    ("cancel", ""): set(OPEN),
    ("retry", ""): {"failed", "canceled"},
}
# where an allowed event leaves a track
TARGET = {
    "submit": "created",
    "park": "parked",
    "route": "queued",
    "unroute": "parked",
    "release": "queued",
    "restart": "parked",
    "fail": "failed",
    "cancel": "canceled",
    "retry": "parked",
}
OWNER = "gpu0@a|t-run|1"


@pytest.fixture
def jobs(redis_base_url):
    client = redis.Redis.from_url(f"{redis_base_url}/506", decode_responses=True)
    client.flushdb()
    yield JobStore(client, "lc", ttl_s=600)
    client.flushdb()


def _args(event: str, stage: str) -> dict:
    args = {
        "stage": stage,
        "owner": OWNER,
        "worker": "gpu0@a",
        "lease_ms": 60_000,
        "queue": "gpu0",
        "task_ids": json.dumps(["t-run", "t2"]),
        "cost": 1.0,
        "pid": "1",
    }
    return {**args, "task_id": "t-run"} if event == "start" else args


PATHS = {  # the steps that bring a fresh (created) track to each status
    "created": [],
    "parked": [("park", "")],
    "queued": [("route", "")],
    "running:backbone": [("route", ""), ("start", "backbone")],
    "waiting:superres": [("route", ""), ("start", "backbone"), ("finish", "backbone")],
    "running:superres": [("route", ""), ("start", "backbone"), ("finish", "backbone"), ("start", "superres")],
    "waiting:decode": [
        ("route", ""),
        ("start", "backbone"),
        ("finish", "backbone"),
        ("start", "superres"),
        ("finish", "superres"),
    ],
    "done": [("route", "")]
    + [(e, s) for s in ("backbone", "superres", "decode", "export") for e in ("start", "finish")],
    "failed": [("route", ""), ("fail", "")],
    "canceled": [("route", ""), ("cancel", "")],
}


def _put(jobs: JobStore, status: str, lease: bool) -> str:
    """A one-track music job whose track reached `status` through the transitions themselves."""
    job_id = jobs.create("music", {}, [{"seed": 1}], cost=1.0)
    if status == "new":  # a track not written yet
        jobs.redis.delete(jobs.track_key(job_id, 0))
        jobs.redis.zrem(jobs.keys.created, f"{job_id}:0")
        jobs.redis.zrem(jobs.keys.jobs_in_state("music", "queued"), job_id)
        jobs.redis.hset(jobs.job_key(job_id), "n_waiting", 0)
        return job_id
    for event, stage in PATHS[status]:
        assert jobs.transition(event, job_id, 0, **_args(event, stage)), (status, event, stage)
    if not lease:
        jobs.redis.delete(jobs.lease_key(job_id, 0))  # as if it expired
    assert jobs.track(job_id, 0)["status"] == status
    return job_id


@pytest.mark.parametrize("event,stage", sorted(ALLOWED))
def test_every_event_from_every_status(jobs, event, stage):
    holds = TRANSITIONS[event].holder == "lease"
    for status in STATUSES:
        job_id = _put(jobs, status, lease=holds and status.startswith("running:"))
        before = jobs.redis.hgetall(jobs.track_key(job_id, 0))
        outcome = jobs.transition(event, job_id, 0, **_args(event, stage))
        expected = status in ALLOWED[(event, stage)]
        assert outcome.applied == expected, (event, stage, status, outcome)
        after = jobs.redis.hgetall(jobs.track_key(job_id, 0))
        if not expected:
            assert after == before, (event, status)  # a refused event changes nothing
            continue
        assert int(after["version"]) == int(before.get("version", 0)) + 1
        want = (
            TARGET.get(event)
            or {
                "start": f"running:{stage}",
                "adopt": f"running:{stage}",
                "report": status,
                "resend": status,
                "finish": {"backbone": "waiting:superres", "superres": "waiting:decode"}.get(stage),
            }[event]
        )
        assert after["status"] == want, (event, status, after["status"])
        _check_bookkeeping(jobs)


def test_the_table_in_the_module_is_the_one_tested():
    assert set(TRANSITIONS) == {event for event, _ in ALLOWED}


def test_a_live_lease_of_another_refuses_everyone_but_its_holder(jobs):
    job_id = _put(jobs, "running:backbone", lease=True)
    other = {"owner": "gpu1@b|t-other|2"}
    for event in ("start", "restart", "fail", "cancel", "report", "finish", "release"):
        outcome = jobs.transition(event, job_id, 0, **{**_args(event, "backbone"), **other})
        assert not outcome and "lease" in outcome.reason, (event, outcome)
    assert jobs.transition("report", job_id, 0, {"progress": 0.5}, owner=OWNER)
    dead = jobs.lease(job_id, 0)
    taken = jobs.transition(
        "start", job_id, 0, **{**_args("start", "backbone"), "owner": "gpu0@a|t-run|9", "steal": dead}
    )
    assert taken.status == "running:backbone" and jobs.lease(job_id, 0) == "gpu0@a|t-run|9"
    assert not jobs.transition("report", job_id, 0, {"progress": 0.6}, owner=OWNER)  # no longer its lease


def test_delivery_of_another_chain_is_refused(jobs):
    job_id = _put(jobs, "queued", lease=False)
    outcome = jobs.transition("start", job_id, 0, **{**_args("start", "backbone"), "task_id": "old-chain"})
    assert not outcome and "chain" in outcome.reason


def test_a_pending_cancel_wins_over_a_transition_that_would_keep_the_track_open(jobs):
    cases = [
        ("created", "park", ""),
        ("parked", "route", "backbone"),
        ("queued", "start", "backbone"),
        ("queued", "unroute", ""),
        ("running:backbone", "finish", "backbone"),
        ("running:backbone", "release", "backbone"),
        ("waiting:superres", "restart", ""),
    ]
    for status, event, stage in cases:
        job_id = _put(jobs, status, lease=status.startswith("running:"))
        jobs.redis.set(jobs.keys.cancel(job_id), "1")
        outcome = jobs.transition(event, job_id, 0, **{**_args(event, stage), "cancel_detail": "canceled here"})
        assert outcome.applied and outcome.canceled and outcome.status == "canceled", (status, event, outcome)
        track = jobs.track(job_id, 0)
        assert (track["state"], track["detail"]) == ("canceled", "canceled here")
        assert jobs.lease(job_id, 0) is None
        _check_bookkeeping(jobs)


def test_the_last_stage_finishing_is_done_even_with_a_cancel_pending(jobs):
    job_id = _put(jobs, "waiting:decode", lease=False)
    for stage in ("decode", "export"):
        assert jobs.transition("start", job_id, 0, **_args("start", stage)).status == f"running:{stage}"
        if stage == "export":
            jobs.redis.set(jobs.keys.cancel(job_id), "1")
        outcome = jobs.transition("finish", job_id, 0, **_args("finish", stage))
    assert outcome.status == "done" and not outcome.canceled
    assert jobs.record(job_id)["state"] == "done"


def test_restart_keeps_finished_stages_and_gives_up_after_the_cap(jobs):
    job_id = _put(jobs, "running:superres", lease=False)
    kept = {"backbone": {"finished_at": 1.0}}
    for attempt in (1, 2):
        outcome = jobs.transition("restart", job_id, 0, {"stages": kept}, max_restarts=2, give_up="gave up")
        assert outcome.status == "parked"
        assert jobs.route(job_id, 0, "gpu0", ["t-run"]).status == "queued"
        # its chain starts at superres now: a start of backbone is refused, of superres allowed
        assert not jobs.transition("start", job_id, 0, **_args("start", "backbone"))
        assert jobs.transition("start", job_id, 0, **_args("start", "superres")).status == "running:superres"
        jobs.redis.delete(jobs.lease_key(job_id, 0))
        assert jobs.track(job_id, 0)["restarts"] == attempt
    outcome = jobs.transition("restart", job_id, 0, {"stages": kept}, max_restarts=2, give_up="gave up")
    assert outcome.status == "failed" and jobs.track(job_id, 0)["error"] == "gave up"
    _check_bookkeeping(jobs)


def test_unroute_takes_the_message_or_refuses(jobs):
    job_id = _put(jobs, "queued", lease=False)
    jobs.redis.rpush("lc-broker", "other", "the-message")
    assert not jobs.transition("unroute", job_id, 0, lrem=["lc-broker", "gone"])
    assert jobs.track(job_id, 0)["status"] == "queued"
    assert jobs.transition("unroute", job_id, 0, lrem=["lc-broker", "the-message"]).status == "parked"
    assert jobs.redis.lrange("lc-broker", 0, -1) == ["other"]


def test_structural_fields_are_the_machines(jobs):
    job_id = _put(jobs, "running:backbone", lease=True)
    outcome = jobs.transition("report", job_id, 0, {"status": "done"}, owner=OWNER)
    assert not outcome and "state machine" in outcome.reason
    assert jobs.track(job_id, 0)["status"] == "running:backbone"


def test_every_transition_is_published_with_its_version(jobs):
    pubsub = jobs.redis.pubsub()
    job_id = jobs.create("music", {}, [{"seed": 1}], cost=1.0)
    pubsub.subscribe(jobs.events_channel(job_id))
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"
    jobs.route(job_id, 0, "gpu0", ["t-run", "t2"])
    jobs.transition("start", job_id, 0, **_args("start", "backbone"))
    jobs.report(job_id, 0, OWNER, progress=0.5, detail="10/20 tokens")
    seen = []
    while len(seen) < 3:
        message = pubsub.get_message(timeout=2)
        assert message is not None, seen
        seen.append(json.loads(message["data"]))
    assert [(e["event"], e["status"], e["version"]) for e in seen] == [
        ("route", "queued", 2),
        ("start", "running:backbone", 3),
        ("report", "running:backbone", 4),
    ]
    assert (seen[2]["state"], seen[2]["progress"], seen[2]["detail"]) == ("backbone", 0.5, "10/20 tokens")
    pubsub.close()


def test_every_transition_is_appended_to_the_jobs_stream_which_expires_with_it(jobs):
    """The stream the SSE route replays: the same payloads as the channel, in order, under increasing ids,
    trimmed to the newest `events_maxlen`, with the job record's expiry."""
    job_id = jobs.create("music", {}, [{"seed": 1}], cost=1.0)
    pubsub = jobs.redis.pubsub()
    pubsub.subscribe(jobs.events_channel(job_id))
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"
    jobs.route(job_id, 0, "gpu0", ["t-run", "t2"])
    jobs.transition("start", job_id, 0, **_args("start", "backbone"))
    published = json.loads(pubsub.get_message(timeout=2)["data"])
    pubsub.close()
    events = jobs.events_after(job_id, "0-0")
    assert [(e["event"], e["version"], e["job_state"]) for _, e in events] == [
        ("submit", 1, "queued"),
        ("route", 2, "queued"),
        ("start", 3, "running"),
    ]
    assert published == {**events[1][1], "id": events[1][0]}  # the channel carries the entry's id
    assert jobs.events_after(job_id, events[0][0]) == events[1:]  # only what came after an id
    assert jobs.events_after(job_id, events[-1][0]) == []
    stream = jobs.keys.event_stream(job_id)
    assert abs(jobs.redis.ttl(stream) - jobs.redis.ttl(jobs.job_key(job_id))) <= 1 and jobs.redis.ttl(stream) > 0

    short = JobStore(jobs.redis, jobs.prefix, ttl_s=600, events_maxlen=2)
    other = short.create("music", {}, [{"seed": 1}], cost=1.0)
    short.route(other, 0, "gpu0", ["t-run"])
    short.cancel(other, 0, "canceled")
    assert [(e["event"], e["job_state"]) for _, e in short.events_after(other, "0-0")] == [
        ("route", "queued"),
        ("cancel", "canceled"),
    ]


def test_random_walks_keep_the_bookkeeping_exact(jobs):
    """Bounded random walk over three jobs of both kinds and several queues: after every step, each track's
    sets, the queue cost counters and the per-state job sets agree with the tracks themselves."""
    rng = random.Random(7)
    ids = [
        jobs.create(kind, {}, [{"seed": i} for i in range(n)], cost=c)
        for kind, n, c in (("music", 2, 1.5), ("lipsync", 1, 2.25), ("music", 3, 0.5))
    ]
    stages = {"music": ["backbone", "superres", "decode", "export"], "lipsync": ["prepare", "lipsync", "mux"]}
    for _ in range(400):
        job_id = rng.choice(ids)
        job = jobs.job(job_id)
        track = rng.randrange(job["num_tracks"])
        event = rng.choice(sorted(TRANSITIONS))
        stage = rng.choice(stages[job["kind"]])
        owner = jobs.lease(job_id, track) if rng.random() < 0.7 else "someone|else|0"
        args = {**_args(event, stage), "owner": owner or OWNER, "queue": rng.choice(["gpu0", "gpu1"])}
        args.pop("task_id", None)
        if event == "start" and rng.random() < 0.5:
            jobs.redis.delete(jobs.lease_key(job_id, track))  # an expired lease
        if rng.random() < 0.02:
            jobs.redis.set(jobs.keys.cancel(job_id), "1")
        jobs.transition(event, job_id, track, **args)
        _check_bookkeeping(jobs)
    assert any(jobs.record(j)["state"] != "queued" for j in ids)


def _check_bookkeeping(jobs: JobStore) -> None:
    keys: Layout = jobs.keys
    r = jobs.redis
    unrouted = set(r.zrange(keys.unrouted, 0, -1))
    created = set(r.zrange(keys.created, 0, -1))
    queues = {q for q in r.smembers(keys.queues)}
    counts: dict[tuple[str, str], set[str]] = {}
    expected_load: dict[str, dict[str, float]] = {q: {} for q in queues}
    for job_id in r.zrange(keys.jobs, 0, -1):
        job = jobs.job(job_id)
        if job is None:
            continue
        tracks = jobs.tracks(job_id, job["num_tracks"])
        for t in tracks:
            m, status, queue = f"{job_id}:{t['track']}", t["status"], t["queue"]
            assert (m in unrouted) == (status == "parked"), (m, status)
            assert (m in created) == (status == "created"), (m, status)
            for q in queues:
                assert (r.zscore(keys.waiting(q), m) is not None) == (status == "queued" and queue == q), (m, status, q)
                in_load = status not in ("created", "parked", "done", "failed", "canceled") and queue == q
                assert (r.zscore(keys.load(q), m) is not None) == in_load, (m, status, q)
                if in_load:
                    expected_load[q][m] = t["cost"]
            if status in ("created", "parked"):
                assert queue == ""
            if not status.startswith("running:"):
                assert r.get(keys.lease(job_id, t["track"])) is None, (m, status)
        if len(tracks) == job["num_tracks"]:
            state = expected_overall([t["state"] for t in tracks])
            counts.setdefault((job["kind"], state), set()).add(job_id)
    for q in queues:
        assert int(r.get(keys.cost(q)) or 0) == sum(round(c * 1000) for c in expected_load[q].values()), q
    for kind in ("music", "lipsync"):
        for state in ("queued", "running", "done", "failed", "canceled", "partial"):
            assert set(r.zrange(keys.jobs_in_state(kind, state), 0, -1)) == counts.get((kind, state), set()), (
                kind,
                state,
            )


def test_the_readme_documents_the_table_as_it_is():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    rows = {}
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].startswith("`") and cells[0].strip("`") in TRANSITIONS:
            rows[cells[0].strip("`")] = cells
    assert set(rows) == set(TRANSITIONS)
    for name, t in TRANSITIONS.items():
        event, sources, target, holder, cancel, _ = rows[name]
        assert [s.strip().strip("`") for s in sources.split(",")] == list(t.sources), name
        assert (target.strip("`"), holder, cancel) == (t.target, t.holder, "yes" if t.cancel else "no"), name


def test_the_job_index_holds_only_jobs_that_exist(jobs):
    """Issue 24, loose end 9: `{p}:jobs` (the listing's index) lost nothing when jobs expired, so with more jobs
    than a listing reads it grew by one id per job for good. Each submission now drops the expired ones."""
    short = JobStore(jobs.redis, jobs.prefix, ttl_s=1)
    old = [short.create("music", {}, [{"seed": 1}], cost=1.0) for _ in range(5)]
    wait_until(lambda: not any(jobs.redis.exists(jobs.job_key(j)) for j in old), 10, 0.05, "the short jobs to expire")
    assert set(jobs.redis.zrange(jobs.jobs_key, 0, -1)) == set(old)  # the index still names them
    kept = short.create("music", {}, [{"seed": 1}], cost=1.0)
    assert jobs.redis.zrange(jobs.jobs_key, 0, -1) == [kept]  # bounded by what exists, whoever lists it
    assert jobs.redis.zrange(jobs.keys.tenant_jobs("default"), 0, -1) == [kept]
