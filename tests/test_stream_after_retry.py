"""A job's event stream follows it across a cancel and a retry (issue 24, item 1): a stream ends only when the
job's current run has ended, and a client folding a replayed stream into the record it fetched first (the CLI's
`with_event`) only moves forward. Replaying a cancel that a retry undid, or resuming with Last-Event-ID from before the
retry, must not send `event: end`; the web's stream (EventCursor, which the events server shares) against a
real Redis, and the cursor's own rule without I/O."""

from __future__ import annotations

import json

from app.clients.following import with_event
from app.clients.http_client import sse_messages
from app.http.events import EventCursor, end_frame


def _cursor(state: str) -> EventCursor:
    return EventCursor("j", "0-0", job_state=state, heartbeat_s=1.0, max_s=60.0, clock=lambda: 0.0)


def test_the_latest_event_decides_whether_the_job_has_ended():
    replay = [("1-0", {"job_state": "running"}), ("2-0", {"job_state": "canceled"}), ("3-0", {"job_state": "queued"})]
    cursor = _cursor("queued")
    frames = cursor.take(replay)
    assert len(frames) == 3 and not cursor.done and not cursor.ended and cursor.block_ms() == 1000
    assert cursor.take([]) == [] and not cursor.done and cursor.needs_state  # it waits for what comes next
    ended = _cursor("canceled")
    ended.take(replay[:2])
    assert ended.ended and ended.block_ms() is None
    assert ended.take([]) == [end_frame("j", "canceled")] and ended.done


def _stream(stack, job_id: str, last_id: str | None = None) -> list[tuple[str, str | None, dict]]:
    headers = {**stack.auth, **({"Last-Event-ID": last_id} if last_id else {})}
    reply = stack.client.get(f"/api/v1/jobs/{job_id}/events", headers=headers)  # bounded by ENCORE_SSE_MAX_S
    assert reply.status_code == 200
    return [(event, event_id, json.loads(data)) for event, event_id, data in sse_messages(reply.text.splitlines())]


def test_a_retried_jobs_stream_does_not_end_on_the_cancel_it_replays(make_stack):
    stack = make_stack(ENCORE_SSE_HEARTBEAT_S="0.2", ENCORE_SSE_MAX_S="1.5")
    job_id = stack.submit_music(duration_s=2.0, num_tracks=2)  # no worker: both tracks wait
    assert stack.client.delete(f"/api/v1/jobs/{job_id}", headers=stack.auth).status_code == 200
    ended = _stream(stack, job_id)
    assert ended[-1][0] == "end" and ended[-1][2]["state"] == "canceled"
    last_seen = ended[-2][1]
    assert stack.client.post(f"/api/v1/jobs/{job_id}/retry", headers=stack.auth).status_code == 200

    replayed = _stream(stack, job_id)  # from the start: the cancel, then the retry
    states = [data["job_state"] for event, _, data in replayed if event == "message"]
    assert "canceled" in states and states[-1] == "queued", states
    assert all(event != "end" for event, _, _ in replayed), replayed[-2:]  # open until ENCORE_SSE_MAX_S

    resumed = _stream(stack, job_id, last_id=last_seen)  # a client that saw the end, back after the retry
    assert [data["event"] for event, _, data in resumed if event == "message"] == ["retry", "retry"]
    assert all(event != "end" for event, _, _ in resumed) and stack.job(job_id)["state"] == "queued"


def test_a_client_folding_a_replayed_stream_into_its_record_only_moves_forward():
    states = ["queued", "backbone", "backbone", "superres", "decoding", "exporting", "done"]
    events = [
        {"track": 0, "version": n, "state": state, "progress": n / 10, "job_state": "running"}
        for n, state in enumerate(states, start=1)
    ]
    events[-1]["job_state"] = "done"
    record = {"state": "running", "tracks": [{"track": 0, "version": 4, "state": "superres", "progress": 0.4}]}
    seen = []
    for event in [*events, {"track": 7, "version": 99, "state": "failed"}]:  # replayed from the start
        record = with_event(record, event)
        seen.append((record["tracks"][0]["state"], record["state"]))
    assert seen[:4] == [("superres", "running")] * 4  # the history before what it had: nothing moves back
    assert seen[4:] == [("decoding", "running"), ("exporting", "running"), ("done", "done"), ("done", "done")]
    assert record["tracks"][0]["version"] == 7 and record["tracks"][0]["progress"] == 0.7
