"""Print the configuration table of docs/configuration.md from the settings module: one row per `Settings`
field, with the environment variables its default factory reads, their defaults, and the field's line in
`SETTING_DESCRIPTIONS`. The variables and defaults are read from the factories' source (each one is a lambda
over `_env(NAME, default)` / `os.environ`), so the table cannot say what the code does not do.

    python scripts/config_table.py            # print the table (markdown)
    python scripts/config_table.py --write    # put it between the markers in docs/configuration.md
    python scripts/config_table.py --check    # exit 1, with a diff, when the docs' table differs

tests/test_docs.py fails when the docs' table differs from what this prints.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

# The module that holds `Settings`, `SETTING_DESCRIPTIONS` and `_env`: the one line to change when it moves.
SETTINGS_MODULE = "app.core.config"

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "configuration.md"
BEGIN = (
    "<!-- config-table: printed by scripts/config_table.py from the settings module; tests/test_docs.py checks it -->"
)
END = "<!-- /config-table -->"
ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
UNSET = object()  # a variable read without a default (os.environ.get(NAME), os.environ[NAME])


def settings_module() -> ModuleType:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(SETTINGS_MODULE)


def _factories(module: ModuleType) -> dict[str, ast.Lambda]:
    """Each `Settings` field's `default_factory=lambda: ...`, as parsed from the module's source."""
    tree = ast.parse(inspect.getsource(module))
    settings = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Settings")
    factories: dict[str, ast.Lambda] = {}
    for node in settings.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(node.value, ast.Call):
            for keyword in node.value.keywords:
                if keyword.arg == "default_factory" and isinstance(keyword.value, ast.Lambda):
                    factories[node.target.id] = keyword.value
    return factories


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def _variables(factory: ast.Lambda, module: ModuleType) -> list[tuple[str, Any]]:
    """(variable, default) for every read in the factory, in source order: `_env(NAME, default)` with its
    default evaluated in the module, `os.environ.get(NAME)` / `os.environ[NAME]` as UNSET, and a module-level
    dict of variable names the factory iterates (e.g. MODEL_PATH_VARIABLES) as one UNSET read per value."""
    reads: list[tuple[int, int, str, Any]] = []
    names = vars(module)
    for node in ast.walk(factory.body):
        where = (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("_env", "_int", "_float")
        ):
            name, default = node.args
            value = eval(compile(ast.Expression(default), "<default>", "eval"), dict(names))  # the module's own code
            reads.append((*where, ast.literal_eval(name), value))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and _is_environ(node.func.value)
            and isinstance(node.args[0], ast.Constant)
        ):
            reads.append((*where, node.args[0].value, UNSET))
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.slice, ast.Constant):
            reads.append((*where, node.slice.value, UNSET))
        elif isinstance(node, ast.Name) and isinstance(names.get(node.id), dict):
            table = names[node.id]
            if table and all(isinstance(v, str) and ENV_NAME.match(v) for v in table.values()):
                reads.extend((*where, variable, UNSET) for variable in table.values())
    seen: dict[str, Any] = {}
    for *_, name, default in sorted(reads, key=lambda read: read[:2]):
        seen.setdefault(name, default)
    return list(seen.items())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(value: Any) -> str:
    if value is UNSET:
        return "(unset)"
    return f"`{_cell(str(value))}`" if value != "" else "(empty)"


def rows() -> list[tuple[str, str, str, str]]:
    """(variables, defaults, field, meaning) per Settings field, in the dataclass's order."""
    module = settings_module()
    factories = _factories(module)
    descriptions: dict[str, str] = module.SETTING_DESCRIPTIONS
    fields = [f.name for f in dataclasses.fields(module.Settings)]
    missing = [name for name in fields if name not in descriptions]
    unknown = sorted(set(descriptions) - set(fields))
    if missing or unknown:
        raise SystemExit(f"SETTING_DESCRIPTIONS: no description for {missing}; no such field: {unknown}")
    table = []
    for name in fields:
        variables = _variables(factories[name], module) if name in factories else []
        if not variables:
            raise SystemExit(f"Settings.{name}: its default factory reads no environment variable")
        table.append(
            (
                " / ".join(f"`{v}`" for v, _ in variables),
                " / ".join(_default(d) for _, d in variables),
                f"`{name}`",
                _cell(descriptions[name]),
            )
        )
    return table


def table() -> str:
    lines = ["| variable | default | `Settings` field | meaning |", "|---|---|---|---|"]
    lines += [f"| {variables} | {defaults} | {name} | {meaning} |" for variables, defaults, name, meaning in rows()]
    return "\n".join(lines) + "\n"


def generated_block(text: str) -> str:
    """What a document holds between the markers (the markers' lines excluded)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise SystemExit(f"expected one {BEGIN!r} and one {END!r}")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].removeprefix("\n")


def write(doc: Path = DOC) -> None:
    text = doc.read_text(encoding="utf-8")
    old = generated_block(text)
    doc.write_text(text.replace(BEGIN + "\n" + old + END, BEGIN + "\n" + table() + END, 1), encoding="utf-8")


def _shown(doc: Path) -> str:
    return str(doc.relative_to(REPO)) if doc.is_relative_to(REPO) else str(doc)


def check(doc: Path = DOC) -> int:
    """0 when the document's table is what `table()` prints; else 1, with a unified diff on stderr."""
    documented, printed = generated_block(doc.read_text(encoding="utf-8")), table()
    if documented == printed:
        print(f"{_shown(doc)}: the configuration table matches {SETTINGS_MODULE}")
        return 0
    import difflib

    sys.stderr.writelines(
        difflib.unified_diff(
            documented.splitlines(keepends=True),
            printed.splitlines(keepends=True),
            f"{_shown(doc)} (documented)",
            f"{SETTINGS_MODULE} (printed)",
        )
    )
    print("run: python scripts/config_table.py --write", file=sys.stderr)
    return 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help=f"replace the table in {DOC.relative_to(REPO)}")
    action.add_argument("--check", action="store_true", help="exit 1 when the docs' table differs")
    args = parser.parse_args()
    if args.write:
        write()
    elif args.check:
        raise SystemExit(check())
    else:
        sys.stdout.write(table())


if __name__ == "__main__":
    main()
