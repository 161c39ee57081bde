"""The one small HTTP/1.1 server of the admin-style ports (the services' admin ports, the cert-signer's
API): trio + h11, one request per connection, everything bounded.

- plain TCP, or TLS from a callable read at each handshake (a reloading context), or both on one
  port (``tls_optional``: a connection whose first byte opens a TLS handshake record gets TLS, any
  other is plain HTTP); the client certificate, when one was presented and verified, is handed to
  the handler;
- request head <= ``max_head`` bytes (431/400 from h11), body <= ``max_body`` (413 before reading a
  declared oversized body), handshake and request deadlines, a cap on concurrent connections;
- a handler that raises costs that request a 500 (details only in the log), never the server;
- an answer sent whole ends cleanly (TLS ``close_notify``, then FIN); one cut short is a reset.
"""

from __future__ import annotations

import http
import json
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11
import structlog
import trio
from cryptography import x509

from clusterproxy_protocol import request_heads
from clusterproxy_protocol.closing import close_cleanly
from clusterproxy_protocol.logs import get_logger

__all__ = ["HttpLimits", "Request", "Response", "serve_http", "serve_stream"]


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query
    headers: dict[str, str]  # lower-case names
    body: bytes
    peer_ip: str
    peer_cert: x509.Certificate | None


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    content_type: str = "application/json"

    @classmethod
    def json(cls, value: Any, status: int = 200, headers: tuple[tuple[str, str], ...] = ()) -> Response:
        return cls(status, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode(), headers)

    @classmethod
    def text(cls, text: str, status: int = 200) -> Response:
        return cls(status, (text + "\n").encode(), content_type="text/plain; charset=utf-8")


@dataclass(frozen=True)
class HttpLimits:
    max_body: int = 64 << 10
    max_head: int = 16 << 10
    handshake_timeout: float = 10.0
    request_timeout: float = 10.0
    max_connections: int = 256
    linger_bytes: int = 1 << 20  # read and drop this much of an oversized body so the client sees 413
    linger_timeout: float = 2.0


Handler = Callable[[Request], Awaitable[Response]]
# How a server words the errors it answers itself: (status, error code, reason) -> response.
ErrorResponse = Callable[[int, str, str], Response]


def text_error(status: int, error: str, reason: str) -> Response:
    return Response.text(reason, status)


class _Oversized(Exception):
    pass


