"""Does the device carry hold every package a GPU bench needs? Checked here, before a device call is spent.

The device image has its own Python packages (bench/device_packages.txt); bench/device_carry.sh carries the
rest as wheels (the names in bench/device_carry.txt). A bench that needs a distribution in neither list stops
at that import on the device, after the machine's start was paid for.

    python bench/carry_check.py bench/gpu_song.py --tiny        # exit 1 when the bench fails so

runs the bench here (on the CPU, with its own arguments) under a Python that holds only those packages: a venv
whose site-packages links this environment's copies of the listed distributions and nothing else. The bench and
every Python it starts with `sys.executable` (section children, a Celery worker and its pool child) then see
what the device will have: an optional import fails quietly as it will there, a needed one fails the run here.
Prints one JSON object: the return code, the bench's failed sections, the modules that were missing, and the end
of stderr when the run failed. tests/test_bench_gpu_song.py and test_bench_gpu_lipsync.py run their benches so.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MISSING = re.compile(r"No module named '([^']+)'")


def normalized(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def listed(path: Path) -> set[str]:
    """The names in a package list: one per line; `#` comments and anything after the name ignored."""
    names = set()
    for line in path.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if fields:
            names.add(normalized(fields[0]))
    return names


def device_packages() -> set[str]:
    """What the GPU machine's Python will hold: its image's packages and the carried wheels."""
    return listed(REPO / "bench" / "device_packages.txt") | listed(REPO / "bench" / "device_carry.txt")


def _top_level_entries(dist: importlib.metadata.Distribution) -> set[str]:
    """The names a distribution installed directly under site-packages (packages, modules, .libs, dist-info)."""
    entries = set()
    for file in dist.files or []:
        top = file.parts[0]
        if top not in ("..", "__pycache__"):
            entries.add(top)
    return entries


def make_device_python(folder: Path, packages: set[str]) -> Path:
    """A venv in `folder` whose site-packages links only `packages` (by normalized name) of this environment;
    returns its python. The repository itself is found as it is here: from the working directory."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(folder)
    site = folder / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for dist in importlib.metadata.distributions():
        if normalized(dist.metadata["Name"]) not in packages:
            continue
        origin = Path(str(dist.locate_file("")))
        for entry in _top_level_entries(dist):
            source, target = origin / entry, site / entry
            if source.exists() and not target.exists():
                target.symlink_to(source)
    return folder / "bin" / "python"


def run_as_on_device(
    command: list[str], timeout_s: float, packages: set[str] | None = None
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`command` (its first word: "python", replaced by the device-like venv's) with only the device's
    `packages` (default: the two lists) installed; (its result, the modules it found missing)."""
    with tempfile.TemporaryDirectory() as folder:
        python = make_device_python(Path(folder) / "venv", device_packages() if packages is None else packages)
        run = subprocess.run(
            [str(python), *command[1:]], cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    return run, sorted(set(MISSING.findall(run.stderr)))


def failed_sections(stdout: str) -> dict[str, str]:
    """The GPU benches print one JSON line per section and go on when one fails: {section: its error}."""
    failed = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            for name, value in json.loads(line).items():
                if isinstance(value, dict) and "error" in value:
                    failed[name] = str(value["error"])[-500:]
    return failed


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    run, missing = run_as_on_device(["python", *sys.argv[1:]], timeout_s=1800)
    failed = failed_sections(run.stdout)
    report = {
        "returncode": run.returncode,
        "failed_sections": failed,
        "missing_modules": missing,
        "stderr_tail": run.stderr[-3000:] if run.returncode or failed else "",
    }
    print(json.dumps(report, indent=2))
    sys.exit(1 if run.returncode or failed else 0)


if __name__ == "__main__":
    main()
