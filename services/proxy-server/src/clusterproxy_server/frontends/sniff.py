"""Tell HTTP/2 from HTTP/1.1 on the client port by the client's first bytes, not by ALPN.

Go's HTTP transport (kubectl, client-go, any ``http.Transport`` with an ``https://`` proxy URL) offers
ALPN ``h2`` to the proxy and then speaks HTTP/1.1 ``CONNECT`` on the connection. Trusting ALPN would
make us send HTTP/2 SETTINGS to a client reading an HTTP/1.1 status line. Every HTTP/2 client starts
with the fixed connection preface and no HTTP/1.1 request can start with it, so the first bytes decide;
the server says nothing before they arrive.

Bytes that are neither (no preface, and a first line that is no HTTP/1.x request line) are
``"unknown"``: we cannot tell which protocol the client speaks, so nothing can be answered in it, and
the connection is closed without a reply (what RFC 9113 §3.4 asks of an invalid preface).
"""

from __future__ import annotations

import re
from typing import Literal

import trio

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FIRST_READ = 16 << 10

# RFC 9112 §3: method SP request-target SP HTTP-version, after optional empty lines. The start is
# lenient (a prefix that may still become a request line); the whole line decides.
_REQUEST_LINE = re.compile(rb"(?:\r?\n)*[!#$%&'*+.^_`|~0-9A-Za-z-]+ [\x21-\x7e]+ HTTP/1\.\d\r?\n")
_REQUEST_LINE_START = re.compile(
    rb"(?:\r?\n)*\r?[!#$%&'*+.^_`|~0-9A-Za-z-]*( [\x21-\x7e]*( H?T?T?P?/?\d?\.?\d?\r?)?)?"
)

ClientProtocol = Literal["h2", "http1", "unknown"]


def _http1_verdict(received: bytes) -> ClientProtocol | None:
    """``"http1"`` once the first line is a request line, ``"unknown"`` once it cannot become one,
    None while it still may."""
    if _REQUEST_LINE.match(received):
        return "http1"
    start = _REQUEST_LINE_START.match(received)
    if start is not None and start.end() == len(received):
        return None
    return "unknown"


async def client_protocol(stream: trio.abc.ReceiveStream) -> tuple[ClientProtocol, bytes]:
    """The protocol the client speaks and the bytes read to find out (to be processed first).
    Returns ``("http1", received)`` when the client closes before its first line is complete."""
    received = b""
    while True:
        data = await stream.receive_some(FIRST_READ)
        if not data:
            return "http1", received
        received += data
        if not H2_PREFACE.startswith(received[: len(H2_PREFACE)]):
            verdict = _http1_verdict(received)
            if verdict is not None:
                return verdict, received
            if len(received) >= FIRST_READ:
                return "unknown", received
            continue
        if len(received) >= len(H2_PREFACE):
            return "h2", received
