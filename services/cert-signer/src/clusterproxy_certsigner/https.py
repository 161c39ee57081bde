"""The signing API's HTTPS server: the protocol library's HTTP/1.1 server with TLS, JSON errors
(``{"error": CODE, "reason": TEXT}``) and every request logged; a :class:`SignerError` raised by a
handler becomes its status and JSON body."""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from clusterproxy_protocol import HttpLimits, Request, Response, get_logger, serve_http

from .errors import SignerError

__all__ = ["HttpLimits", "Request", "Response", "serve_https"]

Handler = Callable[[Request], Awaitable[Response]]


def json_error(status: int, error: str, reason: str) -> Response:
    return Response.json({"error": error, "reason": reason}, status)


def signer_error(exc: SignerError) -> Response:
    headers: tuple[tuple[str, str], ...] = ()
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        headers = (("retry-after", str(max(1, int(retry_after + 0.999)))),)
    return Response.json(exc.body(), exc.status, headers)


async def serve_https(
    listeners: list[trio.SocketListener],
    context: Callable[[], ssl.SSLContext],
    handler: Handler,
    limits: HttpLimits = HttpLimits(),
    *,
    log: Any = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    async def handle(request: Request) -> Response:
        try:
            return await handler(request)
        except SignerError as exc:
            return signer_error(exc)

    await serve_http(
        listeners,
        handle,
        limits,
        tls=context,
        error_response=json_error,
        log=log or get_logger("cert-signer.https"),
        log_requests=True,
        task_status=task_status,
    )
