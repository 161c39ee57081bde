"""The manager's Prometheus metrics (``/metrics`` on its admin port), names prefixed
``cluster_proxy_addon_manager_``."""

from __future__ import annotations

import prometheus_client as prom

__all__ = ["ManagerMetrics"]

PREFIX = "cluster_proxy_addon_manager_"


class ManagerMetrics:
    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry()
        self.reconciles = prom.Counter(
            PREFIX + "reconciles_total",
            "Reconciles by kind of key (hub, cma, cluster) and result (ok, retry, error)",
            ["kind", "result"],
            registry=self.registry,
        )
        self.reconcile_seconds = prom.Histogram(
            PREFIX + "reconcile_seconds",
            "Time of one reconcile",
            ["kind"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.writes = prom.Counter(
            PREFIX + "writes_total",
            "Writes to the API server by kind and verb (apply, status, delete)",
            ["kind", "verb"],
            registry=self.registry,
        )
        self.tokens_minted = prom.Counter(
            PREFIX + "tokens_minted_total",
            "Bootstrap tokens minted, by party (proxy-server, agent, hub-client)",
            ["party"],
            registry=self.registry,
        )
        self.queue_depth = prom.Gauge(
            PREFIX + "queue_depth", "Keys waiting in the work queue", registry=self.registry
        )
        self.clusters_available = prom.Gauge(
            PREFIX + "clusters_available",
            "Clusters with an agent tunnel at the last poll of the proxy-servers",
            registry=self.registry,
        )
        self.availability_polls = prom.Counter(
            PREFIX + "availability_polls_total",
            "Polls of the proxy-servers' admin API by result (ok: at least one answered, failed)",
            ["result"],
            registry=self.registry,
        )
