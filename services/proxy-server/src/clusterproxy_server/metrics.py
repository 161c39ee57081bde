"""Prometheus metrics of one proxy-server (a registry per instance: no module-level state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from clusterproxy_protocol.renewal_metrics import RenewerCollector, RenewerCounters


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.tunnels = Gauge(
            "cluster_proxy_server_agent_tunnels", "Live agent tunnels", ["cluster"], registry=r
        )
        self.tunnel_connects = Counter(
            "cluster_proxy_server_agent_connects_total", "Agent tunnels registered", ["cluster"], registry=r
        )
        self.rejected = Counter(
            "cluster_proxy_server_rejected_connections_total",
            "Connections refused before any stream (TLS or registration failures)",
            ["port", "reason"],
            registry=r,
        )
        self.streams_open = Gauge(
            "cluster_proxy_server_streams_open", "Proxied streams open now", ["frontend"], registry=r
        )
        self.streams = Counter(
            "cluster_proxy_server_streams_total",
            "Proxied stream requests by result",
            ["frontend", "status"],
            registry=r,
        )
        self.bytes = Counter(
            "cluster_proxy_server_stream_bytes_total",
            "Bytes relayed on client streams, by direction (to_target, to_client)",
            ["direction"],
            registry=r,
        )
        self.dial_seconds = Histogram(
            "cluster_proxy_server_dial_seconds", "Time from CONNECT to the agent's answer", registry=r
        )

    def watch_renewer(self, renewer: RenewerCounters) -> None:
        """Export a :class:`~clusterproxy_protocol.reloader.CertRenewer`'s counters."""
        self.registry.register(RenewerCollector(renewer, "cluster_proxy_server_"))
