"""Server-sent events (issue 14, item 1) against the web tier as deployed (gunicorn, gthread) with a real worker:
a real HTTP client reads a job's stream from its submission to its end, resumes with Last-Event-ID and gets
only what came later; the stream is bounded (heartbeats while nothing changes, a maximum duration) and a
client that goes away frees its thread."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import requests
import pytest

from app.clients.http_client import sse_messages
from harness.processes import wait_until
from harness.tenants import bearer, write_tenants_file

pytestmark = pytest.mark.slow  # event streams of whole jobs (~15 s here)

TRACK_STATES = ["queued", "backbone", "superres", "decoding", "exporting", "done"]


class EventReader:
    """A real streaming HTTP client of one job's events: raw lines, and (event, id, data) messages."""

    def __init__(self, url: str, job_id: str, last_id: str | None = None, timeout: float = 30):
        headers = {"Accept": "text/event-stream", **({"Last-Event-ID": last_id} if last_id else {})}
        self.reply = requests.get(
            f"{url}/api/v1/jobs/{job_id}/events", headers=headers, stream=True, timeout=(5, timeout)
        )
        self.lines: list[str] = []
        self._lines = self.reply.iter_lines(chunk_size=None, decode_unicode=True)

    def _recorded(self):
        for line in self._lines:
            self.lines.append(line)
            yield line

    def messages(self):
        for event, event_id, data in sse_messages(self._recorded()):
            yield event, event_id, json.loads(data)

    def read_to_end(self, deadline_s: float = 120) -> list[tuple[str, str | None, dict]]:
        """Every message up to and including `event: end` (the test fails past the deadline)."""
        started, seen = time.monotonic(), []
        for message in self.messages():
            seen.append(message)
            if message[0] == "end":
                return seen
            assert time.monotonic() - started < deadline_s, seen[-3:]
        raise AssertionError(f"the stream closed without `event: end`: {seen[-3:]}")


def stream_id_key(event_id: str) -> tuple[int, int]:
    millis, _, seq = event_id.partition("-")
    return int(millis), int(seq)


def test_a_job_streams_every_change_to_its_end_and_resumes_after_the_last_id(make_stack):
    stack = make_stack(ENCORE_SSE_HEARTBEAT_S="0.3")
    url = stack.start_gunicorn()
    job_id = requests.post(
        f"{url}/api/v1/music",
        timeout=10,
        json={"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0, "num_tracks": 1, "seed": 3},
    ).json()["job_id"]

    reader = EventReader(url, job_id)
    assert reader.reply.status_code == 200
    assert reader.reply.headers["Content-Type"].startswith("text/event-stream")
    assert reader.reply.headers["Cache-Control"] == "no-cache"
    messages = reader.messages()
    first = [next(messages), next(messages)]  # replayed: written before the client connected
    assert [m[2]["event"] for m in first] == ["submit", "park"] and first[1][2]["detail"] == "waiting for a worker"
    # Nothing changes until a worker is live: heartbeat comments keep the stream open meanwhile.
    stack.start_worker(0, wait=False)
    rest = reader.read_to_end()
    assert ": heartbeat" in reader.lines  # sent while the worker was starting (~seconds at 0.3 s apart)
    events, end = first + rest[:-1], rest[-1]

    assert end[0] == "end" and end[2] == {"job_id": job_id, "state": "done"} and end[1] is None
    ids = [m[1] for m in events]
    assert all(ids) and ids == sorted(ids, key=stream_id_key) and len(set(ids)) == len(ids)  # monotonic
    assert all(m[0] == "message" and m[2]["job_id"] == job_id and m[2]["track"] == 0 for m in events)
    states = [m[2]["state"] for m in events]
    assert [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]] == TRACK_STATES, states
    assert [m[2]["version"] for m in events] == list(range(1, len(events) + 1))  # every transition, in order
    # Progress reports are streamed too (a sub-second stage's middle ones are throttled away: PROGRESS_EVERY_S;
    # each stage's final 1.0 always goes out).
    assert any(m[2]["event"] == "report" and 0 < m[2]["progress"] <= 1 for m in events)
    assert events[-1][2]["job_state"] == "done" and all(m[2]["job_state"] != "done" for m in events[:-1])
    record = stack.job(job_id)
    assert record["state"] == "done" and record["tracks"][0]["version"] == len(events)

    # Resume from an event in the middle: exactly the later ones are replayed, then the end.
    middle = len(events) // 2
    resumed = EventReader(url, job_id, last_id=ids[middle]).read_to_end(30)
    assert [(m[1], m[2]) for m in resumed[:-1]] == [(m[1], m[2]) for m in events[middle + 1 :]]
    assert resumed[-1][0] == "end"
    # From the last id: nothing to replay, and the job has ended.
    assert [m[0] for m in EventReader(url, job_id, last_id=ids[-1]).read_to_end(10)] == ["end"]

    for wrong in ("yesterday", f"{2**64}-0", f"0-{2**64}"):  # not an id, or a part past Redis's 64 bits
        bad = requests.get(f"{url}/api/v1/jobs/{job_id}/events", headers={"Last-Event-ID": wrong}, timeout=10)
        assert bad.status_code == 400 and bad.json()["field"] == "Last-Event-ID", wrong
    top = requests.get(
        f"{url}/api/v1/jobs/{job_id}/events", headers={"Last-Event-ID": f"{2**64 - 1}-{2**64 - 1}"}, timeout=10
    )
    assert top.status_code == 200  # the largest id Redis knows: nothing after it yet
    top.close()
    assert requests.get(f"{url}/api/v1/jobs/{'0' * 32}/events", timeout=10).status_code == 404
    # The stream lives and dies with the job record.
    ttl = stack.redis.ttl(f"encore:job:{job_id}:events")
    assert 0 < ttl <= stack.settings.job_ttl_s and abs(ttl - stack.redis.ttl(f"encore:job:{job_id}")) <= 1


