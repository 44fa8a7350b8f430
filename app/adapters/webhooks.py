"""Webhooks: a job's start, progress and end POSTed to the URL its submitter gave, signed the Standard
Webhooks way (https://www.standardwebhooks.com: `webhook-id`, `webhook-timestamp`, `webhook-signature` =
"v1," + base64 HMAC-SHA256 of "<id>.<timestamp>.<body>" under ENCORE_WEBHOOK_SECRET, via the
`standardwebhooks` package).

How a message travels, so that none is lost to a crash:
1. the transition that makes the event (app/control/lifecycle.py) appends it to the outbox list {p}:webhooks:outbox
   in the same atomic step (a transactional outbox);
2. the webhook worker (`celery -A app worker -Q webhooks -P threads`: never a GPU queue) runs `pump_outbox`
   in its master, moving each message to its own in-flight list, sending one `encore.webhooks.deliver`
   task for it, then dropping it from that list (a master that dies in between finds it there on restart);
3. the task POSTs it; a failure is retried with jittered exponential backoff (ENCORE_WEBHOOK_BACKOFF_S doubling,
   each delay drawn between its step and the next, at most ENCORE_WEBHOOK_BACKOFF_CAP_S apart: `backoff_s`) up
   to ENCORE_WEBHOOK_MAX_ATTEMPTS; every attempt is recorded in the job's record (`webhook.deliveries`).
   Delivery is at least once: receivers dedupe on webhook-id.
   Each attempt holds a lease (app/control/webhook_leases.py): one whose worker died mid-attempt, or while it
   held the retry's countdown, is sent again by a webhook worker's pump within a lease, not after kombu's
   hour-long visibility timeout.
Where a webhook may go (issue 22): a URL is parsed once, by `parse_url`, which refuses anything two parsers
could read differently (a backslash, whitespace, percent signs or other odd characters in the authority,
numbers that are not a dotted-quad IPv4 or a bracketed IPv6 address: `2130706433`, `0x7f000001`, `127.1`) and
rebuilds the URL from its parts; that rebuilt URL is what the job stores and what is sent. Its host must be in
ENCORE_WEBHOOK_HOSTS when that is set, its port 80 or 443 unless an entry names it. At every delivery the host
is resolved (so a name that later resolves inside is caught: DNS rebinding) and every address must be public
or inside ENCORE_WEBHOOK_ALLOW_PRIVATE; the request then goes to that checked address (http.client, with the
URL's name in the Host header and as the TLS server name), never to a second resolution, and never through a
proxy from the environment. A 307/308 redirect is followed, at most MAX_REDIRECTS times, each hop checked the
same way; other redirects are not followed. A delivery record keeps the status and an error class, never what
the target sent.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import logging
import random
import re
import socket
import ssl
import string
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Sequence
from urllib.parse import urljoin, urlsplit

import redis
from standardwebhooks import Webhook

from app.adapters import addresses
from app.adapters.redis_conn import decoded
from app.core.config import Settings, webhook_entry, webhook_network
from app.core.keys import Layout

log = logging.getLogger("encore.webhooks")

EVENTS = ("start", "progress", "completed", "failed", "canceled")
DEFAULT_EVENTS = ("start", "completed", "failed", "canceled")
MAX_REDIRECTS = 3
MAX_URL_CHARS = 2000
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
OPEN_PORTS = (80, 443)  # the ports any allowed host may use; others must be named
DEFAULT_PORT = {"http": 80, "https": 443}
URL_CHARACTERS = frozenset(string.ascii_letters + string.digits + "-._~:/?#[]@!$&'()*+,;=%")  # RFC 3986's
_AUTHORITY = re.compile(r"(?:\[([0-9a-f:.]+)\]|([a-z0-9.-]+))(?::([0-9]{1,5}))?")
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")  # what inet_aton, and so getaddrinfo, reads as a number
RESOLVED_ADDRESSES = 16  # the most addresses of one name checked (and tried) per delivery
# Retry delays are drawn from this (`backoff_s`): a receiver that was down fails every delivery at once, and
# without jitter they would all come back at the same moments, each retry a burst on a receiver just back up.
JITTER = random.Random()


class WebhookRefused(ValueError):
    """A submitted webhook that cannot be used (named field, message)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass(frozen=True)
class Target:
    """A parsed webhook URL: what is checked is what is sent. `address` is set when the host is a literal."""

    scheme: str
    host: str  # lower case, no trailing dot; an IPv6 address without brackets
    port: int
    path: str  # with the query; never empty
    address: IPAddress | None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = "" if self.port == DEFAULT_PORT[self.scheme] else f":{self.port}"
        return f"{self.scheme}://{host}{port}{self.path}"


