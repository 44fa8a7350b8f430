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

from harness.processes import redis_work
from harness.tenants import bearer, write_tenants_file

REPO = Path(__file__).resolve().parents[1]
MUSIC = {"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0, "num_tracks": 1, "seed": 3}
KHALA = {"mode": "instrumental", "prompt_mode": "tags", "tags": "lo-fi", "duration": 1}
TOKENS = {"acme-1": "acme", "acme-2": "acme", "beta-1": "beta", "ops-1": "ops"}


@pytest.fixture
def tenants_file(tmp_path) -> Path:
    return write_tenants_file(tmp_path / "tenants.json", TOKENS)


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
        theirs, their_work = redis_work(stack.redis, lambda t=token: call(stack, method, template.format(id=job_id), t))
        missing, missing_work = redis_work(
            stack.redis, lambda t=token: call(stack, method, template.format(id=unknown), t)
        )
        # The same Redis commands for both (scripts' own commands included): no time to tell them apart by.
        assert their_work == missing_work, (their_work, missing_work)
        assert theirs.status_code == missing.status_code == 404, (theirs.get_json(), missing.get_json())
        assert theirs.get_data().replace(job_id.encode(), b"ID") == missing.get_data().replace(unknown.encode(), b"ID")
        assert dict(theirs.headers) == dict(missing.headers) | {"Content-Length": theirs.headers["Content-Length"]}
    # the owner (either of its tokens) and the admin are not told it does not exist
    for token in ("acme-1", "acme-2", "ops-1"):
        reply = call(stack, method, template.format(id=job_id), token)
        if reply.status_code == 404:  # a file of a job not done yet: its 404 names the track or file, not the job
            assert template.endswith(("0.mp3", "video.mp4", "/mp3", "/wav")), (template, reply.get_json())
            assert reply.get_json()["field"] in ("track", "file", "index"), reply.get_json()
            assert reply.get_data() != missing.get_data().replace(unknown.encode(), job_id.encode())
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


def test_a_token_matches_as_its_exact_bytes_padded_only_by_spaces_and_tabs(make_stack):
    two = make_stack(API_TOKEN="alpha,beta")
    job_id = submit(two, "alpha")
    path = f"/api/v1/jobs/{job_id}"
    for padding in (" ", "\t", "  \t"):
        assert two.client.get(path, headers={"Authorization": f"Bearer alpha{padding}"}).status_code == 200
    for padding in ("\x85", "\xa0", "\x0b", "\x1c"):  # whitespace to str.strip(), never to HTTP
        for header in (f"Bearer alpha{padding}", f"Bearer {padding}alpha"):
            reply = two.client.get(path, headers={"Authorization": header})
            assert reply.status_code == 401 and reply.get_json()["field"] == "authorization", repr(header)


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


def _as_if_written_before_tenants(client, job_id: str) -> None:
    """A job hash without its tenant, and (written before job views too: app/control/views.py) no view."""
    client.hdel(f"encore:job:{job_id}", "tenant")
    client.delete(f"encore:job:{job_id}:view")


def test_a_job_written_before_tenants_belongs_to_the_default_tenant(make_stack):
    one = make_stack(API_TOKEN="solo")
    job_id = submit(one, "solo")
    _as_if_written_before_tenants(one.redis, job_id)
    assert one.client.get(f"/api/v1/jobs/{job_id}", headers=bearer("solo")).status_code == 200
    two = make_stack(API_TOKEN="alpha,beta")
    old = submit(two, "alpha")
    _as_if_written_before_tenants(two.redis, old)  # `default` owns it now: no client tenant sees it
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


# -- per-tenant limits and usage (app/control/tenant_limits.py) ---------------------------------------------------


def limited_stack(make_stack, tmp_path, acme_limits: dict, **env: str):
    """acme (client, with `acme_limits`), beta (client, the defaults) and ops (admin)."""
    tokens = {"acme-1": "acme", "beta-1": "beta", "ops-1": "ops"}
    path = write_tenants_file(tmp_path / "limited.json", tokens, limits={"acme": acme_limits})
    return make_stack(ENCORE_TENANTS_FILE=str(path), **env)


def post_music(stack, token: str, **fields):
    return stack.client.post("/api/v1/music", json={**MUSIC, **fields}, headers=bearer(token))


def test_a_tenants_open_tracks_are_capped_and_room_comes_back_as_they_end(make_stack, tmp_path):
    stack = limited_stack(make_stack, tmp_path, {"max_open_tracks": 3})
    first = post_music(stack, "acme-1", num_tracks=2).get_json()["job_id"]
    assert post_music(stack, "acme-1").status_code == 202  # 3 open: at the cap
    refused = post_music(stack, "acme-1")
    assert refused.status_code == 429 and refused.get_json()["field"] == "tracks"
    assert int(refused.headers["Retry-After"]) >= 1
    assert "has 3 tracks open and may have 3" in refused.get_json()["error"]
    assert post_music(stack, "beta-1").status_code == 202  # another tenant's room is its own
    assert call(stack, "DELETE", f"/api/v1/jobs/{first}", "acme-1").status_code == 200  # 2 tracks end
    assert post_music(stack, "acme-1", num_tracks=2).status_code == 202  # 3 open again
    full = post_music(stack, "acme-1")
    assert full.status_code == 429
    # a retry reopens tracks: it counts against the cap as a submit does
    assert call(stack, "POST", f"/api/v1/jobs/{first}/retry", "acme-1").status_code == 429
    usage = stack.client.get("/api/v1/usage", headers=bearer("acme-1")).get_json()["tenants"]
    assert usage == [{"tenant": "acme", "jobs": 3, "tracks": 5, "gpu_seconds": 0.0, "open_tracks": 3}]


def test_a_client_tenant_may_not_ask_for_more_priority_than_it_is_given(make_stack, tmp_path):
    stack = limited_stack(make_stack, tmp_path, {"max_priority": "high"})
    refused = post_music(stack, "beta-1", priority="high")  # clients: normal by default
    assert refused.status_code == 403 and refused.get_json()["field"] == "priority"
    assert post_music(stack, "beta-1", priority="normal").status_code == 202
    assert post_music(stack, "acme-1", priority="high").status_code == 202  # its own limit allows it
    assert post_music(stack, "ops-1", priority="high").status_code == 202  # admins may
    low = make_stack(API_TOKEN="a,b", ENCORE_TENANT_MAX_PRIORITY="low")
    assert post_music(low, "a", priority="normal").status_code == 403
    assert post_music(low, "a", priority="low").status_code == 202


def test_a_tenants_song_length_and_retries_are_its_own(make_stack, tmp_path):
    stack = limited_stack(make_stack, tmp_path, {"max_song_s": 1.5, "max_retries": 1})
    refused = post_music(stack, "acme-1", duration_s=2.0)
    assert refused.status_code == 403 and refused.get_json()["field"] == "duration_s"
    assert post_music(stack, "beta-1", duration_s=2.0).status_code == 202
    job_id = post_music(stack, "acme-1", duration_s=1.0).get_json()["job_id"]
    for attempt in range(2):
        assert call(stack, "DELETE", f"/api/v1/jobs/{job_id}", "acme-1").status_code == 200
        retried = call(stack, "POST", f"/api/v1/jobs/{job_id}/retry", "acme-1")
        assert retried.status_code == (200 if attempt == 0 else 403), retried.get_json()
    assert retried.get_json()["field"] == "retries"


def test_a_tenants_face_video_length_is_its_own(make_stack, tmp_path):
    from harness.media import face_video, tone

    stack = limited_stack(make_stack, tmp_path, {"max_video_s": 3.5})
    video, audio = face_video(tmp_path / "face.mp4", 4.0), tone(tmp_path / "voice.wav", 1.0)

    def upload(token: str):
        with open(video, "rb") as v, open(audio, "rb") as a:
            return stack.client.post(
                "/api/v1/lipsync",
                data={"video": (v, video.name), "audio": (a, audio.name)},
                content_type="multipart/form-data",
                headers=bearer(token),
            )

    refused = upload("acme-1")
    assert refused.status_code == 403 and refused.get_json()["field"] == "video", refused.get_json()
    assert upload("beta-1").status_code == 202


def test_each_tenant_has_its_own_submit_rate(make_stack, tmp_path):
    stack = limited_stack(
        make_stack, tmp_path, {"submit_rate_limit": "2/minute"}, ENCORE_RATE_LIMIT_STRATEGY="moving-window"
    )
    replies = [post_music(stack, "acme-1") for _ in range(3)]
    assert [r.status_code for r in replies] == [202, 202, 429]
    assert replies[2].headers["X-RateLimit-Limit"] == "2" and int(replies[2].headers["Retry-After"]) >= 1
    beta = post_music(stack, "beta-1")  # the deployment's default rate, in a window of its own
    assert beta.status_code == 202 and beta.headers["X-RateLimit-Limit"] != "2"


def test_a_deployment_that_configures_nothing_has_a_rate_limit_and_a_cap():
    settings = Settings()
    assert settings.submit_rate_limit and settings.tenant_max_open_tracks > 0


def test_the_default_rate_limit_applies_to_an_open_deployment(make_stack):
    reply = make_stack().client.post("/api/v1/music", json=MUSIC)
    assert reply.status_code == 202 and reply.headers["X-RateLimit-Limit"] == "300"  # 300/minute
    off = make_stack(ENCORE_SUBMIT_RATE_LIMIT="off").client.post("/api/v1/music", json=MUSIC)
    assert off.status_code == 202 and "X-RateLimit-Limit" not in off.headers
    with pytest.raises(ValueError, match="ENCORE_SUBMIT_RATE_LIMIT is empty"):
        make_stack(ENCORE_SUBMIT_RATE_LIMIT=" ")


def test_usage_is_a_tenants_own_and_an_admins_for_all(make_stack, tmp_path):
    stack = limited_stack(make_stack, tmp_path, {})
    post_music(stack, "acme-1", num_tracks=2)
    post_music(stack, "beta-1")
    mine = stack.client.get("/api/v1/usage", headers=bearer("beta-1")).get_json()["tenants"]
    assert [(r["tenant"], r["jobs"], r["tracks"]) for r in mine] == [("beta", 1, 1)]
    refused = stack.client.get("/api/v1/usage?tenant=acme", headers=bearer("beta-1"))
    assert refused.status_code == 403 and refused.get_json()["field"] == "role"
    every = stack.client.get("/api/v1/usage?tenant=all", headers=bearer("ops-1")).get_json()["tenants"]
    assert {r["tenant"]: r["tracks"] for r in every} == {"acme": 2, "beta": 1, "default": 0, "ops": 0}
    assert stack.client.get("/api/v1/usage?tenant=nope", headers=bearer("ops-1")).status_code == 404
    anonymous = stack.client.get("/metrics").get_data(as_text=True)
    assert "encore_tenant" not in anonymous and "encore_jobs" in anonymous
    client = stack.client.get("/metrics", headers=bearer("beta-1")).get_data(as_text=True)
    assert "encore_tenant" not in client
    admin = stack.client.get("/metrics", headers=bearer("ops-1")).get_data(as_text=True)
    assert 'encore_tenant_tracks_submitted_total{tenant="acme"} 2.0' in admin
    assert 'encore_tenant_open_tracks{tenant="beta"} 1.0' in admin


@pytest.mark.parametrize("name", ["admin", "default", "token-0123456789ab"])
def test_a_tenants_file_name_another_source_gives_is_refused_naming_it(tmp_path, name):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {name: {"token_sha256": ["a" * 64]}}}))
    with pytest.raises(ValueError, match=f"ENCORE_TENANTS_FILE: tenant name '{name}' is reserved"):
        Settings(tenants_file=path)


