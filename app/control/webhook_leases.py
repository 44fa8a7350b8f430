"""Leases on webhook deliveries, so that a delivery whose worker died is back in flight within a lease's time.

A `deliver` task is `acks_late`; when its worker is killed, kombu keeps the message in `unacked` until the
visibility timeout (an hour here), and a retry waiting for its countdown is held the same way. So the delivery
is not left to Celery alone: each message handed out has a record in Redis ({p}:webhooks:pending:data: the
message, the attempt due and the Celery task id that may make it) and a deadline ({p}:webhooks:pending). An
attempt claims its message (pushing the deadline one lease on), settles it when delivered or given up, or hands
it to the next attempt's task id when it retries (the deadline is then the countdown plus a lease). Whatever
passes its deadline unsettled (its worker died) is given a new task id and sent again by any webhook worker's
pump (app/tasks/webhooks.py); the old task id is stale from then on, so the hour-late Celery message that kombu
restores does nothing. Delivery stays at least once, always under the message's one webhook-id.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from app.adapters.webhooks import MAX_REDIRECTS
from app.control.scripts import script
from app.control.services import Services
from app.core.config import Settings

RESEND_BATCH = 50  # overdue messages one pump pass sends again


def attempt_lease_s(settings: Settings) -> float:
    """How long one attempt may take before its message counts as abandoned: every hop of a redirect chain
    timing out, and a margin for the worker to record the result."""
    return settings.webhook_timeout_s * (MAX_REDIRECTS + 1) + 5.0


def new_task_id() -> str:
    return uuid.uuid4().hex


def _call(svc: Services, *args: Any) -> Any:
    return script(svc.redis, "webhook_pending")(keys=[], args=[svc.jobs.keys.prefix, *args])


def register(svc: Services, message: dict[str, Any], attempt: int, task_id: str, deadline: float) -> None:
    """A message handed out to `task_id` for `attempt` (the outbox's, or the same message again)."""
    record = json.dumps({"message": json.dumps(message), "attempt": attempt, "task": task_id})
    _call(svc, "register", message["id"], record, repr(deadline))


def claim(svc: Services, message_id: str, task_id: str, deadline: float) -> bool:
    """The attempt `task_id` begins, holding the message until `deadline`; False when the task is stale."""
    return bool(_call(svc, "claim", message_id, task_id, repr(deadline)))


def settle(svc: Services, message_id: str, task_id: str) -> bool:
    """Delivered or given up: the message is forgotten; False when the task was stale."""
    return bool(_call(svc, "settle", message_id, task_id))


def reschedule(svc: Services, message_id: str, task_id: str, next_task_id: str, attempt: int, deadline: float) -> bool:
    """The next attempt (number `attempt`) is `next_task_id`'s, due to have begun by `deadline`."""
    return bool(_call(svc, "reschedule", message_id, task_id, next_task_id, attempt, repr(deadline)))


def take_overdue(svc: Services, now: float, lease_s: float) -> list[tuple[dict[str, Any], int, str]]:
    """Messages past their deadline, each now held by a new task id for a lease: (message, attempt, task id) to
    send again. Atomic, so two pumps never both take one."""
    ids = [new_task_id() for _ in range(RESEND_BATCH)]
    taken = _call(svc, "overdue", repr(now), repr(lease_s), RESEND_BATCH, *ids)
    records = [json.loads(raw) for raw in taken]
    return [(json.loads(r["message"]), int(r["attempt"]), str(r["task"])) for r in records]
