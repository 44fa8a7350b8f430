"""Webhooks (issue 14, item 2): checked at submit, written to the outbox by the transitions, delivered by the
webhook worker (a real `celery -Q webhooks -P threads` process) to a real HTTP receiver that fails the first
attempts; signatures verified with the standardwebhooks package, as a receiver would."""
from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from standardwebhooks import Webhook

from app.adapters import webhooks
from app.core.config import Settings
from tests.support.processes import wait_until

SECRET = "whsec_" + base64.b64encode(b"encore-test-webhook-secret-0123").decode()


class Receiver:
    """A loopback HTTP server recording every POST; the first `fail_first` answer 500. `redirect_to`: every
    request answers 307 to that URL instead."""

    def __init__(self, fail_first: int = 0, redirect_to: str | None = None):
        self.requests: list[tuple[dict[str, str], bytes, float]] = []
        self.fail_first, self.redirect_to = fail_first, redirect_to
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.requests.append(({k.lower(): v for k, v in self.headers.items()}, body, time.time()))
                if receiver.redirect_to:
                    self.send_response(307)
                    self.send_header("Location", receiver.redirect_to)
                elif len(receiver.requests) <= receiver.fail_first:
                    self.send_response(500)
                else:
                    self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/encore"

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def receiver():
    servers = []

    def make(**kwargs) -> Receiver:
        servers.append(Receiver(**kwargs))
        return servers[-1]
    yield make
    for server in servers:
        server.close()


def settings(**overrides) -> Settings:
    return Settings(**{"webhook_secret": SECRET, **overrides})


def test_the_target_is_checked_at_submit():
    check = webhooks.check_target
    assert check(None, None, settings()) is None
    assert check("https://hooks.example.com/x", None, settings()) == {
        "url": "https://hooks.example.com/x", "events": ["start", "completed", "failed", "canceled"]}
    assert check("http://a.example.com/x", ["completed", "completed"], settings())["events"] == ["completed"]
    cases = [("ftp://example.com/x", None, {}, "webhook"), ("http:///x", None, {}, "webhook"),
             ("http://user:pw@example.com/", None, {}, "webhook"), ("http://example.com/", ["done"], {}, "webhook_events"),
             ("http://example.com/", [], {}, "webhook_events"), (None, ["start"], {}, "webhook_events"),
             ("http://evil.test/", None, {"webhook_hosts": ("example.com", ".corp.example")}, "webhook"),
             ("http://example.com/", None, {"webhook_secret": ""}, "webhook")]
    for url, events, extra, field in cases:
        with pytest.raises(webhooks.WebhookRefused) as refused:
            check(url, events, settings(**extra))
        assert refused.value.field == field, (url, events, extra)
    hosts = ("example.com", ".corp.example")
    assert webhooks.host_allowed("example.com", hosts) and webhooks.host_allowed("a.b.corp.example", hosts)
    assert not webhooks.host_allowed("xexample.com", hosts) and not webhooks.host_allowed("corp.example.evil", hosts)
    assert [webhooks.backoff_s(n, settings(webhook_backoff_s=1.0, webhook_backoff_cap_s=5.0)) for n in (1, 2, 3, 4)] \
        == [1.0, 2.0, 4.0, 5.0]


def test_a_signature_verifies_with_the_standard_library_and_fails_when_tampered():
    body = json.dumps({"type": "job.completed", "data": {"job_id": "x"}})
    headers = webhooks.signed_headers(SECRET, "msg_1", body)
    assert Webhook(SECRET).verify(body, headers)["data"]["job_id"] == "x"
    with pytest.raises(Exception):
        Webhook(SECRET).verify(body.replace("x", "y"), headers)