def test_a_tenant_given_twice_in_a_tenants_file_is_refused_not_dropped(tmp_path):
    path = tmp_path / "tenants.json"
    twice = '{"tenants": {"acme": {"token_sha256": ["%s"]}, "acme": {"token_sha256": ["%s"]}}}' % ("a" * 64, "b" * 64)
    path.write_text(twice)
    with pytest.raises(ValueError, match="ENCORE_TENANTS_FILE: .*the key 'acme' is given twice"):
        Settings(tenants_file=path)
    path.write_text(twice.replace('"acme": {"token_sha256": ["b', '"beta": {"token_sha256": ["b'))
    assert {t.name for t in Settings(tenants_file=path).tenants.tenants} == {"acme", "beta"}


@pytest.mark.parametrize(
    "limits, message",
    [
        ({"max_open_tracks": -1}, "limits.max_open_tracks"),
        ({"max_retries": 1.5}, "limits.max_retries"),
        ({"max_priority": "urgent"}, "limits.max_priority"),
        ({"submit_rate_limit": "lots"}, "limits.submit_rate_limit"),
        ({"submit_rate_limit": ""}, "limits.submit_rate_limit"),
        ({"submit_rate_limit": "0/minute"}, "limits.submit_rate_limit: 0 per 1 minute lets no request through"),
        ({"max_song_s": 0}, "limits.max_song_s"),
        ({"max_video_s": "long"}, "limits.max_video_s"),
        ({"speed": 1}, "limits may hold"),
    ],
)
def test_the_tenants_limits_are_checked_at_start(tmp_path, limits, message):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {"acme": {"token_sha256": ["a" * 64], "limits": limits}}}))
    with pytest.raises(ValueError, match=f"ENCORE_TENANTS_FILE: tenant 'acme': {message}"):
        Settings(tenants_file=path)
    with pytest.raises(ValueError, match="ENCORE_TENANT_MAX_PRIORITY must be one of"):
        Settings(tenant_max_priority="urgent")


