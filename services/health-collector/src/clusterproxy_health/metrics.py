"""Prometheus metrics of one collector (a registry per instance: no module-level state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .state import ClusterRecord

PROBE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class CollectorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.probe_seconds = Histogram(
            "cluster_proxy_health_probe_seconds",
            "Latency of successful probes through the tunnel, by cluster",
            ["cluster"],
            buckets=PROBE_BUCKETS,
            registry=r,
        )
        self.probe_failures = Counter(
            "cluster_proxy_health_probe_failures_total",
            "Failed probes by cluster and reason (refused_503, timeout, tls, http_500, proxy_server, ...)",
            ["cluster", "reason"],
            registry=r,
        )
        self.agents = Gauge(
            "cluster_proxy_health_agents_connected",
            "Distinct agents of the cluster holding a tunnel to some proxy-server replica",
            ["cluster"],
            registry=r,
        )
        self.tunnels = Gauge(
            "cluster_proxy_health_agent_tunnels",
            "Agent tunnels of the cluster over every replica that answered",
            ["cluster"],
            registry=r,
        )
        self.healthy = Gauge(
            "cluster_proxy_health_cluster_healthy",
            "1 when the cluster is installed, available and its last probe succeeded, else 0",
            ["cluster"],
            registry=r,
        )
        self.server_up = Gauge(
            "cluster_proxy_health_proxy_server_up",
            "1 when the proxy-server replica's admin port answered the last round, else 0",
            ["url"],
            registry=r,
        )
        self.clusters = Gauge("cluster_proxy_health_clusters", "Clusters known to the collector", registry=r)
        self.round_seconds = Gauge(
            "cluster_proxy_health_round_seconds",
            "Duration of the last round (servers, addons, probes)",
            registry=r,
        )
        self.rounds = Counter("cluster_proxy_health_rounds_total", "Rounds completed", registry=r)
        self._server_urls: set[str] = set()
        self._failure_labels: set[tuple[str, str]] = set()

    def cluster(self, record: ClusterRecord) -> None:
        name = record.name
        self.agents.labels(name).set(len({t.agent_id for t in record.tunnels}))
        self.tunnels.labels(name).set(len(record.tunnels))
        self.healthy.labels(name).set(1 if record.healthy else 0)

    def probe(self, name: str, latency: float | None, reason: str) -> None:
        if latency is not None:
            self.probe_seconds.labels(name).observe(latency)
        else:
            labels = (name, reason or "unknown")
            self._failure_labels.add(labels)
            self.probe_failures.labels(*labels).inc()

    def forget(self, name: str) -> None:
        """Drop a forgotten cluster's series (a fleet that churns must not grow the registry forever)."""
        for family in (self.agents, self.tunnels, self.healthy, self.probe_seconds):
            try:
                family.remove(name)
            except KeyError:
                pass
        for labels in [k for k in self._failure_labels if k[0] == name]:
            self._failure_labels.discard(labels)
            self.probe_failures.remove(*labels)

    def servers(self, up: dict[str, bool]) -> None:
        for url in self._server_urls - set(up):
            self.server_up.remove(url)
        for url, reachable in up.items():
            self.server_up.labels(url).set(1 if reachable else 0)
        self._server_urls = set(up)
