"""Webhooks (issue 14, item 2): checked at submit, written to the outbox by the transitions, delivered by the
webhook worker (a real `celery -Q webhooks -P threads` process) to a real HTTP receiver that fails the first
attempts; signatures verified with the standardwebhooks package, as a receiver would.

Issue 22, item 4: webhooks that cannot reach inside. One test per bypass a tester found (the backslash host
trick, each numeric and loopback spelling, the port rule, a redirect to another port, a name that resolves
inside), against real loopback receivers this file starts: a receiver is reachable only where a test opts in
through ENCORE_WEBHOOK_ALLOW_PRIVATE, and every refusal is shown to have sent it nothing."""

from __future__ import annotations

import base64
import os
import random
import signal
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis
from standardwebhooks import Webhook

from app.adapters import webhooks
from app.control import webhook_leases as leases
from app.core.config import Settings
from app.core.keys import Layout
from harness.processes import wait_until
from harness.stack import unit_services

SECRET = "whsec_" + base64.b64encode(b"encore-test-webhook-secret-0123").decode()


class Receiver:
    """A loopback HTTP server recording every POST; the first `fail_first` answer 500 (with `body`).
    `redirect_to`: a request to /hooks/encore answers `redirect_status` to that URL instead."""

    def __init__(
        self,
        fail_first: int = 0,
        redirect_to: str | None = None,
        redirect_status: int = 307,
        body: bytes = b"",
        hold_first: int = 0,
    ):
        self.requests: list[tuple[dict[str, str], bytes, float]] = []
        self.paths: list[str] = []
        self.fail_first, self.redirect_to, self.redirect_status = fail_first, redirect_to, redirect_status
        self.body = body
        self.hold_first = hold_first  # the first requests get no answer until `release` is set
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.requests.append(({k.lower(): v for k, v in self.headers.items()}, body, time.time()))
                receiver.paths.append(self.path)
                if len(receiver.requests) <= receiver.hold_first:
                    receiver.release.wait(60)
                    return  # no answer: the sender is gone by now
                answer = b""
                if receiver.redirect_to and self.path == "/hooks/encore":
                    self.send_response(receiver.redirect_status)
                    self.send_header("Location", receiver.redirect_to)
                elif len(receiver.requests) <= receiver.fail_first:
                    self.send_response(500)
                    answer = receiver.body
                else:
                    self.send_response(204)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}/hooks/encore"
        self.allow = f"127.0.0.1:{self.port}"  # its ENCORE_WEBHOOK_ALLOW_PRIVATE entry

    def close(self) -> None:
        self.release.set()
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
        "url": "https://hooks.example.com/x",
        "events": ["start", "completed", "failed", "canceled"],
    }
    assert check("http://a.example.com/x", ["completed", "completed"], settings())["events"] == ["completed"]
    cases = [
        ("ftp://example.com/x", None, {}, "webhook"),
        ("http:///x", None, {}, "webhook"),
        ("http://user:pw@example.com/", None, {}, "webhook"),
        ("http://example.com/", ["done"], {}, "webhook_events"),
        ("http://example.com/", [], {}, "webhook_events"),
        (None, ["start"], {}, "webhook_events"),
        ("http://evil.test/", None, {"webhook_hosts": ("example.com", ".corp.example")}, "webhook"),
        ("http://example.com/", None, {"webhook_secret": ""}, "webhook"),
    ]
    for url, events, extra, field in cases:
        with pytest.raises(webhooks.WebhookRefused) as refused:
            check(url, events, settings(**extra))
        assert refused.value.field == field, (url, events, extra)
    hosts = ("example.com", ".corp.example:8443")
    assert webhooks.host_allowed("example.com", hosts) and webhooks.host_allowed("a.b.corp.example", hosts)
    assert not webhooks.host_allowed("xexample.com", hosts) and not webhooks.host_allowed("corp.example.evil", hosts)
    assert (
        webhooks.named_ports("a.corp.example", hosts) == {8443} and webhooks.named_ports("example.com", hosts) == set()
    )
    assert (
        check("HTTP://Hooks.Example.COM.:443/a?b=1#frag", None, settings())["url"]
        == "http://hooks.example.com:443/a?b=1"
    )
    assert check("https://hooks.example.com:443", None, settings())["url"] == "https://hooks.example.com/"
    for entry in ("hooks:0", "hooks:http", "[::1]8080"):  # a typo stops the service at start
        with pytest.raises(ValueError, match="ENCORE_WEBHOOK_HOSTS"):
            Settings(webhook_hosts=(entry,))
    for entry in ("10.0.0.1/8", "hooks.example.com", "[::1", "127.0.0.1:70000"):
        with pytest.raises(ValueError, match="ENCORE_WEBHOOK_ALLOW_PRIVATE"):
            Settings(webhook_allow_private=(entry,))


