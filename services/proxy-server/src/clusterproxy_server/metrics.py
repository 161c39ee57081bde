"""Prometheus metrics of one proxy-server (a registry per instance: no module-level state)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from clusterproxy_protocol import RenewerCollector, RenewerCounters


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
        self.http2_limits = Counter(
            "cluster_proxy_server_http2_limit_trips_total",
            "HTTP/2 abuse limits that tripped, by port (client, agent) and limit (concurrent_streams, "
            "reset_budget, reply_backlog, frame_size, frame_timeout, stream_stall, idle_timeout)",
            ["port", "limit"],
            registry=r,
        )
        self.pending_dials = Gauge(
            "cluster_proxy_server_pending_dials", "Dials sent toward agents and not answered yet", registry=r
        )
        self.pending_dial_refusals = Counter(
            "cluster_proxy_server_pending_dial_refusals_total",
            "Requests refused with 429 at a pending-dial bound, by bound (connection, client)",
            ["scope"],
            registry=r,
        )
        self.agent_dial_failures = Counter(
            "cluster_proxy_server_agent_dial_failures_total",
            "Dials that failed at the agent itself (kind: status, an answer not marked as the target's; "
            "timeout, no answer within the agent answer timeout)",
            ["cluster", "agent_id", "kind"],
            registry=r,
        )
        self.dial_retries = Counter(
            "cluster_proxy_server_dial_retries_total",
            "Dials sent to another tunnel after an agent-level failure",
            ["cluster"],
            registry=r,
        )
        self.agent_ejections = Counter(
            "cluster_proxy_server_agent_ejections_total",
            "Tunnels taken out of routing for a cool-down (outlier ejection)",
            ["cluster", "agent_id"],
            registry=r,
        )
        self.agent_replacements = Counter(
            "cluster_proxy_server_agent_replacements_total",
            "Tunnels replaced by a new tunnel of the same agent identity (the old one did not answer a PING)",
            ["cluster"],
            registry=r,
        )

        self.agent_duplicate_dials = Counter(
            "cluster_proxy_server_agent_duplicate_dials_total",
            "Agent tunnels closed at registration because the agent already holds one to this replica "
            "(agents looking for a missing replica behind a load balancer)",
            ["cluster"],
            registry=r,
        )

        self.client_refusals = Counter(
            "cluster_proxy_server_client_refusals_total",
            "Client connections and streams refused at a per-identity bound (connections, streams, rate, "
            "buffer) or at the process's buffer budget (server_buffer), by client common name",
            ["client", "bound"],
            registry=r,
        )
        self.buffer_bytes = Gauge(
            "cluster_proxy_server_buffer_bytes",
            "Bytes of stream windows granted for client streams (the most the server may be made to hold "
            "for data not read yet), scope process",
            ["scope"],
            registry=r,
        )

    def watch_client_buffers(self, read: Callable[[], dict[str, int]]) -> None:
        """Export ``read()`` (client common name -> bytes of stream windows held) at each scrape: only
        the identities connected now, so a client that left leaves no series behind."""
        self.registry.register(_ClientBuffers(read))

    def count_limit(self, port: str) -> Callable[[str], None]:
        """Count an HTTP/2 abuse limit that tripped on a connection of ``port`` (client or agent)."""
        return lambda limit: self.http2_limits.labels(port, limit).inc()

    def watch_renewer(self, renewer: RenewerCounters) -> None:
        """Export a :class:`~clusterproxy_protocol.renewer.CertRenewer`'s counters."""
        self.registry.register(RenewerCollector(renewer, "cluster_proxy_server_"))


class _ClientBuffers(Collector):
    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        self._read = read

    def collect(self) -> list[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "cluster_proxy_server_client_buffer_bytes",
            "Bytes of stream windows granted for one client identity's streams, by client common name",
            labels=["client"],
        )
        for client, used in sorted(self._read().items()):
            family.add_metric([client], used)
        return [family]
