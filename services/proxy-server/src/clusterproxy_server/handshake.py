"""The TLS handshake both the agent port and the client port start with."""

from __future__ import annotations

import ssl

import structlog
import trio

from clusterproxy_protocol.wire import format_address
from clusterproxy_server.metrics import ServerMetrics


async def accept_tls(
    tcp: trio.SocketStream,
    context: ssl.SSLContext,
    port: str,
    timeout: float,
    metrics: ServerMetrics,
    log: structlog.stdlib.BoundLogger,
) -> trio.SSLStream | None:
    """The mutually authenticated stream, or None (counted, logged, connection closed) on failure."""
    peer = format_address(tcp.socket.getpeername())
    stream = trio.SSLStream(tcp, context, server_side=True, https_compatible=True)
    try:
        with trio.fail_after(timeout):
            await stream.do_handshake()
        return stream
    except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        cause = exc.__cause__ or exc
        reason = "handshake timeout" if isinstance(exc, trio.TooSlowError) else type(cause).__name__
        metrics.rejected.labels(port, reason).inc()
        log.info("tls_handshake_failed", port=port, peer=peer, error=str(cause) or reason)
        await trio.aclose_forcefully(tcp)
        return None
