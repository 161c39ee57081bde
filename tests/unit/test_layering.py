"""Nothing imports a service but the service itself: no library (``libs/*``) imports a service package,
and no service (``services/*``) imports another one. Services talk to each other over their APIs and
run each other as processes; what two of them share is a library.

Which package is which kind comes from the folders (``libs/NAME/src/PACKAGE``,
``services/NAME/src/PACKAGE``), so a new library or service is covered without editing this file.
The sans-IO rule of the protocol core is ``tests/unit/test_sans_io.py``."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: top-level folder -> the kind of every package under it
KINDS = {"libs": "library", "services": "service"}
DYNAMIC_IMPORTS = ("import_module", "__import__")


@dataclass(frozen=True)
class Package:
    name: str  # the import name, e.g. clusterproxy_castore
    kind: str  # "library" or "service"
    folder: Path  # the package's own folder: .../src/<name>


def packages(root: Path) -> dict[str, Package]:
    """Every package of the repository's projects, by import name, with its kind."""
    found: dict[str, Package] = {}
    for top, kind in KINDS.items():
        for init in sorted((root / top).glob("*/src/*/__init__.py")):
            name = init.parent.name
            assert name not in found, (
                f"two projects ship the package {name}: {found[name].folder}, {init.parent}"
            )
            found[name] = Package(name, kind, init.parent)
    return found


def imported_modules(source: str | ast.AST) -> Iterator[tuple[int, str]]:
    """(line, module) of every absolute import: ``import``, ``from ... import`` (at any depth, a
    function's too), and ``importlib.import_module("...")`` / ``__import__("...")`` with a literal
    name. Relative imports stay inside their own package and are left out. ``source`` may be parsed
    already."""
    for node in ast.walk(source if isinstance(source, ast.AST) else ast.parse(source)):
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
            yield node.lineno, name


def violations(root: Path) -> list[str]:
    """Every import of a service from outside it, as ``path:line: what imports what``."""
    by_name = packages(root)
    found = []
    for package in by_name.values():
        for path in sorted(package.folder.rglob("*.py")):
            for line, module in imported_modules(path.read_text()):
                target = by_name.get(module.split(".", 1)[0])
                if target is None or target.kind != "service" or target.name == package.name:
                    continue
                found.append(
                    f"{path.relative_to(root)}:{line}: the {package.kind} {package.name} imports "
                    f"{module} of the service {target.name}"
                )
    return found


def test_every_library_and_service_is_covered() -> None:
    """Each project (a folder with a pyproject.toml under libs/ or services/) is seen, as its kind."""
    found = packages(ROOT)
    for top, kind in KINDS.items():
        projects = sorted(p.parent for p in (ROOT / top).glob("*/pyproject.toml"))
        assert len(projects) >= 3, f"only {len(projects)} projects under {top}/"
        for project in projects:
            seen = [p for p in found.values() if p.folder.parent == project / "src"]
            assert [p.kind for p in seen] == [kind], (
                f"{project.relative_to(ROOT)}: packages {seen} under src/; the rule needs exactly one, a {kind}"
            )
    assert sum(len(list(p.folder.rglob("*.py"))) for p in found.values()) > 100


def test_no_library_or_other_service_imports_a_service() -> None:
    found = violations(ROOT)
    assert not found, (
        "a library must not import a service, nor a service another service (share a library instead):\n"
        + "\n".join(found)
    )


def _write(root: Path, relative: str, text: str = "") -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_tree_that_breaks_the_rule_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, "libs/base/pyproject.toml")
    _write(tmp_path, "libs/base/src/pkg_base/__init__.py")
    _write(tmp_path, "libs/bad/src/pkg_badlib/__init__.py", "import pkg_one.api\n")
    _write(tmp_path, "services/one/src/pkg_one/__init__.py", "from pkg_one import api\nimport pkg_base\n")
    _write(tmp_path, "services/one/src/pkg_one/api.py", "from . import pkg_two\n")
    _write(
        tmp_path,
        "services/two/src/pkg_two/deep/mod.py",
        "import importlib\n\ndef f():\n    return importlib.import_module('pkg_one.api')\n",
    )
    _write(
        tmp_path, "services/two/src/pkg_two/__init__.py", "from pkg_base import x\nfrom pkg_two import deep\n"
    )

    assert {p.name: p.kind for p in packages(tmp_path).values()} == {
        "pkg_badlib": "library",
        "pkg_base": "library",
        "pkg_one": "service",
        "pkg_two": "service",
    }
    assert violations(tmp_path) == [
        "libs/bad/src/pkg_badlib/__init__.py:1: the library pkg_badlib imports pkg_one.api of the service pkg_one",
        "services/two/src/pkg_two/deep/mod.py:4: the service pkg_two imports pkg_one.api of the service pkg_one",
    ]


