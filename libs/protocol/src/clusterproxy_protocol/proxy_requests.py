"""HTTP/1.1 forward-proxy requests, sans-IO: the request head a proxy reads (``CONNECT host:port``, or
a plain-HTTP request in absolute form), the cluster a proxy URL's user name names, and the answers.

One implementation for both HTTP/1.1 proxies of the project: the proxy-server's client port
(``clusterproxy_server.frontends.http1``) and the local proxy of ``cluster-proxy proxy``. Heads are
read by h11 through :func:`clusterproxy_protocol.request_heads.next_event`, so both refuse the same
malformed requests with the same words.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11

from clusterproxy_protocol import request_heads
from clusterproxy_protocol.errors import STATUS_PHRASES, MalformedTarget, clean_reason
from clusterproxy_protocol.wire import REASON_HEADER, format_authority

__all__ = [
    "HOP_BY_HOP",
    "MAX_REQUEST_HEAD",
    "BadRequest",
    "ConnectRequest",
    "RequestHeadReader",
    "cluster_from_proxy_authorization",
    "error_response",
    "established",
    "forward_form",
]

MAX_REQUEST_HEAD = 16 << 10
HOP_BY_HOP = {"connection", "proxy-connection", "proxy-authorization", "keep-alive", "te", "upgrade"}


class BadRequest(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class ConnectRequest:
    method: str
    target: str
    headers: dict[str, str]  # lower-case names; the last value of a repeated header
    early_data: bytes  # bytes the client sent after the request head (its first tunnel bytes)
    header_list: list[tuple[str, str]]


class RequestHeadReader:
    """Reads one request head from the bytes given to :meth:`feed` as they arrive."""

    def __init__(self) -> None:
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD)
        self.received = 0

    def feed(self, data: bytes | bytearray) -> ConnectRequest | None:
        """The request once its head is whole, else None (more bytes needed). ``b""`` is the end of
        the client's input. Raises :class:`BadRequest` (status and reason) for a malformed head, one
        over :data:`MAX_REQUEST_HEAD` (431), or an end of input within the head."""
        if not data and not self.received:
            raise BadRequest(400, "the client closed without sending a request")
        self.received += len(data)
        self._conn.receive_data(data)  # type: ignore[arg-type]  # h11 takes b"" for the end of input; declared bytes, it appends to a bytearray: any bytes-like does
        try:
            event = request_heads.next_event(self._conn)
        except h11.RemoteProtocolError as exc:
            raise BadRequest(exc.error_status_hint, request_heads.malformed_reason(exc)) from None
        if event is h11.NEED_DATA:  # never after the end of input: h11 raises for a cut head
            return None
        if isinstance(event, h11.Request):
            header_list = [(n.decode("ascii"), v.decode("latin-1")) for n, v in event.headers.raw_items()]
            return ConnectRequest(
                event.method.decode("ascii"),
                event.target.decode("ascii", "replace"),
                {name.lower(): value for name, value in header_list},
                bytes(self._conn.trailing_data[0]),
                header_list,
            )
        raise BadRequest(400, "expected an HTTP request")


def cluster_from_proxy_authorization(value: str | None) -> str | None:
    """The user name of ``Proxy-Authorization: Basic ...`` (the proxy URL's ``NAME@``), if any.
    Raises :class:`MalformedTarget` when the credentials are not base64."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise MalformedTarget("Proxy-Authorization is not valid base64 of 'cluster:'") from None
    return decoded.partition(":")[0] or None


def forward_form(request: ConnectRequest) -> tuple[str, bytes]:
    """For a plain-HTTP proxy request (``GET http://host/path``): the target authority and the request
    head rewritten to origin form, one request per connection (``connection: close``)."""
    url = urlsplit(request.target)
    if url.scheme != "http" or not url.hostname:
        raise BadRequest(400, f"cannot proxy {request.target!r}: use CONNECT, or an absolute http:// URL")
    authority = format_authority(url.hostname, url.port or 80)
    path = url.path or "/"
    if url.query:
        path += "?" + url.query
    lines = [f"{request.method} {path} HTTP/1.1"]
    lines += [f"{name}: {value}" for name, value in request.header_list if name.lower() not in HOP_BY_HOP]
    lines.append("connection: close")
    return authority, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def established() -> bytes:
    return b"HTTP/1.1 200 Connection Established\r\n\r\n"


def error_response(status: int, reason: str, headers: Sequence[tuple[str, str]] = ()) -> bytes:
    """An error answer that closes the connection: the reason in :data:`REASON_HEADER` and the body."""
    reason = clean_reason(reason)
    body = (reason + "\n").encode()
    phrase = STATUS_PHRASES.get(status, "Error")
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
    head = (
        f"HTTP/1.1 {status} {phrase}\r\n{REASON_HEADER}: {reason}\r\n{extra}content-type: text/plain\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body
