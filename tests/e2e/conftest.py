"""A real proxy-server with real agents (separate processes), shared by the tests of a module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from tests.support.pki import PkiFiles
from tests.support.procs import Hub

AGENTS = [("cluster1", "agent-a"), ("cluster2", "agent-a")]


@pytest.fixture(scope="module")
def hub(pki: PkiFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """Server + one agent for cluster1 and cluster2; cluster3 is known but has no agent."""
    hub = Hub(pki, Path(tmp_path_factory.mktemp("logs")))

    async def start() -> None:
        await hub.start_server("--known-clusters", "cluster3", "--dial-timeout", "10s")
        for cluster, agent_id in AGENTS:
            hub.start_agent(cluster, agent_id, "--allow", "127.0.0.0/8", "--dial-timeout", "2s")
        for cluster, agent_id in AGENTS:
            await hub.wait_agent(cluster, agent_id)

    try:
        trio.run(start)
        yield hub
    finally:
        hub.stop()