def parse_url(url: str) -> Target:
    """The one parser of webhook URLs (submit, delivery and every redirect hop); WebhookRefused("webhook")."""
    if len(url) > MAX_URL_CHARS:
        raise WebhookRefused("webhook", f"longer than {MAX_URL_CHARS} characters")
    odd = sorted({char for char in url if char not in URL_CHARACTERS})
    if odd:
        raise WebhookRefused(
            "webhook",
            f"must be printable ASCII without {' '.join(map(repr, odd))} "
            "(percent-encode the path; a host in its ASCII form)",
        )
    parts = urlsplit(url)  # safe to split here: nothing left that parsers disagree on
    if parts.scheme not in DEFAULT_PORT or not parts.netloc:
        raise WebhookRefused("webhook", "must be an http:// or https:// URL with a host")
    if "@" in parts.netloc:
        raise WebhookRefused("webhook", "must not carry credentials")
    authority = _AUTHORITY.fullmatch(parts.netloc.lower())
    if authority is None:
        raise WebhookRefused("webhook", f"{parts.netloc!r} is not host, host:port or [IPv6]:port")
    v6, name, port_text = authority.groups()
    port = int(port_text) if port_text else DEFAULT_PORT[parts.scheme]
    if not 0 < port < 65536:
        raise WebhookRefused("webhook", f"port {port} is not from 1 to 65535")
    address: IPAddress | None
    if v6 is not None:
        try:
            address = ipaddress.IPv6Address(v6)
        except ValueError:
            raise WebhookRefused("webhook", f"[{v6}] is not an IPv6 address") from None
        host = str(address)
    else:
        host = name[:-1] if name.endswith(".") else name
        labels = host.split(".")
        if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
            raise WebhookRefused("webhook", f"host {host!r} is not a DNS name or an IP address")
        address = None
        if _NUMERIC_LABEL.fullmatch(labels[-1]):  # a resolver would read it as an IPv4 address in some spelling
            try:
                address = ipaddress.IPv4Address(host)
            except ValueError:
                address = None
            if address is None or str(address) != host:
                raise WebhookRefused("webhook", f"host {host!r}: an IPv4 address must be written a.b.c.d in decimal")
    return Target(parts.scheme, host, port, (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), address)


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether `host` is in the allow-list: exact names (or addresses), or ".example.com" for it and its
    subdomains, each with an optional ":port" (see `named_ports`); an empty list allows any host."""
    return not allowed or bool(_matching(host, allowed))


def named_ports(host: str, allowed: tuple[str, ...]) -> set[int]:
    """The ports beside 80 and 443 that the allow-list's entries matching `host` name."""
    return {port for _, port in _matching(host, allowed) if port is not None}


def _matching(host: str, allowed: tuple[str, ...]) -> list[tuple[str, int | None]]:
    host = _canonical(host.lower().rstrip("."))
    entries = [webhook_entry(entry, "ENCORE_WEBHOOK_HOSTS") for entry in allowed]
    return [
        (name, port)
        for name, port in entries
        if host == _canonical(name) or (name.startswith(".") and (host.endswith(name) or host == name[1:]))
    ]


def _canonical(host: str) -> str:
    """An IP address in its one spelling (`::0:1` -> `::1`), a name as it is."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def public(address: IPAddress) -> bool:
    """Whether `address` is on the public internet: outside every IANA special-purpose block and the clouds'
    metadata addresses, nor an IPv6 form that carries such an IPv4 address (app/adapters/addresses.py)."""
    return addresses.is_public(address)


def refusal(target: Target, address: IPAddress | None, settings: Settings) -> str | None:
    """Why this server may not send to `target` (reached at `address`, when known), or None: its host must be in
    ENCORE_WEBHOOK_HOSTS (when set); its port 80 or 443 unless an entry names it; a non-public address must be
    inside an ENCORE_WEBHOOK_ALLOW_PRIVATE entry (one with a port allows that port only)."""
    if not host_allowed(target.host, settings.webhook_hosts):
        return f"host {target.host} is not in this server's ENCORE_WEBHOOK_HOSTS"
    ports = set(OPEN_PORTS) | named_ports(target.host, settings.webhook_hosts)
    private = [webhook_network(entry) for entry in settings.webhook_allow_private]
    if address is None:  # a name not yet resolved: a port any private entry names may still turn out right
        ports |= {port for _, port in private if port is not None}
    elif not public(address):
        covering = [port for network, port in private if address.version == network.version and address in network]
        if not any(port in (None, target.port) for port in covering):
            return (
                f"{address} is not a public address ({addresses.why_not_public(address)}) and {address} port "
                f"{target.port} is not in this server's ENCORE_WEBHOOK_ALLOW_PRIVATE"
            )
        if target.port in covering:
            return None
    if target.port not in ports:
        return f"port {target.port}: only 80 and 443, or a port an ENCORE_WEBHOOK_HOSTS entry names"
    return None


def check_target(url: str | None, events: Sequence[str] | None, settings: Settings) -> dict[str, Any] | None:
    """The webhook a job stores ({"url": the rebuilt URL, "events"}), or None without a URL; WebhookRefused
    names the field. A name is resolved at delivery, not here; "localhost" and a literal address are judged now."""
    if url is None:
        if events:
            raise WebhookRefused("webhook_events", "given without a webhook URL")
        return None
    target = parse_url(url)
    local = target.host == "localhost" or target.host.endswith(".localhost")  # RFC 6761: loopback, whatever DNS says
    why = refusal(target, ipaddress.IPv4Address("127.0.0.1") if local else target.address, settings)
    if why:
        raise WebhookRefused("webhook", why)
    if not settings.webhook_secret:
        raise WebhookRefused("webhook", "this server has no ENCORE_WEBHOOK_SECRET: it cannot sign webhooks")
    chosen = list(DEFAULT_EVENTS) if events is None else list(dict.fromkeys(events))
    unknown = [name for name in chosen if name not in EVENTS]
    if unknown or not chosen:
        raise WebhookRefused("webhook_events", f"must be a non-empty subset of {', '.join(EVENTS)}")
    return {"url": target.url, "events": chosen}


def split_events(text: str | None) -> list[str] | None:
    """A form field's comma-separated events as a list (None when absent)."""
    return None if text is None else [name.strip() for name in text.split(",") if name.strip()]