async def serve_http(
    listeners: list[trio.SocketListener],
    handler: Handler,
    limits: HttpLimits = HttpLimits(),
    *,
    tls: Callable[[], ssl.SSLContext] | None = None,
    tls_optional: bool = False,
    error_response: ErrorResponse = text_error,
    log: structlog.typing.FilteringBoundLogger | None = None,
    log_requests: bool = False,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    log = log or get_logger("http")
    slots = trio.CapacityLimiter(limits.max_connections)

    async def handle(tcp: trio.SocketStream) -> None:
        try:
            slots.acquire_nowait()
        except trio.WouldBlock:
            log.warning("connection_refused", reason="too many connections", limit=limits.max_connections)
            await trio.aclose_forcefully(tcp)
            return
        try:
            server = _Connection(handler, limits, error_response, log, log_requests)
            context = tls() if tls is not None else None
            if context is not None and tls_optional and not await _opens_tls(tcp, limits.handshake_timeout):
                context = None
            await server.serve(tcp, context)
        except Exception:
            log.exception("connection_handler_failed")
            await trio.aclose_forcefully(tcp)
        finally:
            slots.release()

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started()


async def serve_stream(
    stream: trio.abc.Stream,
    handler: Handler,
    limits: HttpLimits = HttpLimits(),
    *,
    peer: str = "",
    error_response: ErrorResponse = text_error,
    log: structlog.typing.FilteringBoundLogger | None = None,
    log_requests: bool = False,
) -> None:
    """One request on a stream the caller accepted (a tunnel stream: no socket, no TLS of ours), served
    as :func:`serve_http` serves a connection: the same limits, deadlines, error answers and clean
    close. ``peer`` names the other end in :attr:`Request.peer_ip` and the log."""
    connection = _Connection(handler, limits, error_response, log or get_logger("http"), log_requests)
    await connection.answer(stream, peer, None)


TLS_HANDSHAKE_RECORD = 0x16  # the first byte of every TLS ClientHello; never the first of an HTTP method


async def _opens_tls(tcp: trio.SocketStream, timeout: float) -> bool:
    """Whether the client's first byte starts a TLS handshake, read without taking it off the socket
    (``MSG_PEEK``), so that TLS or h11 then reads the connection from its first byte. A client that
    sends nothing within ``timeout`` is taken as plain: the request deadline then ends it."""
    with trio.move_on_after(timeout):
        try:
            first = await tcp.socket.recv(1, socket.MSG_PEEK)
        except OSError:
            return False
        return first[:1] == bytes([TLS_HANDSHAKE_RECORD])
    return False


@dataclass
class _Connection:
    handler: Handler
    limits: HttpLimits
    error_response: ErrorResponse
    log: structlog.typing.FilteringBoundLogger
    log_requests: bool

    async def serve(self, tcp: trio.SocketStream, context: ssl.SSLContext | None) -> None:
        peer_ip = str(tcp.socket.getpeername()[0])
        stream: trio.abc.Stream = tcp
        peer_cert = None
        if context is not None:
            stream = trio.SSLStream(tcp, context, server_side=True, https_compatible=True)
            try:
                with trio.fail_after(self.limits.handshake_timeout):
                    await stream.do_handshake()
            except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                cause = exc.__cause__ or exc
                self.log.info("tls_handshake_failed", peer=peer_ip, error=str(cause) or type(cause).__name__)
                await trio.aclose_forcefully(tcp)
                return
            der = stream.getpeercert(binary_form=True)
            peer_cert = x509.load_der_x509_certificate(der) if der else None
        await self.answer(stream, peer_ip, peer_cert)

    async def answer(self, stream: trio.abc.Stream, peer_ip: str, peer_cert: x509.Certificate | None) -> None:
        """Read one request from ``stream``, answer it, close the stream (cleanly when the answer went
        out whole)."""
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_head)
        started = time.monotonic()
        response: Response | None = None
        method = path = ""
        with trio.move_on_after(self.limits.request_timeout) as deadline:
            try:
                head, body = await self._read_request(stream, conn)
            except h11.RemoteProtocolError as exc:
                response = self.error_response(
                    exc.error_status_hint, "bad_request", request_heads.malformed_reason(exc)
                )
            except _Oversized:
                response = self.error_response(
                    413, "request_too_large", f"request body larger than {self.limits.max_body} bytes"
                )
            except (trio.BrokenResourceError, trio.ClosedResourceError, EOFError):
                await trio.aclose_forcefully(stream)
                return
            else:
                method = head.method.decode("ascii", "replace")
                path = head.target.decode("ascii", "replace").split("?", 1)[0]
                headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in head.headers}
                try:
                    response = await self.handler(Request(method, path, headers, body, peer_ip, peer_cert))
                except Exception as exc:  # a bug or a failing dependency: answer 500, keep serving
                    self.log.exception("request_failed", method=method, path=path, error=str(exc))
                    response = self.error_response(
                        500, "internal_error", "the server failed to handle the request; see its log"
                    )
        if deadline.cancelled_caught and response is None:
            response = self.error_response(408, "request_timeout", "request not received in time")
        assert response is not None
        sent = False
        with trio.move_on_after(self.limits.request_timeout):
            sent = await _send(stream, conn, response, head_only=method == "HEAD")
        if conn.their_state not in (h11.DONE, h11.CLOSED, h11.ERROR):
            with trio.move_on_after(self.limits.linger_timeout):
                await _linger(stream, self.limits.linger_bytes)
        if self.log_requests:
            self.log.info(
                "request",
                method=method,
                path=path,
                status=response.status,
                peer=peer_ip,
                client=None if peer_cert is None else peer_cert.subject.rfc4514_string(),
                duration_ms=round((time.monotonic() - started) * 1000, 1),
            )
        if sent:
            await close_cleanly(stream)
        else:
            await trio.aclose_forcefully(stream)

    async def _read_request(self, stream: trio.abc.Stream, conn: h11.Connection) -> tuple[h11.Request, bytes]:
        head: h11.Request | None = None
        body = bytearray()
        while True:
            event = request_heads.next_event(conn)
            if event is h11.NEED_DATA:
                data = await stream.receive_some(16 << 10)
                if not data:
                    raise EOFError
                conn.receive_data(data)  # type: ignore[arg-type]  # h11 declares bytes; it appends to a bytearray, so any bytes-like read does
                continue
            if isinstance(event, h11.Request):
                head = event
                for name, value in event.headers:
                    if name == b"content-length" and int(value) > self.limits.max_body:
                        raise _Oversized
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > self.limits.max_body:
                    raise _Oversized
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                return head, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                raise EOFError


async def _send(
    stream: trio.abc.Stream, conn: h11.Connection, response: Response, *, head_only: bool
) -> bool:
    """Whether the whole answer went out."""
    headers = [
        ("content-type", response.content_type),
        ("content-length", str(len(response.body))),
        ("connection", "close"),
        ("cache-control", "no-store"),
        *response.headers,
    ]
    try:
        data = conn.send(
            h11.Response(status_code=response.status, headers=headers, reason=_phrase(response.status))
        )
        if not head_only:
            data += conn.send(h11.Data(data=response.body)) or b""
        data += conn.send(h11.EndOfMessage()) or b""
    except h11.LocalProtocolError:
        # e.g. the request was so broken that h11 cannot answer within the protocol: answer raw
        data = b"HTTP/1.1 %d %s\r\nconnection: close\r\ncontent-length: %d\r\ncontent-type: %s\r\n\r\n%s" % (
            response.status,
            _phrase(response.status),
            len(response.body),
            response.content_type.encode(),
            response.body,
        )
    try:
        await stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False
    return True


def _phrase(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


async def _linger(stream: trio.abc.Stream, budget: int) -> None:
    """Read and drop what the client is still sending (up to ``budget``), so that closing does not
    reset the connection before the client has read our answer."""
    try:
        while budget > 0:
            data = await stream.receive_some(64 << 10)
            if not data:
                return
            budget -= len(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
