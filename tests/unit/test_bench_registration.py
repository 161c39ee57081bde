"""bench.registration: the agents registered, read from a real server's /metrics text format."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from bench.registration import tunnels_held
from clusterproxy_protocol.admin import INVENTORY_LABELS, metrics_response


def test_the_tunnels_of_every_cluster_are_summed_and_nothing_else() -> None:
    registry = CollectorRegistry()
    tunnels = Gauge(
        "cluster_proxy_server_agent_tunnels", "Live agent tunnels", ["cluster"], registry=registry
    )
    connects = Counter(
        "cluster_proxy_server_agent_connects_total",
        "Agent tunnels registered",
        ["cluster"],
        registry=registry,
    )
    tunnels.labels("a").set(2)
    tunnels.labels("b").set(1)
    tunnels.labels("gone").set(0)
    connects.labels("a").inc(7)  # a name with the gauge's prefix, not counted
    assert tunnels_held(generate_latest(registry).decode()) == 3


def test_a_server_with_no_tunnel_yet_holds_none() -> None:
    registry = CollectorRegistry()
    Gauge("cluster_proxy_server_agent_tunnels", "Live agent tunnels", ["cluster"], registry=registry)
    assert tunnels_held(generate_latest(registry).decode()) == 0


def test_the_plain_admin_ports_total_is_read() -> None:
    """What bench.registration reads: the server's plain /metrics, whose cluster labels are summed
    away into one total (the labelled series are for hub clients over mutual TLS)."""
    registry = CollectorRegistry()
    tunnels = Gauge(
        "cluster_proxy_server_agent_tunnels", "Live agent tunnels", ["cluster"], registry=registry
    )
    tunnels.labels("a").set(2)
    tunnels.labels("b").set(1)
    plain = metrics_response(registry, without=INVENTORY_LABELS).body.decode()
    assert 'cluster="' not in plain
    assert tunnels_held(plain) == 3
