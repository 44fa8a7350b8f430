"""The OpenAPI document tells the truth (issue 11, item 5): schemathesis generates requests from it for every
operation against the web tier as deployed (gunicorn, a real worker, a finished job to reach the downloads)
and runs all its checks on every reply: no server error; status codes, content types, headers and bodies as
documented; what the document allows accepted and what it forbids refused (issue 36, item 13).

A few hundred cases by default; ENCORE_SCHEMATHESIS_EXAMPLES raises the examples per operation. The fast tests
first: every reference of the document resolves, and the replies a tester found undocumented (a redirect's
content type, a tenant's 403) are documented as the server gives them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import jsonschema_rs
import requests
import pytest

from harness.media import face_video, tone
from harness.processes import LONGEST_WAIT_S, wait_until
from harness.tenants import bearer, write_tenants_file

CHECKS = "all"
SET_ASIDE_LOG = "ENCORE_SCHEMATHESIS_SET_ASIDE"  # where the hook below writes each failure it sets aside
EXAMPLES = int(os.environ.get("ENCORE_SCHEMATHESIS_EXAMPLES", "15"))
SEED = os.environ.get("ENCORE_SCHEMATHESIS_SEED", "2026")
TOKEN = "schemathesis-token"


def _document(stack, headers: dict[str, str]) -> dict[str, Any]:
    reply = stack.client.get("/api/v1/openapi.json", headers=headers)
    assert reply.status_code == 200
    return reply.get_json()


def _references(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _references(value)
    elif isinstance(node, list):
        for value in node:
            yield from _references(value)


def _resolves(document: dict[str, Any], reference: str) -> bool:
    """Whether a local reference (a JSON pointer after `#`, RFC 6901) names something in the document."""
    if not reference.startswith("#/"):
        return False
    node: Any = document
    for part in reference[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return isinstance(node, dict)


def test_every_reference_of_the_document_resolves(make_stack):
    """The retry's and the usage's replies named components the document did not hold (their nested models too)."""
    stack = make_stack(API_TOKEN=TOKEN)
    document = _document(stack, bearer(TOKEN))
    references = set(_references(document))
    assert [r for r in sorted(references) if not _resolves(document, r)] == []
    assert {"#/components/schemas/RetryReply", "#/components/schemas/UsageReply"} <= references
    assert {"#/components/schemas/TenantUsage", "#/components/schemas/TrackReply"} <= references  # nested ones


def test_a_redirect_is_documented_with_the_content_type_it_has(make_stack):
    """The stream's 307 to the events server was documented as text/event-stream; it is Werkzeug's short HTML
    page. The same for a download's 302 to a presigned URL; a 304 has no body."""
    stack = make_stack(API_TOKEN=TOKEN, ENCORE_EVENTS_URL="http://127.0.0.1:9")
    document = _document(stack, stack.auth)
    reply = stack.client.get(f"/api/v1/jobs/{stack.submit_music()}/events", headers=stack.auth)
    assert reply.status_code == 307, reply.get_data(as_text=True)
    stream = document["paths"]["/api/v1/jobs/{job_id}/events"]["get"]["responses"]
    assert list(stream["307"]["content"]) == [reply.mimetype] == ["text/html"]
    for path in ("/api/v1/jobs/{job_id}/tracks/{file_name}", "/job/{job_id}/track/{index}/{fmt}"):
        download = document["paths"][path]["get"]["responses"]
        assert list(download["302"]["content"]) == ["text/html"] and "content" not in download["304"]
        assert set(download["200"]["content"]) == {"audio/mpeg", "audio/wav"}


