"""The one HTTP/1.1 client of the project: one request per stream, on h11, over any trio stream.

The stream is the caller's: a TCP socket, TLS over it, a tunnel stream to a cluster, TLS inside a
tunnel stream. Every request says ``Connection: close`` (nothing here keeps a connection alive), the
response is read whole (Content-Length, chunked or close-delimited, as h11 frames it) into memory up to
``max_body`` bytes, and every way the answer can fail is an :class:`HTTPClientError`:

- :class:`ResponseTooLarge`: the body passed ``max_body`` (unless ``truncate``: then the rest is read
  and dropped, for a caller that wants only the start of the body);
- :class:`NoResponse`: the server closed the connection before a response head;
- :class:`MalformedResponse`: not HTTP/1.1, or a body cut short by the close;
- :class:`HTTPStatusError`, from :meth:`Response.raise_for_status`: the status in words and the first
  line of the body, ``403 Forbidden: not allowed``.

Transport failures stay what the stream raises (OSError, ``trio.BrokenResourceError``,
``trio.ClosedResourceError``); the caller sets the deadline (:func:`get` takes one for its own dial).
"""

from __future__ import annotations

import http
import json
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import h11
import trio

from .wire import format_authority

__all__ = [
    "MAX_BODY",
    "HTTPClientError",
    "HTTPStatusError",
    "MalformedResponse",
    "NoResponse",
    "Response",
    "ResponseTooLarge",
    "connect",
    "first_line",
    "get",
    "read_response",
    "request",
    "status_words",
]

MAX_BODY = 4 << 20
RECEIVE_SIZE = 64 << 10
MAX_ERROR_LINE = 200  # characters of the body an error message quotes
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})  # a body, even an empty one, is declared for these


class HTTPClientError(Exception):
    """The answer cannot be used: too large, missing, malformed, or an error status."""


class ResponseTooLarge(HTTPClientError):
    def __init__(self, limit: int, status: int) -> None:
        super().__init__(f"response body larger than {limit} bytes")
        self.limit = limit
        self.status = status  # of the answer whose body it was


class NoResponse(HTTPClientError):
    """The server closed the connection before it answered."""


class MalformedResponse(HTTPClientError):
    """The server broke HTTP/1.1, or closed the connection in the middle of its answer."""


def status_words(status: int, reason: str = "") -> str:
    """``403 Forbidden``: the standard phrase, else the server's own, else the number alone."""
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = reason
    return f"{status} {phrase}".strip()


def first_line(body: bytes, limit: int = MAX_ERROR_LINE) -> str:
    """The first non-blank line of ``body``, whitespace squeezed, cut at ``limit`` characters."""
    for line in body.decode("utf-8", "replace").splitlines():
        words = " ".join(line.split())
        if words:
            return words[:limit] + ("..." if len(words) > limit else "")
    return ""


class HTTPStatusError(HTTPClientError):
    """An error status: the message is ``<status> <phrase>: <first line of the body>``."""

    def __init__(self, response: Response) -> None:
        line = first_line(response.body)
        words = status_words(response.status, response.reason)
        super().__init__(f"{words}: {line}" if line else words)
        self.response = response
        self.status = response.status


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    body: bytes
    reason: str = ""

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name.lower(), default)

    def raise_for_status(self) -> Response:
        """Itself, or :class:`HTTPStatusError` for a status of 400 or more."""
        if self.status >= 400:
            raise HTTPStatusError(self)
        return self

    def json(self) -> Any:
        """The body as JSON (ValueError when it is not)."""
        return json.loads(self.body)

    @property
    def words(self) -> str:
        """The status in words, ``404 Not Found``."""
        return status_words(self.status, self.reason)


