"""The events server (`python -m app events`, on ENCORE_EVENTS_BIND): GET /api/v1/jobs/<id>/events and /healthz on
one asyncio loop (aiohttp, redis.asyncio).

Why a server of its own: under gunicorn's gthread workers an open event stream holds a thread for as long as it is
open, and 200 streams froze /healthz and the polls of a 2 x 32-thread web for 105 s. Here a stream is a coroutine
and a pooled Redis connection blocked in XREAD: thousands cost memory, not threads, and the web keeps its threads for
short requests. The body is the web's, built by the same `EventCursor` (app/http/events.py).

Who may follow a job: a ticket the web signed when it redirected the client here (`?ticket=`, app/control/streams.py),
or a bearer token checked here as the web checks it, with the same rule for the job's owner (another tenant's job
answers 404 exactly as a job that does not exist). Each tenant holds at most ENCORE_MAX_STREAMS_PER_TENANT streams
open across every events-server process (429 `streams` past it), counted in Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import secrets
import signal
import time
from typing import Any, AsyncIterator, Sequence

import redis
import redis.asyncio
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from app.adapters.redis_conn import async_redis_client
from app.control.streams import AsyncStreams, async_ticket_secret, slot_ttl_s, ticket_tenant
from app.core.config import Settings, load_settings
from app.http.events import HEADERS, OPENING, STREAMS_RETRY_S, EventCursor, read_timeout_s, valid_event_id

log = logging.getLogger("encore.events")

ROUTE = "/api/v1/jobs/{job_id}/events"
# A page on the web's origin follows the 307 here, to another origin: its EventSource needs CORS. `*` is safe: no
# cookie is ever read here, and a stream needs a ticket or a token.
CORS = {"Access-Control-Allow-Origin": "*"}
PREFLIGHT = {
    **CORS,
    "Access-Control-Allow-Methods": "GET",
    "Access-Control-Allow-Headers": "Authorization, Last-Event-ID, Cache-Control, Accept",
    "Access-Control-Max-Age": "600",
}
CONTENT_TYPE = "text/event-stream; charset=utf-8"  # what the web's Flask response says
LISTEN_BACKLOG = 2048  # a thousand clients may connect at once
# A stream's blocked XREAD holds a pooled Redis connection: one per open stream, and a few for the short commands.
# Past this a new stream is answered 503 (its client retries); Redis' own default maxclients is 10,000.
REDIS_CONNECTIONS = 8000
# The pool keeps every connection it ever opened (1,000 streams closed left ~930 idle connections in Redis): this
# often the idle ones are closed (a connection in use is left alone; the next command reconnects).
IDLE_RELEASE_S = 10.0
REDIS_CLIENT_NAME = "encore-events"
SHUTDOWN_S = 5.0  # open streams are cut after this at a stop: their clients resume with Last-Event-ID


def _json(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON reply written as the web's Flask writes it (compact, keys in order, a final newline), so an error here
    is byte-equal to the web's."""
    text = json.dumps(body, separators=(",", ":")) + "\n"
    return web.Response(text=text, status=status, content_type="application/json", headers={**CORS, **(headers or {})})


