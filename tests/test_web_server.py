"""The web tier as deployed (gunicorn -c gunicorn.conf.py), over real sockets: slow clients do not starve fast
ones, a body that stops arriving is answered 408, and request heads are bounded (issue 11, item 2)."""

from __future__ import annotations

import json
import socket
import time
from contextlib import ExitStack

import pytest
import requests

pytestmark = pytest.mark.slow  # gunicorn under hostile and stalled clients, then a job (~30 s here)


STALLED_CLIENTS = 10
IDLE_S = 4.0
BOUNDARY = "encore-stalled"


def _stall_an_upload(url: str) -> socket.socket:
    """Send a lip-sync upload's head and half of its body, then nothing more."""
    host, port = url.removeprefix("http://").split(":")
    client = socket.create_connection((host, int(port)), timeout=30)
    part = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="video"; filename="v.mp4"\r\n'
        "Content-Type: video/mp4\r\n\r\n"
    ).encode() + b"\0" * 200_000
    head = (
        f"POST /api/v1/lipsync HTTP/1.1\r\nHost: {host}\r\nContent-Type: multipart/form-data; "
        f"boundary={BOUNDARY}\r\nContent-Length: {2 * len(part)}\r\n\r\n"
    ).encode()
    client.sendall(head + part)
    return client


def _reply_status(client: socket.socket) -> int:
    """The status code of the one reply the server sends on `client` (its socket timeout bounds the wait)."""
    data = b""
    while b"\r\n" not in data:
        chunk = client.recv(4096)
        if not chunk:
            raise AssertionError(f"connection closed without a reply (got {data!r})")
        data += chunk
    return int(data.split(b" ", 2)[1])


def _slowest_read(url: str, paths: list[str], rounds: int) -> float:
    slowest = 0.0
    for _ in range(rounds):
        for path in paths:
            started = time.monotonic()
            assert requests.get(url + path, timeout=30).status_code == 200
            slowest = max(slowest, time.monotonic() - started)
    return slowest


@pytest.fixture
def stack(make_stack):
    return make_stack(ENCORE_BODY_IDLE_S=str(IDLE_S))


def test_stalled_uploads_delay_no_other_request_and_are_answered_408(stack):
    url = stack.start_gunicorn()
    job_id = stack.submit_music()
    reads = ["/healthz", f"/api/v1/jobs/{job_id}"]
    with ExitStack() as stalled:
        clients = [stalled.enter_context(_stall_an_upload(url)) for _ in range(STALLED_CLIENTS)]
        started = time.monotonic()
        assert _slowest_read(url, reads, rounds=5) < 1.0
        assert time.monotonic() - started < IDLE_S  # measured while every upload was still stalled
        statuses = [_reply_status(client) for client in clients]
    assert statuses == [408] * STALLED_CLIENTS
    assert _slowest_read(url, reads, rounds=2) < 1.0
    assert stack.job(job_id)["state"] == "queued"  # nothing else changed
    assert [j["job_id"] for j in stack.client.get("/api/v1/jobs").get_json()["jobs"]] == [job_id]


def test_the_check_sees_the_stall_under_sync_workers(stack):
    """Two stalled uploads hold both workers of the old sync setup: /healthz waits until a 408 frees one."""
    url = stack.start_gunicorn("-k", "sync", "--threads", "1")  # more threads would make it gthread
    with ExitStack() as stalled:
        for _ in range(2):
            stalled.enter_context(_stall_an_upload(url))
        started = time.monotonic()
        assert requests.get(url + "/healthz", timeout=30).status_code == 200
        assert time.monotonic() - started > 1.0


def _refused(reply: requests.Response, status: int, field: str) -> str:
    """gunicorn's own refusal, answered as JSON naming the field like every other error (not its HTML page)."""
    assert reply.status_code == status, reply.text[:300]
    assert reply.headers["Content-Type"] == "application/json", reply.text[:300]
    body = reply.json()
    assert body["field"] == field and body["error"].startswith(f"{field}: "), body
    return body["error"]


def test_request_heads_are_bounded_and_refused_in_json(stack):
    url = stack.start_gunicorn()
    assert "8190 bytes" in _refused(
        requests.get(url + "/healthz", headers={"X-Big": "a" * 9000}, timeout=10), 431, "headers"
    )
    many = {f"X-H{i}": "1" for i in range(150)}
    assert "more than 100 header fields" in _refused(
        requests.get(url + "/healthz", headers=many, timeout=10), 431, "headers"
    )
    assert "longer than 8190 bytes" in _refused(requests.get(url + "/healthz?" + "a" * 9000, timeout=10), 414, "url")
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as raw:
        raw.sendall(b"NOT A REQUEST LINE AT ALL\r\n\r\n")
        answer = b""
        while chunk := raw.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"Content-Type: application/json" in head, answer[:300]
    assert json.loads(body)["field"] == "request"
    assert requests.get(url + "/healthz", timeout=10).status_code == 200


