"""Names that lead somewhere (issue 37, item 6): every module path the docs, the README and the code's docstrings
and comments name (`app/control/lifecycle.TRANSITIONS`, `app.control.readiness`, `jobs.record`) resolves to a
module, file or attribute that exists. Modules moved twice in this code's history, and nine docstrings went on
naming the old places."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path
from types import ModuleType

from flask import Flask

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "app"
# `app.x.y` or `app/x/y.attr` (not inside a longer path or word): a module, a file or folder, an attribute.
APP_PATH = re.compile(r"(?<![\w/.-])app(?:[./][A-Za-z_]\w*)+")
# `module.attr` where `module` is the name of one of app's modules (`jobs.record`): the short form docstrings use.
SHORT = re.compile(r"(?<![\w/.-])([a-z_][a-z0-9_]*)\.([A-Za-z_]\w*)(?![\w(/-])")
A_FLASK_APP = Flask(__name__)  # docstrings name a Flask application's attributes as `app.<name>` too
FILE_SUFFIXES = {"py", "md", "lua", "json", "toml", "sh", "yml", "yaml", "txt", "mp3", "mp4", "wav", "png", "log"}


def prose_of_python(path: Path) -> str:
    """A module's docstrings and comments: where it names other code in words (its code is checked by running)."""
    source = path.read_text(encoding="utf-8")
    parts = [
        doc
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and (doc := ast.get_docstring(node, clean=False))
    ]
    parts += [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    return "\n".join(parts)


def texts() -> dict[str, str]:
    found = {
        str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in [REPO / "README.md", *REPO.glob("docs/*.md")]
    }
    found |= {str(p.relative_to(REPO)): prose_of_python(p) for p in APP.rglob("*.py")}
    found |= {
        str(p.relative_to(REPO)): "\n".join(
            line.split("--", 1)[1] for line in p.read_text().splitlines() if "--" in line
        )
        for p in APP.rglob("*.lua")
    }
    return found


def _attribute_path(module: ModuleType, attributes: list[str]) -> bool:
    target: object = module
    for name in attributes:
        if not hasattr(target, name):
            return False
        target = getattr(target, name)
    return True


def resolves(reference: str) -> bool:
    """Whether `app...` names a folder, a file, a module, or an attribute (path) of one."""
    parts = re.split(r"[./]", reference.rstrip("."))
    if REPO.joinpath(*parts).is_dir():
        return True
    if len(parts) > 1 and hasattr(A_FLASK_APP, parts[1]):
        return True  # `app.extensions`, `app.before_request`: a Flask application's attributes, not a module
    if parts[-1] in FILE_SUFFIXES:
        return (REPO / "/".join(parts[:-1])).with_suffix("." + parts[-1]).exists()
    for end in range(len(parts), 0, -1):
        path = REPO.joinpath(*parts[:end])
        if end == len(parts) and path.is_dir():
            return True
        if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
            return _attribute_path(importlib.import_module(".".join(parts[:end])), parts[end:])
        if path.is_dir():
            return False  # a folder with the rest of the name nowhere in it
    return False


def module_names() -> dict[str, list[str]]:
    """app's modules by their last name (`jobs` -> app.control.jobs, app.http.jobs)."""
    names: dict[str, list[str]] = {}
    for path in APP.rglob("*.py"):
        if path.name != "__init__.py":
            names.setdefault(path.stem, []).append(".".join(path.relative_to(REPO).with_suffix("").parts))
    return names


def test_the_resolver_tells_a_moved_name_from_a_real_one():
    assert resolves("app/control/lifecycle.TRANSITIONS") and resolves("app.control.readiness")
    assert resolves("app/control/lua") and resolves("app/control/lua/transition.lua")
    assert not resolves("app/lifecycle.TRANSITIONS") and not resolves("app.readiness")
    assert not resolves("app/control/jobs.JobStore.no_such_method")
    assert resolves("app.extensions")  # the Flask application's, in a docstring


def test_every_module_path_named_in_docs_docstrings_and_comments_resolves():
    unresolved = sorted(
        {(where, m[0]) for where, text in texts().items() for m in APP_PATH.finditer(text) if not resolves(m[0])}
    )
    assert not unresolved, unresolved


def test_every_short_module_attribute_named_in_prose_exists():
    """`jobs.take_lease`: a name of one of app's modules, then an attribute that one of them must have."""
    names = module_names()
    missing = set()
    for where, text in texts().items():
        for module, attribute in SHORT.findall(text):
            if module not in names or attribute in FILE_SUFFIXES:
                continue
            if not any(hasattr(importlib.import_module(full), attribute) for full in names[module]):
                missing.add((where, f"{module}.{attribute}"))
    assert not missing, sorted(missing)