def test_retry_delays_are_jittered_between_the_schedules_steps_and_never_past_its_cap():
    """Attempt n waits between base × 2^(n-1) and twice that, both capped: never sooner than the doubling schedule,
    never longer than the cap, and two deliveries that failed together draw different delays."""
    config = settings(webhook_backoff_s=1.0, webhook_backoff_cap_s=5.0)
    rng = random.Random(37)
    steps = {1: (1.0, 2.0), 2: (2.0, 4.0), 3: (4.0, 5.0), 4: (5.0, 5.0), 8: (5.0, 5.0)}
    for attempt, (least, most) in steps.items():
        draws = [webhooks.backoff_s(attempt, config, rng) for _ in range(200)]
        assert all(least <= delay <= most for delay in draws), attempt
        assert max(draws) - min(draws) >= 0.8 * (most - least), attempt  # spread over the step, not one point

    def schedule(seed: int) -> list[float]:
        seeded = random.Random(seed)
        return [webhooks.backoff_s(attempt, config, seeded) for attempt in range(1, 9)]

    assert schedule(7) == schedule(7) != schedule(8)  # reproducible from its seed, and a seed's own
    assert all(1.0 <= delay <= 5.0 for delay in schedule(7)) and schedule(7) == sorted(schedule(7))
    assert len(set(schedule(7)[:3])) == 3 and webhooks.backoff_s(1, config, rng) != webhooks.backoff_s(1, config, rng)
    assert 1.0 <= webhooks.backoff_s(1, settings()) <= 2.0  # the module's own generator, the default base
    assert webhooks.backoff_s(1, settings(webhook_backoff_s=10.0, webhook_backoff_cap_s=5.0)) == 5.0


def test_a_signature_verifies_with_the_standard_library_and_fails_when_tampered():
    body = json.dumps({"type": "job.completed", "data": {"job_id": "x"}})
    headers = webhooks.signed_headers(SECRET, "msg_1", body)
    assert Webhook(SECRET).verify(body, headers)["data"]["job_id"] == "x"
    with pytest.raises(Exception):
        Webhook(SECRET).verify(body.replace("x", "y"), headers)


def refused_everywhere(url: str, config: Settings, *receivers: Receiver) -> str:
    """Assert `url` is refused at submit (400 naming `webhook`) and at delivery (nothing sent to any of
    `receivers`); the delivery's error."""
    with pytest.raises(webhooks.WebhookRefused) as refused:
        webhooks.check_target(url, None, config)
    assert refused.value.field == "webhook", url
    status, error = webhooks.post(url, "{}", {}, 2, config)
    assert status is None and error.startswith("refused: "), (url, status, error)
    assert all(not receiver.requests for receiver in receivers), url
    return error


@pytest.mark.parametrize(
    "url", ["http://169.254.169.254\\.allowed.test/latest/meta-data/", "http://127.0.0.2\\.allowed.test/"]
)
def test_the_backslash_host_trick_is_refused_at_submit_and_at_delivery(url):
    """urlsplit read the host as "<address>\\.allowed.test" (allowed) and urllib3 as the address: now the one
    parser refuses the backslash, and the sender only ever sends what that parser rebuilt."""
    config = settings(webhook_hosts=(".allowed.test",))
    assert "'\\\\'" in refused_everywhere(url, config)
    assert (
        webhooks.check_target("http://hooks.allowed.test/latest/", None, config)["url"]
        == "http://hooks.allowed.test/latest/"
    )