def test_the_priority_levels_are_the_services_own():
    from app.core.priority import PRIORITIES
    from app.core.tenants import PRIORITY_LEVELS

    assert tuple(reversed(PRIORITY_LEVELS)) == PRIORITIES


@pytest.mark.slow  # a real worker runs a tiny music job (~20 s)
def test_a_tenants_gpu_seconds_are_the_stage_seconds_its_jobs_ran(make_stack, tmp_path):
    stack = limited_stack(make_stack, tmp_path, {})
    stack.auth = bearer("ops-1")  # the stack's helpers read the worker table: an admin's
    stack.start_worker(0)
    job_id = post_music(stack, "acme-1", duration_s=1.0).get_json()["job_id"]
    record = stack.wait_job(job_id, timeout=300)
    assert record["state"] == "done", record
    ran = sum(stage["duration_s"] for stage in record["tracks"][0]["stages"].values())
    [acme] = stack.client.get("/api/v1/usage", headers=bearer("acme-1")).get_json()["tenants"]
    assert acme["gpu_seconds"] == pytest.approx(ran, abs=0.01 * len(record["tracks"][0]["stages"]))
    assert acme["gpu_seconds"] > 0 and acme["open_tracks"] == 0
    [beta] = stack.client.get("/api/v1/usage", headers=bearer("beta-1")).get_json()["tenants"]
    assert beta["gpu_seconds"] == 0


