"""The webhook worker's task and its outbox pump (app/adapters/webhooks.py says how a message travels; the
leases that bring back a delivery whose worker died are app/control/webhook_leases.py).

Run it apart from the GPU workers, on its own queue:
    celery -A app worker -Q webhooks -P threads -c 8 -n webhooks@%h
Its master moves messages from the outbox into `deliver` tasks and sends again those whose lease ran out; the
thread pool POSTs them.
"""

from __future__ import annotations

import logging
import threading
import time

from app.adapters import webhooks
from app.adapters.celery_app import celery
from app.control import webhook_leases as leases
from app.control.services import Services, services

log = logging.getLogger("encore.webhooks")


@celery.task(name="encore.webhooks.deliver", bind=True, acks_late=True, max_retries=None)
def deliver(self, message: dict, attempt: int | None = None) -> bool:
    """One attempt, if this task is still the message's current one; a failed attempt hands the message to a
    new task sent after the backoff (exponential, jittered: webhooks.backoff_s) until ENCORE_WEBHOOK_MAX_ATTEMPTS."""
    svc = services()
    lease_s = leases.attempt_lease_s(svc.settings)
    if attempt is None:  # sent before deliveries had leases: no record to check it against
        attempt = self.request.retries + 1
    elif not leases.claim(svc, message["id"], self.request.id, time.time() + lease_s):
        log.info("event=webhook_stale id=%s task=%s", message["id"], self.request.id)  # settled, or sent again
        return False
    delivered, retry_in = webhooks.deliver(svc.redis, svc.jobs.keys, svc.settings, message, attempt)
    if retry_in is None:
        leases.settle(svc, message["id"], self.request.id)
        return delivered
    follow = leases.new_task_id()
    deadline = time.time() + retry_in + lease_s
    if leases.reschedule(svc, message["id"], self.request.id, follow, attempt + 1, deadline):
        _send(svc, message, attempt + 1, follow, countdown=retry_in)
    return False


def _send(svc: Services, message: dict, attempt: int, task_id: str, countdown: float | None = None) -> None:
    deliver.apply_async((message, attempt), task_id=task_id, countdown=countdown, queue=svc.settings.webhook_queue)


def send(message: dict) -> None:
    """Hand an outbox message to a first attempt, under a lease."""
    svc = services()
    task_id = leases.new_task_id()
    leases.register(svc, message, 1, task_id, time.time() + leases.attempt_lease_s(svc.settings))
    _send(svc, message, 1, task_id)


def resend_overdue(svc: Services) -> int:
    """Send again every delivery whose lease ran out (its worker died mid-attempt, or while holding its retry)."""
    due = leases.take_overdue(svc, time.time(), leases.attempt_lease_s(svc.settings))
    for message, attempt, task_id in due:
        _send(svc, message, attempt, task_id)
        log.warning("event=webhook_resent job_id=%s id=%s attempt=%d", message.get("job_id"), message["id"], attempt)
    return len(due)


def pump_forever(worker: str, stop: threading.Event) -> None:
    """The master's loop: outbox -> delivery tasks, and overdue deliveries sent again, until the worker stops (a
    failure is logged, then retried)."""
    svc = services()
    moved = webhooks.recover_in_flight(svc.redis, svc.jobs.keys, worker)
    if moved:
        log.info("worker=%s event=webhooks_recovered count=%d", worker, moved)
    while not stop.is_set():
        try:
            webhooks.pump_outbox(svc.redis, svc.jobs.keys, worker, send, block_s=1.0)
            resend_overdue(svc)
        except Exception:
            log.exception("webhook pump failed; retrying")
            stop.wait(1.0)
