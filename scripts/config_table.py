"""Print the configuration table of docs/configuration.md from the settings module: one row per `Settings`
field, from its declaration (`setting()` and its kin in the settings module): the variables it reads, their
defaults and its description. The table is printed from what the code reads, so it cannot say what the code
does not do.

    python scripts/config_table.py            # print the table (markdown)
    python scripts/config_table.py --write    # put it between the markers in docs/configuration.md
    python scripts/config_table.py --check    # exit 1, with a diff, when the docs' table differs

tests/test_docs.py fails when the docs' table differs from what this prints.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

# The module that holds `Settings` and `declarations()`: the one line to change when it moves.
SETTINGS_MODULE = "app.core.config"

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "configuration.md"
BEGIN = (
    "<!-- config-table: printed by scripts/config_table.py from the settings module; tests/test_docs.py checks it -->"
)
END = "<!-- /config-table -->"


def settings_module() -> ModuleType:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(SETTINGS_MODULE)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(value: str | None) -> str:
    if value is None:
        return "(unset)"
    return f"`{_cell(value)}`" if value != "" else "(empty)"


def rows() -> list[tuple[str, str, str, str]]:
    """(variables, defaults, field, meaning) per Settings field, in the dataclass's order."""
    table = []
    for name, declared in settings_module().declarations().items():
        table.append(
            (
                " / ".join(f"`{variable}`" for variable, _ in declared.variables),
                " / ".join(_default(default) for _, default in declared.variables),
                f"`{name}`",
                _cell(declared.description),
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
