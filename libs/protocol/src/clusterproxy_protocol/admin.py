"""The services' admin ports: GET routes (/healthz, /readyz, /metrics, JSON APIs) over the shared
HTTP/1.1 server (:mod:`clusterproxy_protocol.httpserver`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import prometheus_client
import trio

from clusterproxy_protocol.httpserver import HttpLimits, Request, Response, serve_http
from clusterproxy_protocol.logs import get_logger

__all__ = ["Response", "Route", "metrics_response", "serve_admin"]

Route = Callable[[], Awaitable[Response] | Response]


def metrics_response(registry: prometheus_client.CollectorRegistry) -> Response:
    return Response(
        200, prometheus_client.generate_latest(registry), content_type=prometheus_client.CONTENT_TYPE_LATEST
    )


async def serve_admin(
    listeners: list[trio.SocketListener],
    routes: dict[str, Route],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve GET (and HEAD) requests for ``routes`` (exact paths) on ``listeners``."""

    async def handle(request: Request) -> Response:
        route = routes.get(request.path)
        if route is None:
            return Response.text(f"not found: {request.path} (try: {', '.join(sorted(routes))})", 404)
        if request.method not in ("GET", "HEAD"):
            return Response.text(f"method {request.method} not allowed; use GET", 405)
        result = route()
        return await result if isinstance(result, Awaitable) else result

    await serve_http(
        listeners, handle, HttpLimits(max_body=0), log=get_logger("admin"), task_status=task_status
    )
