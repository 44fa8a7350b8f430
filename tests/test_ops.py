"""Operator surfaces: bearer-token auth on /api/*, Prometheus metrics after a real job."""

from __future__ import annotations

import logging

from prometheus_client.parser import text_string_to_metric_families
import pytest

from harness.processes import wait_until

pytestmark = pytest.mark.slow  # metrics and logs after a job on a worker (~13 s here)


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_api_token_guards_api_routes_only(make_stack):
    stack = make_stack(API_TOKEN="s3cret, second")
    client = stack.client
    for path in ("/api/v1/status", "/api/v1/jobs", "/api/v1/jobs/" + "0" * 32):
        reply = client.get(path)
        assert reply.status_code == 401, path
        assert reply.get_json()["field"] == "authorization"
        assert reply.headers["WWW-Authenticate"].startswith("Bearer")
    assert client.get("/api/v1/status", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/api/v1/status", headers={"Authorization": "Basic s3cret"}).status_code == 401
    assert client.get("/api/v1/jobs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/api/v1/jobs", headers={"Authorization": "Bearer second"}).status_code == 200
    # two tokens are two client tenants: the worker table is for admins (tests/test_tenants.py)
    assert client.get("/api/v1/status", headers={"Authorization": "Bearer second"}).status_code == 403
    reply = client.post("/api/v1/music", json={"mode": "instrumental", "tags": "x", "duration_s": 2})
    assert (
        reply.status_code == 401
        and client.get("/api/v1/jobs", headers={"Authorization": "Bearer s3cret"}).get_json()["jobs"] == []
    )
    for path in ("/status", "/tags", "/api/status", "/job/" + "0" * 32):  # the Khala-compatible routes too
        assert client.get(path).status_code == 401, path
    assert client.post("/generate", json={}).status_code == 401
    assert client.get("/tags", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/healthz").status_code == 200
    assert client.get("/metrics").status_code == 200
    assert client.get("/").status_code == 200


def test_metrics_and_job_event_logs_after_a_job(make_stack, caplog):
    caplog.set_level(logging.INFO, logger="encore")
    stack = make_stack()
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=2.0)
    assert stack.wait_job(job_id)["state"] == "done"
    web_lines = [r.getMessage() for r in caplog.records if f"job={job_id}" in r.getMessage()]
    assert any("event=submitted" in line and "kind=music" in line for line in web_lines), web_lines
    assert any("track=0 queue=gpu0" in line and "event=routed" in line for line in web_lines), web_lines

    # The record says done before the worker has logged the last stage's end (it logs after writing it).
    def logged_to_the_end():
        lines = [line for line in stack.worker_log(0).splitlines() if f"job={job_id}" in line]
        return lines if any("event=stage_finished" in line and "stage=export" in line for line in lines) else None

    worker_lines = wait_until(logged_to_the_end, 30, what="the worker's last log lines")
    for stage in ("backbone", "superres", "decode", "export"):
        assert any(
            "track=0 queue=gpu0 worker=gpu0@" in line and "event=stage_started" in line and f"stage={stage}" in line
            for line in worker_lines
        ), stage
        assert any(
            "event=stage_finished" in line and f"stage={stage}" in line and "duration_s=" in line
            for line in worker_lines
        ), stage
    assert any("event=track_done" in line for line in worker_lines)
    reply = stack.client.get("/metrics")
    assert reply.status_code == 200 and reply.mimetype == "text/plain"
    samples = _samples(reply.get_data(as_text=True))
    assert samples[("encore_jobs", (("kind", "music"), ("state", "done")))] == 1
    assert samples[("encore_jobs_submitted_total", (("kind", "music"),))] == 1
    assert samples[("encore_jobs_submitted_total", (("kind", "lipsync"),))] == 0
    for stage in ("backbone", "superres", "decode", "export"):
        labels = (("kind", "music"), ("stage", stage))
        assert samples[("encore_stage_duration_seconds_count", labels)] == 1
        assert samples[("encore_stage_duration_seconds_sum", labels)] > 0
        assert samples[("encore_stage_duration_seconds_bucket", tuple(sorted(labels + (("le", "+Inf"),))))] == 1
    assert samples[("encore_workers", (("status", "idle"),))] == 1
    assert samples[("encore_workers", (("status", "offline"),))] == 0
    assert samples[("encore_queue_waiting_tracks", (("queue", "gpu0"),))] == 0
    assert samples[("encore_queue_outstanding_tracks", (("queue", "gpu0"),))] == 0


def test_openapi_lists_every_route_with_request_schemas(make_stack):
    stack = make_stack()
    reply = stack.client.get("/api/v1/openapi.json")
    assert reply.status_code == 200
    spec = reply.get_json()
    assert spec["openapi"].startswith("3.1")
    import re

    for rule in stack.app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule.rule)
        assert path in spec["paths"], path
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            assert method.lower() in spec["paths"][path], (path, method)
    music = spec["paths"]["/api/v1/music"]["post"]
    assert music["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/MusicRequest")
    schema = spec["components"]["schemas"]["MusicRequest"]
    assert schema["properties"]["top_k"]["maximum"] == 200 and schema["additionalProperties"] is False
    assert schema["properties"]["duration_s"]["anyOf"][0]["maximum"] == stack.settings.music().max_duration_s
    assert schema["else"]["required"] == ["lyrics"] and len(schema["anyOf"]) == 2  # lyrics unless instrumental
    lipsync = spec["paths"]["/api/v1/lipsync"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert set(lipsync["required"]) == {"video", "audio"} and lipsync["additionalProperties"] is False
    assert {"video", "audio", "fps", "extra_margin", "batch_size", "webhook", "webhook_events"} <= set(
        lipsync["properties"]
    )
    # 200: a repeat of an Idempotency-Key; 409: that key with another body
    assert {"200", "202", "400", "408", "409", "413", "503"} <= set(
        spec["paths"]["/api/v1/lipsync"]["post"]["responses"]
    )
    track = spec["paths"]["/api/v1/jobs/{job_id}/tracks/{file_name}"]["get"]["responses"]["200"]["content"]
    assert set(track) == {"audio/mpeg", "audio/wav"}
    assert spec["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/KhalaGenerate"
    )
    assert all(op["security"] == [] for item in spec["paths"].values() for op in item.values())  # no API_TOKEN
    assert spec["paths"]["/api/v1/jobs/{job_id}"]["get"]["parameters"][0]["name"] == "job_id"
