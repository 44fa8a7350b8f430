"""The events server (issue 22, item 3): job event streams served on one asyncio loop, apart from the web's threads.
Real redis-server, the real events server (`python -m app events`) as a subprocess, the web over a socket: a
stream followed through the web's 307 to `event: end`, Last-Event-ID replay, the same refusals as the web (a bad
ticket, another tenant's job, an unknown job), the per-tenant cap (429 `streams`, freed when a stream closes, and
after its expiry when its process was killed), and the web's own cap when it serves streams itself."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import redis.asyncio
import requests

from app.clients.following import follow_events
from app.clients.http_client import Client, sse_messages
from app.clients.reporters import LineReporter
from app.control.streams import AsyncStreams, make_ticket, ticket_tenant
from app.http.events_server import IDLE_RELEASE_S, REDIS_CLIENT_NAME
from harness.processes import free_port, wait_until
from harness.tenants import bearer, write_tenants_file

TOKENS = {"acme-1": "acme", "beta-1": "beta", "ops-1": "ops"}
MUSIC = {"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0, "num_tracks": 1, "seed": 3}
UNKNOWN = "f" * 32


@pytest.fixture
def tenants_file(tmp_path) -> Path:
    return write_tenants_file(tmp_path / "tenants.json", TOKENS)


@pytest.fixture
def deployment(make_stack, tenants_file):
    """A web (a live server over the stack's app) whose streams go to an events server, tenants configured."""

    def make(**env: str):
        port = free_port()
        events_url = f"http://127.0.0.1:{port}"
        settings = {"ENCORE_TENANTS_FILE": str(tenants_file), "ENCORE_SSE_HEARTBEAT_S": "0.3", **env}
        stack = make_stack(ENCORE_EVENTS_URL=events_url, **settings)
        stack.start_events_server(port)
        return stack, stack.base_url, events_url

    return make


def submit(stack, token: str) -> str:
    reply = stack.client.post("/api/v1/music", json=MUSIC, headers=bearer(token))
    assert reply.status_code == 202, reply.get_json()
    return reply.get_json()["job_id"]


class Reader:
    """A streaming HTTP client of one job's events (requests, as the CLI follows them)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None):
        self.reply = requests.get(url, headers=headers or {}, stream=True, timeout=(5, 30))
        self.lines = self.reply.iter_lines(chunk_size=None, decode_unicode=True) if self.reply.ok else iter(())

    def messages(self):
        for event, event_id, data in sse_messages(self.lines):
            yield event, event_id, json.loads(data)

    def close(self) -> None:
        self.reply.close()


def events_path(job_id: str) -> str:
    return f"/api/v1/jobs/{job_id}/events"


def test_a_stream_follows_the_webs_307_to_event_end_and_resumes_after_the_last_id(deployment):
    stack, web, events_url = deployment()
    job_id = submit(stack, "acme-1")

    moved = requests.get(f"{web}{events_path(job_id)}", headers=bearer("acme-1"), allow_redirects=False, timeout=5)
    assert moved.status_code == 307 and moved.headers["Cache-Control"] == "no-store"
    assert moved.headers["Location"].startswith(f"{events_url}{events_path(job_id)}?ticket=")

    # requests follows the 307 to the other origin: it drops the Authorization header there, the ticket stands for it.
    reader = Reader(f"{web}{events_path(job_id)}", bearer("acme-1"))
    assert reader.reply.status_code == 200 and reader.reply.url.startswith(events_url)
    assert reader.reply.headers["Content-Type"].startswith("text/event-stream")
    assert reader.reply.headers["Cache-Control"] == "no-cache"
    messages = reader.messages()
    first = [next(messages), next(messages)]  # replayed: written before the client connected
    assert [m[2]["event"] for m in first] == ["submit", "park"]
    assert stack.client.delete(f"/api/v1/jobs/{job_id}", headers=bearer("acme-1")).status_code == 200
    rest = []
    for message in messages:
        rest.append(message)
        if message[0] == "end":
            break
    assert rest[-1] == ("end", None, {"job_id": job_id, "state": "canceled"})
    assert rest[0][2]["event"] == "cancel"
    reader.close()

    # A reconnect with Last-Event-ID (kept across the redirect) gets only what came after it.
    again = Reader(f"{web}{events_path(job_id)}", {**bearer("acme-1"), "Last-Event-ID": first[1][1]})
    replayed = list(again.messages())
    assert [m[2].get("event") for m in replayed] == ["cancel", None] and replayed[-1][0] == "end"


def test_a_stream_sends_heartbeats_ends_after_its_bound_and_frees_its_slot(deployment):
    stack, web, events_url = deployment(ENCORE_SSE_MAX_S="1.5")
    job_id = submit(stack, "acme-1")
    started = time.monotonic()
    reader = Reader(f"{events_url}{events_path(job_id)}", bearer("acme-1"))
    lines = list(reader.lines)  # returns when the server closes the stream
    assert 1.4 < time.monotonic() - started < 10
    assert ": heartbeat" in lines and "event: end" not in lines  # bounded, not ended: the client resumes
    wait_until(lambda: stack.redis.zcard("encore:tenant:acme:streams") == 0, 10, 0.05, "the slot to be released")


def test_the_cli_follows_a_job_through_the_redirect(deployment):
    stack, web, _ = deployment()
    job_id = submit(stack, "acme-1")
    client = Client(web, "acme-1")
    result: dict = {}
    follower = threading.Thread(
        target=lambda: result.update(follow_events(client, job_id, LineReporter(), 60)), daemon=True
    )
    follower.start()
    # Cancel only once the CLI's stream is open at the events server (its tenant holds a slot there).
    wait_until(lambda: stack.redis.zcard("encore:tenant:acme:streams") == 1, 30, what="the CLI's stream")
    stack.client.delete(f"/api/v1/jobs/{job_id}", headers=bearer("acme-1"))
    follower.join(30)
    assert result.get("state") == "canceled"


def test_the_events_server_refuses_as_the_web_does(deployment):
    stack, web, events_url = deployment()
    job_id = submit(stack, "acme-1")
    unknown_at_web = stack.client.get(events_path(UNKNOWN), headers=bearer("acme-1"))
    assert unknown_at_web.status_code == 404

    def direct(job: str, **headers: str) -> requests.Response:
        return requests.get(f"{events_url}{events_path(job)}", headers=headers, timeout=5)

    # A bearer token straight at the events server: the web's 404 for another tenant's job and an unknown one.
    for reply in (direct(job_id, **bearer("beta-1")), direct(UNKNOWN, **bearer("acme-1"))):
        assert reply.status_code == 404
        assert reply.content.replace(UNKNOWN.encode(), job_id.encode()) == unknown_at_web.data.replace(
            UNKNOWN.encode(), job_id.encode()
        )
    # No token, a bad one: the web's 401 (the same body and challenge).
    at_web = stack.client.get(events_path(job_id))
    for reply in (direct(job_id), direct(job_id, **bearer("nobody"))):
        assert reply.status_code == 401 == at_web.status_code
        assert reply.content == at_web.data and reply.headers["WWW-Authenticate"] == at_web.headers["WWW-Authenticate"]
    # The web refuses another tenant before any redirect: no ticket is ever signed for it.
    assert requests.get(f"{web}{events_path(job_id)}", headers=bearer("beta-1"), timeout=5).status_code == 404
    # Tickets: made up, tampered with (another tenant, another job), or expired.
    ticket = (
        requests.get(f"{web}{events_path(job_id)}", headers=bearer("acme-1"), allow_redirects=False, timeout=5)
        .headers["Location"]
        .split("ticket=")[1]
    )
    expires, tenant, signature = ticket.split(".")
    other_job = submit(stack, "acme-1")
    for bad in ("x", f"{expires}.beta.{signature}", f"{int(expires) - 120}.{tenant}.{signature}"):
        reply = requests.get(f"{events_url}{events_path(job_id)}", params={"ticket": bad}, timeout=5)
        assert reply.status_code == 401 and reply.json()["field"] == "ticket", bad
    reply = requests.get(f"{events_url}{events_path(other_job)}", params={"ticket": ticket}, timeout=5)
    assert reply.status_code == 401 and reply.json()["field"] == "ticket"
    # A good ticket for a job gone since: 404, as the web.
    stack.redis.delete(f"encore:job:{job_id}")
    gone = requests.get(f"{events_url}{events_path(job_id)}", params={"ticket": ticket}, timeout=5)
    assert gone.status_code == 404 and gone.json() == {"error": f"job {job_id} not found", "field": "job_id"}
    # A bad Last-Event-ID: the web's 400.
    for wrong in ("nope", f"{2**64}-0"):
        bad_id = direct(other_job, **bearer("acme-1"), **{"Last-Event-ID": wrong})
        assert bad_id.status_code == 400 and bad_id.json()["field"] == "Last-Event-ID", wrong
    # Its own liveness, and the CORS preflight a page on the web's origin makes after the redirect.
    assert requests.get(f"{events_url}/healthz", timeout=5).json() == {"events": "ok", "redis": "ok", "streams": 0}
    preflight = requests.options(f"{events_url}{events_path(job_id)}", timeout=5)
    assert preflight.status_code == 204 and "Last-Event-ID" in preflight.headers["Access-Control-Allow-Headers"]


def test_malformed_requests_get_json_errors_and_log_one_line_without_what_they_sent(deployment):
    """Issue 36, item 11: what aiohttp refuses itself (a request it cannot parse) and what its router refuses (no
    such route, another method) is answered in JSON like every other error; a client's malformed request logs one
    line, no traceback, and nothing of what it sent (a ticket in its request line stays out of the log)."""
    stack, web, events_url = deployment()
    job_id = submit(stack, "acme-1")
    ticket = (
        requests.get(f"{web}{events_path(job_id)}", headers=bearer("acme-1"), allow_redirects=False, timeout=5)
        .headers["Location"]
        .split("ticket=")[1]
    )
    port = int(events_url.rsplit(":", 1)[1])
    malformed = [
        f"GET {events_path(job_id)}?ticket={ticket} HTTP/1.1\x01\r\nHost: x\r\n\r\n".encode(),  # bad request line
        b"G\x00T / HTTP/1.1\r\n\r\n",  # bad method
        f"GET {events_path(job_id)}?ticket={ticket} HTTP/1.1\r\nBad Header: y\r\n\r\n".encode(),
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # a request line past aiohttp's limit
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    ]
    for raw in malformed:
        status, headers, body = raw_exchange(port, raw)
        assert status == 400 and "application/json" in headers, (raw[:60], status, headers)
        assert json.loads(body)["field"] == "request" and ticket not in body, body
    for method, path, status in (("GET", "/nope", 404), ("POST", events_path(job_id), 405)):
        reply = requests.request(method, f"{events_url}{path}", timeout=5)
        assert reply.status_code == status and reply.headers["Content-Type"].startswith("application/json")
        assert reply.json()["error"].startswith(f"{method} {path}"), reply.text
    log = stack.root / "logs" / f"events-{port}.log"
    wait_until(lambda: log.read_text().count("refused a malformed request") == len(malformed), 10, 0.1, "the log")
    text = log.read_text()
    assert "Traceback" not in text and ticket not in text and ticket.split(".")[2] not in text, text[-2000:]


def raw_exchange(port: int, raw: bytes) -> tuple[int, str, str]:
    """Send `raw` bytes as a request and read the whole reply (the server closes the connection after an error):
    its status, its header block and its body."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(raw)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode("latin-1").lower(), body.decode()


def test_the_redis_connections_of_ended_streams_are_closed(deployment):
    """Issue 36, item 12: the pool keeps every connection it opened; the events server closes the idle ones every
    IDLE_RELEASE_S, so after 40 streams end Redis holds a handful of its connections, not the 40."""
    stack, web, events_url = deployment()
    job_id = submit(stack, "acme-1")

    def events_server_connections() -> int:
        return sum(client.get("name") == REDIS_CLIENT_NAME for client in stack.redis.client_list())

    readers = [Reader(f"{events_url}{events_path(job_id)}", bearer("acme-1")) for _ in range(40)]
    assert all(reader.reply.status_code == 200 for reader in readers)
    peak = wait_until(lambda: (n := events_server_connections()) >= 20 and n, 20, 0.1, "the streams' connections")
    for reader in readers:
        reader.close()
    wait_until(lambda: events_server_connections() <= 3, 3 * IDLE_RELEASE_S + 10, 0.2, "idle connections closed")
    assert requests.get(f"{events_url}/healthz", timeout=5).json()["redis"] == "ok", peak  # it reconnects at need


def test_a_tenant_past_its_cap_gets_429_until_one_of_its_streams_closes(deployment):
    stack, web, events_url = deployment(ENCORE_MAX_STREAMS_PER_TENANT="2")
    job_id = submit(stack, "acme-1")
    url = f"{web}{events_path(job_id)}"
    open_streams = [Reader(url, bearer("acme-1")) for _ in range(2)]
    assert [r.reply.status_code for r in open_streams] == [200, 200]
    assert requests.get(f"{events_url}/healthz", timeout=5).json()["streams"] == 2
    refused = requests.get(url, headers=bearer("acme-1"), timeout=5)
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) > 0
    assert refused.json()["field"] == "streams" and refused.json()["error"].startswith("streams: ")
    # Another tenant (here an admin following the same job) has slots of its own.
    admin = Reader(url, bearer("ops-1"))
    assert admin.reply.status_code == 200
    admin.close()

    open_streams[0].close()  # the client goes away: its slot is freed

    def admitted() -> Reader | None:
        reader = Reader(url, bearer("acme-1"))
        if reader.reply.status_code == 200:
            return reader
        assert reader.reply.status_code == 429
        return None

    wait_until(admitted, 10, 0.1, "a slot freed by the closed stream").close()
    open_streams[1].close()


