"""Tenants (app/core/tenants.py) against the real app and a real redis-server: a client tenant sees and steers only
its own jobs, on every route that names a job, native and Khala-compatible; another tenant's job answers exactly as
a job that does not exist; admins see every job and alone run the operator routes; idempotency keys are per tenant;
the deployments that configure one token or none keep working; a bad tenant configuration refuses to start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.core.config import Settings, load_settings
from app.core.tenants import ADMIN, CLIENT, DEFAULT_TENANT, Tenant, tenant_directory, token_digest, token_tenant_name

REPO = Path(__file__).resolve().parents[1]
MUSIC = {"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0, "num_tracks": 1, "seed": 3}
KHALA = {"mode": "instrumental", "prompt_mode": "tags", "tags": "lo-fi", "duration": 1}
TOKENS = {"acme-1": "acme", "acme-2": "acme", "beta-1": "beta", "ops-1": "ops"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def tenants_file(tmp_path) -> Path:
    path = tmp_path / "tenants.json"
    tenants: dict[str, dict] = {}
    for token, name in TOKENS.items():
        spec = tenants.setdefault(name, {"role": ADMIN if name == "ops" else CLIENT, "token_sha256": []})
        spec["token_sha256"].append(token_digest(token))
    path.write_text(json.dumps({"tenants": tenants}))
    return path


@pytest.fixture
def stack(make_stack, tenants_file):
    return make_stack(ENCORE_TENANTS_FILE=str(tenants_file))


def submit(stack, token: str, key: str | None = None, **fields) -> str:
    headers = {**bearer(token), **({"Idempotency-Key": key} if key else {})}
    reply = stack.client.post("/api/v1/music", json={**MUSIC, **fields}, headers=headers)
    assert reply.status_code in (200, 202), reply.get_json()
    return reply.get_json()["job_id"]


def listed(stack, token: str) -> set[str]:
    reply = stack.client.get("/api/v1/jobs?limit=500", headers=bearer(token))
    assert reply.status_code == 200, reply.get_json()
    return {job["job_id"] for job in reply.get_json()["jobs"]}


# Every route that names a job: (method, path template, whether the owner gets something other than 404).
JOB_ROUTES = [
    ("GET", "/api/v1/jobs/{id}"),
    ("GET", "/api/v1/jobs/{id}/events"),
    ("GET", "/api/v1/jobs/{id}/tracks/0.mp3"),
    ("GET", "/api/v1/jobs/{id}/video.mp4"),
    ("POST", "/api/v1/jobs/{id}/retry"),
    ("DELETE", "/api/v1/jobs/{id}"),
    ("GET", "/job/{id}"),
    ("GET", "/job/{id}/track/0/mp3"),
    ("GET", "/api/job/{id}"),
    ("GET", "/api/job/{id}/track/0/wav"),
]


def call(stack, method: str, path: str, token: str):
    return stack.client.open(path, method=method, headers=bearer(token))


@pytest.mark.parametrize("method,template", JOB_ROUTES)
def test_another_tenants_job_answers_as_a_job_that_does_not_exist(stack, method, template):
    job_id = submit(stack, "acme-1")
    unknown = "f" * 32
    for token in ("beta-1",):
        theirs = call(stack, method, template.format(id=job_id), token)
        missing = call(stack, method, template.format(id=unknown), token)
        assert theirs.status_code == missing.status_code == 404, (theirs.get_json(), missing.get_json())
        assert theirs.get_data().replace(job_id.encode(), b"ID") == missing.get_data().replace(unknown.encode(), b"ID")
        assert dict(theirs.headers) == dict(missing.headers) | {"Content-Length": theirs.headers["Content-Length"]}
    # the owner (either of its tokens) and the admin are not told it does not exist
    for token in ("acme-1", "acme-2", "ops-1"):
        assert call(stack, method, template.format(id=job_id), token).status_code != 404 or template.endswith(
            ("0.mp3", "video.mp4", "/mp3", "/wav")  # the owner's 404 there is "not done yet", not "no such job"
        )
    assert stack.redis.exists(f"encore:cancel:{job_id}") == (method == "DELETE")  # only the owner's cancel took
    assert stack.redis.hget(f"encore:job:{job_id}", "tenant") == "acme"


def test_the_owner_and_the_admin_see_the_job_and_the_not_done_file_is_not_unknown(stack):
    job_id = submit(stack, "acme-1")
    for token in ("acme-1", "acme-2", "ops-1"):
        assert stack.client.get(f"/api/v1/jobs/{job_id}", headers=bearer(token)).get_json()["job_id"] == job_id
        file_reply = stack.client.get(f"/api/v1/jobs/{job_id}/tracks/0.mp3", headers=bearer(token))
        assert file_reply.status_code == 404 and "not done" in file_reply.get_json()["error"]
    beta = stack.client.get(f"/api/v1/jobs/{job_id}/tracks/0.mp3", headers=bearer("beta-1"))
    assert beta.get_json()["error"] == f"job {job_id} not found"


def test_lists_hold_a_tenants_own_jobs_and_every_job_for_an_admin(stack):
    acme = {submit(stack, "acme-1"), submit(stack, "acme-2", webhook=None)}
    beta = {submit(stack, "beta-1")}
    assert listed(stack, "acme-1") == listed(stack, "acme-2") == acme
    assert listed(stack, "beta-1") == beta
    assert listed(stack, "ops-1") == acme | beta


def test_cancel_and_retry_by_the_owner_work_and_by_another_tenant_change_nothing(stack):
    job_id = submit(stack, "acme-1")  # no worker: parked
    assert call(stack, "DELETE", f"/api/v1/jobs/{job_id}", "beta-1").status_code == 404
    assert stack.client.get(f"/api/v1/jobs/{job_id}", headers=bearer("acme-1")).get_json()["state"] == "queued"
    canceled = call(stack, "DELETE", f"/api/v1/jobs/{job_id}", "acme-2")
    assert canceled.status_code == 200 and canceled.get_json()["cancel_requested"] is True
    state = stack.client.get(f"/api/v1/jobs/{job_id}", headers=bearer("acme-1")).get_json()["state"]
    assert state == "canceled"
    assert call(stack, "POST", f"/api/v1/jobs/{job_id}/retry", "beta-1").status_code == 404
    assert stack.client.get(f"/api/v1/jobs/{job_id}", headers=bearer("acme-1")).get_json()["state"] == "canceled"
    retried = call(stack, "POST", f"/api/v1/jobs/{job_id}/retry", "acme-1")
    assert retried.status_code == 200 and retried.get_json()["retried"] == [0]


def test_idempotency_keys_belong_to_a_tenant_and_are_shared_by_its_tokens(stack):
    first = submit(stack, "acme-1", key="order-1")
    assert submit(stack, "acme-2", key="order-1") == first  # the same tenant: the same job, replayed
    other = submit(stack, "beta-1", key="order-1")
    assert other != first  # another tenant's key of the same name is its own
    assert stack.redis.hget(f"encore:job:{other}", "tenant") == "beta"
    khala = [
        stack.client.post("/generate", json=KHALA, headers={**bearer(t), "Idempotency-Key": "k"}).get_json()["job_id"]
        for t in ("acme-1", "beta-1", "acme-2")
    ]
    assert khala[0] == khala[2] != khala[1]
    assert stack.client.get(f"/job/{khala[1]}", headers=bearer("acme-1")).status_code == 404


@pytest.mark.parametrize(
    "method,path",
    [("POST", "/api/v1/queues/gpu0/drain"), ("DELETE", "/api/v1/queues/gpu0/drain"), ("GET", "/api/v1/status")],
)
def test_operator_routes_are_for_admins(stack, method, path):
    submit(stack, "acme-1")  # a queue exists once a worker registered; the role is checked first either way
    refused = call(stack, method, path, "beta-1")
    assert refused.status_code == 403 and refused.get_json()["field"] == "role"
    assert call(stack, method, path, "ops-1").status_code != 403
    assert call(stack, method, path, "nobody").status_code == 401


def test_api_token_lists_are_client_tenants_and_admins_are_named(make_stack):
    two = make_stack(API_TOKEN="alpha,beta")
    job_id = submit(two, "alpha")
    assert two.client.get(f"/api/v1/jobs/{job_id}", headers=bearer("beta")).status_code == 404
    assert call(two, "GET", "/api/v1/status", "alpha").status_code == 403  # nobody named an admin
    assert two.redis.hget(f"encore:job:{job_id}", "tenant") == token_tenant_name("alpha")
    named = make_stack(API_TOKEN="alpha,beta", ENCORE_ADMIN_TOKENS="root")
    assert call(named, "GET", "/api/v1/status", "root").status_code == 200
    assert call(named, "GET", "/api/v1/status", "alpha").status_code == 403


def test_one_token_and_no_token_keep_working_as_one_admin_tenant(make_stack):
    one = make_stack(API_TOKEN="solo")
    job_id = submit(one, "solo")
    assert call(one, "GET", "/api/v1/status", "solo").status_code == 200
    assert listed(one, "solo") == {job_id}
    assert one.redis.hget(f"encore:job:{job_id}", "tenant") == DEFAULT_TENANT
    assert call(one, "GET", "/api/v1/status", "other").status_code == 401
    none = make_stack()
    reply = none.client.post("/api/v1/music", json=MUSIC)
    assert reply.status_code == 202
    assert none.client.get("/api/v1/status").status_code == 200
    assert none.client.get(f"/api/v1/jobs/{reply.get_json()['job_id']}").status_code == 200


def test_a_job_written_before_tenants_belongs_to_the_default_tenant(make_stack):
    one = make_stack(API_TOKEN="solo")
    job_id = submit(one, "solo")
    one.redis.hdel(f"encore:job:{job_id}", "tenant")
    assert one.client.get(f"/api/v1/jobs/{job_id}", headers=bearer("solo")).status_code == 200
    two = make_stack(API_TOKEN="alpha,beta")
    old = submit(two, "alpha")
    two.redis.hdel(f"encore:job:{old}", "tenant")  # `default` owns it now: no client tenant sees it
    assert two.client.get(f"/api/v1/jobs/{old}", headers=bearer("alpha")).status_code == 404


def test_the_directory_follows_the_documented_rules(tmp_path):
    assert tenant_directory(()).for_authorization("") == Tenant(DEFAULT_TENANT, ADMIN)
    one = tenant_directory(("t",))
    assert one.for_authorization("Bearer t") == Tenant(DEFAULT_TENANT, ADMIN)
    assert one.for_authorization("Bearer t2") is None and one.for_authorization("Basic t") is None
    assert one.for_authorization("Bearer ") is None and one.for_authorization("Bearer té") is None
    two = tenant_directory(("a", "b"), ("x",))
    assert two.for_authorization("bearer a") == Tenant(token_tenant_name("a"), CLIENT)
    assert two.for_authorization("Bearer x") == Tenant("admin", ADMIN)
    assert {t.name for t in two.tenants} == {token_tenant_name("a"), token_tenant_name("b"), "admin"}


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read"),
        ("{not json", "is not JSON"),
        ("[]", "must hold"),
        ('{"tenants": {}}', "must hold"),
        ('{"tenants": {"Acme!": {"token_sha256": ["' + "a" * 64 + '"]}}}', "tenant name"),
        ('{"tenants": {"acme": {"role": "root", "token_sha256": ["' + "a" * 64 + '"]}}}', "role must be"),
        ('{"tenants": {"acme": {"token_sha256": ["plain-token"]}}}', "is not a SHA-256"),
        ('{"tenants": {"acme": {"token_sha256": []}}}', "non-empty list"),
        ('{"tenants": {"acme": {"token": "x", "token_sha256": ["' + "a" * 64 + '"]}}}', "only"),
        ('{"tenants": {"a": {"token_sha256": ["' + "a" * 64 + '"]}, "b": {"token_sha256": ["' + "a" * 64 + '"]}}}', "twice"),
    ],
)  # fmt: skip
def test_a_bad_tenants_file_refuses_to_start_naming_the_setting(tmp_path, content, message):
    path = tmp_path / "tenants.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match="ENCORE_TENANTS_FILE") as raised:
        Settings(tenants_file=path)
    assert message in str(raised.value)


def test_a_token_in_two_places_or_an_empty_admin_entry_refuses_to_start(monkeypatch):
    with pytest.raises(ValueError, match="ENCORE_ADMIN_TOKENS: a token is given twice"):
        Settings(api_tokens=("a", "b"), admin_tokens=("b",))
    monkeypatch.setenv("ENCORE_ADMIN_TOKENS", "x,")
    with pytest.raises(ValueError, match="ENCORE_ADMIN_TOKENS: entry 2 of 2 is empty"):
        load_settings()


@pytest.mark.parametrize("program", ["web", "worker"])
def test_the_web_and_a_worker_refuse_to_start_on_an_unreadable_tenants_file(tmp_path, program):
    command = (
        [sys.executable, "-c", "from app.web import create_app; create_app()"]
        if program == "web"
        else [str(Path(sys.executable).with_name("celery")), "-A", "app", "worker", "-Q", "gpu0", "-c", "1"]
    )
    started = subprocess.run(
        command,
        cwd=REPO,
        env={**os.environ, "ENCORE_TENANTS_FILE": str(tmp_path / "absent.json"), "REDIS_URL": "redis://127.0.0.1:1/0"},
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0
    assert "ENCORE_TENANTS_FILE: cannot read" in started.stderr


def test_hash_token_prints_the_digest_a_tenants_file_stores():
    printed = subprocess.run(
        [sys.executable, "-m", "app", "hash-token"],
        cwd=REPO,
        input="s3cret\n",
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert printed.stdout.strip() == token_digest("s3cret")
