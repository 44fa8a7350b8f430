"""Tracing (issue 15, item 4): with OTEL_EXPORTER_OTLP_ENDPOINT set, the web (gunicorn) and a real worker
export their spans over OTLP/HTTP to a receiver in this test process, which decodes them with
opentelemetry-proto: one trace per job, the submit's server span its root, a span per stage chained under
it. Without the variable nothing is exported."""

from __future__ import annotations

from itertools import pairwise
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from app.adapters import tracing
from app.core.config import Settings
from harness.processes import wait_until

pytestmark = pytest.mark.slow  # a traced job on a worker (~9 s here)

MUSIC_STAGES = ["backbone", "superres", "decode", "export"]


class Collector:
    """An OTLP/HTTP trace receiver: every span posted to /v1/traces, decoded, with its service name."""

    def __init__(self):
        self.spans: list[dict] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource in request.resource_spans:
                    service = next(
                        (a.value.string_value for a in resource.resource.attributes if a.key == "service.name"), ""
                    )
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            collector.spans.append(
                                {
                                    "service": service,
                                    "name": span.name,
                                    "trace": span.trace_id.hex(),
                                    "id": span.span_id.hex(),
                                    "parent": span.parent_span_id.hex(),
                                    "attributes": {
                                        a.key: a.value.string_value or a.value.int_value for a in span.attributes
                                    },
                                }
                            )
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"


@pytest.fixture
def collector():
    """Set up before the stack and so stopped after it: the processes' last flush still has a receiver."""
    receiver = Collector()
    yield receiver
    receiver.server.shutdown()


def test_tracing_is_off_without_an_endpoint():
    assert not tracing.enabled(Settings(otel_endpoint=""))
    assert tracing.configure(Settings(otel_endpoint=""), "web") is False


def test_one_trace_per_job_with_a_span_per_stage(collector, make_stack):
    # without the backbone engine: the stages an engine runs for a track it adopted open no span yet (issue 35 note)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "200", "ENCORE_BACKBONE_SLOTS": "1"}
    stack = make_stack(**env)
    stack.start_worker(0)
    url = stack.start_gunicorn()
    jobs = []
    for seed in (1, 2):
        reply = requests.post(
            f"{url}/api/v1/music",
            timeout=10,
            json={"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0, "num_tracks": 1, "seed": seed},
        )
        assert reply.status_code == 202, reply.text
        jobs.append(reply.json()["job_id"])
    for job_id in jobs:
        assert stack.wait_job(job_id, timeout=120)["state"] == "done"

    def stage_spans(job_id):
        found = [s for s in collector.spans if s["attributes"].get("encore.job_id") == job_id]
        return found if len(found) == len(MUSIC_STAGES) else None

    for job_id in jobs:
        stages = wait_until(lambda job_id=job_id: stage_spans(job_id), 60, 0.2, f"the stage spans of {job_id}")
        assert [s["name"] for s in stages] == [f"stage {name}" for name in MUSIC_STAGES]
        assert {s["service"] for s in stages} == {"encore-worker"}
        assert len({s["trace"] for s in stages}) == 1  # one trace per job
        for earlier, later in pairwise(stages):
            assert later["parent"] == earlier["id"]  # each stage published by the one before it
        root = wait_until(
            lambda stages=stages: next((s for s in collector.spans if s["id"] == stages[0]["parent"]), None),
            30,
            0.2,
            "the submit's span",
        )
        assert root["service"] == "encore-web" and root["name"] == "POST /api/v1/music"
        assert root["trace"] == stages[0]["trace"] and root["parent"] == ""
    traces = {s["trace"] for s in collector.spans if s["attributes"].get("encore.job_id") in jobs}
    assert len(traces) == 2  # the two jobs do not share a trace
