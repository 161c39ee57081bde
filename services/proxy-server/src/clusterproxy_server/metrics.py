"""Prometheus metrics of one proxy-server (a registry per instance: no module-level state)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class _RenewerCollector(Collector):
    """The certificate renewer's counters, read when scraped."""

    def __init__(self, renewer: Any, prefix: str) -> None:
        self._renewer = renewer
        self._prefix = prefix

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        r, p = self._renewer, self._prefix
        yield CounterMetricFamily(p + "cert_renewals", "Certificate renewals done", value=r.renewals)
        yield CounterMetricFamily(p + "cert_renewal_failures", "Failed renewal attempts", value=r.failures)
        yield CounterMetricFamily(
            p + "trust_bundle_updates", "Trust bundle changes loaded", value=r.trust_updates
        )
        try:
            not_after = r.certificate.not_valid_after_utc.timestamp()
        except Exception:  # a file being replaced: skip this scrape's value
            return
        yield GaugeMetricFamily(
            p + "cert_not_after_seconds", "Expiry of the current certificate (Unix time)", value=not_after
        )


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
            "cluster_proxy_server_stream_bytes_total", "Bytes relayed", ["direction"], registry=r
        )
        self.dial_seconds = Histogram(
            "cluster_proxy_server_dial_seconds", "Time from CONNECT to the agent's answer", registry=r
        )

    def watch_renewer(self, renewer: Any) -> None:
        """Export a :class:`~clusterproxy_protocol.reloader.CertRenewer`'s counters."""
        self.registry.register(_RenewerCollector(renewer, "cluster_proxy_server_"))
