"""The registry's choice of a tunnel with ejection: ejected tunnels last, and never for a retry."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from clusterproxy_protocol.errors import NoAgentConnected
from clusterproxy_server.ejection import EjectionPolicy, OutlierEjection
from clusterproxy_server.registry import AgentTunnel, Registry


@dataclass
class IdleMux:
    open_streams: int = 0
    accepts_streams: bool = True
    peer_draining: bool = False
    bytes_in: int = 0
    bytes_out: int = 0
    last_rtt: float | None = None


def registry_with(*agent_ids: str) -> tuple[Registry, dict[str, AgentTunnel]]:
    registry = Registry(ejection=OutlierEjection(EjectionPolicy(min_dials=2)))
    tunnels = {name: AgentTunnel("cluster1", name, IdleMux(), "127.0.0.1:1") for name in agent_ids}  # type: ignore[arg-type]
    for tunnel in tunnels.values():
        registry.add(tunnel)
    return registry, tunnels


def test_an_ejected_tunnel_is_picked_only_when_nothing_else_is_left() -> None:
    registry, tunnels = registry_with("bad", "good")
    tunnels["good"].mux.open_streams = 50  # type: ignore[attr-defined]
    assert registry.pick("cluster1") is tunnels["bad"]  # the least loaded
    assert registry.record_dial(tunnels["bad"], failed=True) is None
    assert registry.record_dial(tunnels["bad"], failed=True) is not None
    assert registry.pick("cluster1") is tunnels["good"]
    assert registry.pick("cluster1", exclude={tunnels["good"]}) is tunnels["bad"]
    with pytest.raises(NoAgentConnected, match="ejected"):
        registry.pick("cluster1", exclude={tunnels["good"]}, fall_back_to_ejected=False)
    assert [entry["ejected"] for entry in registry.describe()] == [True, False]


def test_find_names_the_tunnel_of_an_agent_identity() -> None:
    registry, tunnels = registry_with("agent-a", "agent-b")
    assert registry.find("cluster1", "agent-b") is tunnels["agent-b"]
    registry.remove(tunnels["agent-b"])
    assert registry.find("cluster1", "agent-b") is None
    assert registry.find("cluster2", "agent-a") is None