def _error(status: int, message: str, field: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    return _json({"error": message, **({"field": field} if field else {})}, status, headers)


def _not_found(job_id: str) -> web.Response:
    return _error(404, f"job {job_id} not found", "job_id")


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """The router's own refusals (no such route: 404; another method: 405) as JSON, like every other error."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _error(exc.status, f"{request.method} {request.path}: {exc.reason.lower()}", None, allow)


class JsonErrorsProtocol(RequestHandler):
    """aiohttp's connection handler, answering what it refuses itself (a request it cannot parse, a handler that
    timed out or failed) in JSON instead of plain text. A client's malformed request is logged as one line that
    names its kind and nothing it sent (aiohttp's message quotes the raw request line, and with it a ticket), with
    no traceback; a server fault keeps its traceback."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        kind = type(exc).__name__ if exc is not None else "error"
        if status < 500:
            log.info("refused a malformed request from %s (%d, %s)", request.remote, status, kind)
            body = {"error": f"request: malformed HTTP ({kind})", "field": "request"}
        else:
            log.error("%d on %s %s", status, request.method, request.path, exc_info=exc)
            body = {"error": f"internal error ({status}); retry, or poll the job"}
        if request.writer.output_size > 0:  # the stream is under way: no second response can be sent
            raise ConnectionError("response already under way")
        response = _json(body, status)
        response.force_close()
        return response


class JsonErrorsServer(web.Server):
    """aiohttp's server, making a `JsonErrorsProtocol` for each connection."""

    def __call__(self) -> RequestHandler:
        return JsonErrorsProtocol(self, loop=self._loop, **self._kwargs)


class EventsRunner(web.AppRunner):
    """The application's runner, serving through a `JsonErrorsServer` (run_app has no way to name the
    connection handler)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = JsonErrorsServer  # the same server, with the handler above for each connection
        return server


class EventsServer:
    """One process's handlers, over its asyncio Redis client."""

    def __init__(self, settings: Settings, client: redis.asyncio.Redis | None = None):
        self.settings = settings
        self.redis = (
            client
            if client is not None
            else async_redis_client(
                settings, REDIS_CONNECTIONS, read_timeout_s(settings.sse_heartbeat_s), REDIS_CLIENT_NAME
            )
        )
        self.streams = AsyncStreams(self.redis, settings.key_prefix)
        self.process = secrets.token_hex(6)  # names this process's slots in the tenants' sets
        self.open = 0  # streams open in this process (/healthz shows it)

    def application(self) -> web.Application:
        app = web.Application(middlewares=[json_errors])
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get(ROUTE, self.events)
        app.router.add_route("OPTIONS", ROUTE, self.preflight)
        app.cleanup_ctx.append(self._release_idle_connections)
        app.on_cleanup.append(self._close)
        return app

    async def _release_idle_connections(self, app: web.Application) -> AsyncIterator[None]:
        """While the server runs: every IDLE_RELEASE_S, close the pool's idle Redis connections (those of streams
        that ended), so Redis holds about one connection per open stream, not the most ever open at once."""

        async def every_while() -> None:
            while True:
                await asyncio.sleep(IDLE_RELEASE_S)
                try:
                    await self.redis.connection_pool.disconnect(inuse_connections=False)
                except (redis.RedisError, OSError) as exc:
                    log.warning("closing idle Redis connections failed (tried again later): %s", exc)

        task = asyncio.create_task(every_while())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _close(self, app: web.Application) -> None:
        await self.redis.aclose()

    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness of this server and its Redis (as the web's /healthz), and the streams it holds open."""
        try:
            await self.redis.ping()
        except redis.RedisError as exc:
            body = {"events": "ok", "redis": f"down: {exc}", "streams": self.open, "error": f"redis: down ({exc})"}
            return _json(body, 503)
        return _json({"events": "ok", "redis": "ok", "streams": self.open})

    async def preflight(self, request: web.Request) -> web.Response:
        return web.Response(status=204, headers=PREFLIGHT)

    async def events(self, request: web.Request) -> web.StreamResponse:
        """The checks the web makes (who, whose job, Last-Event-ID), the tenant's slot, then the stream."""
        job_id = request.match_info["job_id"]
        try:
            tenant = await self._tenant(request, job_id)
            if isinstance(tenant, web.Response):
                return tenant
            after = request.headers.get("Last-Event-ID", "").strip()
            if after and not valid_event_id(after):
                return _error(400, "Last-Event-ID: expected an event id such as 1700000000000-0", "Last-Event-ID")
            state = await self.streams.state(job_id)
            if state is None:
                return _not_found(job_id)
            member = f"{self.process}:{secrets.token_hex(8)}"
            if not await self._claim(tenant, member):
                cap = self.settings.max_streams_per_tenant
                return _error(
                    429,
                    f"streams: tenant {tenant} already has {cap} event streams open "
                    "(ENCORE_MAX_STREAMS_PER_TENANT); close one, retry later, or poll the job",
                    "streams",
                    {"Retry-After": str(STREAMS_RETRY_S)},
                )
        except redis.RedisError as exc:
            return _error(503, f"redis: down ({exc})")
        try:
            return await self._stream(request, job_id, after or "0-0", state, tenant, member)
        finally:
            await asyncio.shield(self._release(tenant, member))

    async def _tenant(self, request: web.Request, job_id: str) -> str | web.Response:
        """The tenant the stream counts against, or the refusal: 401 for a bad ticket or token, 404 for a job this
        tenant may not see (as for an unknown one)."""
        ticket = request.query.get("ticket")
        if ticket is not None:
            secret = await async_ticket_secret(self.redis, self.streams.layout)
            name = ticket_tenant(secret, ticket, job_id, time.time())
            if name is None:
                return _error(
                    401, "ticket: not valid for this job, or expired; open the stream at the web server again", "ticket"
                )
            return name if await self.streams.owner(job_id) is not None else _not_found(job_id)
        found = self.settings.tenants.for_authorization(request.headers.get("Authorization", ""))
        if found is None:
            return _error(
                401,
                "authorization: a valid 'Authorization: Bearer <token>' header is required",
                "authorization",
                {"WWW-Authenticate": 'Bearer realm="encore"'},
            )
        owner = await self.streams.owner(job_id)
        if owner is None or not found.may_see(owner):
            return _not_found(job_id)
        return found.name

    def _slot_ttl_s(self) -> float:
        return slot_ttl_s(self.settings.sse_heartbeat_s)

    async def _claim(self, tenant: str, member: str) -> bool:
        now = time.time()
        return await self.streams.claim(tenant, member, now, self._slot_ttl_s(), self.settings.max_streams_per_tenant)

    async def _release(self, tenant: str, member: str) -> None:
        try:
            await self.streams.release(tenant, member)
        except redis.RedisError:
            pass  # the slot expires by itself

    async def _stream(
        self, request: web.Request, job_id: str, after: str, state: str, tenant: str, member: str
    ) -> web.StreamResponse:
        """The SSE body (EventCursor), its slot refreshed about every heartbeat; ends as the web's does."""
        response = web.StreamResponse(headers={**HEADERS, **CORS, "Content-Type": CONTENT_TYPE})
        settings = self.settings
        cursor = EventCursor(
            job_id, after, job_state=state, heartbeat_s=settings.sse_heartbeat_s, max_s=settings.sse_max_s
        )
        self.open += 1
        try:
            await response.prepare(request)
            await response.write(OPENING.encode())
            refreshed = time.monotonic()
            while not cursor.over:
                frames = cursor.take(await self.streams.events_after(job_id, cursor.last, block_ms=cursor.block_ms()))
                if cursor.needs_state:
                    frames += cursor.idle(await self.streams.state(job_id))
                if frames:
                    await response.write("".join(frames).encode())  # a gone client makes this fail
                if time.monotonic() - refreshed >= settings.sse_heartbeat_s:
                    await self._claim(tenant, member)  # keeps the slot alive (it may pass the cap: it is held)
                    refreshed = time.monotonic()
        except redis.RedisError as exc:
            log.warning("job %s: stream ended by a Redis error (its client resumes): %s", job_id, exc)
        except ConnectionError:
            pass  # the client went away
        finally:
            self.open -= 1
        return response


def bind_address(bind: str) -> tuple[str, int]:
    """ENCORE_EVENTS_BIND "host:port" (an IPv6 host bracketed) as (host, port)."""
    host, _, port = bind.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"ENCORE_EVENTS_BIND: {bind!r} is not host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


def main(bind: str | None = None) -> int:
    """Serve until SIGINT or SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = load_settings()
    host, port = bind_address(bind or settings.events_bind)
    server = EventsServer(settings)
    log.info("events server on %s:%d (at most %d streams per tenant)", host, port, settings.max_streams_per_tenant)
    asyncio.run(_serve(server.application(), host, port))
    return 0


def command_line(argv: Sequence[str] | None = None) -> int:
    """`python -m app events [--bind host:port]`: app/__main__.py hands the command here, so the server's entry and
    its arguments live with the server (`encore events` becomes this command too; the client imports none of it)."""
    parser = argparse.ArgumentParser(prog="python -m app events")
    parser.add_argument("--bind", help="host:port (default: ENCORE_EVENTS_BIND)")
    return main(parser.parse_args(argv).bind)


async def _serve(app: web.Application, host: str, port: int) -> None:
    """Listen until SIGINT or SIGTERM, then close: open streams are cut after SHUTDOWN_S."""
    runner = EventsRunner(
        app,
        handler_cancellation=True,  # a client that goes away frees its stream and slot at once
        shutdown_timeout=SHUTDOWN_S,
        access_log=None,  # a thousand open streams would each log on close; errors still log
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
