"""The agent WebSocket port (``--agent-websocket-listen``): agent tunnels carried in WebSockets, for
hubs that agents reach only through an L7 ingress (which terminates the outer TLS and forwards the
upgrade here as plain HTTP).

The upgrade must ask for :data:`~clusterproxy_protocol.wire.WEBSOCKET_PATH` and the subprotocol
:data:`~clusterproxy_protocol.wire.WEBSOCKET_SUBPROTOCOL`; then the WebSocket's byte stream goes to the
agent port's own path (:meth:`.agent_port.AgentPort.serve_transport`): the mutual TLS handshake with
an agent certificate, registration, the tunnel. Nothing is trusted from the HTTP layer: the agent's
identity is its certificate, checked inside; ``X-Forwarded-For`` only names the peer in the logs.
"""

from __future__ import annotations

import h11
import structlog
import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, wrap_server_stream

from clusterproxy_protocol import (
    MAX_MESSAGE,
    READ_SIZE,
    WEBSOCKET_PATH,
    WEBSOCKET_SUBPROTOCOL,
    Prefixed,
    WebSocketStream,
    format_address,
    request_heads,
)
from clusterproxy_server.agent_port import AgentPort
from clusterproxy_server.frontends.connection import send_and_close
from clusterproxy_server.frontends.http1_messages import MAX_REQUEST_HEAD, error_response
from clusterproxy_server.metrics import ServerMetrics

PORT = "agent-websocket"  # the label of this port's refusals and limits
MAX_FORWARDED_FOR = 200  # characters of X-Forwarded-For kept for the logs


class AgentWebSocketPort:
    def __init__(
        self,
        agent_port: AgentPort,
        *,
        metrics: ServerMetrics,
        log: structlog.typing.FilteringBoundLogger,
        handshake_timeout: float,
    ) -> None:
        self.agent_port = agent_port
        self.metrics = metrics
        self.log = log
        self.handshake_timeout = handshake_timeout

    async def serve(self, tcp: trio.SocketStream) -> None:
        peer = format_address(tcp.socket.getpeername())
        async with trio.open_nursery() as connection_tasks:  # the WebSocket's reader
            upgraded = await self._upgrade(connection_tasks, tcp, peer)
            if upgraded is not None:
                stream, peer = upgraded
                try:
                    await self.agent_port.serve_transport(stream, peer, PORT)
                finally:
                    await trio.aclose_forcefully(stream)
            connection_tasks.cancel_scope.cancel()

    async def _upgrade(
        self, tasks: trio.Nursery, tcp: trio.SocketStream, peer: str
    ) -> tuple[WebSocketStream, str] | None:
        """The WebSocket's byte stream and the peer's name (with its X-Forwarded-For), or None (refused:
        counted, logged, answered with a status and the reason)."""
        try:
            with trio.fail_after(self.handshake_timeout):
                try:
                    head = await _checked_head(tcp)
                except h11.RemoteProtocolError as exc:
                    reason = request_heads.malformed_reason(exc)
                    self._refused(peer, "malformed request", reason)
                    await send_and_close(tcp, error_response(exc.error_status_hint, reason))
                    return None
                request = await wrap_server_stream(
                    tasks, Prefixed(head, tcp), max_message_size=MAX_MESSAGE, receive_buffer_size=READ_SIZE
                )
                forwarded = _forwarded_for(request)
                if forwarded:
                    peer = f"{peer} for {forwarded}"
                refusal = _refusal(request)
                if refusal is not None:
                    status, reason, label = refusal
                    self._refused(peer, label, reason)
                    await request.reject(status, body=f"{reason}\n".encode())
                    return None
                connection = await request.accept(subprotocol=WEBSOCKET_SUBPROTOCOL)
        except trio.TooSlowError:
            self._refused(peer, "handshake timeout", "no complete WebSocket upgrade request in time")
            return None
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._refused(peer, "upgrade failed", f"connection lost during the upgrade: {type(exc).__name__}")
            return None
        return WebSocketStream(connection), peer

    def _refused(self, peer: str, label: str, reason: str) -> None:
        self.metrics.rejected.labels(PORT, label).inc()
        self.log.info("websocket_upgrade_refused", port=PORT, peer=peer, error=reason)


async def _checked_head(tcp: trio.SocketStream) -> bytes:
    """The bytes read until the upgrade request's head was whole (or the peer closed), once h11 and
    :mod:`~clusterproxy_protocol.request_heads` accept it; their RemoteProtocolError when they do not.
    wsproto parses the head again from these bytes, but answers what it cannot parse with a bare 400
    and no reason: a malformed head is refused here, with its reason, before wsproto sees it."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD)
    received = bytearray()
    while request_heads.next_event(conn) is h11.NEED_DATA:
        data = await tcp.receive_some(READ_SIZE)
        received += data
        conn.receive_data(data)  # b"" (the peer closed): h11 ends in ConnectionClosed or an error
    return bytes(received)


def _refusal(request: WebSocketRequest) -> tuple[int, str, str] | None:
    """(status, reason, metric label) of an upgrade this port refuses, or None."""
    path = request.path.split("?", 1)[0]
    if path != WEBSOCKET_PATH:
        return 404, f"no tunnel at {path[:100]!r}: agents connect to {WEBSOCKET_PATH}", "websocket path"
    if WEBSOCKET_SUBPROTOCOL not in request.proposed_subprotocols:
        return (
            400,
            f"the agent tunnel needs the WebSocket subprotocol {WEBSOCKET_SUBPROTOCOL!r}",
            "websocket subprotocol",
        )
    return None


def _forwarded_for(request: WebSocketRequest) -> str:
    for name, value in request.headers:
        if name.lower() == b"x-forwarded-for":
            return value.decode("ascii", "replace")[:MAX_FORWARDED_FOR]
    return ""
