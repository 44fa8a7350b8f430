"""The OpenAPI document tells the truth (issue 11, item 5): schemathesis generates requests from it for every
operation against the web tier as deployed (gunicorn, a real worker, a finished job to reach the downloads)
and checks every reply: no server error, and status codes, content types, headers and bodies as documented.

A few hundred cases by default; ENCORE_SCHEMATHESIS_EXAMPLES raises the examples per operation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import requests
import pytest

from tests.support.processes import LONGEST_WAIT_S, wait_until

pytestmark = pytest.mark.slow  # schemathesis against a live stack (~30 s here; ENCORE_SCHEMATHESIS_EXAMPLES)

CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
    "response_schema_conformance"
)
EXAMPLES = int(os.environ.get("ENCORE_SCHEMATHESIS_EXAMPLES", "15"))
TOKEN = "schemathesis-token"


def _run_schemathesis(url: str, config: Path, report: Path) -> subprocess.CompletedProcess:
    st = Path(sys.executable).with_name("st")
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
            "2026",
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
        cwd=report.parent,
    )  # its cache goes there, not the repo


def test_schemathesis_finds_no_server_error_and_no_undocumented_reply(make_stack, tmp_path):
    stack = make_stack(API_TOKEN=TOKEN)
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
    report = tmp_path / "report.json"
    run = _run_schemathesis(url, config, report)
    summary = json.loads(report.read_text())
    assert summary["exit_code"] == 0 and run.returncode == 0, run.stdout[-6000:]
    cases = summary["test_cases"]
    assert cases["with_failures"] == 0 and summary["failures"] == [] and summary["errors"] == []
    assert cases["generated"] >= 300, cases  # bounded but not trivial
    assert summary["operations"]["tested"] == len(operations) - 1  # all but the document's own URL, which st reads
    print(
        f"schemathesis: {summary['operations']['tested']} operations, {cases['generated']} cases, "
        f"{cases['with_failures']} with failures, {len(summary['errors'])} errors, "
        f"{summary['running_time']:.0f} s"
    )
    assert stack.job(job_id)["state"] == "done"  # the run did not disturb the finished job