def test_the_rate_limiter_runs_for_the_submit_routes_only(make_stack):
    """The submit views consult it themselves: it adds no hook that every request would run (one cost a job poll
    ~60 µs), and only the submits carry its headers."""

    def hooks(app) -> list[str]:
        tables = (app.before_request_funcs, app.after_request_funcs, app.teardown_request_funcs)
        return [getattr(hook, "__qualname__", repr(hook)) for table in tables for hook in table.get(None, [])]

    stack = make_stack()
    assert hooks(stack.app) == hooks(make_stack(ENCORE_SUBMIT_RATE_LIMIT="off").app)
    submitted = stack.client.post("/api/v1/music", json=MUSIC)
    assert submitted.status_code == 202 and "X-RateLimit-Limit" in submitted.headers
    polled = stack.client.get(f"/api/v1/jobs/{submitted.get_json()['job_id']}")
    assert polled.status_code == 200 and "X-RateLimit-Limit" not in polled.headers


def test_an_open_deployments_metrics_carry_no_tenant_series(make_stack):
    """With no token configured the one implicit tenant's usage is the totals: a scrape does not pay for it."""
    stack = make_stack()
    assert stack.client.post("/api/v1/music", json=MUSIC).status_code == 202
    text = stack.client.get("/metrics").get_data(as_text=True)
    assert "encore_jobs_submitted_total" in text and "encore_tenant" not in text
