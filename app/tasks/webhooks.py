"""The webhook worker's task and its outbox pump (app/adapters/webhooks.py says how a message travels).

Run it apart from the GPU workers, on its own queue:
    celery -A app worker -Q webhooks -P threads -c 8 -n webhooks@%h
Its master moves messages from the outbox into `deliver` tasks; the thread pool POSTs them.
"""

from __future__ import annotations

import logging
import threading

from app.adapters import webhooks
from app.adapters.celery_app import celery
from app.control.services import services

log = logging.getLogger("encore.webhooks")


@celery.task(name="encore.webhooks.deliver", bind=True, acks_late=True, max_retries=None)
def deliver(self, message: dict) -> bool:
    """One attempt; a failed one is retried later (exponential backoff) until ENCORE_WEBHOOK_MAX_ATTEMPTS."""
    svc = services()
    attempt = self.request.retries + 1
    delivered, retry_in = webhooks.deliver(svc.redis, svc.jobs.keys, svc.settings, message, attempt)
    if retry_in is not None:
        raise self.retry(countdown=retry_in, queue=svc.settings.webhook_queue)
    return delivered


def send(message: dict) -> None:
    deliver.apply_async((message,), queue=services().settings.webhook_queue)


def pump_forever(worker: str, stop: threading.Event) -> None:
    """The master's loop: outbox -> delivery tasks, until the worker stops (a failure is logged, then retried)."""
    svc = services()
    moved = webhooks.recover_in_flight(svc.redis, svc.jobs.keys, worker)
    if moved:
        log.info("worker=%s event=webhooks_recovered count=%d", worker, moved)
    while not stop.is_set():
        try:
            webhooks.pump_outbox(svc.redis, svc.jobs.keys, worker, send, block_s=1.0)
        except Exception:
            log.exception("webhook pump failed; retrying")
            stop.wait(1.0)