# -- signing and sending --------------------------------------------------------------------------------


def signed_headers(secret: str, message_id: str, body: str, at: float | None = None) -> dict[str, str]:
    stamp = datetime.fromtimestamp(time.time() if at is None else at, tz=timezone.utc)
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(int(stamp.timestamp())),
        "webhook-signature": Webhook(secret).sign(message_id, stamp, body),
        "content-type": "application/json",
        "user-agent": "encore-webhooks",
    }


def resolve(target: Target, settings: Settings) -> list[IPAddress]:
    """The addresses a delivery may connect to, resolved now; WebhookRefused when any of them is refused (an
    answer that mixes public and inside addresses is not trusted) or the name does not resolve."""
    if target.address is not None:
        addresses: list[IPAddress] = [target.address]
    else:
        try:
            infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        except OSError as exc:
            raise WebhookRefused("webhook", f"{target.host} does not resolve ({type(exc).__name__})") from None
        addresses = []
        for info in infos[:RESOLVED_ADDRESSES]:
            try:  # normalised: whatever the resolver accepted, ipaddress reads the address it returned
                address = ipaddress.ip_address(info[4][0])
            except ValueError:
                raise WebhookRefused("webhook", f"{target.host} resolved to {info[4][0]!r}") from None
            if address not in addresses:
                addresses.append(address)
    for address in addresses:
        why = refusal(target, address, settings)
        if why:
            raise WebhookRefused("webhook", why)
    return addresses


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP(S) connection for the URL's name (its Host header, its TLS server name and certificate check)
    whose socket goes only to the addresses `resolve` checked: no second lookup can send it elsewhere."""

    def __init__(self, target: Target, addresses: list[IPAddress], timeout_s: float):
        super().__init__(target.host, target.port, timeout=timeout_s)
        self.default_port = DEFAULT_PORT[target.scheme]  # the Host header leaves out the scheme's own port
        self.addresses = addresses
        self.tls = ssl.create_default_context() if target.scheme == "https" else None

    def connect(self) -> None:
        error: OSError = OSError("no address")
        for address in self.addresses:
            try:
                sock = socket.create_connection((str(address), self.port), self.timeout)
            except OSError as exc:
                error = exc
                continue
            try:
                self.sock = self.tls.wrap_socket(sock, server_hostname=self.host) if self.tls else sock
            except BaseException:
                sock.close()
                raise
            return
        raise error


def _send(
    target: Target, addresses: list[IPAddress], body: bytes, headers: dict[str, str], timeout_s: float
) -> tuple[int, str | None]:
    """POST once: (status, Location header or None). Nothing of the body is read."""
    connection = _PinnedConnection(target, addresses, timeout_s)
    try:
        connection.request("POST", target.path, body=body, headers=headers)
        reply = connection.getresponse()
        return reply.status, reply.getheader("location")
    finally:
        connection.close()


def post(url: str, body: str, headers: dict[str, str], timeout_s: float, settings: Settings) -> tuple[int | None, str]:
    """POST once to a checked address, following 307/308 redirects whose targets pass the same checks: (HTTP
    status or None, error text or ""). The error names a class of failure only, never what the target sent."""
    try:
        target = parse_url(url)
    except WebhookRefused as exc:
        return None, f"refused: {exc.message}"
    redirected: int | None = None  # the status of the redirect that led here
    for _ in range(MAX_REDIRECTS + 1):
        try:
            addresses = resolve(target, settings)
        except WebhookRefused as exc:
            return redirected, ("redirect not followed: " if redirected else "refused: ") + exc.message
        try:
            status, location = _send(target, addresses, body.encode(), headers, timeout_s)
        except (OSError, http.client.HTTPException) as exc:  # refused, timed out, TLS, not HTTP
            return None, type(exc).__name__
        if 200 <= status < 300:
            return status, ""
        if status not in (307, 308) or not location:
            return status, f"answered {status}" + (
                " (only 307 and 308 redirects are followed)" if 300 <= status < 400 else ""
            )
        try:
            target = parse_url(urljoin(target.url, location))
        except WebhookRefused as exc:
            return status, f"redirect not followed: {exc.message}"
        why = refusal(target, target.address, settings)
        if why:
            return status, f"redirect not followed: {why}"
        redirected = status
    return None, f"more than {MAX_REDIRECTS} redirects"


def backoff_s(attempt: int, settings: Settings, rng: random.Random = JITTER) -> float:
    """Seconds before attempt `attempt` + 1 (attempt counts from 1): drawn between its step of the exponential
    schedule (base, 2 base, 4 base ...) and the next step, both capped, so deliveries that failed together do
    not retry in lockstep; never sooner than the step, never longer than the cap."""
    step = settings.webhook_backoff_s * 2 ** (attempt - 1)
    cap = settings.webhook_backoff_cap_s
    return rng.uniform(min(step, cap), min(2 * step, cap))


def deliver(
    client: redis.Redis, layout: Layout, settings: Settings, message: dict[str, Any], attempt: int
) -> tuple[bool, float | None]:
    """One delivery attempt of an outbox message, recorded in its job; (delivered, seconds until the next
    attempt or None when there is none: delivered, given up, or the job is gone)."""
    job_key = layout.job(message["job_id"])
    url = decoded(client.hget(job_key, "webhook"))
    if not url:
        return False, None  # the job expired: nobody to tell
    body = json.dumps(
        {"type": f"job.{message['type']}", "timestamp": _iso(message["at"]), "data": message["data"]},
        separators=(",", ":"),
    )
    started = time.time()
    status, error = post(
        url, body, signed_headers(settings.webhook_secret, message["id"], body), settings.webhook_timeout_s, settings
    )
    delivered = not error
    retry_in = None if delivered or attempt >= settings.webhook_max_attempts else backoff_s(attempt, settings)
    record = {
        "id": message["id"],
        "type": message["type"],
        "attempt": attempt,
        "at": round(started, 3),
        "status": status,
        "error": error,
        "delivered": delivered,
        "retry_in_s": retry_in,
    }
    deliveries = layout.webhook_deliveries(message["job_id"])
    pipe = client.pipeline()
    pipe.rpush(deliveries, json.dumps(record))
    pipe.ltrim(deliveries, -settings.webhook_history, -1)
    ttl = client.ttl(job_key)
    pipe.expire(deliveries, ttl if ttl and ttl > 0 else settings.job_ttl_s)
    pipe.execute()
    log.info(
        "event=webhook job_id=%s id=%s type=%s attempt=%d status=%s delivered=%s %s",
        message["job_id"],
        message["id"],
        message["type"],
        attempt,
        status,
        delivered,
        error,
    )
    return delivered, retry_in


def _iso(at: float) -> str:
    return datetime.fromtimestamp(float(at), tz=timezone.utc).isoformat().replace("+00:00", "Z")


# -- the outbox pump ---------------------------------------------------------------------------------------


def pump_outbox(
    client: redis.Redis, layout: Layout, worker: str, send: Callable[[dict[str, Any]], None], block_s: float = 1.0
) -> int:
    """Move one message from the outbox to this worker's in-flight list (waiting up to `block_s`), `send`
    it, then drop it from the list; returns how many were sent (0 or 1). Call `recover_in_flight` first."""
    mine = layout.webhook_in_flight(worker)
    # BLMOVE takes a float timeout (Redis >= 6); redis-py's annotation says int.
    raw = decoded(client.blmove(layout.webhook_outbox, mine, block_s, "LEFT", "RIGHT"))  # type: ignore[arg-type]
    if raw is None:
        return 0
    send(json.loads(raw))
    client.lrem(mine, 1, raw)
    return 1


def recover_in_flight(client: redis.Redis, layout: Layout, worker: str) -> int:
    """Put back on the outbox what this worker's previous run moved but never sent (it died in between)."""
    moved = 0
    while client.lmove(layout.webhook_in_flight(worker), layout.webhook_outbox, "RIGHT", "LEFT") is not None:
        moved += 1
    return moved
