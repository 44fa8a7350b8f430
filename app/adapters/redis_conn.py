"""Every Redis connection Encore opens: a plain URL (REDIS_URL), or the current primary behind Redis Sentinel
(REDIS_SENTINELS + REDIS_SENTINEL_MASTER), for Encore's own clients and for Celery's broker and results.

With Sentinel, redis-py's `Sentinel(...).master_for()` asks the sentinels for the primary on every new
connection, so after a failover the next command reaches the promoted replica (the Lua scripts are loaded
again by redis-py on NOSCRIPT); commands during the switch raise ConnectionError, which the web answers 503.
Celery and kombu take the same sentinels as `sentinel://` URLs with the `master_name` transport option
(Celery's supported way to a highly available Redis; Redis Cluster is not supported by Celery), and the rate
limiter (the limits library) its `redis+sentinel://` URI with the credentials and database as options.
The database number and the primary's password still come from REDIS_URL.
"""

from __future__ import annotations

from typing import Any, cast, overload
from urllib.parse import quote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.sentinel
from redis.exceptions import LockError
from redis.lock import Lock
from redis.sentinel import Sentinel
from redis.typing import ZSetRangeResponse

from app.core.config import Settings

SENTINEL_CONNECT_TIMEOUT_S = 2.0


def _database(settings: Settings) -> int:
    path = urlsplit(settings.redis_url).path.strip("/")
    return int(path) if path.isdigit() else 0


def _password(settings: Settings) -> str | None:
    return urlsplit(settings.redis_url).password or None


def redis_client(settings: Settings, *, decode_responses: bool, read_timeout_s: float | None = None) -> redis.Redis:
    """A client of the primary: REDIS_URL's server, or the one the sentinels name now. `read_timeout_s`: its
    sockets' read timeout instead of redis-py's (5 s), for a client whose blocking reads (XREAD BLOCK) wait longer:
    redis-py would raise TimeoutError at 5 s."""
    timeout = {} if read_timeout_s is None else {"socket_timeout": read_timeout_s}
    if not settings.redis_sentinels:
        return redis.Redis.from_url(settings.redis_url, decode_responses=decode_responses, **timeout)
    sentinel = Sentinel(list(settings.redis_sentinels), sentinel_kwargs=_sentinel_kwargs(settings))
    return sentinel.master_for(
        settings.redis_sentinel_master,
        db=_database(settings),
        password=_password(settings),
        decode_responses=decode_responses,
        socket_connect_timeout=SENTINEL_CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        **timeout,
    )


def _sentinel_kwargs(settings: Settings) -> dict[str, Any]:
    """How a client talks to the sentinels themselves: short timeouts, and their own password (never the primary's)."""
    auth = {"password": settings.redis_sentinel_password} if settings.redis_sentinel_password else {}
    return {"socket_connect_timeout": SENTINEL_CONNECT_TIMEOUT_S, "socket_timeout": SENTINEL_CONNECT_TIMEOUT_S, **auth}


def async_redis_client(
    settings: Settings, max_connections: int, read_timeout_s: float, client_name: str | None = None
) -> redis.asyncio.Redis:
    """An asyncio text client of the same primary (the events server's): REDIS_URL's server, or the sentinels'; its
    pool opens at most `max_connections` (redis.asyncio's default, 100, would cap the blocked reads it serves), and
    its reads time out after `read_timeout_s` (above its longest XREAD BLOCK; redis-py's default is 5 s); each
    connection names itself `client_name` (CLIENT LIST shows whose connections they are)."""
    if not settings.redis_sentinels:
        return redis.asyncio.Redis.from_url(
            settings.redis_url,
            decode_responses=True,
            max_connections=max_connections,
            socket_timeout=read_timeout_s,
            client_name=client_name,
        )
    sentinel = redis.asyncio.sentinel.Sentinel(
        list(settings.redis_sentinels), sentinel_kwargs=_sentinel_kwargs(settings)
    )
    return sentinel.master_for(
        settings.redis_sentinel_master,
        db=_database(settings),
        password=_password(settings),
        decode_responses=True,
        max_connections=max_connections,
        socket_timeout=read_timeout_s,
        socket_connect_timeout=SENTINEL_CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        client_name=client_name,
    )


