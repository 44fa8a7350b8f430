"""The Celery application. Importing it is cheap (no torch): the web uses it to send tasks by name; the
worker imports the task modules through `include`."""

from __future__ import annotations

from celery import Celery

from app.core.config import Settings
from app.adapters.redis_conn import celery_connection

TASK_MODULES = ["app.tasks.music", "app.tasks.lipsync", "app.tasks.webhooks", "app.tasks.worker_hooks"]


def make_celery(settings: Settings | None = None) -> Celery:
    """A Celery app configured from celeryconfig; `settings` overrides the Redis URL (web, tests)."""
    instance = Celery("encore", include=TASK_MODULES)
    instance.config_from_object("celeryconfig")
    if settings is not None:
        connection = celery_connection(settings)
        for name in ("broker_transport_options", "result_backend_transport_options"):
            if name in connection:
                connection[name] = {**(instance.conf.get(name) or {}), **connection[name]}
        instance.conf.update(**connection)
    return instance


celery = make_celery()
