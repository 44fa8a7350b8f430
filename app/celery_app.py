"""The Celery application. Importing it is cheap (no torch): the web uses it to send tasks by name; the
worker imports the task modules through `include`."""
from __future__ import annotations

from celery import Celery

from app.config import Settings

TASK_MODULES = ["app.tasks.music", "app.tasks.lipsync", "app.tasks.webhooks", "app.tasks.worker_hooks"]


def make_celery(settings: Settings | None = None) -> Celery:
    """A Celery app configured from celeryconfig; `settings` overrides the Redis URL (web, tests)."""
    instance = Celery("encore", include=TASK_MODULES)
    instance.config_from_object("celeryconfig")
    if settings is not None:
        instance.conf.update(broker_url=settings.redis_url, result_backend=settings.redis_url)
    return instance


celery = make_celery()
