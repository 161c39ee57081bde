"""HTTP/1.1 on trio streams with h11, for both sides of the gateway: the server side that the hub's
aggregator talks to (keep-alive, streamed answers) and the client side toward a managed cluster's
kube-apiserver (one request per tunnel stream)."""

from __future__ import annotations

import json
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11
import trio

__all__ = [
    "HTTPConnection",
    "IncomingRequest",
    "ProtocolFailure",
    "cancel_when_closed",
    "header_values",
    "incoming",
    "serve_requests",
    "serve_tls",
]

RECEIVE_SIZE = 64 << 10
IDLE_TIMEOUT = 300.0  # a kept-alive connection with no request (Go's clients close theirs at 90 s)
BODY_TIMEOUT = 60.0
HANDSHAKE_TIMEOUT = 10.0
MAX_CONNECTIONS = 512  # per listening port: TLS connections served at once


async def serve_tls(
    listeners: list[trio.SocketListener],
    context: Callable[[], ssl.SSLContext],
    serve: Callable[[trio.SSLStream[Any]], Awaitable[None]],
) -> None:
    """Accept TLS connections (``context()`` read for each, so a renewed certificate is used at once),
    at most :data:`MAX_CONNECTIONS` at a time; a handshake that does not finish within
    :data:`HANDSHAKE_TIMEOUT` or fails closes its connection; ``serve`` gets the rest, and the
    connection is closed when it returns."""
    limit = trio.CapacityLimiter(MAX_CONNECTIONS)

    async def handle(tcp: trio.SocketStream) -> None:
        async with limit:
            stream = trio.SSLStream(tcp, context(), server_side=True)
            try:
                try:
                    with trio.fail_after(HANDSHAKE_TIMEOUT):
                        await stream.do_handshake()
                except (trio.TooSlowError, trio.BrokenResourceError, ssl.SSLError):
                    return  # no handshake: nothing was asked, nobody to answer
                await serve(stream)
            finally:
                await trio.aclose_forcefully(stream)

    await trio.serve_listeners(handle, listeners)


class ProtocolFailure(Exception):
    """The peer broke HTTP/1.1 (or went away mid-message)."""


def header_values(headers: list[tuple[bytes, bytes]], name: str) -> list[str]:
    """Every value of header ``name`` (any case), in order; comma-separated values are not split."""
    wanted = name.lower().encode()
    return [value.decode("latin-1") for key, value in headers if key.lower() == wanted]


@dataclass
class IncomingRequest:
    method: str
    target: str  # path and query, as sent
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    path: str = ""
    query: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def header(self, name: str, default: str = "") -> str:
        values = header_values(self.headers, name)
        return values[0] if values else default


class HTTPConnection:
    """One h11 connection over a trio stream; ``role`` is ``h11.SERVER`` or ``h11.CLIENT``."""

    def __init__(self, stream: trio.abc.Stream, role: Any, *, max_head: int = 64 << 10) -> None:
        self.stream = stream
        self.conn = h11.Connection(role, max_incomplete_event_size=max_head)

    async def next_event(self) -> Any:
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise ProtocolFailure(str(exc)) from None
            if event is not h11.NEED_DATA:
                return event
            try:
                data = await self.stream.receive_some(RECEIVE_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ProtocolFailure(f"connection lost: {exc}") from None
            try:
                self.conn.receive_data(data)  # type: ignore[arg-type]  # h11 declares bytes; it appends to a bytearray, so any bytes-like read does
            except h11.RemoteProtocolError as exc:
                raise ProtocolFailure(str(exc)) from None

    async def send(self, event: Any) -> None:
        data = self.conn.send(event)
        if data:
            await self.stream.send_all(data)

    async def read_body(self, limit: int) -> bytes:
        """The rest of the current message's body (ProtocolFailure above ``limit`` bytes)."""
        body = bytearray()
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > limit:
                    raise ProtocolFailure(f"request body larger than {limit} bytes")
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                raise ProtocolFailure("connection closed in the middle of a message")

    async def respond(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        head = [("Content-Type", content_type), ("Content-Length", str(len(body))), *(headers or [])]
        await self.send(h11.Response(status_code=status, headers=head))
        await self.send(h11.Data(data=body))
        await self.send(h11.EndOfMessage())

    async def respond_json(self, status: int, value: Any) -> None:
        await self.respond(status, (json.dumps(value) + "\n").encode())


async def cancel_when_closed(http: HTTPConnection, scope: trio.CancelScope) -> None:
    """During a streamed answer the client sends nothing; the end of its stream means it went away."""
    try:
        data = await http.stream.receive_some(RECEIVE_SIZE)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        data = b""
    if not data:
        scope.cancel()
        return
    # a pipelined request: h11 keeps it for after this answer
    http.conn.receive_data(data)  # type: ignore[arg-type]  # h11 declares bytes; it appends to a bytearray, so any bytes-like read does
    await trio.sleep_forever()


def incoming(event: h11.Request) -> IncomingRequest:
    target = event.target.decode("latin-1")
    parts = urlsplit(target)
    return IncomingRequest(
        method=event.method.decode("ascii"),
        target=target,
        headers=list(event.headers),
        path=parts.path,
        query=parts.query,
    )


async def serve_requests(
    http: HTTPConnection,
    handle: Callable[[HTTPConnection, IncomingRequest], Awaitable[None]],
    *,
    max_body: int,
    too_large: Callable[[str], Any],
) -> None:
    """The keep-alive loop of one server connection: each request head, its body (whole, at most
    ``max_body`` bytes; ``too_large(reason)`` is the JSON answer beyond it), then ``handle``, until the
    client closes, stays idle for IDLE_TIMEOUT, or an answer leaves the connection unusable (an
    upgrade, an answer cut short). Transport errors end the loop quietly; the caller closes the stream."""
    try:
        while True:
            event: Any = None
            with trio.move_on_after(IDLE_TIMEOUT):
                event = await http.next_event()
            if not isinstance(event, h11.Request):  # closed, or idle too long
                break
            request = incoming(event)
            if http.conn.they_are_waiting_for_100_continue:
                await http.send(h11.InformationalResponse(status_code=100, headers=[]))
            with trio.fail_after(BODY_TIMEOUT):
                request.body = await http.read_body(max_body)
            await handle(http, request)
            if http.conn.our_state is not h11.DONE or http.conn.their_state is not h11.DONE:
                break
            http.conn.start_next_cycle()
    except ProtocolFailure as exc:
        if http.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and "larger than" in str(exc):
            with trio.move_on_after(2):
                await http.respond_json(413, too_large(str(exc)))
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
        pass