@pytest.mark.slow  # waits out a slot's expiry after a kill -9 (~4 s) and starts a second events server (~1 s)
def test_a_killed_events_servers_slots_expire(deployment):
    stack, web, events_url = deployment(ENCORE_MAX_STREAMS_PER_TENANT="1", ENCORE_SSE_HEARTBEAT_S="0.5")
    job_id = submit(stack, "acme-1")
    held = Reader(f"{events_url}{events_path(job_id)}", bearer("acme-1"))
    assert held.reply.status_code == 200
    os.killpg(stack.events_servers[events_url].pid, signal.SIGKILL)  # no chance to release its slot
    stack.events_servers[events_url].wait(10)
    held.close()
    second = stack.start_events_server()
    url = f"{second}{events_path(job_id)}"
    assert requests.get(url, headers=bearer("acme-1"), timeout=5).status_code == 429  # the dead stream's slot
    wait_until(
        lambda: requests.get(url, headers=bearer("acme-1"), stream=True, timeout=5).status_code == 200,
        20,
        0.2,
        "the killed stream's slot to expire",
    )


def test_the_web_serves_at_most_half_its_threads_of_streams_itself(make_stack):
    stack = make_stack(ENCORE_WEB_THREADS="2", ENCORE_SSE_HEARTBEAT_S="0.2")  # no ENCORE_EVENTS_URL: one stream
    job_id = stack.submit_music()
    url = f"{stack.base_url}{events_path(job_id)}"
    first = Reader(url)
    assert first.reply.status_code == 200
    refused = requests.get(url, timeout=5)
    assert refused.status_code == 429 and refused.headers["Retry-After"]
    assert refused.json()["field"] == "streams"
    first.close()  # noticed at its next heartbeat, which closes the body and frees the place
    wait_until(lambda: stack.app.extensions["encore"].streams.open == 0, 10, 0.05, "the closed stream's place")
    stack.client.delete(f"/api/v1/jobs/{job_id}")
    # An ended job's stream ends by itself and frees its place, even where nothing closes the response (the Flask
    # test client).
    for _ in range(3):
        assert b"event: end" in stack.client.get(events_path(job_id)).data
    assert stack.app.extensions["encore"].streams.open == 0