def test_redirects_are_followed_on_the_same_host_only(receiver):
    final = receiver()
    same_host = receiver(redirect_to=final.url)  # 127.0.0.1 -> 127.0.0.1: followed
    status, error = webhooks.post(same_host.url, "{}", {"content-type": "application/json"}, 5)
    assert (status, error) == (204, "") and len(final.requests) == 1
    elsewhere = receiver(redirect_to=final.url.replace("127.0.0.1", "localhost"))
    status, error = webhooks.post(elsewhere.url, "{}", {}, 5)
    assert status == 307 and "another host" in error and len(final.requests) == 1
    status, error = webhooks.post("http://127.0.0.1:9/", "{}", {}, 2)  # nothing listens on the discard port
    assert status is None and error


def test_the_submit_routes_refuse_a_bad_webhook(make_stack):
    stack = make_stack(ENCORE_WEBHOOK_SECRET=SECRET, ENCORE_WEBHOOK_HOSTS="127.0.0.1")
    reply = stack.client.post("/api/v1/music", json={"mode": "instrumental", "tags": "x", "webhook": "http://example.com/"})
    assert reply.status_code == 400 and reply.get_json()["field"] == "webhook"
    reply = stack.client.post("/api/v1/music", json={"mode": "instrumental", "tags": "x",
                                                     "webhook": "http://127.0.0.1/", "webhook_events": ["soon"]})
    assert reply.status_code == 400 and reply.get_json()["field"] == "webhook_events.0"  # the element named
    reply = stack.client.post("/api/v1/lipsync", data={"webhook": "gopher://127.0.0.1/"}, content_type="multipart/form-data")
    assert reply.status_code == 400 and reply.get_json()["field"] == "webhook"
    assert stack.client.get("/api/v1/jobs").get_json()["jobs"] == []


@pytest.mark.slow  # real retries with backoff (~31 s here)
def test_events_are_signed_filtered_and_retried_with_backoff(make_stack, receiver):
    """A two-event job (start, completed) whose receiver fails its first two requests: each event arrives,
    signed; the failed attempts were retried at growing intervals, and the record lists every attempt.
    Progress was not asked for and never sent."""
    hooks = receiver(fail_first=2)
    stack = make_stack(ENCORE_WEBHOOK_SECRET=SECRET, ENCORE_WEBHOOK_BACKOFF_S="0.4", ENCORE_WEBHOOK_PROGRESS_S="0")
    stack.start_webhook_worker()
    stack.start_worker(0)
    job_id = stack.submit_music(webhook=hooks.url, webhook_events=["start", "completed"])
    assert stack.wait_job(job_id, timeout=120)["state"] == "done"

    def delivered():
        record = stack.job(job_id)
        done = [d for d in record["webhook"]["deliveries"] if d["delivered"]]
        return record if len(done) == 2 else None
    record = wait_until(delivered, 60, 0.2, "both webhooks delivered")
    received = [(headers, Webhook(SECRET).verify(body, headers), at) for headers, body, at in hooks.requests]
    types = [body["type"] for _, body, _ in received]
    assert set(types) == {"job.start", "job.completed"} and len(received) == 4  # 2 failed + 2 delivered
    ids = {body["type"]: headers["webhook-id"] for headers, body, _ in received}
    assert ids["job.start"] != ids["job.completed"]
    completed = next(body for _, body, _ in received if body["type"] == "job.completed")
    assert completed["data"]["job_id"] == job_id and completed["data"]["job_state"] == "done"
    deliveries = record["webhook"]["deliveries"]
    first = [d for d in deliveries if d["id"] == deliveries[0]["id"]]
    assert [d["attempt"] for d in first][:2] == [1, 2] and first[0]["status"] == 500 and not first[0]["delivered"]
    assert first[0]["retry_in_s"] == 0.4
    failures = [d for d in deliveries if not d["delivered"]]
    assert len(failures) == 2 and all(d["status"] == 500 for d in failures)
    retried = [d for d in deliveries if d["attempt"] > 1]
    assert retried and all(d["at"] - next(f["at"] for f in deliveries if f["id"] == d["id"] and f["attempt"] == 1)
                           >= 0.35 for d in retried)
    assert record["webhook"]["events"] == ["start", "completed"]