def limits_storage(settings: Settings) -> tuple[str, dict[str, Any]]:
    """The limits library's storage URI and options for the same Redis (it spells a socket redis+unix://).

    Behind Sentinel: redis+sentinel://<sentinels>/<name>, and as options the database and the primary's
    password from REDIS_URL and the sentinels' own password (REDIS_SENTINEL_PASSWORD). Its URI holds no
    database, and a password in it would be sent to the sentinels and the primary alike."""
    redis_url = settings.redis_url
    if not settings.redis_sentinels:
        return (
            "redis+unix://" + redis_url.removeprefix("unix://") if redis_url.startswith("unix://") else redis_url
        ), {}
    hosts = ",".join(f"{host}:{port}" for host, port in settings.redis_sentinels)
    options: dict[str, Any] = {
        "db": _database(settings),
        "password": _password(settings),
        "socket_connect_timeout": SENTINEL_CONNECT_TIMEOUT_S,
        # Reads from the primary: a replica lags, and a window read there told a client it had hits left that the
        # primary had counted (X-RateLimit-Remaining 2 where 0 was true; tests/test_sentinel.py, now and then).
        "use_replicas": False,
        "sentinel_kwargs": {
            "password": settings.redis_sentinel_password or None,
            "socket_connect_timeout": SENTINEL_CONNECT_TIMEOUT_S,
            "socket_timeout": SENTINEL_CONNECT_TIMEOUT_S,
        },
    }
    return f"redis+sentinel://{hosts}/{settings.redis_sentinel_master}", options


def celery_connection(settings: Settings) -> dict[str, Any]:
    """broker_url, result_backend and their transport options for Celery (merged into celeryconfig's)."""
    if not settings.redis_sentinels:
        return {"broker_url": settings.redis_url, "result_backend": settings.redis_url}
    password = _password(settings)
    auth = f":{quote(password, safe='')}@" if password else ""
    urls = ";".join(f"sentinel://{auth}{host}:{port}/{_database(settings)}" for host, port in settings.redis_sentinels)
    options: dict[str, Any] = {"master_name": settings.redis_sentinel_master}
    if settings.redis_sentinel_password:
        options["sentinel_kwargs"] = {"password": settings.redis_sentinel_password}
    return {
        "broker_url": urls,
        "result_backend": urls,
        "broker_transport_options": options,
        "result_backend_transport_options": dict(options),
    }


# redis-py types every reply `bytes | str` (and containers of them) whichever way the client was opened. Encore's
# text clients (decode_responses=True: every client but the artifact store's) only ever get str back, so for
# their replies these say so to the type checker; they return their argument unchanged.


@overload
def decoded(reply: bytes | str) -> str: ...
@overload
def decoded(reply: bytes | str | None) -> str | None: ...
@overload
def decoded(reply: dict[bytes | str, bytes | str]) -> dict[str, str]: ...
@overload
def decoded(reply: set[bytes | str]) -> set[str]: ...
@overload
def decoded(reply: list[bytes | str]) -> list[str]: ...
def decoded(reply: Any) -> Any:
    """A text client's reply (a value, None, a hash, a set or a list) as the str it is."""
    return reply


def decoded_members(reply: ZSetRangeResponse) -> list[str]:
    """A text client's ZRANGE (or ZRANGEBYSCORE, ZREVRANGE) reply without scores: the members."""
    return cast(list[str], reply)


def release_lock(lock: Lock) -> None:
    """Free a redis-py Lock this process holds; one that expired meanwhile (and may be another's now) is left
    alone: Lock.release checks its token, where a bare DEL would free another process's lock."""
    try:
        lock.release()
    except LockError:
        pass