def test_tickets_name_their_tenant_only_for_their_job_and_time():
    ticket = make_ticket("secret", "job-1", "acme.eu", now=1000, ttl_s=60)
    assert ticket_tenant("secret", ticket, "job-1", now=1059) == "acme.eu"
    assert ticket_tenant("secret", ticket, "job-1", now=1061) is None  # expired
    assert ticket_tenant("secret", ticket, "job-2", now=1000) is None  # another job
    assert ticket_tenant("other", ticket, "job-1", now=1000) is None  # another deployment's key
    assert ticket_tenant("secret", ticket.replace("acme.eu", "acme"), "job-1", now=1000) is None
    assert ticket_tenant("secret", "1060.acme." + "0" * 64, "job-1", now=1000) is None


def test_the_cap_script_counts_live_slots_only(redis_base_url):
    async def scenario() -> None:
        client = redis.asyncio.Redis.from_url(f"{redis_base_url}/503", decode_responses=True)
        await client.flushdb()
        streams = AsyncStreams(client, "encore")
        try:
            assert await streams.claim("acme", "a", now=100, ttl_s=10, cap=2)
            assert await streams.claim("acme", "b", now=100, ttl_s=10, cap=2)
            assert not await streams.claim("acme", "c", now=101, ttl_s=10, cap=2)  # full
            assert await streams.claim("beta", "c", now=101, ttl_s=10, cap=2)  # per tenant
            assert await streams.claim("acme", "a", now=105, ttl_s=10, cap=2)  # a held slot refreshes at the cap
            assert await streams.open_streams("acme", now=105) == 2
            await streams.release("acme", "b")
            assert await streams.claim("acme", "c", now=106, ttl_s=10, cap=2)
            # "a" was refreshed to 115, "c" expires at 116: past 115.5 only "c" counts, and a new one fits.
            assert await streams.claim("acme", "d", now=115.5, ttl_s=10, cap=2)
            assert await streams.open_streams("acme", now=115.5) == 2
            assert 0 < await client.pttl("encore:tenant:acme:streams") <= 10_000  # an idle set goes away
        finally:
            await client.aclose()

    asyncio.run(scenario())


