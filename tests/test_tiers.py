"""The fast tier (`-m "not slow"`, docs/testing.md) keeps its promise: it still sends a real music job and a real
lip-sync job through real Celery workers, and it is a real subset (the slow marker selects something). The
selection is what pytest itself collects in a child process, so a `slow` mark added to the wrong test, a
renamed end-to-end test or an unregistered marker breaks this test rather than silently thinning the tier."""

from __future__ import annotations

import re
import subprocess

from harness.processes import PYTHON, REPO

FAST = "not slow"
# Files whose tests submit a job over HTTP to real `celery worker` processes (harness/stack.py) running the
# tiny models end to end: the fast tier must keep at least one test of each.
END_TO_END = {"music": "tests/test_music_e2e.py", "lipsync": "tests/test_lipsync_e2e.py"}


def collect(*args: str) -> tuple[list[str], int]:
    """The node ids pytest collects with these arguments (no test runs), and how many it deselected."""
    done = subprocess.run(
        [PYTHON, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    nodes = [line for line in done.stdout.splitlines() if re.match(r"^tests/\S+\.py::", line)]
    summary = re.search(r"(\d+)/(\d+) tests? collected \((\d+) deselected\)", done.stdout)
    return nodes, int(summary.group(3)) if summary else 0


def test_the_fast_tier_sends_a_real_job_through_each_pipeline():
    fast, deselected = collect("-m", FAST)
    for pipeline, path in END_TO_END.items():
        assert any(node.startswith(f"{path}::") for node in fast), f"the fast tier runs no real {pipeline} job ({path})"
    assert deselected > 0, "no test is marked slow: the fast tier is the whole suite"
    this = f"tests/test_tiers.py::{test_the_fast_tier_sends_a_real_job_through_each_pipeline.__name__}"
    assert this in fast, "this guarantee must itself run in the fast tier"


def test_the_slow_marker_is_registered_and_markers_are_strict():
    config = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert "--strict-markers" in config, "a misspelt marker (slwo) must be an error, not a silently empty tier"
    assert re.search(r'^\s*"slow:', config, re.MULTILINE), "the slow marker is not registered in pyproject.toml"


def test_the_documented_fast_command_is_the_one_tested_here():
    doc = (REPO / "docs" / "testing.md").read_text(encoding="utf-8")
    assert f'bash scripts/test.sh -m "{FAST}"' in doc
    assert f'-m "{FAST}"' in (REPO / "scripts" / "test.sh").read_text(encoding="utf-8")
