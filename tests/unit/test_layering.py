"""No module under ``libs/`` imports a service package: the libraries and the CLI use the services as
processes and over their APIs, never their Python modules."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

LIBS = Path(__file__).resolve().parents[2] / "libs"
SERVICE_PACKAGES = ("clusterproxy_server", "clusterproxy_agent", "clusterproxy_certsigner")
DYNAMIC_IMPORTS = ("import_module", "__import__")


def _is_service(module: str) -> bool:
    return module.split(".", 1)[0] in SERVICE_PACKAGES


def service_imports(source: str) -> Iterator[tuple[int, str]]:
    """(line, module) of every import of a service package: ``import``, ``from ... import``, and
    ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in DYNAMIC_IMPORTS
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        else:
            continue
        for name in names:
            if _is_service(name):
                yield node.lineno, name


def test_no_module_under_libs_imports_a_service_package() -> None:
    sources = sorted(LIBS.rglob("*.py"))
    assert len(sources) > 20, f"found only {len(sources)} modules under {LIBS}"
    found = [
        f"{path.relative_to(LIBS.parent)}:{line}: imports {module}"
        for path in sources
        for line, module in service_imports(path.read_text())
    ]
    assert not found, "libs/ must not import a service package:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "import clusterproxy_server",
        "import os, clusterproxy_agent.main as agent",
        "from clusterproxy_certsigner.cli_commands import run_certs",
        "def f():\n    from clusterproxy_certsigner import store",
        "import importlib\nimportlib.import_module('clusterproxy_server.app')",
        "__import__('clusterproxy_agent')",
    ],
)
def test_each_form_of_import_is_found(source: str) -> None:
    assert [module for _, module in service_imports(source)]


def test_other_imports_pass() -> None:
    source = "import clusterproxy_protocol\nfrom . import clusterproxy_server\nfrom clusterproxy_sdk import x"
    assert list(service_imports(source)) == []
