"""The static checks are part of the suite: ruff's lint rules, ruff's formatting and mypy, as configured in
pyproject.toml, at zero findings. A finding fails here with the checker's own report, so the README's test
command (and CI) catches what a review would: a late-bound loop variable, a zip that drops the tail, a value
that may be None where the code indexes it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, check=False, capture_output=True, text=True, timeout=400)


@pytest.mark.parametrize(
    "check",
    [
        pytest.param(("ruff", "check", "--no-cache", "."), id="ruff-lint"),
        pytest.param(("ruff", "format", "--check", "--no-cache", "."), id="ruff-format"),
        pytest.param(("mypy",), id="mypy"),
    ],
)
def test_static_check_has_no_findings(check: tuple[str, ...]):
    tool = BIN / check[0]
    assert tool.exists(), f"{tool} is missing: requirements.txt pins it (scripts/setup.sh installs it)"
    result = _run(str(tool), *check[1:])
    assert result.returncode == 0, f"{' '.join(check)} found:\n{result.stdout[-6000:]}{result.stderr[-2000:]}"


def test_the_checks_fail_on_a_finding(tmp_path: Path):
    """The checks above can fail: the same configuration reports a planted bug of each kind."""
    (tmp_path / "pyproject.toml").write_text(
        (REPO / "pyproject.toml")
        .read_text()
        .replace('files = ["app", "celeryconfig.py", "flowerconfig.py", "gunicorn.conf.py"]', 'files = ["planted.py"]')
    )
    (tmp_path / "planted.py").write_text(
        "def pairs(a: list[int], b: list[int]) -> list[tuple[int, int]]:\n"
        "    return list(zip(a, b))\n"
        "\n"
        "\n"
        "def first(d: dict[str, int] | None) -> int:\n"
        "    return d['x']\n"
    )
    lint = subprocess.run(
        [str(BIN / "ruff"), "check", "--no-cache", "planted.py"],
        cwd=tmp_path,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert lint.returncode == 1 and "B905" in lint.stdout, lint.stdout
    (tmp_path / "badly_formatted.py").write_text("x=1\n")
    fmt = subprocess.run(
        [str(BIN / "ruff"), "format", "--check", "--no-cache", "badly_formatted.py"],
        cwd=tmp_path,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fmt.returncode == 1 and "badly_formatted.py" in fmt.stdout, fmt.stdout
    types = subprocess.run(
        [str(BIN / "mypy"), "--no-incremental"], cwd=tmp_path, check=False, capture_output=True, text=True, timeout=300
    )
    assert types.returncode == 1 and "planted.py:6" in types.stdout and "[index]" in types.stdout, types.stdout
