"""docs/architecture.md names every module of every package with its job: one table per package,
introduced by a line ``Modules of `PACKAGE` ...``, one row per module (its path inside the package in
the first cell, in backticks). A module added without a row, or a row left behind by a module that is
gone, fails here: a newcomer reads that page to find where a job lives."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
INTRO = re.compile(r"^Modules of `(\w+)`")
NAMED = re.compile(r"`([\w/]+\.py)`")


def packages() -> dict[str, Path]:
    """Every importable package of a library or a service: ``libs/*/src/PKG``, ``services/*/src/PKG``."""
    found = {}
    for init in sorted([*ROOT.glob("libs/*/src/*/__init__.py"), *ROOT.glob("services/*/src/*/__init__.py")]):
        found[init.parent.name] = init.parent
    return found


def modules(package: Path) -> set[str]:
    return {path.relative_to(package).as_posix() for path in package.rglob("*.py")}


def tables(text: str) -> dict[str, set[str]]:
    """Package -> the modules its table names: the first cell of each row of the table that follows
    the package's ``Modules of`` line (the header row and its rule name none)."""
    named: dict[str, set[str]] = {}
    package: str | None = None
    in_table = False
    for line in text.splitlines():
        if match := INTRO.match(line):
            package, in_table = match.group(1), False
            named.setdefault(package, set())
        elif package is not None and line.startswith("|"):
            in_table = True
            first_cell = line.split("|")[1]
            named[package].update(NAMED.findall(first_cell))
        elif in_table:  # the first line after the table ends it
            package, in_table = None, False
    return named


def test_tables_are_read_row_by_row() -> None:
    text = (
        "Modules of `pkg_a` (libs/a):\n\n| module | job |\n|---|---|\n| `one.py` | a `two.py` in the job |\n"
        "| `sub/three.py` | x |\n\nprose naming `four.py`\n\nModules of `pkg_b`:\n\n| module | job |\n"
        "|---|---|\n| `five.py` | y |\n"
    )
    assert tables(text) == {"pkg_a": {"one.py", "sub/three.py"}, "pkg_b": {"five.py"}}


def test_every_module_of_every_package_is_in_its_table() -> None:
    named = tables(DOC.read_text())
    found = packages()
    assert len(found) >= 10, found  # the four libraries and six services at least: the glob looks right
    missing = [f"{name}: no `Modules of `{name}`` table" for name in found if name not in named]
    for name, package in found.items():
        for module in sorted(modules(package) - named.get(name, set())):
            missing.append(f"{name}: {module}")
    assert not missing, (
        "docs/architecture.md lacks these modules (a row in their package's table: the module and its "
        "job):\n" + "\n".join(missing)
    )


def test_every_module_a_table_names_exists() -> None:
    found = packages()
    stale = []
    for name, listed in tables(DOC.read_text()).items():
        if name not in found:
            stale.append(f"{name}: no such package")
            continue
        stale.extend(f"{name}: {module}" for module in sorted(listed - modules(found[name])))
    assert not stale, "docs/architecture.md names modules that are gone:\n" + "\n".join(stale)