def test_a_submission_beyond_its_tenants_limits_is_a_documented_403(make_stack, tmp_path):
    """A priority above the tenant's highest is refused 403 naming `priority` on every submitting route, and
    the document lists that 403 (with the error body) on each of them."""
    tenants = write_tenants_file(
        tmp_path / "tenants.json", {"acme-1": "acme"}, limits={"acme": {"max_priority": "low"}}
    )
    stack = make_stack(ENCORE_TENANTS_FILE=str(tenants))
    auth = bearer("acme-1")
    document = _document(stack, auth)
    video, audio = face_video(tmp_path / "face.mp4", 3.2), tone(tmp_path / "voice.wav", 2.0)
    with open(video, "rb") as v, open(audio, "rb") as a:
        lipsync = stack.client.post(
            "/api/v1/lipsync",
            data={"video": (v, "face.mp4"), "audio": (a, "voice.wav")},
            content_type="multipart/form-data",
            headers=auth,
        )
    replies = {
        "/api/v1/music": stack.client.post(
            "/api/v1/music", json={"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0}, headers=auth
        ),
        "/api/v1/lipsync": lipsync,
        "/generate": stack.client.post("/generate", json={"mode": "instrumental", "tags": "lo-fi"}, headers=auth),
        "/api/generate": stack.client.post(
            "/api/generate", json={"mode": "instrumental", "tags": "lo-fi"}, headers=auth
        ),
    }
    for path, reply in replies.items():
        assert reply.status_code == 403 and reply.get_json()["field"] == "priority", (path, reply.get_json())
        documented = document["paths"][path]["post"]["responses"]["403"]
        assert "priority" in documented["description"]
        schema = {**document, **documented["content"]["application/json"]["schema"]}
        assert jsonschema_rs.Draft202012Validator(schema).is_valid(reply.get_json())
    assert stack.client.get("/api/v1/jobs", headers=auth).get_json()["jobs"] == []


def _set_aside(failure: Any, case: Any, response: Any) -> str | None:
    """Why a failure of schemathesis's checks is not a disagreement of the document and the server, or None.
    Only rules the document states in words because JSON Schema cannot state them are set aside; every other
    failure fails the test."""
    operation = f"{case.operation.method.upper()} {case.operation.path}"
    if failure.code == "ST202" and response.status_code == 400:  # a request valid by the schema refused
        try:
            refusal = json.loads(response.content)
        except ValueError:
            return None
        if operation == "POST /api/v1/lipsync" and refusal.get("field") in ("video", "audio"):
            return "a file's contents (readable media, its streams, lengths and pixels): no schema describes them"
        if operation == "POST /api/v1/music" and refusal.get("field") == "duration_s":
            if "with this prompt and lyrics" in refusal.get("error", ""):
                return "the longest song depends on the tokens of its prompt and lyrics"
    if failure.code == "ST301" and getattr(failure, "free", "").startswith("DELETE /api/v1/jobs/"):
        return "DELETE cancels a job: its record stays readable (canceled) until it expires (docs/api.md)"
    return None


def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    """schemathesis's `filter_failure` hook (this module is its hooks module in `st`): keep every failure but
    those `_set_aside` explains, each written to the test's log."""
    why = _set_aside(failure, case, response)
    if why is not None:
        with open(os.environ[SET_ASIDE_LOG], "a") as log:
            log.write(f"{failure.code} {case.operation.method.upper()} {case.operation.path}: {why}\n")
    return why is None


if os.environ.get("SCHEMATHESIS_HOOKS") == __name__:  # imported by `st` as its hooks module
    import schemathesis

    schemathesis.hook(filter_failure)


def _run_schemathesis(url: str, config: Path, report: Path, set_aside: Path) -> subprocess.CompletedProcess:
    st = Path(sys.executable).with_name("st")
    repo = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [
            str(st),
            "--no-color",
            "--config-file",
            str(config),
            "run",
            f"{url}/api/v1/openapi.json",
            "-H",
            f"Authorization: Bearer {TOKEN}",
            "--checks",
            CHECKS,
            "--max-examples",
            str(EXAMPLES),
            # one worker: two threads sometimes hit CPython 3.11's "AST constructor recursion depth mismatch"
            # inside schemathesis (a SystemError of the interpreter, not of the API)
            "--seed",
            SEED,
            "--request-timeout",
            "30",
            "--workers",
            "1",
            "--report",
            "json",
            "--report-json-path",
            str(report),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=LONGEST_WAIT_S,
        cwd=report.parent,  # its cache goes there, not the repo
        env={**os.environ, "SCHEMATHESIS_HOOKS": __name__, "PYTHONPATH": str(repo), SET_ASIDE_LOG: str(set_aside)},
    )


@pytest.mark.slow  # schemathesis against a live stack (~30 s here; ENCORE_SCHEMATHESIS_EXAMPLES)
def test_schemathesis_finds_no_server_error_and_no_undocumented_reply(make_stack, tmp_path):
    # An admin (every operation answers it) whose jobs may ask for priority normal at most: a generated `high`
    # meets the tenant's 403, which the document must list too.
    tenants = write_tenants_file(
        tmp_path / "tenants.json", {TOKEN: "ops"}, admins=("ops",), limits={"ops": {"max_priority": "normal"}}
    )
    stack = make_stack(ENCORE_TENANTS_FILE=str(tenants))
    stack.auth = bearer(TOKEN)  # what the stack's own helpers send
    stack.start_worker(0, ENCORE_PRELOAD="1")  # its models loaded: /readyz answers 200, not a 5xx
    url = stack.start_gunicorn()
    wait_until(lambda: requests.get(f"{url}/readyz", timeout=10).status_code == 200, 120, 0.2, "/readyz 200")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    job_id = requests.post(
        f"{url}/api/v1/music",
        headers=auth,
        timeout=10,
        json={"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0, "num_tracks": 1, "seed": 1},
    ).json()["job_id"]
    assert stack.wait_job(job_id)["state"] == "done"
    spec = requests.get(f"{url}/api/v1/openapi.json", headers=auth, timeout=10).json()
    operations = [(path, method) for path, item in spec["paths"].items() for method in item]
    routes = [
        (rule, method)
        for rule in stack.app.url_map.iter_rules()
        if rule.endpoint != "static"
        for method in rule.methods - {"HEAD", "OPTIONS"}
    ]
    assert len(operations) == len(routes) == 28
    assert all(
        op["security"] == ([] if path in ("/", "/healthz", "/readyz", "/metrics") else [{"bearer": []}])
        for path, item in spec["paths"].items()
        for op in item.values()
    )

    config = tmp_path / "schemathesis.toml"
    config.write_text(  # identifiers that exist, so that generated requests reach past the 404s
        "[parameters]\n"
        + "".join(
            f'"path.{name}" = {json.dumps(value)}\n'
            for name, value in {"job_id": job_id, "queue": "gpu0", "file_name": "0.mp3", "fmt": "mp3"}.items()
        )
        + '"path.index" = 0\n'
    )
    report, set_aside = tmp_path / "report.json", tmp_path / "set-aside.txt"
    set_aside.touch()
    run = _run_schemathesis(url, config, report, set_aside)
    summary = json.loads(report.read_text())
    assert summary["exit_code"] == 0 and run.returncode == 0, run.stdout[-6000:]
    cases = summary["test_cases"]
    assert cases["with_failures"] == 0 and summary["failures"] == [] and summary["errors"] == []
    assert cases["generated"] >= 300, cases  # bounded but not trivial
    assert summary["operations"]["tested"] == len(operations) - 1  # all but the document's own URL, which st reads
    reasons = set_aside.read_text().splitlines()
    print(
        f"schemathesis: {summary['operations']['tested']} operations, {cases['generated']} cases, "
        f"{cases['with_failures']} with failures, {len(summary['errors'])} errors, "
        f"{summary['running_time']:.0f} s; set aside ({len(reasons)}): {sorted(set(reasons))}"
    )
    assert stack.job(job_id)["state"] == "done"  # the run did not disturb the finished job
