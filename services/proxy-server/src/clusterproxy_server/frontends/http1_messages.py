"""HTTP/1.1 CONNECT request head parsing and responses for the client port's HTTP/1.1 frontend."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

import h11
import trio

from clusterproxy_protocol import request_heads
from clusterproxy_protocol.errors import STATUS_PHRASES, clean_reason
from clusterproxy_protocol.wire import REASON_HEADER, format_authority

MAX_REQUEST_HEAD = 16 << 10


class BadRequest(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


HOP_BY_HOP = {"connection", "proxy-connection", "proxy-authorization", "keep-alive", "te", "upgrade"}


@dataclass(frozen=True)
class ConnectRequest:
    method: str
    target: str
    headers: dict[str, str]
    early_data: bytes  # bytes the client sent after the request head (its first tunnel bytes)
    header_list: list[tuple[str, str]]


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


async def read_request(stream: trio.abc.ReceiveStream, received: bytes = b"") -> ConnectRequest | None:
    """Read one request head; None when the client closed before sending anything. ``received``:
    bytes of the request already read from ``stream``."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD)
    if received:  # h11 takes b"" for end of input
        conn.receive_data(received)
    while True:
        try:
            event = request_heads.next_event(conn)
        except h11.RemoteProtocolError as exc:
            raise BadRequest(exc.error_status_hint, request_heads.malformed_reason(exc)) from None
        if event is h11.NEED_DATA:
            data = await stream.receive_some(MAX_REQUEST_HEAD)
            if not data and conn.their_state is h11.IDLE and not conn.trailing_data[0]:
                return None
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Request):
            header_list = [(n.decode("ascii"), v.decode("latin-1")) for n, v in event.headers.raw_items()]
            return ConnectRequest(
                event.method.decode("ascii"),
                event.target.decode("ascii", "replace"),
                {name.lower(): value for name, value in header_list},
                bytes(conn.trailing_data[0]),
                header_list,
            )
        raise BadRequest(400, "expected an HTTP request")


def established() -> bytes:
    return b"HTTP/1.1 200 Connection Established\r\n\r\n"


def error_response(status: int, reason: str) -> bytes:
    reason = clean_reason(reason)
    body = (reason + "\n").encode()
    phrase = STATUS_PHRASES.get(status, "Error")
    head = (
        f"HTTP/1.1 {status} {phrase}\r\n{REASON_HEADER}: {reason}\r\ncontent-type: text/plain\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body
