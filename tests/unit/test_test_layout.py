"""The tests' own layout: code that several test modules share lives in ``tests/support`` (a module
named for its job), never in a test module another one imports. Importing a test module runs its
module-level code and fixtures a second time under another name, and ties a test's helpers to
whichever file happened to need them first. The benchmarks (``bench/``) borrow the tests' helpers
too, by the same rule: from ``tests/support``, never from a test module."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
CHECKED = (TESTS, ROOT / "bench")  # every tree whose modules may use the tests' helpers


def is_test_module(dotted: str) -> bool:
    """``tests.e2e.test_resilience``: a module of the test tree whose file pytest collects."""
    parts = dotted.split(".")
    return parts[0] == "tests" and parts[-1].startswith("test_")


def imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every module an ``import`` or ``from ... import`` names, with its line: ``from tests.kube import
    test_gateway`` names ``tests.kube.test_gateway`` as well as ``tests.kube``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def test_imports_of_test_modules_are_found() -> None:
    source = (
        "import tests.e2e.test_a\n"
        "from tests.kube import test_gateway as base\n"
        "from tests.unit.test_b import helper\n"
        "from tests.support.waiting import wait_until\n"
        "from tests.support import require\n"
    )
    found = [(line, name) for line, name in imported_modules(ast.parse(source)) if is_test_module(name)]
    assert found == [(1, "tests.e2e.test_a"), (2, "tests.kube.test_gateway"), (3, "tests.unit.test_b")]


def test_no_test_module_imports_another() -> None:
    offenders = []
    paths = sorted(path for tree in CHECKED for path in tree.rglob("*.py"))
    assert any(path.parent.name == "bench" for path in paths), (
        "bench/ has no module: the check looks in the wrong place"
    )
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in imported_modules(tree):
            if is_test_module(name):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not offenders, (
        "shared test code belongs in tests/support (a module named for its job), not in a test module; "
        "bench/ imports it from there too:\n" + "\n".join(offenders)
    )
