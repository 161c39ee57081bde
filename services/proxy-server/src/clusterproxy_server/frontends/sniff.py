"""Tell HTTP/2 from HTTP/1.1 on the client port by the client's first bytes, not by ALPN.

Go's HTTP transport (kubectl, client-go, any ``http.Transport`` with an ``https://`` proxy URL) offers
ALPN ``h2`` to the proxy and then speaks HTTP/1.1 ``CONNECT`` on the connection. Trusting ALPN would
make us send HTTP/2 SETTINGS to a client reading an HTTP/1.1 status line. Every HTTP/2 client starts
with the fixed connection preface and no HTTP/1.1 request can start with it, so the first bytes decide;
the server says nothing before they arrive.

Bytes that are neither (no preface, and a first line that is no HTTP/1.x request line) are
``"unknown"``: we cannot tell which protocol the client speaks, so nothing can be answered in it, and
the connection is closed without a reply (what RFC 9113 §3.4 asks of an invalid preface).

This module only tells who is speaking, never whether the request is valid: a first line that starts
with a method and a space and ends in an ``HTTP/1.`` version is an HTTP/1.x client, whatever lies
between (a NUL or a control byte in the target, a space, a bare CR) and whatever its version's minor
part is (``HTTP/1.x``). Such a request is malformed, and the HTTP/1.1 frontend's parser (h11) answers
it ``400`` with the reason, in the protocol the client speaks; so does a request line still growing
when :data:`FIRST_READ` bytes have come (h11's head limit answers it). A first byte that no method
starts with (a TLS record, binary garbage) or a last word that is no ``HTTP/1.`` version (h2spec's
``INVALID CONNECTION PREFACE``, a botched preface's ``PRI * HTTP/2.0``, HTTP/0.9's bare target) is
no HTTP/1.x client: closed, nothing sent.
"""

from __future__ import annotations

import re
from typing import Literal

import trio

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FIRST_READ = 16 << 10

# The shape of RFC 9112 §3's method SP request-target SP HTTP-version, after optional empty lines:
# a method token, a space, anything but a line end, a space and a last word starting "HTTP/1." (the
# target's and the version's validity are h11's to judge, with a reason). The start is lenient (a
# prefix that may still become a request line); the whole line decides.
_REQUEST_LINE = re.compile(rb"(?:\r?\n)*[!#$%&'*+.^_`|~0-9A-Za-z-]+ [^\n]* HTTP/1\.[^ \n]*\n")
_REQUEST_LINE_START = re.compile(rb"(?:\r?\n)*\r?[!#$%&'*+.^_`|~0-9A-Za-z-]*(?: [^\n]*)?")

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
            if len(received) >= FIRST_READ:  # a request line too long: h11's limit answers it
                return "http1", received
            continue
        if len(received) >= len(H2_PREFACE):
            return "h2", received
