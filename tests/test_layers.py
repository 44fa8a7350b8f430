"""Import directions between Encore's layers, checked on the source: a module may import its own layer and the
layers below it, never one above it, and the two top-level peers (the HTTP layer and the workers) never import
each other. The clients speak HTTP: they import no part of the server side, whatever its rank. A module outside
every layer fails the test too, so a new file has to say where it belongs."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Lowest first. Two layers on one rank are peers: neither may import the other.
LAYERS: dict[str, tuple[int, tuple[str, ...]]] = {
    "pipeline": (0, ("app.pipeline",)),
    "core": (1, ("app.core",)),
    "adapters": (2, ("app.adapters",)),
    "control": (3, ("app.control",)),
    "http": (4, ("app.http", "app.web")),
    "workers": (4, ("app.tasks",)),
    "clients": (5, ("app.clients",)),
    # `python -m app`: hands `events` to the HTTP layer's server entry and every other command to the client.
    "entry": (6, ("app.__main__",)),
}
# What a client never imports though it sits above them: the servers (the HTTP layer, the events server in it, the
# workers) and the job store they share. A client machine has none of their packages, and `encore events` execs
# `python -m app events` rather than importing the server.
SERVER_SIDE: dict[str, tuple[str, ...]] = {"clients": ("adapters", "control", "http", "workers")}
PACKAGE_ROOT = "app"  # app/__init__.py exposes the Celery app for `celery -A app`; it belongs to no layer


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str | None:
    for name, (_, prefixes) in LAYERS.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    return None


def imported_modules(path: Path, module: str, root: Path) -> list[tuple[int, str]]:
    """Every app module `path` imports, lazily or not, with its line; `from app.x import y` counts y when y is a
    module of its own."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                exists = (root / Path(*candidate.split("."))).with_suffix(".py").is_file() or (
                    root / Path(*candidate.split("."))
                ).is_dir()
                found.append((node.lineno, candidate if exists else base))
    return [(line, name) for line, name in found if name == PACKAGE_ROOT or name.startswith(PACKAGE_ROOT + ".")]


def violations(root: Path = REPO) -> list[str]:
    problems = []
    for path in sorted((root / "app").rglob("*.py")):
        module = module_name(path, root)
        if module == PACKAGE_ROOT:
            continue
        source = layer_of(module)
        if source is None:
            problems.append(f"{module}: in no layer (tests/test_layers.py LAYERS)")
            continue
        rank = LAYERS[source][0]
        for line, target_module in imported_modules(path, module, root):
            target = layer_of(target_module)
            if target == source:
                continue
            if target is None or LAYERS[target][0] >= rank or target in SERVER_SIDE.get(source, ()):
                problems.append(f"{path.relative_to(root)}:{line}: {source} imports {target_module} ({target})")
    return problems


def test_no_layer_imports_a_layer_above_it_or_a_peer_and_no_client_imports_a_server():
    assert violations() == []


def test_the_check_sees_upward_and_peer_imports_and_unplaced_modules(tmp_path):
    """The rule is not vacuous: on a small tree of the same shape it reports an upward import (even a lazy one),
    a peer import between the HTTP layer and the workers, a client importing a server (the events server, lazily,
    as the CLI once did), and a module in no layer; downward imports pass, and `python -m app` may import both."""
    files = {
        "app/__init__.py": "",
        "app/pipeline/model.py": "def f():\n    from app.control.jobs import JobStore\n    return JobStore\n",
        "app/control/jobs.py": "from app.core import ids\nJobStore = ids\n",
        "app/core/ids.py": "",
        "app/tasks/stage.py": "from app.http import schemas\nfrom app.control import jobs\n",
        "app/http/schemas.py": "",
        "app/http/events_server.py": "",
        "app/clients/cli.py": "from app.core import ids\ndef events():\n    from app.http.events_server import main\n",
        "app/__main__.py": "from app.http import events_server\nfrom app.clients import cli\n",
        "app/stray.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert violations(tmp_path) == [
        "app/clients/cli.py:3: clients imports app.http.events_server (http)",
        "app/pipeline/model.py:2: pipeline imports app.control.jobs (control)",
        "app.stray: in no layer (tests/test_layers.py LAYERS)",
        "app/tasks/stage.py:1: workers imports app.http.schemas (http)",
    ]