INSIDE = [
    "http://127.0.0.1:16379/",
    "http://localhost/",
    "http://LocalHost./x",
    "http://app.localhost/",
    "http://[::1]/",
    "http://169.254.169.254/latest/meta-data/",
    "http://0.0.0.0/",
    "http://2130706433/",
    "http://0x7f000001/",
    "http://127.1/",
    "http://0177.0.0.1/",
    "http://127.0.0.1./",
    "http://10.0.0.7/",
    "http://192.168.1.1/",
    "http://172.16.0.1/",
    "http://100.64.0.1/",
    "http://224.0.0.1/",
    "http://255.255.255.255/",
    "http://[::]/",
    "http://[fe80::1]/",
    "http://[fc00::1]/",
    "http://[ff02::1]/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:a9fe:a9fe]/",
    "http://[::127.0.0.1]/",
    "http://[2002:7f00:1::]/",
    "http://[64:ff9b::a9fe:a9fe]/",
    "http://[fe80::1%25eth0]/",
    "http://127.0.0.1%2e/",
    "http://127.0.0.1 /",
    "http://127.0.0.1\t/",
]


@pytest.mark.parametrize("url", INSIDE)
def test_inside_addresses_in_every_spelling_are_refused(url):
    """With no allow-list, each spelling a tester got accepted (and more: mapped, 6to4, NAT64, zone ids, a
    trailing dot, percent-encoding) is refused at submit and, given to the sender directly, at delivery."""
    refused_everywhere(url, settings())


def test_ports_other_than_80_and_443_must_be_named(receiver):
    """A host allowed on 80/443 is not allowed on any other port: the entry must name it."""
    named, other = receiver(), receiver()
    config = settings(webhook_allow_private=(named.allow,))
    assert webhooks.check_target(named.url, None, config)["url"] == named.url
    assert webhooks.post(named.url, "{}", {}, 5, config) == (204, "") and len(named.requests) == 1
    refused_everywhere(other.url, config, other)
    refused_everywhere("http://127.0.0.1/", config)  # the address allowed on one port only
    refused_everywhere(f"http://2130706433:{named.port}/", config)  # its other spellings stay refused
    whole = settings(webhook_allow_private=("127.0.0.0/8",))  # a network without a port: 80 and 443 only
    refused_everywhere(other.url, whole, other)
    assert webhooks.check_target("http://127.0.0.1/", None, whole)
    public = settings(webhook_hosts=(".example.com",))
    for url in ("http://hooks.example.com:8080/", "https://hooks.example.com:16379/", "http://hooks.example.com:0/"):
        with pytest.raises(webhooks.WebhookRefused):
            webhooks.check_target(url, None, public)
    assert webhooks.check_target("https://hooks.example.com/", None, public)
    assert webhooks.check_target("http://hooks.example.com:8443/", None, settings(webhook_hosts=(".example.com:8443",)))
    with pytest.raises(webhooks.WebhookRefused):
        webhooks.check_target("http://hooks.example.com:8444/", None, settings(webhook_hosts=(".example.com:8443",)))


def test_a_redirect_is_checked_at_every_hop(receiver):
    """A redirect to another port of the allowed host is not followed (nothing reaches that port); one to an
    allowed port is, as is one to another path; a 302 (which would turn POST into GET) is not followed."""
    final = receiver()
    hop = receiver(redirect_to=final.url)
    only_hop = settings(webhook_allow_private=(hop.allow,))
    status, error = webhooks.post(hop.url, "{}", {}, 5, only_hop)
    assert status == 307 and error.startswith("redirect not followed") and not final.requests
    both = settings(webhook_allow_private=(hop.allow, final.allow))
    assert webhooks.post(hop.url, "{}", {}, 5, both) == (204, "") and len(final.requests) == 1
    same_port = receiver(redirect_to="/hooks/elsewhere")
    assert webhooks.post(same_port.url, "{}", {}, 5, settings(webhook_allow_private=(same_port.allow,))) == (204, "")
    assert same_port.paths == ["/hooks/encore", "/hooks/elsewhere"]
    for location in (
        f"http://127.0.0.1:{final.port}\\@allowed.test/",
        f"http://2130706433:{final.port}/",
        f"http://localhost:{final.port}/x",
    ):
        tricky = receiver(redirect_to=location)
        status, error = webhooks.post(tricky.url, "{}", {}, 5, settings(webhook_allow_private=(tricky.allow,)))
        assert status == 307 and error.startswith("redirect not followed"), (location, error)
    assert len(final.requests) == 1
    found = receiver(redirect_to=final.url, redirect_status=302)
    status, error = webhooks.post(found.url, "{}", {}, 5, settings(webhook_allow_private=(found.allow, final.allow)))
    assert status == 302 and "307 and 308" in error and len(final.requests) == 1


