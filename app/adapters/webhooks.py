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
3. the task POSTs it; a failure is retried with exponential backoff (ENCORE_WEBHOOK_BACKOFF_S doubling, at
   most ENCORE_WEBHOOK_BACKOFF_CAP_S apart) up to ENCORE_WEBHOOK_MAX_ATTEMPTS; every attempt is recorded
   in the job's record (`webhook.deliveries`). Delivery is at least once: receivers dedupe on webhook-id.
Redirects are followed only to the same host; the URL is checked at submit time (http or https, and a host
in ENCORE_WEBHOOK_HOSTS when that is set).
"""
from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timezone
from typing import Any, Callable, Sequence
from urllib.parse import urljoin, urlsplit

import redis
import requests
from standardwebhooks import Webhook

from app.adapters.redis_conn import decoded
from app.core.config import Settings
from app.core.keys import Layout

log = logging.getLogger("encore.webhooks")

EVENTS = ("start", "progress", "completed", "failed", "canceled")
DEFAULT_EVENTS = ("start", "completed", "failed", "canceled")
MAX_REDIRECTS = 3
MAX_URL_CHARS = 2000


class WebhookRefused(ValueError):
    """A submitted webhook that cannot be used (named field, message)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether `host` is in the allow-list: exact names, or ".example.com" for it and its subdomains; an
    empty list allows any host."""
    host = host.lower().rstrip(".")
    return not allowed or any(host == entry or (entry.startswith(".") and (host.endswith(entry) or host == entry[1:]))
                              for entry in allowed)


def check_target(url: str | None, events: Sequence[str] | None, settings: Settings) -> dict[str, Any] | None:
    """The webhook a job stores ({"url", "events"}), or None without a URL; WebhookRefused names the field."""
    if url is None:
        if events:
            raise WebhookRefused("webhook_events", "given without a webhook URL")
        return None
    if len(url) > MAX_URL_CHARS:
        raise WebhookRefused("webhook", f"longer than {MAX_URL_CHARS} characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookRefused("webhook", "must be an http:// or https:// URL with a host")
    if parts.username or parts.password:
        raise WebhookRefused("webhook", "must not carry credentials")
    if not host_allowed(parts.hostname, settings.webhook_hosts):
        raise WebhookRefused("webhook", f"host {parts.hostname} is not in this server's ENCORE_WEBHOOK_HOSTS")
    if not settings.webhook_secret:
        raise WebhookRefused("webhook", "this server has no ENCORE_WEBHOOK_SECRET: it cannot sign webhooks")
    chosen = list(DEFAULT_EVENTS) if events is None else list(dict.fromkeys(events))
    unknown = [name for name in chosen if name not in EVENTS]
    if unknown or not chosen:
        raise WebhookRefused("webhook_events", f"must be a non-empty subset of {', '.join(EVENTS)}")
    return {"url": url, "events": chosen}


def split_events(text: str | None) -> list[str] | None:
    """A form field's comma-separated events as a list (None when absent)."""
    return None if text is None else [name.strip() for name in text.split(",") if name.strip()]


# -- signing and sending --------------------------------------------------------------------------------

def signed_headers(secret: str, message_id: str, body: str, at: float | None = None) -> dict[str, str]:
    stamp = datetime.fromtimestamp(time.time() if at is None else at, tz=timezone.utc)
    return {"webhook-id": message_id, "webhook-timestamp": str(int(stamp.timestamp())),
            "webhook-signature": Webhook(secret).sign(message_id, stamp, body), "content-type": "application/json",
            "user-agent": "encore-webhooks"}


def post(url: str, body: str, headers: dict[str, str], timeout_s: float) -> tuple[int | None, str]:
    """POST once, following redirects on the same host only: (HTTP status or None, error text or "")."""
    host = urlsplit(url).hostname
    for _ in range(MAX_REDIRECTS + 1):
        try:
            reply = requests.post(url, data=body.encode(), headers=headers, timeout=timeout_s, allow_redirects=False)
        except requests.RequestException as exc:
            return None, f"{type(exc).__name__}: {exc}"[:300]
        if reply.is_redirect and reply.headers.get("location"):
            target = urljoin(url, reply.headers["location"])
            if urlsplit(target).hostname != host or urlsplit(target).scheme not in ("http", "https"):
                return reply.status_code, f"redirect to another host not followed ({urlsplit(target).hostname})"
            url = target
            continue
        if 200 <= reply.status_code < 300:
            return reply.status_code, ""
        return reply.status_code, f"answered {reply.status_code}"
    return None, f"more than {MAX_REDIRECTS} redirects"


def backoff_s(attempt: int, settings: Settings) -> float:
    """Seconds before attempt `attempt` + 1 (attempt counts from 1): base, 2 base, 4 base ..., capped."""
    return min(settings.webhook_backoff_cap_s, settings.webhook_backoff_s * 2 ** (attempt - 1))


def deliver(client: redis.Redis, layout: Layout, settings: Settings, message: dict[str, Any],
            attempt: int) -> tuple[bool, float | None]:
    """One delivery attempt of an outbox message, recorded in its job; (delivered, seconds until the next
    attempt or None when there is none: delivered, given up, or the job is gone)."""
    job_key = layout.job(message["job_id"])
    url = decoded(client.hget(job_key, "webhook"))
    if not url:
        return False, None  # the job expired: nobody to tell
    body = json.dumps({"type": f"job.{message['type']}", "timestamp": _iso(message["at"]), "data": message["data"]},
                      separators=(",", ":"))
    started = time.time()
    status, error = post(url, body, signed_headers(settings.webhook_secret, message["id"], body), settings.webhook_timeout_s)
    delivered = not error
    retry_in = None if delivered or attempt >= settings.webhook_max_attempts else backoff_s(attempt, settings)
    record = {"id": message["id"], "type": message["type"], "attempt": attempt, "at": round(started, 3),
              "status": status, "error": error, "delivered": delivered, "retry_in_s": retry_in}
    deliveries = layout.webhook_deliveries(message["job_id"])
    pipe = client.pipeline()
    pipe.rpush(deliveries, json.dumps(record))
    pipe.ltrim(deliveries, -settings.webhook_history, -1)
    ttl = client.ttl(job_key)
    pipe.expire(deliveries, ttl if ttl and ttl > 0 else settings.job_ttl_s)
    pipe.execute()
    log.info("event=webhook job_id=%s id=%s type=%s attempt=%d status=%s delivered=%s %s", message["job_id"],
             message["id"], message["type"], attempt, status, delivered, error)
    return delivered, retry_in


def _iso(at: float) -> str:
    return datetime.fromtimestamp(float(at), tz=timezone.utc).isoformat().replace("+00:00", "Z")


# -- the outbox pump ---------------------------------------------------------------------------------------

def pump_outbox(client: redis.Redis, layout: Layout, worker: str, send: Callable[[dict[str, Any]], None],
                block_s: float = 1.0) -> int:
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