@pytest.mark.slow  # waits for one 6 s heartbeat (~7 s)
def test_a_stream_quieter_than_redis_pys_read_timeout_stays_open(deployment):
    """redis-py's clients time a read out after 5 s: a stream's blocking read of up to one heartbeat (15 s by default)
    must not end it. Both servers: the events server and the web serving the stream itself."""
    stack, web, events_url = deployment(ENCORE_SSE_HEARTBEAT_S="6")
    job_id = submit(stack, "acme-1")
    alone = make_web_without_events_server(stack)
    readers = [
        Reader(f"{events_url}{events_path(job_id)}", bearer("acme-1")),
        Reader(f"{alone}{events_path(job_id)}", bearer("acme-1")),
    ]
    for reader in readers:
        assert reader.reply.status_code == 200
        lines = []
        for line in reader.lines:
            lines.append(line)
            if line == ": heartbeat":
                break
        assert ": heartbeat" in lines, lines  # the stream outlived 5 s of silence
        reader.close()


def make_web_without_events_server(stack) -> str:
    """A second live web over the stack's Redis that serves streams itself (no ENCORE_EVENTS_URL)."""
    from werkzeug.serving import make_server

    from app.web import create_app

    settings = dataclasses.replace(stack.settings, events_url="")
    server = make_server("127.0.0.1", 0, create_app(settings), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}"