def test_a_name_is_resolved_and_checked_at_delivery(receiver):
    """`localhost` resolves to loopback when the webhook is delivered: refused there, even when the host
    allow-list names it, and delivered (to the checked address, the name in the Host header) only when the
    operator allows that address and port."""
    hooks = receiver()
    url = f"http://localhost:{hooks.port}/hooks/encore"
    assert all(
        not webhooks.public(address)
        for address in webhooks.resolve(webhooks.parse_url(url), settings(webhook_allow_private=(hooks.allow,)))
    )
    for config in (settings(), settings(webhook_hosts=(f"localhost:{hooks.port}",))):
        status, error = webhooks.post(url, "{}", {}, 5, config)
        assert (
            status is None
            and "127.0.0.1 is not a public address (127.0.0.0/8: loopback)" in error
            and not hooks.requests
        )
    allowed = settings(webhook_allow_private=(hooks.allow, f"[::1]:{hooks.port}"))
    assert webhooks.post(url, "{}", {}, 5, allowed) == (204, "")
    assert hooks.requests[0][0]["host"] == f"localhost:{hooks.port}"
    status, error = webhooks.post("http://encore-no-such-host.invalid/", "{}", {}, 5, settings())
    assert status is None and "does not resolve" in error


def test_a_delivery_record_keeps_the_status_and_time_never_what_the_target_sent(redis_base_url, receiver):
    """A receiver that answers 500 with a body, and a service that answers with a non-HTTP banner: the job's
    delivery records hold the status, the time and an error class, none of what either sent."""
    hooks = receiver(fail_first=1, body=b"inside-secret-body")
    banner = socket.create_server(("127.0.0.1", 0))

    def answer_with_a_banner() -> None:
        connection, _ = banner.accept()
        with connection:
            connection.sendall(b"SSH-2.0-inside-secret-banner\r\n")
            connection.recv(65536)

    threading.Thread(target=answer_with_a_banner, daemon=True).start()
    client = redis.Redis.from_url(f"{redis_base_url}/505", decode_responses=True)
    layout = Layout("encore-webhook-records")
    port = banner.getsockname()[1]
    config = settings(webhook_allow_private=(hooks.allow, f"127.0.0.1:{port}"))
    records = {}
    try:
        for job_id, url in (("j-http", hooks.url), ("j-banner", f"http://127.0.0.1:{port}/")):
            client.hset(layout.job(job_id), mapping={"webhook": url})
            message = {"id": f"msg_{job_id}_1", "type": "completed", "at": time.time(), "job_id": job_id, "data": {}}
            started = time.time()
            delivered, retry_in = webhooks.deliver(client, layout, config, message, 1)
            assert not delivered and retry_in is not None and 1.0 <= retry_in <= 2.0  # the first step, jittered
            [records[job_id]] = [json.loads(raw) for raw in client.lrange(layout.webhook_deliveries(job_id), 0, -1)]
            assert records[job_id]["retry_in_s"] == retry_in  # the record says when the retry comes
            assert started - 1 <= records[job_id]["at"] <= time.time() + 1 and not records[job_id]["delivered"]
            assert "inside-secret" not in json.dumps(records[job_id]), records[job_id]
        assert len(hooks.requests) == 1 and records["j-http"]["status"] == 500, records["j-http"]
        assert records["j-banner"]["status"] is None and records["j-banner"]["error"] == "BadStatusLine"
    finally:
        banner.close()
        for job_id in ("j-http", "j-banner"):
            client.delete(layout.job(job_id), layout.webhook_deliveries(job_id))


