"""The WebSocket transport: a tunnel's byte stream carried in WebSocket binary messages
(trio-websocket), for hubs reachable only through an L7 ingress or a proxy that passes no raw TLS.

The agent dials ``wss://INGRESS/v1/tunnel`` (TLS with the ingress, whose certificate it verifies), asks
for the subprotocol :data:`~clusterproxy_protocol.wire.WEBSOCKET_SUBPROTOCOL`, and then runs on the
WebSocket exactly what it runs on TCP: the mutual TLS handshake with the proxy-server's agent port (its
own certificate, ALPN ``h2``) and the HTTP/2 tunnel. The ingress terminates only the outer TLS and sees
the inner one as opaque binary messages; the agent's identity is checked by the proxy-server as on the
raw port, and a man in the middle at the ingress gets ciphertext. See docs/protocol.md.

:class:`WebSocketStream` turns a :class:`trio_websocket.WebSocketConnection` into a
``trio.abc.Stream``: message boundaries mean nothing (``send_all`` may be split into several messages,
``receive_some`` returns a message's bytes in as many pieces as asked). A close with code 1000 is the
end of the stream; anything else (1006: the TCP connection dropped, 1009: a message too large, a text
message) is a failure, so a cut never looks like an end (the inner TLS would tell anyway: its
``close_notify`` is missing).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, WebSocketConnection, wrap_client_stream

from clusterproxy_protocol.errors import describe_exception
from clusterproxy_protocol.wire import WEBSOCKET_SUBPROTOCOL

__all__ = [
    "MAX_MESSAGE",
    "READ_SIZE",
    "WebSocketFailed",
    "WebSocketStream",
    "host_header",
    "open_websocket",
]

SEND_CHUNK = 256 << 10  # bytes per message: large enough that framing costs little, well under MAX
MAX_MESSAGE = 1 << 20  # the largest message accepted (a peer sending more is cut off with 1009)
READ_SIZE = 256 << 10  # bytes read from the transport at a time (trio-websocket's default is 4 KiB)
CLOSE_GRACE = 2.0  # seconds our close frame and the peer's answer may take
NORMAL_CLOSURE = 1000
UNSUPPORTED_DATA = 1003


class WebSocketFailed(OSError):
    """The WebSocket could not be opened: refused by the HTTP server (its status and body in the
    message), the connection lost during the handshake, or no agreement on the subprotocol."""


class WebSocketStream(trio.abc.Stream):
    """A byte stream over one WebSocket connection (binary messages only)."""

    def __init__(self, connection: WebSocketConnection) -> None:
        self.connection = connection
        self._pending = b""
        self._at_end = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        try:
            for start in range(0, len(view), SEND_CHUNK):
                await self.connection.send_message(bytes(view[start : start + SEND_CHUNK]))
        except ConnectionClosed as exc:
            raise trio.BrokenResourceError(f"WebSocket closed: {_reason(exc)}") from exc
        if not view:
            await trio.lowlevel.checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if not self._pending:
            if self._at_end:
                await trio.lowlevel.checkpoint()
                return b""
            try:
                message = await self.connection.get_message()
            except ConnectionClosed as exc:
                if exc.reason is not None and exc.reason.code == NORMAL_CLOSURE:
                    self._at_end = True
                    return b""
                raise trio.BrokenResourceError(f"WebSocket closed: {_reason(exc)}") from exc
            if isinstance(message, str):
                with trio.move_on_after(CLOSE_GRACE):
                    await self.connection.aclose(UNSUPPORTED_DATA, "text message on a binary tunnel")
                raise trio.BrokenResourceError("the peer sent a text message; the tunnel is binary")
            self._pending = message
        size = len(self._pending) if max_bytes is None else max_bytes
        data, self._pending = self._pending[:size], self._pending[size:]
        return data

    async def aclose(self) -> None:
        """Close frame out, the peer's in (bounded), then the connection under it (closed by
        trio-websocket even when the wait is cut short)."""
        with trio.move_on_after(CLOSE_GRACE):
            await self.connection.aclose()


def host_header(host: str, port: int, secure: bool) -> str:
    """The ``Host`` of a request to ``host:port`` (an IPv6 address in brackets), the port left out
    when it is the scheme's default."""
    bracketed = f"[{host}]" if ":" in host else host
    return bracketed if port == (443 if secure else 80) else f"{bracketed}:{port}"


def _reason(exc: ConnectionClosed) -> str:
    reason = exc.reason
    if reason is None:
        return "no close frame"
    text = f"code {reason.code} ({reason.name})"
    return f"{text}: {reason.reason}" if reason.reason else text


class _ReaderTasks:
    """What trio-websocket starts its reader task in: ``nursery``, with a refusal of the upgrade (which
    trio-websocket raises from the reader, to cancel its nursery) caught and ``handshake`` cancelled
    instead, so that one refused dial costs the dial, not the nursery's other tasks."""

    def __init__(self, nursery: trio.Nursery, handshake: trio.CancelScope) -> None:
        self._nursery = nursery
        self._handshake = handshake
        self.rejection: ConnectionRejected | None = None

    def start_soon(self, reader: Callable[[], Awaitable[None]]) -> None:
        self._nursery.start_soon(self._guarded, reader)

    async def _guarded(self, reader: Callable[[], Awaitable[None]]) -> None:
        try:
            await reader()
        except ConnectionRejected as exc:
            self.rejection = exc
            self._handshake.cancel()


async def open_websocket(
    nursery: trio.Nursery,
    stream: trio.abc.Stream,
    host: str,
    resource: str,
    *,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> WebSocketStream:
    """The WebSocket handshake on ``stream`` (TCP, TLS with an ingress, a forward proxy's tunnel);
    ``host`` is the ``Host`` header, ``resource`` the path. ``nursery`` runs the connection's reader
    task: it must live as long as the stream. :class:`WebSocketFailed` when the server refuses."""
    where = f"{host}{resource}"
    with trio.CancelScope() as handshake:
        tasks = _ReaderTasks(nursery, handshake)
        try:
            connection = await wrap_client_stream(
                tasks,  # type: ignore[arg-type]  # all it does with a nursery is start_soon
                stream,  # type: ignore[arg-type]  # any trio stream works; the hint is narrower than the code
                host,
                resource,
                subprotocols=[WEBSOCKET_SUBPROTOCOL],
                extra_headers=extra_headers,
                max_message_size=MAX_MESSAGE,
                receive_buffer_size=READ_SIZE,
            )
        except ConnectionClosed as exc:
            raise WebSocketFailed(
                f"connection closed during the WebSocket upgrade to {where}: {_reason(exc)}"
            ) from None
        except (trio.BrokenResourceError, OSError) as exc:
            raise WebSocketFailed(f"WebSocket upgrade to {where} failed: {describe_exception(exc)}") from exc
    if tasks.rejection is not None:
        await trio.aclose_forcefully(stream)
        body = (tasks.rejection.body or b"").decode("utf-8", "replace").strip()[:300]
        raise WebSocketFailed(
            f"WebSocket upgrade to {where} refused with HTTP {tasks.rejection.status_code}"
            + (f": {body}" if body else "")
        )
    if connection.subprotocol != WEBSOCKET_SUBPROTOCOL:
        await WebSocketStream(connection).aclose()
        raise WebSocketFailed(
            f"{where} accepted the WebSocket without the {WEBSOCKET_SUBPROTOCOL!r} subprotocol "
            f"(it chose {connection.subprotocol!r}): not a proxy-server's tunnel endpoint"
        )
    return WebSocketStream(connection)
