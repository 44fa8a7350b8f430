"""HTTP API: validates requests, writes job records, routes tracks to GPU queues, serves results.

Speaks HTTP and job records only; no model code is imported here. This module only wires the application:
the views live in app/http/ (pages, ops, submit, jobs, and the Khala contract), and read the shared handles
that `create_app` builds through `app.http.context.context()`, so two applications in one process (tests,
tools) keep their own settings, Redis and caches.
"""

from __future__ import annotations

import logging

from flask import Flask
from flask.json.provider import DefaultJSONProvider

from app.adapters.celery_app import make_celery
from app.core.config import Settings, load_settings
from app.http import errors, guards, jobs, khala, ops, pages, submit
from app.http.context import WebContext, install
from app.http.events import StreamGate, read_timeout_s
from app.adapters.redis_conn import redis_client
from app.control.metrics import make_registry
from app.pipeline.profiles import load_lipsync_profile
from app.http.ratelimit import install as install_rate_limits
from app.control.services import build_services
from app.adapters.tracing import instrument_flask

NATIVE_BLUEPRINTS = (ops.blueprint, pages.blueprint, submit.blueprint, jobs.blueprint)


def _configure_logging() -> None:
    """Job events (`job=… event=…`) go to stderr at INFO unless the host process configured logging."""
    logger = logging.getLogger("encore")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def build_context(settings: Settings) -> WebContext:
    """The handles every view of one application shares: Redis and the stores, a Celery app that sends stages
    by name, the profiles requests are checked against, the metrics registry, the Khala tag catalogue."""
    services = build_services(settings)
    celery = make_celery(settings)
    transport_options = dict(celery.conf.broker_transport_options or {})
    return WebContext(
        settings=settings,
        services=services,
        celery=celery,
        profile=settings.music(),
        lipsync_profile=load_lipsync_profile(settings.lipsync_profile, settings.lipsync_model_dir),
        transport_options=transport_options,
        metrics=make_registry(services, transport_options),
        tags=khala.load_catalogue(settings.tags_file),
        streams=StreamGate.for_threads(settings.web_threads, shared=not settings.tenants.open),
        stream_redis=redis_client(
            settings, decode_responses=True, read_timeout_s=read_timeout_s(settings.sse_heartbeat_s)
        ),
    )


def create_app(settings: Settings | None = None) -> Flask:
    """The web application for `settings` (the environment's by default): its context, hooks, error
    handlers and blueprints. gunicorn calls it once per worker process."""
    settings = settings or load_settings()
    _configure_logging()
    shared = build_context(settings)
    app = Flask(__name__)  # the page and its assets are app/static
    install(app, shared)
    assert isinstance(app.json, DefaultJSONProvider)
    app.json.sort_keys = False  # records keep their field order; sorting every reply costs a poll ~5 %
    app.config["SERVICES"] = shared.services  # for tests and tools holding the app
    # Bodies larger than both upload limits together are refused before they are read (413).
    app.config["MAX_CONTENT_LENGTH"] = int((settings.max_video_mb + settings.max_audio_mb + 1) * 2**20)
    app.config["MAX_FORM_PARTS"] = submit.MAX_FORM_PARTS
    app.config["MAX_FORM_MEMORY_SIZE"] = submit.MAX_FORM_MEMORY_BYTES
    instrument_flask(app, settings)  # first: the request span wraps the other hooks
    for exception, handler in errors.HANDLERS:
        app.register_error_handler(exception, handler)
    app.before_request(guards.arm_body_timeout)
    app.before_request(guards.authenticate)  # every request gets its tenant; protected routes need one
    install_rate_limits(app, settings)  # the submit views consult it
    khala.register(app, settings.compat_prefix)
    for blueprint in NATIVE_BLUEPRINTS:
        app.register_blueprint(blueprint)
    return app