def test_the_submit_routes_refuse_a_bad_webhook(make_stack):
    stack = make_stack(ENCORE_WEBHOOK_SECRET=SECRET, ENCORE_WEBHOOK_HOSTS="127.0.0.1")
    reply = stack.client.post(
        "/api/v1/music", json={"mode": "instrumental", "tags": "x", "webhook": "http://example.com/"}
    )
    assert reply.status_code == 400 and reply.get_json()["field"] == "webhook"
    reply = stack.client.post(
        "/api/v1/music",
        json={"mode": "instrumental", "tags": "x", "webhook": "http://127.0.0.1/", "webhook_events": ["soon"]},
    )
    assert reply.status_code == 400 and reply.get_json()["field"] == "webhook_events.0"  # the element named
    reply = stack.client.post(
        "/api/v1/lipsync", data={"webhook": "gopher://127.0.0.1/"}, content_type="multipart/form-data"
    )
    assert reply.status_code == 400 and reply.get_json()["field"] == "webhook"
    for url in ("http://127.0.0.1\\.example.com/", "http://127.0.0.1:16379/", "http://2130706433/"):
        reply = stack.client.post("/api/v1/music", json={"mode": "instrumental", "tags": "x", "webhook": url})
        assert reply.status_code == 400 and reply.get_json()["field"] == "webhook", url
        reply = stack.client.post("/api/v1/lipsync", data={"webhook": url}, content_type="multipart/form-data")
        assert reply.status_code == 400 and reply.get_json()["field"] == "webhook", url
    assert stack.client.get("/api/v1/jobs").get_json()["jobs"] == []


@pytest.mark.slow  # real retries with backoff (~31 s here)
def test_events_are_signed_filtered_and_retried_with_backoff(make_stack, receiver):
    """A two-event job (start, completed) whose receiver fails its first two requests: each event arrives,
    signed; the failed attempts were retried at growing intervals, and the record lists every attempt.
    Progress was not asked for and never sent."""
    hooks = receiver(fail_first=2)
    stack = make_stack(
        ENCORE_WEBHOOK_SECRET=SECRET,
        ENCORE_WEBHOOK_BACKOFF_S="0.4",
        ENCORE_WEBHOOK_PROGRESS_S="0",
        ENCORE_WEBHOOK_ALLOW_PRIVATE=hooks.allow,
    )  # the loopback receiver, opted in
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
    assert 0.4 <= first[0]["retry_in_s"] <= 0.8  # the first step, jittered up to the second
    failures = [d for d in deliveries if not d["delivered"]]
    assert len(failures) == 2 and all(d["status"] == 500 for d in failures)
    retried = [d for d in deliveries if d["attempt"] > 1]
    assert retried and all(
        d["at"] - next(f["at"] for f in deliveries if f["id"] == d["id"] and f["attempt"] == 1) >= 0.35 for d in retried
    )
    assert record["webhook"]["events"] == ["start", "completed"]


def _delivered(stack, job_id: str) -> dict | None:
    record = stack.job(job_id)
    return record if any(d["delivered"] for d in record["webhook"]["deliveries"]) else None


