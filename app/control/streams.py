"""Event streams served apart from the web (app/http/events_server.py): the tickets the web hands a client when it
redirects a stream there, the per-tenant cap on open streams that every events-server process shares, and the
reads of a job that a stream makes, on an asyncio Redis client.

A ticket is `<expiry>.<tenant>.<HMAC-SHA256 of job id, tenant and expiry>`: the web has already checked the token
and the job's owner when it signs one, so the events server only checks the signature and the clock. The key is
made once, at random, and kept in Redis (`ticket_secret` in app/core/keys.py), where the web and every events
server read it: nothing to configure, and a ticket is good on any events server of the deployment.

The cap: each open stream is a member of its tenant's sorted set, scored by when it expires; the stream refreshes
it as it goes and removes it when it ends, and a member whose process died expires by itself (lua/claim_stream.lua
drops expired members before it counts).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from typing import Any

import redis
import redis.asyncio

from app.control.jobs import OWNER_FIELDS, owner_of, stream_entries
from app.control.lifecycle import READ_JOB_LIBRARIES, read_job_args, read_job_preludes
from app.control.scripts import async_script
from app.core.ids import is_job_id
from app.core.keys import Layout

TICKET_S = 60  # the least a ticket is good for: the client follows the redirect at once
TICKET = re.compile(r"([0-9]{1,12})\.([a-z0-9][a-z0-9_.-]{0,62})\.([0-9a-f]{64})", re.ASCII)  # matched whole


def _signature(secret: str, job_id: str, tenant: str, expires: int) -> str:
    return hmac.new(secret.encode(), f"{job_id}\n{tenant}\n{expires}".encode(), hashlib.sha256).hexdigest()


def make_ticket(secret: str, job_id: str, tenant: str, now: float, ttl_s: float = TICKET_S) -> str:
    """A ticket that lets whoever holds it follow `job_id`'s events as `tenant` until `now + ttl_s`."""
    expires = int(now + ttl_s)
    return f"{expires}.{tenant}.{_signature(secret, job_id, tenant, expires)}"


def ticket_tenant(secret: str, ticket: str, job_id: str, now: float) -> str | None:
    """The tenant a ticket was signed for, when it is well formed, signed with `secret` for this job, and not
    expired at `now`; None otherwise."""
    found = TICKET.fullmatch(ticket)
    if found is None:
        return None
    expires, tenant, signature = int(found[1]), found[2], found[3]
    if expires < now or not hmac.compare_digest(signature, _signature(secret, job_id, tenant, expires)):
        return None
    return tenant


def ticket_secret(client: redis.Redis, layout: Layout) -> str:
    """The deployment's ticket key, made on first use (SET NX: two processes racing agree on one)."""
    pipe = client.pipeline(transaction=False)
    pipe.set(layout.ticket_secret, secrets.token_hex(32), nx=True)
    pipe.get(layout.ticket_secret)
    return str(pipe.execute()[1])


async def async_ticket_secret(client: redis.asyncio.Redis, layout: Layout) -> str:
    """`ticket_secret` on an asyncio client."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.set(layout.ticket_secret, secrets.token_hex(32), nx=True)
        pipe.get(layout.ticket_secret)
        replies = await pipe.execute()
    return str(replies[1])


def slot_ttl_s(heartbeat_s: float) -> float:
    """How long a stream's slot lives without a refresh: a few heartbeats (the stream refreshes it at each)."""
    return 3 * heartbeat_s + 2


class AsyncStreams:
    """What one events-server process asks Redis: who owns a job, its events, its state, and the tenants' slots."""

    def __init__(self, client: redis.asyncio.Redis, prefix: str):
        self.redis = client
        self.layout = Layout(prefix)
        self._read_job = async_script(client, "read_job", *read_job_preludes(), libraries=READ_JOB_LIBRARIES)
        self._claim = async_script(client, "claim_stream")

    async def owner(self, job_id: str) -> str | None:
        """As JobStore.owner: the job's tenant (`default` when older than tenants), None for an unknown job."""
        if not is_job_id(job_id):
            return None
        tenant, kind = await self.redis.hmget(self.layout.job(job_id), OWNER_FIELDS)
        return owner_of(tenant, kind)

    async def state(self, job_id: str) -> str | None:
        """The job's overall state (as its record shows it), None when the job is gone."""
        reply = await self._read_job(keys=[], args=read_job_args(self.layout.prefix, job_id))
        if not reply:
            return None
        state: str = json.loads(reply)["state"]  # the read's, by the one rule (lua/tracks.lua)
        return state

    async def events_after(
        self, job_id: str, after: str, block_ms: int | None = None, count: int = 500
    ) -> list[tuple[str, dict[str, Any]]]:
        """As JobStore.events_after; a blocked read holds one connection of the pool, not a thread."""
        reply = await self.redis.xread({self.layout.event_stream(job_id): after}, count=count, block=block_ms)
        return stream_entries(reply)

    async def claim(self, tenant: str, member: str, now: float, ttl_s: float, cap: int) -> bool:
        """Take (or refresh) `member`'s slot among `tenant`'s open streams: False when `cap` are open already."""
        args: list[str | int] = [
            self.layout.prefix,
            tenant,
            member,
            int(now * 1000),
            int((now + ttl_s) * 1000),
            cap,
            int(ttl_s * 1000),
        ]
        return bool(await self._claim(keys=[], args=args))

    async def release(self, tenant: str, member: str) -> None:
        await self.redis.zrem(self.layout.tenant_streams(tenant), member)

    async def open_streams(self, tenant: str, now: float) -> int:
        """The tenant's slots not expired at `now`."""
        return int(await self.redis.zcount(self.layout.tenant_streams(tenant), f"({int(now * 1000)}", "+inf"))
