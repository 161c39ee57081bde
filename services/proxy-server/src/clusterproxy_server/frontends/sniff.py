"""Tell HTTP/2 from HTTP/1.1 on the client port by the client's first bytes, not by ALPN.

Go's HTTP transport (kubectl, client-go, any ``http.Transport`` with an ``https://`` proxy URL) offers
ALPN ``h2`` to the proxy and then speaks HTTP/1.1 ``CONNECT`` on the connection. Trusting ALPN would
make us send HTTP/2 SETTINGS to a client reading an HTTP/1.1 status line. Every HTTP/2 client starts
with the fixed connection preface and no HTTP/1.1 request can start with it, so the first bytes decide;
the server says nothing before they arrive.
"""

from __future__ import annotations

from typing import Literal

import trio

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FIRST_READ = 16 << 10

ClientProtocol = Literal["h2", "http1"]


async def client_protocol(stream: trio.abc.ReceiveStream) -> tuple[ClientProtocol, bytes]:
    """The protocol the client speaks and the bytes read to find out (to be processed first).
    Returns ``("http1", b"")`` when the client closes before sending anything."""
    received = b""
    while True:
        data = await stream.receive_some(FIRST_READ)
        if not data:
            return "http1", received
        received += data
        if not H2_PREFACE.startswith(received[: len(H2_PREFACE)]):
            return "http1", received
        if len(received) >= len(H2_PREFACE):
            return "h2", received