@pytest.mark.parametrize(
    ("source", "module"),
    [
        ("import clusterproxy_server", "clusterproxy_server"),
        ("import os, clusterproxy_agent.main as agent", "clusterproxy_agent.main"),
        (
            "from clusterproxy_certsigner.cli_commands import run_certs",
            "clusterproxy_certsigner.cli_commands",
        ),
        ("def f():\n    from clusterproxy_certsigner import store", "clusterproxy_certsigner"),
        ("import importlib\nimportlib.import_module('clusterproxy_server.app')", "clusterproxy_server.app"),
        ("__import__('clusterproxy_agent')", "clusterproxy_agent"),
    ],
)
def test_each_form_of_import_is_found(source: str, module: str) -> None:
    assert module in [name for _, name in imported_modules(source)]


def test_relative_imports_are_left_out() -> None:
    assert list(imported_modules("from . import clusterproxy_server\nfrom .x import y")) == []


# The protocol library's public API (docs/architecture.md, clusterproxy_protocol/__init__.py): from
# outside the library (the services, the other libraries, bench) only the package's names and its
# public submodules are imported; the library's own tests (tests/) may reach its internals.
PROTOCOL = "clusterproxy_protocol"
PROTOCOL_USERS = ("services", "libs", "bench")


def protocol_api_violations(root: Path, public: set[str], submodules: set[str]) -> list[str]:
    """Every import of the protocol library from outside it that is not of its public API (a name in
    ``public``, a submodule in ``submodules``), as ``path:line: what``."""
    library = root / "libs" / "protocol"
    found = []
    for top in PROTOCOL_USERS:
        for path in sorted((root / top).rglob("*.py")):
            if library in path.parents or ".venv" in path.parts:
                continue
            source = path.read_text()
            if PROTOCOL not in source:
                continue
            where = f"{path.relative_to(root)}"
            tree = ast.parse(source)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == PROTOCOL:
                    for alias in node.names:
                        if alias.name not in public:
                            found.append(f"{where}:{node.lineno}: {alias.name} is not public in {PROTOCOL}")
            for line, module in imported_modules(tree):
                head, _, rest = module.partition(".")
                if head == PROTOCOL and rest and rest.split(".", 1)[0] not in submodules:
                    found.append(f"{where}:{line}: imports {module}, a private submodule of {PROTOCOL}")
    return found


def _protocol_api() -> tuple[set[str], set[str]]:
    import clusterproxy_protocol

    return set(clusterproxy_protocol.__all__), set(clusterproxy_protocol.SUBMODULES)


def test_nothing_outside_the_protocol_library_imports_its_internals() -> None:
    found = protocol_api_violations(ROOT, *_protocol_api())
    assert not found, (
        f"outside libs/protocol, import from {PROTOCOL} itself (its __all__), or add the name to its "
        "public API (clusterproxy_protocol/__init__.py says how):\n" + "\n".join(found)
    )


def test_a_private_import_of_the_protocol_library_is_refused(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "libs/protocol/src/clusterproxy_protocol/core.py",
        "from clusterproxy_protocol.wire import x\n",
    )
    _write(
        tmp_path,
        "services/one/src/pkg_one/main.py",
        "from clusterproxy_protocol import Budget, http1client\n"
        "from clusterproxy_protocol import core\n"
        "from clusterproxy_protocol.http1client import get\n"
        "import clusterproxy_protocol.driver\n",
    )
    _write(
        tmp_path,
        "bench/tool.py",
        "def f():\n    from clusterproxy_protocol.windows import Budget\n    return Budget\n",
    )
    _write(
        tmp_path, "libs/sdk/src/pkg_sdk/api.py", "from clusterproxy_protocol import Budget as B, missing\n"
    )

    assert protocol_api_violations(tmp_path, {"Budget", "http1client"}, {"http1client"}) == [
        "services/one/src/pkg_one/main.py:2: core is not public in clusterproxy_protocol",
        "services/one/src/pkg_one/main.py:4: imports clusterproxy_protocol.driver, a private submodule of clusterproxy_protocol",
        "libs/sdk/src/pkg_sdk/api.py:1: missing is not public in clusterproxy_protocol",
        "bench/tool.py:2: imports clusterproxy_protocol.windows, a private submodule of clusterproxy_protocol",
    ]