def _head(method: str, host: str, body: bytes, headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    head = [("host", host), ("connection", "close"), *headers]
    named = {name.lower() for name, _ in headers}
    if (body or method in BODY_METHODS) and "content-length" not in named:
        head.append(("content-length", str(len(body))))
    return head


async def request(
    stream: trio.abc.Stream,
    method: str,
    target: str,
    host: str,
    body: bytes = b"",
    *,
    headers: Sequence[tuple[str, str]] = (),
    max_body: int = MAX_BODY,
    truncate: bool = False,
) -> Response:
    """Send one request on ``stream`` and read its whole response (the stream stays open: the
    caller's). ``host`` is the Host header; ``headers`` come after it and ``Connection: close``."""
    conn = h11.Connection(h11.CLIENT)
    data = conn.send(h11.Request(method=method, target=target, headers=_head(method, host, body, headers)))
    if body:
        data += conn.send(h11.Data(data=body))
    data += conn.send(h11.EndOfMessage())
    await stream.send_all(data)
    return await _receive(stream, conn, max_body=max_body, truncate=truncate)


async def read_response(
    stream: trio.abc.Stream, *, method: str = "GET", max_body: int = MAX_BODY, truncate: bool = False
) -> Response:
    """The response to a request the caller wrote on ``stream`` itself (raw bytes: a test's malformed
    request, say); ``method`` is the one it used (a HEAD's answer has no body)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method=method, target="/", headers=[("host", "-")]))  # h11's state only
    conn.send(h11.EndOfMessage())
    return await _receive(stream, conn, max_body=max_body, truncate=truncate)


async def _receive(
    stream: trio.abc.Stream, conn: h11.Connection, *, max_body: int, truncate: bool
) -> Response:
    head: h11.Response | None = None
    received = bytearray()
    read = 0  # bytes of the answer so far: a close after none is "no answer"
    closed = False
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise _malformed(exc, head, read, closed) from None
        if event is h11.NEED_DATA:
            data = await stream.receive_some(RECEIVE_SIZE)
            read += len(data)
            closed = not data
            conn.receive_data(data)  # type: ignore[arg-type]  # h11 declares bytes; it appends to a bytearray, so any bytes-like read does
            continue
        if isinstance(event, h11.Response):
            head = event
        elif isinstance(event, h11.Data):
            room = max_body - len(received)
            if len(event.data) > room:
                if not truncate:
                    raise ResponseTooLarge(max_body, head.status_code if head else 0)
                received += event.data[: max(room, 0)]
            else:
                received += event.data
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            break
        # h11.InformationalResponse (100 Continue and the like): the real answer follows
    if head is None:
        raise NoResponse("the connection closed before a response")
    headers = {bytes(k).decode("latin-1"): bytes(v).decode("latin-1") for k, v in head.headers}
    return Response(head.status_code, headers, bytes(received), head.reason.decode("latin-1", "replace"))


def _malformed(
    exc: h11.RemoteProtocolError, head: h11.Response | None, read: int, closed: bool
) -> HTTPClientError:
    if head is None and closed:
        where = "before a response" if not read else "in the middle of the response head"
        return NoResponse(f"the connection closed {where}")
    if head is None:
        return MalformedResponse(f"not an HTTP/1.1 answer: {exc}")
    return MalformedResponse(f"the answer ({status_words(head.status_code)}) was cut short: {exc}")


async def connect(
    host: str, port: int, *, tls: ssl.SSLContext | None = None, server_name: str | None = None
) -> trio.abc.Stream:
    """A TCP connection to ``host:port``; with ``tls``, TLS over it checking ``server_name`` (default
    ``host``). The handshake happens with the first request."""
    stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
    if tls is not None:
        stream = trio.SSLStream(stream, tls, server_hostname=server_name or host)
    return stream


async def get(
    host: str,
    port: int,
    path: str,
    *,
    timeout: float = 5.0,
    tls: ssl.SSLContext | None = None,
    server_name: str | None = None,
    headers: Sequence[tuple[str, str]] = (),
    max_body: int = MAX_BODY,
) -> Response:
    """``GET http://host:port/path`` over a new connection (``https://`` with ``tls``), all of it
    within ``timeout`` (``trio.TooSlowError``)."""
    with trio.fail_after(timeout):
        stream = await connect(host, port, tls=tls, server_name=server_name)
        async with stream:
            return await request(
                stream, "GET", path, format_authority(host, port), headers=headers, max_body=max_body
            )