def _kill(proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


@pytest.mark.slow
def test_a_delivery_in_flight_when_its_worker_is_killed_is_sent_again_within_a_lease(make_stack, receiver):
    """Issue 24, loose end 7: kill -9 of the webhook worker while its attempt waits on the receiver. kombu would
    restore that acks_late message after its visibility timeout (an hour); the delivery's lease brings it back
    as soon as the lease runs out, under the same webhook-id, and nothing stays pending."""
    hooks = receiver(hold_first=1)
    stack = make_stack(
        ENCORE_WEBHOOK_SECRET=SECRET, ENCORE_WEBHOOK_TIMEOUT_S="2", ENCORE_WEBHOOK_ALLOW_PRIVATE=hooks.allow
    )
    lease_s = leases.attempt_lease_s(stack.settings)
    hook_worker = stack.start_webhook_worker()
    stack.start_worker(0)
    job_id = stack.submit_music(webhook=hooks.url, webhook_events=["completed"])
    wait_until(lambda: hooks.requests, 120, 0.1, "the first attempt to reach the receiver")
    _kill(hook_worker)
    killed = time.monotonic()
    hooks.release.set()
    stack.start_webhook_worker()
    record = wait_until(lambda: _delivered(stack, job_id), lease_s + 30, 0.2, "the delivery sent again")
    assert time.monotonic() - killed < lease_s + 30  # a lease, not kombu's hour
    ids = [headers["webhook-id"] for headers, _, _ in hooks.requests]
    assert len(ids) == 2 and ids[0] == ids[1]  # the same message, once more
    [done] = record["webhook"]["deliveries"]  # the killed attempt recorded nothing
    assert done["delivered"] and done["attempt"] == 1 and done["id"] == ids[0]
    pending = stack.app.extensions["encore"].services.jobs.keys.webhook_pending
    wait_until(lambda: stack.redis.zcard(pending) == 0, 10, 0.1, "the delivery settled")


@pytest.mark.slow
def test_a_retry_held_by_a_killed_worker_is_made_within_its_countdown_and_a_lease(make_stack, receiver):
    """The first attempt gets a 500; the worker holding the retry's countdown is killed. The retry comes within
    the countdown plus a lease (not an hour later), as attempt 2 of the same webhook-id."""
    hooks = receiver(fail_first=1)
    stack = make_stack(
        ENCORE_WEBHOOK_SECRET=SECRET,
        ENCORE_WEBHOOK_TIMEOUT_S="1",
        ENCORE_WEBHOOK_BACKOFF_S="3",
        ENCORE_WEBHOOK_ALLOW_PRIVATE=hooks.allow,
    )
    lease_s = leases.attempt_lease_s(stack.settings)
    hook_worker = stack.start_webhook_worker()
    stack.start_worker(0)
    job_id = stack.submit_music(webhook=hooks.url, webhook_events=["completed"])
    wait_until(lambda: stack.job(job_id)["webhook"]["deliveries"], 120, 0.05, "the first attempt recorded")
    _kill(hook_worker)
    killed = time.monotonic()
    stack.start_webhook_worker()
    record = wait_until(lambda: _delivered(stack, job_id), 3 + lease_s + 30, 0.2, "the retry")
    assert time.monotonic() - killed < 3 + lease_s + 30
    first, done = record["webhook"]["deliveries"]
    assert (first["attempt"], first["status"], first["delivered"]) == (1, 500, False)
    assert (done["attempt"], done["delivered"]) == (2, True) and done["id"] == first["id"]
    assert len({headers["webhook-id"] for headers, _, _ in hooks.requests}) == 1


def test_only_the_current_attempt_may_act_on_a_pending_delivery(redis_base_url, tmp_path):
    """The lease records of app/control/webhook_leases.py: a message sent again belongs to its new task; the old
    task (kombu restoring its message an hour later) can neither claim, settle nor reschedule it."""
    svc = unit_services(redis_base_url, 505, tmp_path)
    message = {"id": "msg_1", "job_id": "j", "type": "completed", "at": 1.0, "data": {"tracks": []}}
    leases.register(svc, message, 1, "first", deadline=100.0)
    assert leases.take_overdue(svc, now=50.0, lease_s=10.0) == []  # not due yet
    [(again, attempt, task)] = leases.take_overdue(svc, now=150.0, lease_s=10.0)
    assert again == message and attempt == 1 and task != "first"  # the message as sent, the empty list kept
    assert leases.take_overdue(svc, now=155.0, lease_s=10.0) == []  # held by the new task for a lease
    assert not leases.claim(svc, "msg_1", "first", 200.0)
    assert not leases.reschedule(svc, "msg_1", "first", "x", 2, 200.0)
    assert not leases.settle(svc, "msg_1", "first")
    assert leases.claim(svc, "msg_1", task, 200.0)
    assert leases.reschedule(svc, "msg_1", task, "second", 2, 300.0)
    assert not leases.claim(svc, "msg_1", task, 400.0)
    assert leases.claim(svc, "msg_1", "second", 400.0) and leases.settle(svc, "msg_1", "second")
    assert svc.redis.zcard(svc.jobs.keys.webhook_pending) == 0 and not svc.redis.hlen(
        svc.jobs.keys.webhook_pending_data
    )
    assert leases.take_overdue(svc, now=10_000.0, lease_s=10.0) == []
