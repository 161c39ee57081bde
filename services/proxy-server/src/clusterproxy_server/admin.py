"""The proxy-server's admin port: health, readiness, metrics, and what it holds."""

from __future__ import annotations

from collections.abc import Callable

from clusterproxy_protocol.admin import Response, metrics_response
from clusterproxy_server.metrics import ServerMetrics
from clusterproxy_server.registry import Registry


def admin_routes(
    registry: Registry, metrics: ServerMetrics, is_ready: Callable[[], bool]
) -> dict[str, Callable[[], Response]]:
    def ready() -> Response:
        return Response.text("ready") if is_ready() else Response.text("not ready: starting or draining", 503)

    def clusters() -> Response:
        return Response.json(
            {name: {"agents": len(registry.tunnels(name))} for name in sorted(registry.known_clusters)}
        )

    return {
        "/healthz": lambda: Response.text("ok"),
        "/readyz": ready,
        "/metrics": lambda: metrics_response(metrics.registry),
        "/api/v1/agents": lambda: Response.json(registry.describe()),
        "/api/v1/clusters": clusters,
    }
