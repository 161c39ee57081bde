"""The protocol library's public API (``clusterproxy_protocol/__init__.py``): every name in ``__all__``
resolves to the object of its submodule, the ``TYPE_CHECKING`` imports (the one list: the lazy table
and ``__all__`` are read from them) name each thing once under its own name, and importing the package alone loads no submodule (so no trio: the sans-IO
rule of ``tests/unit/test_sans_io.py``). Who may import what of it is ``tests/unit/test_layering.py``."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import clusterproxy_protocol as api

INIT = Path(api.__file__)
SUBMODULES_ON_DISK = {p.stem for p in INIT.parent.glob("*.py") if p.stem != "__init__"}


def type_checking_imports() -> dict[str, tuple[str, str]]:
    """Public name -> (submodule, name there) of the ``if TYPE_CHECKING:`` block of ``__init__``."""
    tree = ast.parse(INIT.read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    )
    found: dict[str, tuple[str, str]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module, ast.unparse(node)
        for alias in node.names:
            public = alias.asname or alias.name
            assert public not in found, f"{public} imported twice under TYPE_CHECKING"
            if node.module == api.__name__:  # a public submodule
                found[public] = (alias.name, "")
            else:
                found[public] = (node.module.removeprefix(api.__name__ + "."), alias.name)
    return found


def test_the_type_checking_imports_are_the_table_and_all() -> None:
    """Read independently of ``__init__``'s own reader: a name imported twice, or under another name
    (mypy re-exports only ``X as X``), fails here."""
    imported = type_checking_imports()
    assert imported == api._WHERE
    assert api.__all__ == list(imported)
    renamed = {public: where for public, where in imported.items() if where[1] not in ("", public)}
    assert not renamed, (
        f"public under another name than its submodule's (mypy would not export it): {renamed}"
    )


def test_the_table_names_existing_submodules_and_no_name_is_a_submodule() -> None:
    """A package attribute named like a submodule is replaced by the submodule when it is first
    imported: ``relay.relay_streams`` is not called ``relay`` for that reason."""
    assert {module for module, _ in api._WHERE.values()} <= SUBMODULES_ON_DISK
    assert not ({name for name, (_, attribute) in api._WHERE.items() if attribute} & SUBMODULES_ON_DISK)


@pytest.mark.parametrize("name", sorted(api.__all__))
def test_every_public_name_resolves_to_its_submodules_object(name: str) -> None:
    value = getattr(api, name)
    if name in api.SUBMODULES:
        assert value is importlib.import_module(f"{api.__name__}.{name}")
    else:
        module, attribute = api._WHERE[name]
        assert value is getattr(importlib.import_module(f"{api.__name__}.{module}"), attribute)
    assert name in dir(api)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        api.no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        exec("from clusterproxy_protocol import no_such_name")


def test_one_implementation_behind_each_shared_name() -> None:
    from clusterproxy_protocol import admin, config, httpserver, windows

    assert api.format_size is windows.format_size is config.format_size
    assert api.Response is httpserver.Response is admin.Response
    assert api.AdminRoute is admin.AdminRoute
    assert api.Route is not admin.AdminRoute


def test_importing_the_package_loads_no_submodule_and_no_io_library() -> None:
    probe = (
        "import sys, clusterproxy_protocol\n"
        "print(' '.join(m for m in sys.modules if m.startswith('clusterproxy_protocol.') or m in ('trio', 'asyncio')))\n"
        "from clusterproxy_protocol import Budget, TunnelCore\n"
        "print('trio' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded, sans_io_names_load_trio = done.stdout.splitlines()
    assert loaded == ""
    assert sans_io_names_load_trio == "False"
