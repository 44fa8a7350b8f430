"""The code layout's rules, checked on the source: settings are read from the environment in app/core/config.py
only, the pipeline never imports Celery, and the web's imports stay free of the model stacks."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "app" / "core" / "config.py"


def _sources(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (REPO / folder).rglob("*.py"))


def _is_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def environment_reads(path: Path) -> list[str]:
    """`os.environ[...]`, `os.environ.get(...)`, `... in os.environ`, `os.getenv(...)`: reading a setting.
    Copying the environment for a child process (`{**os.environ, ...}`, `os.environ.copy()`) is not."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        read = (
            (isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load))
            or (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and _is_environ(node.func.value)
                and node.func.attr in ("get", "setdefault", "pop", "items", "keys", "values")
            )
            or (isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators))
            or (
                isinstance(node, ast.Attribute)
                and node.attr == "getenv"
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
            )
        )
        if read:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_settings_are_read_from_the_environment_in_app_config_only():
    files = [
        path
        for path in _sources("app") + [REPO / "celeryconfig.py", REPO / "flowerconfig.py", REPO / "gunicorn.conf.py"]
        if path != CONFIG
    ]
    assert [read for path in files for read in environment_reads(path)] == []
    assert environment_reads(CONFIG)  # the check does see reads where they are


def test_the_pipeline_has_no_celery_import():
    imports = []
    for path in _sources("app/pipeline"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            imports += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in ("celery", "kombu")]
    assert imports == []


def test_the_web_imports_no_model_code():
    """app.web imports the pipelines' light modules (lyrics, frames, profiles, probe) but never torch."""
    code = "import sys, app.web; print(sorted({'torch', 'megatron', 'diffusers', 'cv2'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


SECRET_ENV = {
    "API_TOKEN": "tok-visible-1,tok-visible-2",
    "ENCORE_WEBHOOK_SECRET": "whsec_c2VjcmV0LXZpc2libGU=",
    "ENCORE_FLOWER_BASIC_AUTH": "admin:pw-visible",
    "AWS_ACCESS_KEY_ID": "ak-visible",
    "AWS_SECRET_ACCESS_KEY": "sk-visible",
    "REDIS_URL": "redis://:redis-pw-visible@127.0.0.1:6379/0",
    "REDIS_SENTINEL_PASSWORD": "sentinel-pw-visible",
}


def test_settings_never_show_a_secret_in_their_repr():
    """Settings are logged and shown in tracebacks: their repr carries no token, password or key (a child process
    builds them from an environment holding one of each)."""
    shown = subprocess.run(
        [sys.executable, "-c", "from app.core.config import load_settings; print(repr(load_settings()))"],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **SECRET_ENV},
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "Settings(" in shown.stdout
    secrets = [
        "tok-visible-1",
        "tok-visible-2",
        "c2VjcmV0LXZpc2libGU",
        "pw-visible",
        "ak-visible",
        "sk-visible",
        "redis-pw-visible",
        "sentinel-pw-visible",
    ]
    leaked = [secret for secret in secrets if secret in shown.stdout]
    assert not leaked, f"repr(Settings) shows {leaked}"
