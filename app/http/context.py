"""The handles every view shares (job store, Celery app, profiles, settings), kept on the Flask application
rather than in closures or module globals: `create_app` builds one `WebContext` per application and stores
it in `app.extensions`, and views read it back with `context()`. Two applications in one process (tests,
tools) therefore never see each other's settings, Redis or caches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from flask import Flask, current_app
from prometheus_client import CollectorRegistry

from app.core.config import Settings
from app.http.events import StreamGate
from app.pipeline.profiles import LipsyncProfile, MusicProfile
from app.control.services import Services

EXTENSION = "encore"  # the key in app.extensions


@dataclass(frozen=True)
class WebContext:
    """One application's shared handles, built once by create_app."""

    settings: Settings
    services: Services
    celery: Celery  # sends stages by name (the web never imports the task modules)
    profile: MusicProfile  # the music profile: request limits and song lengths
    lipsync_profile: LipsyncProfile
    transport_options: dict[str, Any]  # the broker's, for reading queue depths
    metrics: CollectorRegistry  # what GET /metrics exposes
    tags: dict[str, Any]  # the Khala tag catalogue (ENCORE_TAGS_FILE), read once
    streams: StreamGate  # the event streams this process serves itself (none behind ENCORE_EVENTS_URL)
    stream_redis: redis.Redis  # their blocking reads, with a read timeout that outlasts them (events.read_timeout_s)


def install(app: Flask, shared: WebContext) -> None:
    """Make `shared` what `context()` returns inside `app`'s requests."""
    app.extensions[EXTENSION] = shared


def context() -> WebContext:
    """The current application's shared handles (inside a request, or an app context)."""
    shared: WebContext = current_app.extensions[EXTENSION]
    return shared
