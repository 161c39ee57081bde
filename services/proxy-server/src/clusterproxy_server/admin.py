"""The proxy-server's admin port: health, readiness, metrics, and what it holds."""

from __future__ import annotations

from collections.abc import Callable

from clusterproxy_protocol.admin import Reply
from clusterproxy_server.metrics import ServerMetrics
from clusterproxy_server.registry import Registry


def admin_routes(
    registry: Registry, metrics: ServerMetrics, is_ready: Callable[[], bool]
) -> dict[str, Callable[[], Reply]]:
    def ready() -> Reply:
        return Reply.text("ready") if is_ready() else Reply.text("not ready: starting or draining", 503)

    def clusters() -> Reply:
        return Reply.json(
            {name: {"agents": len(registry.tunnels(name))} for name in sorted(registry.known_clusters)}
        )

    return {
        "/healthz": lambda: Reply.text("ok"),
        "/readyz": ready,
        "/metrics": lambda: Reply.metrics(metrics.registry),
        "/api/v1/agents": lambda: Reply.json([t.describe() for t in registry.tunnels()]),
        "/api/v1/clusters": clusters,
    }