def _hostile_batch(url: str, auth: dict[str, str], tmp_path) -> list[int]:
    """The failures issue 11 found, sent over real sockets; the status of each reply."""
    json_headers = {**auth, "Content-Type": "application/json"}
    song = '{"mode": "vocal", "tags": "pop", "lyrics": "[verse]\\nla", "num_tracks": 1'
    bodies = [
        ("/api/v1/music", "[" * 50_000 + "]" * 50_000),
        ("/generate", "[" * 50_000 + "]" * 50_000),
        ("/api/generate", "{" * 5_000),
        ("/api/v1/music", song + ', "temperature": 1' + "0" * 400 + "}"),
        ("/generate", '{"mode": "instrumental", "tags": "x", "temperature": 1' + "0" * 5000 + "}"),
        ("/api/v1/music", song + ', "duration_s": 2, "tags": "\\ud800"}'),
        ("/api/v1/music", song + ', "duration_s": 546, "lyrics": "' + "la " * 3000 + '"}'),
        ("/api/v1/music", "not json"),
        ("/api/v1/music", b"\xff\xfe\x00"),
    ]
    statuses = [
        requests.post(url + path, data=body, headers=json_headers, timeout=30).status_code for path, body in bodies
    ]
    for header in ("Bearer é".encode("utf-8"), b"Bearer \xff", b"Basic x"):
        statuses.append(requests.get(url + "/api/v1/status", headers={"Authorization": header}, timeout=10).status_code)
    statuses += [
        requests.request(method, url + "/api/v1/music", headers=auth, timeout=10).status_code
        for method in ("PUT", "TRACE", "PATCH")
    ]
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"\0" * 4096)
    with open(garbage, "rb") as video, open(garbage, "rb") as audio:
        statuses.append(
            requests.post(
                url + "/api/v1/lipsync", headers=auth, timeout=30, files={"video": video, "audio": audio}
            ).status_code
        )
    return statuses


def test_a_valid_job_completes_after_the_hostile_batch(make_stack, tmp_path):
    stack = make_stack(API_TOKEN="tok", ENCORE_BODY_IDLE_S=str(IDLE_S))
    stack.start_worker(0)
    url = stack.start_gunicorn()
    auth = {"Authorization": "Bearer tok"}
    with ExitStack() as stalled:
        for _ in range(3):
            stalled.enter_context(_stall_an_upload(url))
        statuses = _hostile_batch(url, auth, tmp_path)
    assert all(400 <= status < 500 for status in statuses), statuses
    assert requests.get(url + "/api/v1/jobs", headers=auth, timeout=10).json()["jobs"] == []  # none accepted
    reply = requests.post(
        url + "/api/v1/music",
        headers=auth,
        timeout=10,
        json={"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0, "num_tracks": 1, "seed": 3},
    )
    assert reply.status_code == 202, reply.text
    job = stack.wait_job(reply.json()["job_id"])
    assert job["state"] == "done", job
    assert stack.wait_worker(0, "idle")["status"] == "idle"  # the worker is not wedged
    assert requests.get(url + "/healthz", timeout=10).status_code == 200


def test_a_401_sent_before_a_large_body_is_read_reaches_the_client(make_stack):
    """The token is checked before the body is read; the client still gets the 401, not a broken pipe."""
    stack = make_stack(API_TOKEN="tok")
    url = stack.start_gunicorn()
    for _ in range(2):  # and the connection pool's next request works too
        reply = requests.post(
            url + "/api/v1/lipsync",
            timeout=60,
            files={"video": ("v.mp4", b"\0" * (20 << 20)), "audio": ("a.wav", b"\0" * 100)},
        )
        assert reply.status_code == 401 and reply.json()["field"] == "authorization"


def test_a_chunked_body_past_the_size_limit_is_told_so(make_stack):
    """A body without Content-Length (chunked) that runs past the limit was told "at most 16 form parts"."""
    stack = make_stack(ENCORE_MAX_VIDEO_MB="1", ENCORE_MAX_AUDIO_MB="1")  # the whole body: at most 3 MiB
    url = stack.start_gunicorn()
    boundary = "encore-chunked"

    def body():
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="video"; filename="v.mp4"\r\n'
            "Content-Type: video/mp4\r\n\r\n"
        ).encode()
        for _ in range(5 * 16):  # 5 MiB in 64 KiB chunks
            yield b"\0" * 65536
        yield f"\r\n--{boundary}--\r\n".encode()

    reply = requests.post(
        url + "/api/v1/lipsync",
        data=body(),
        timeout=60,
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    assert reply.status_code == 413, reply.text[:300]
    assert reply.json()["field"] == "body" and "larger than 3 MiB" in reply.json()["error"], reply.json()
    assert stack.client.get("/api/v1/jobs").get_json()["jobs"] == []
