"""The proxy-server's admin port: health, readiness, metrics, and what it holds."""

from __future__ import annotations

from collections.abc import Callable

from clusterproxy_protocol.admin import Response, metrics_response
from clusterproxy_server.metrics import ServerMetrics
from clusterproxy_server.registry import Registry


def admin_routes(
    registry: Registry,
    metrics: ServerMetrics,
    not_ready: Callable[[], str | None],
    server_id: str,
) -> dict[str, Callable[[], Response]]:
    """``not_ready()``: why this replica takes no new connections (starting, draining), None when it does.
    Every agent entry names this replica (``server_id``): behind a load balancer, the answer says which
    replica the agents listed are connected to."""

    def ready() -> Response:
        reason = not_ready()
        return Response.text("ready") if reason is None else Response.text(f"not ready: {reason}", 503)

    def clusters() -> Response:
        return Response.json(
            {name: {"agents": len(registry.tunnels(name))} for name in sorted(registry.known_clusters)}
        )

    return {
        "/healthz": lambda: Response.text("ok"),
        "/readyz": ready,
        "/metrics": lambda: metrics_response(metrics.registry),
        "/api/v1/agents": lambda: Response.json([{**a, "server_id": server_id} for a in registry.describe()]),
        "/api/v1/clusters": clusters,
    }
