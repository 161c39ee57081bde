"""HTTP/1.1 CONNECT request head parsing and responses for the client port's HTTP/1.1 frontend."""

from __future__ import annotations

from dataclasses import dataclass

import h11
import trio

from clusterproxy_protocol.errors import REASON_HEADER, STATUS_PHRASES, clean_reason

MAX_REQUEST_HEAD = 16 << 10


class BadRequest(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class ConnectRequest:
    method: str
    target: str
    headers: dict[str, str]
    early_data: bytes  # bytes the client sent after the request head (its first tunnel bytes)


async def read_request(stream: trio.abc.ReceiveStream) -> ConnectRequest | None:
    """Read one request head; None when the client closed before sending anything."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD)
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise BadRequest(exc.error_status_hint, f"malformed HTTP request: {exc}") from None
        if event is h11.NEED_DATA:
            data = await stream.receive_some(MAX_REQUEST_HEAD)
            if not data and conn.their_state is h11.IDLE and not conn.trailing_data[0]:
                return None
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Request):
            headers: dict[str, str] = {}
            for name, value in event.headers:
                headers[name.decode("ascii").lower()] = value.decode("latin-1")
            return ConnectRequest(
                event.method.decode("ascii"),
                event.target.decode("ascii", "replace"),
                headers,
                bytes(conn.trailing_data[0]),
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
