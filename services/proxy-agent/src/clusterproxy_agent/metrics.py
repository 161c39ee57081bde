"""Prometheus metrics of one agent instance (its own registry: no module-level state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from clusterproxy_protocol import RenewerCollector, RenewerCounters

PREFIX = "cluster_proxy_agent_"
DIAL_RESULTS = ("ok", "refused", "timeout", "forbidden", "bad_target")


class _ByteCounters(Collector):
    """Bytes carried over the tunnels, read live from the connections when scraped."""

    def __init__(self, totals: Callable[[], tuple[int, int]]) -> None:
        self._totals = totals

    def describe(self) -> Iterator[Metric]:
        return self._families(0, 0)

    def collect(self) -> Iterator[Metric]:
        return self._families(*self._totals())

    def _families(self, bytes_in: int, bytes_out: int) -> Iterator[Metric]:
        yield CounterMetricFamily(
            PREFIX + "bytes_in", "Payload bytes received from the proxy-servers over tunnels", value=bytes_in
        )
        yield CounterMetricFamily(
            PREFIX + "bytes_out", "Payload bytes sent to the proxy-servers over tunnels", value=bytes_out
        )


class ReplicaTunnel(Protocol):
    """What the replica families read of a live tunnel (``agent.TunnelRecord``)."""

    @property
    def server_id(self) -> str | None: ...

    @property
    def address(self) -> str: ...

    @property
    def holds_replica(self) -> bool: ...


class _ReplicaFamilies(Collector):
    """The proxy-server replicas this agent holds, read live when scraped (ids come and go with every
    restart of a replica: no label outlives its tunnel)."""

    def __init__(self, tunnels: Callable[[], Sequence[ReplicaTunnel]], expected: Callable[[], int]) -> None:
        self._tunnels = tunnels
        self._expected = expected

    def describe(self) -> Iterator[Metric]:
        return self._families([], 0)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._tunnels(), self._expected())

    def _families(self, tunnels: Sequence[ReplicaTunnel], expected: int) -> Iterator[Metric]:
        per_tunnel = GaugeMetricFamily(
            PREFIX + "server_tunnel",
            "1 per live tunnel, by the proxy-server replica it reached (server_id, empty until the server "
            "said), the address dialed and whether that replica is draining",
            labels=["server_id", "server", "draining"],
        )
        for tunnel in tunnels:
            per_tunnel.add_metric(
                [tunnel.server_id or "", tunnel.address, "false" if tunnel.holds_replica else "true"], 1
            )
        yield per_tunnel
        held = {t.server_id for t in tunnels if t.holds_replica and t.server_id}
        yield GaugeMetricFamily(
            PREFIX + "replicas_held",
            "Distinct proxy-server replicas held by a non-draining tunnel",
            value=len(held),
        )
        yield GaugeMetricFamily(
            PREFIX + "replicas_expected",
            "Proxy-server replicas the agent looks for (the largest cluster-proxy-server-count a held "
            "replica told, or one per --server address)",
            value=expected,
        )


class AgentMetrics:
    def __init__(self, byte_totals: Callable[[], tuple[int, int]] = lambda: (0, 0)) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.tunnels_connected = Gauge(
            PREFIX + "tunnels_connected", "Tunnels currently connected to a proxy-server", registry=r
        )
        self.tunnel_reconnects = Counter(
            PREFIX + "tunnel_reconnects", "Tunnel connection attempts after the first one", registry=r
        )
        self.dials = Counter(
            PREFIX + "dials",
            "Dials to targets by result (ok, refused, timeout, forbidden, bad_target)",
            ["result"],
            registry=r,
        )
        for result in DIAL_RESULTS:
            self.dials.labels(result)
        self.duplicate_dials = Counter(
            PREFIX + "duplicate_dials",
            "Tunnels that reached a proxy-server replica another tunnel already holds (closed at once)",
            registry=r,
        )
        self.open_streams = Gauge(
            PREFIX + "open_streams", "Proxied streams being dialled or relayed", registry=r
        )
        self.http2_limits = Counter(
            PREFIX + "http2_limit_trips",
            "HTTP/2 abuse limits that tripped on tunnels, by limit (concurrent_streams, reset_budget, "
            "reply_backlog, frame_size, frame_timeout, stream_stall)",
            ["limit"],
            registry=r,
        )
        r.register(_ByteCounters(byte_totals))

    def watch_replicas(
        self, tunnels: Callable[[], Sequence[ReplicaTunnel]], expected: Callable[[], int]
    ) -> None:
        """Export the replicas held (``Agent.replica_tunnels``) and looked for."""
        self.registry.register(_ReplicaFamilies(tunnels, expected))

    def count_limit(self, limit: str) -> None:
        self.http2_limits.labels(limit).inc()

    def watch_renewer(self, renewer: RenewerCounters) -> None:
        """Export a :class:`~clusterproxy_protocol.renewer.CertRenewer`'s counters."""
        self.registry.register(RenewerCollector(renewer, PREFIX))