def test_a_stream_is_bounded_and_a_gone_client_frees_its_thread(make_stack):
    """One gunicorn process with two threads serves at most one stream itself (half its threads: the other stays
    for /healthz and the polls, and a second stream is refused 429 `streams`); the stream ends by itself after
    ENCORE_SSE_MAX_S (no `end`: the client would resume), and a client that disconnects is noticed at the next
    heartbeat, so its place serves another stream again."""
    stack = make_stack(ENCORE_SSE_HEARTBEAT_S="0.3", ENCORE_SSE_MAX_S="4")
    url = stack.start_gunicorn(ENCORE_WEB_WORKERS="1", ENCORE_WEB_THREADS="2")
    job_id = requests.post(
        f"{url}/api/v1/music",
        timeout=10,
        json={"mode": "instrumental", "tags": "x", "duration_s": 2.0, "num_tracks": 1},
    ).json()["job_id"]  # parked

    started = time.monotonic()
    bounded = EventReader(url, job_id)
    list(bounded.messages())  # returns when the server closes the stream
    assert 3.5 < time.monotonic() - started < 12
    assert ": heartbeat" in bounded.lines and "event: end" not in bounded.lines

    host, port = urlsplit(url).hostname, urlsplit(url).port

    def open_raw() -> tuple[socket.socket, bytes]:
        """A raw client of the stream, to be closed without reading, as a browser tab that went away."""
        sock = socket.create_connection((host, port), timeout=5)
        sock.sendall(f"GET /api/v1/jobs/{job_id}/events HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        return sock, sock.recv(200)

    held, head = open_raw()
    assert b"200 OK" in head
    refused = requests.get(f"{url}/api/v1/jobs/{job_id}/events", timeout=5)
    assert refused.status_code == 429 and refused.json()["field"] == "streams" and refused.headers["Retry-After"]
    assert requests.get(f"{url}/healthz", timeout=1).ok  # the other thread still serves
    held.close()

    def admitted() -> bool:
        sock, head = open_raw()
        sock.close()
        return b"200 OK" in head

    wait_until(admitted, 1.5, 0.1, "the place freed by the gone client (before its stream's 4 s bound)")


def test_web_stream_places_are_shared_between_tenants_and_a_gone_client_frees_its_place_within_a_second(
    make_stack, tmp_path
):
    """Issue 36, item 9: without the events server, one tenant holds at most half of a web process's stream places
    (the other tenants' first streams still open), and a place comes back about a second after its client closes
    the connection, not at the next heartbeat's failed write (15 s here)."""
    tokens = {"tok-a": "alpha", "tok-b": "beta"}
    stack = make_stack(
        ENCORE_TENANTS_FILE=str(write_tenants_file(tmp_path / "tenants.json", tokens)), ENCORE_SSE_HEARTBEAT_S="15"
    )
    url = stack.start_gunicorn(ENCORE_WEB_WORKERS="1", ENCORE_WEB_THREADS="8")  # 4 stream places, 2 per tenant
    host, port = urlsplit(url).hostname, urlsplit(url).port

    def parked_job(token: str) -> str:
        body = {"mode": "instrumental", "tags": "x", "duration_s": 2.0, "num_tracks": 1}
        reply = requests.post(f"{url}/api/v1/music", json=body, headers=bearer(token), timeout=10)
        assert reply.status_code == 202, reply.text
        return reply.json()["job_id"]

    jobs = {token: parked_job(token) for token in tokens}

    def open_raw(token: str) -> tuple[socket.socket, bytes]:
        sock = socket.create_connection((host, port), timeout=5)
        request = f"GET /api/v1/jobs/{jobs[token]}/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n"
        sock.sendall(request.encode())
        return sock, sock.recv(300)

    held = [open_raw("tok-a") for _ in range(2)]
    assert all(b"200 OK" in head for _, head in held)
    # alpha's third stream: past its share, though two places are free.
    refused = requests.get(f"{url}/api/v1/jobs/{jobs['tok-a']}/events", headers=bearer("tok-a"), timeout=10)
    assert refused.status_code == 429 and refused.json()["field"] == "streams", refused.text
    assert "alpha" in refused.json()["error"] and "share" in refused.json()["error"]
    other, head = open_raw("tok-b")
    assert b"200 OK" in head, head  # beta's stream opens however many alpha asked for
    other.close()

    held[0][0].close()  # a tab that went away

    def admitted() -> bool:
        sock, head = open_raw("tok-a")
        sock.close()
        return b"200 OK" in head

    # Well before the stream's first heartbeat (15 s after it opened), whose failed write would free it otherwise.
    wait_until(admitted, 10, 0.1, "alpha's place freed by its gone client")
    held[1][0].close()
