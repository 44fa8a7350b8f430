"""OpenTelemetry tracing: one trace per job, from the web request that submitted it through a span per stage.

Off unless OTEL_EXPORTER_OTLP_ENDPOINT is set (then spans go there over OTLP/HTTP, with the exporter's own
standard variables: OTEL_EXPORTER_OTLP_HEADERS, OTEL_BSP_SCHEDULE_DELAY, ...; the service is
OTEL_SERVICE_NAME, default "encore", with "-web" or "-worker" appended).
- The web opens a server span per request (`instrument_flask`).
- Celery's `before_task_publish` writes the current trace context (W3C `traceparent`) into the message's
  headers: the submit's span is the parent of the chain's first stage, and each stage's span the parent of
  the next one, which Celery publishes while that stage's span is current.
- In the worker's pool child `task_prerun` reads it back from the request and opens the stage's span
  (attributes: the job id, track and stage), `task_postrun` ends it; a stage that raised marks it an error.
- A job keeps its submit's context (`current_carrier`, in its hash); a stage that a worker runs for a track outside
  the track's own delivery (the backbone engine runs other jobs' tracks in one delivery) opens a `TrackSpan` under
  it, and the track's next stage under that span, so each job's stages stay in its own trace.
The propagation is the OpenTelemetry API's own (`opentelemetry.propagate`); only the wiring is here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from app.core.config import Settings

if TYPE_CHECKING:
    from opentelemetry.propagators.textmap import Getter

log = logging.getLogger("encore.tracing")

_configured = False
_open_spans: dict[str, tuple[Any, Any]] = {}  # task id -> (span, context token)


def enabled(settings: Settings) -> bool:
    return bool(settings.otel_endpoint)


def configure(settings: Settings, role: str) -> bool:
    """Install the tracer provider with an OTLP/HTTP exporter and the Celery hooks, once per process;
    False (and nothing installed) when tracing is off."""
    global _configured
    if _configured or not enabled(settings):
        return _configured
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"{settings.otel_service_name}-{role}"}))
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otel_endpoint.rstrip("/") + "/v1/traces"))
    )
    trace.set_tracer_provider(provider)
    _connect_celery()
    _configured = True
    log.info("event=tracing_on role=%s endpoint=%s", role, settings.otel_endpoint)
    return True


def _tracer():
    from opentelemetry import trace

    return trace.get_tracer("encore")


def _connect_celery() -> None:
    from celery.signals import before_task_publish, task_failure, task_postrun, task_prerun

    before_task_publish.connect(_inject, weak=False)
    task_prerun.connect(_start_stage, weak=False)
    task_postrun.connect(_end_stage, weak=False)
    task_failure.connect(_fail_stage, weak=False)


def _inject(headers: dict | None = None, **_: Any) -> None:
    """The current trace context into the message headers (Celery's protocol 2 headers dict)."""
    if headers is not None:
        from opentelemetry import propagate

        propagate.inject(headers)


@lru_cache(maxsize=1)
def _request_getter() -> Getter[Any]:
    """Reads propagated fields from a Celery task request: custom message headers become its attributes.
    Built on first use, so that a process without tracing never imports OpenTelemetry's context."""
    from opentelemetry.propagators.textmap import Getter

    class RequestGetter(Getter[Any]):
        def get(self, carrier: Any, key: str) -> list[str] | None:
            value = getattr(carrier, key, None)
            if value is None and isinstance(getattr(carrier, "headers", None), dict):
                value = carrier.headers.get(key)
            return None if value is None else [value]

        def keys(self, carrier: Any) -> list[str]:
            return []

    return RequestGetter()


def _start_stage(task_id: str | None = None, task: Any = None, args: tuple = (), **_: Any) -> None:
    from opentelemetry import context, propagate, trace

    parent = propagate.extract(task.request, getter=_request_getter())
    ref = args[0] if args and isinstance(args[0], dict) else {}
    span = _tracer().start_span(
        f"stage {task.name.rsplit('.', 1)[-1]}",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        attributes={
            "celery.task_id": task_id or "",
            "celery.task_name": task.name,
            "encore.job_id": str(ref.get("job_id", "")),
            "encore.track": int(ref.get("track", -1)),
        },
    )
    _open_spans[task_id or ""] = (span, context.attach(trace.set_span_in_context(span)))


def _fail_stage(task_id: str | None = None, exception: BaseException | None = None, **_: Any) -> None:
    opened = _open_spans.get(task_id or "")
    if opened is not None and exception is not None:
        from opentelemetry.trace import Status, StatusCode

        opened[0].record_exception(exception)
        opened[0].set_status(Status(StatusCode.ERROR, str(exception)[:200]))


def _end_stage(task_id: str | None = None, **_: Any) -> None:
    opened = _open_spans.pop(task_id or "", None)
    if opened is not None:
        from opentelemetry import context

        span, token = opened
        context.detach(token)
        span.end()


def instrument_flask(app: Any, settings: Settings) -> None:
    """A server span around every request of `app` (when tracing is on)."""
    if not configure(settings, "web"):
        return
    from flask import g, request
    from opentelemetry import context, trace

    @app.before_request
    def _open_request_span() -> None:
        span = _tracer().start_span(
            f"{request.method} {request.url_rule.rule if request.url_rule else request.path}",
            kind=trace.SpanKind.SERVER,
            attributes={"http.method": request.method, "http.target": request.path},
        )
        g.otel = (span, context.attach(trace.set_span_in_context(span)))

    @app.after_request
    def _record_status(response):
        opened = g.get("otel")
        if opened is not None:
            opened[0].set_attribute("http.status_code", response.status_code)
        return response

    @app.teardown_request
    def _close_request_span(error: BaseException | None = None) -> None:
        opened = g.pop("otel", None)
        if opened is not None:
            span, token = opened
            context.detach(token)
            span.end()


# -- a job's own trace where no Celery delivery of its own carries it (the backbone engine's tracks) -----------


def current_carrier() -> dict[str, str]:
    """The current trace context as W3C fields (`traceparent`, ...): what a job keeps at submission, so that the
    stages a worker runs for it outside its own deliveries still join its trace. Empty when tracing is off."""
    if not _configured:
        return {}
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


class TrackSpan:
    """The span of one stage a worker runs for a track outside that track's own delivery (app/tasks/engine.py):
    a child of `parent` (a carrier: the job's submit, or the track's stage before), named and attributed as a
    delivery's stage span is, plus `encore.in_engine`. `carrier()` is this span's context: the parent of the
    track's next stage, and (`attached`) the context a message published for it carries. No-op when tracing is
    off."""

    def __init__(self, parent: dict[str, str], stage: str, job_id: str, track: int):
        self.span: Any = None
        if not _configured:
            return
        from opentelemetry import propagate, trace

        self.span = _tracer().start_span(
            f"stage {stage}",
            context=propagate.extract(parent),
            kind=trace.SpanKind.INTERNAL,
            attributes={"encore.job_id": job_id, "encore.track": track, "encore.in_engine": 1},
        )

    def carrier(self) -> dict[str, str]:
        if self.span is None:
            return {}
        from opentelemetry import propagate, trace

        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(self.span))
        return carrier

    def end(self, error: str | None = None) -> None:
        """End the span (once; later calls do nothing), marked an error with `error`'s text when given."""
        if self.span is None:
            return
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, error[:200]))
        self.span.end()
        self.span = None


@contextmanager
def attached(carrier: dict[str, str]) -> Iterator[None]:
    """The context in `carrier` is the current one meanwhile: a message published then continues its trace."""
    if not _configured or not carrier:
        yield
        return
    from opentelemetry import context, propagate

    token = context.attach(propagate.extract(carrier))
    try:
        yield
    finally:
        context.detach(token)


def mark_stale(reason: str) -> None:
    """The current stage span is of a delivery that ran nothing (its track had moved on, e.g. in an engine that
    adopted it): `encore.stale` says why, so a trace's reader can tell it from the stage's real run."""
    if _configured:
        from opentelemetry import trace

        trace.get_current_span().set_attribute("encore.stale", reason[:200])
