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


def _assert_one_chained_trace(collector: Collector, job_id: str) -> str:
    """The job's stage spans (less deliveries that ran nothing: `encore.stale`) are one per stage, from the workers,
    in one trace, each stage's span the child of the one before, the first the child of the submit's server span
    (the trace's root); returns the trace's id."""

    def stage_spans():
        found = [
            s
            for s in collector.spans
            if s["attributes"].get("encore.job_id") == job_id and "encore.stale" not in s["attributes"]
        ]
        return found if len(found) == len(MUSIC_STAGES) else None

    stages = wait_until(stage_spans, 60, 0.2, f"the stage spans of {job_id}")
    by_name = {s["name"]: s for s in stages}
    assert sorted(by_name) == sorted(f"stage {name}" for name in MUSIC_STAGES), stages
    chain = [by_name[f"stage {name}"] for name in MUSIC_STAGES]
    assert {s["service"] for s in chain} == {"encore-worker"}
    assert len({s["trace"] for s in chain}) == 1  # one trace per job
    for earlier, later in pairwise(chain):
        assert later["parent"] == earlier["id"], (job_id, later["name"])  # each stage under the one before it
    root = wait_until(
        lambda: next((s for s in collector.spans if s["id"] == chain[0]["parent"]), None), 30, 0.2, "the submit's span"
    )
    assert root["service"] == "encore-web" and root["name"] == "POST /api/v1/music"
    assert root["trace"] == chain[0]["trace"] and root["parent"] == ""
    return str(root["trace"])


def test_tracing_is_off_without_an_endpoint():
    assert not tracing.enabled(Settings(otel_endpoint=""))
    assert tracing.configure(Settings(otel_endpoint=""), "web") is False


def test_one_trace_per_job_with_a_span_per_stage(collector, make_stack):
    # without the backbone engine: every stage a delivery of its own (the next test runs them in an engine)
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

    for job_id in jobs:
        _assert_one_chained_trace(collector, job_id)
    traces = {s["trace"] for s in collector.spans if s["attributes"].get("encore.job_id") in jobs}
    assert len(traces) == 2  # the two jobs do not share a trace


def test_tracks_that_join_an_engine_keep_their_stages_in_their_own_trace(collector, make_stack):
    """Job B's track joins the engine job A's delivery runs: B's stages (run in A's delivery, and its export handed
    on from there to the CPU-stage worker) are spans of B's trace, chained stage after stage under B's submit,
    none in A's trace."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "200", "ENCORE_WORKER_ROLE": "both"}
    stack = make_stack(**env)
    stack.start_worker(0)
    url = stack.start_gunicorn()

    def cpu_worker_idle() -> bool:
        workers = stack.client.get("/api/v1/status", headers=stack.auth).get_json()["workers"]
        return any(w["name"].startswith("cpu0@") and w["status"] == "idle" for w in workers)

    wait_until(cpu_worker_idle, 60, 0.1, "the CPU-stage worker")

    def submit(seed: int, duration_s: float) -> str:
        body = {"mode": "instrumental", "tags": "lo-fi", "duration_s": duration_s, "num_tracks": 1, "seed": seed}
        reply = requests.post(f"{url}/api/v1/music", timeout=10, json=body)
        assert reply.status_code == 202, reply.text
        return reply.json()["job_id"]

    first = submit(1, 120.0)
    wait_until(lambda: stack.job(first)["tracks"][0]["state"] == "backbone", 90, 0.05, "the first song's backbone")
    joined = submit(2, 2.0)
    for job_id in (first, joined):
        assert stack.wait_job(job_id, timeout=180)["state"] == "done"
    stages_run = stack.job(joined)["tracks"][0]["stages"]
    assert stages_run["backbone"].get("in_engine"), "the second job ran alone"
    assert stages_run["export"]["worker"].startswith("cpu0@"), stages_run["export"]

    traces = {job_id: _assert_one_chained_trace(collector, job_id) for job_id in (first, joined)}
    assert traces[first] != traces[joined]
    in_engine = [s for s in collector.spans if s["attributes"].get("encore.in_engine") == 1]
    assert {s["attributes"]["encore.job_id"] for s in in_engine if s["name"] == "stage backbone"} == {joined}
    stale = wait_until(  # the adopted track's own message, delivered once the engine's run ended
        lambda: [s for s in collector.spans if "encore.stale" in s["attributes"]] or None, 60, 0.2, "a stale delivery"
    )
    assert ("stage backbone", joined) in [(s["name"], s["attributes"]["encore.job_id"]) for s in stale]
    assert all(s["trace"] == traces[s["attributes"]["encore.job_id"]] for s in stale)
