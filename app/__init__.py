"""Encore: a GPU job service for music generation and lip-sync on Celery + Redis.

`celery -A app worker -Q gpu0` finds the Celery application as `app.celery`. It is made on first use, not when
the package is imported: importing a part of Encore (the pipeline above all, which must import and run with
nothing else of `app`) builds no Celery app and reads no settings.
"""

from __future__ import annotations

from typing import Any

__all__ = ["celery"]


def __getattr__(name: str) -> Any:
    if name == "celery":
        from app.adapters.celery_app import celery

        return celery
    raise AttributeError(f"module 'app' has no attribute {name!r}")
