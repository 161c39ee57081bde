"""HTTP/1.1 request heads and answers for the client port's HTTP/1.1 frontend: the sans-IO part is
:mod:`clusterproxy_protocol.proxy_requests` (shared with ``cluster-proxy proxy``), re-exported here."""

from __future__ import annotations

import trio

from clusterproxy_protocol import (
    HOP_BY_HOP,
    MAX_REQUEST_HEAD,
    BadRequest,
    ConnectRequest,
    RequestHeadReader,
    error_response,
    established,
    forward_form,
)

__all__ = [
    "HOP_BY_HOP",
    "MAX_REQUEST_HEAD",
    "BadRequest",
    "ConnectRequest",
    "error_response",
    "established",
    "forward_form",
    "read_request",
]


async def read_request(stream: trio.abc.ReceiveStream, received: bytes = b"") -> ConnectRequest | None:
    """Read one request head; None when the client closed before sending anything. ``received``:
    bytes of the request already read from ``stream``."""
    reader = RequestHeadReader()
    request = reader.feed(received) if received else None
    while request is None:
        data = await stream.receive_some(MAX_REQUEST_HEAD)
        if not data and not reader.received:
            return None
        request = reader.feed(data)
    return request
