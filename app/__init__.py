"""Encore: a GPU job service for music generation and lip-sync on Celery + Redis.

`celery -A app worker -Q gpu0` finds the Celery application as `app.celery`.
"""
from app.adapters.celery_app import celery

__all__ = ["celery"]
