"""The sans-IO modules load no I/O library (docs/architecture.md): each imported alone, in a fresh
interpreter, must leave trio and asyncio out of ``sys.modules``."""

from __future__ import annotations

import subprocess
import sys

import pytest

SANS_IO = [
    "clusterproxy_protocol.core",
    "clusterproxy_protocol.events",
    "clusterproxy_protocol.windows",
    "clusterproxy_protocol.framing",
    "clusterproxy_protocol.flow_control",
    "clusterproxy_protocol.h2_connection",
    "clusterproxy_protocol.settings",
    "clusterproxy_protocol.stream_state",
    "clusterproxy_protocol.workarounds",
    "clusterproxy_protocol.wire",
    "clusterproxy_protocol.errors",
    "clusterproxy_protocol.forward_proxy",
    "clusterproxy_protocol.proxy_requests",
    "clusterproxy_protocol.request_heads",
    "clusterproxy_cli.proxy_handshake",
]
IO_LIBRARIES = ("trio", "asyncio")


def loaded_after_import(module: str) -> list[str]:
    probe = f"import sys, {module}; print(' '.join(m for m in {IO_LIBRARIES!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return done.stdout.split()


@pytest.mark.parametrize("module", SANS_IO)
def test_a_sans_io_module_loads_no_io_library(module: str) -> None:
    assert loaded_after_import(module) == []


def test_the_probe_sees_an_io_library_where_one_is_loaded() -> None:
    assert "trio" in loaded_after_import("clusterproxy_protocol.driver")
