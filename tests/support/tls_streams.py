"""A TLS connection with both ends in this process, handshake done."""

from __future__ import annotations

import socket

import trio

from clusterproxy_protocol import tls
from tests.support.pki import PkiFiles


async def tls_pair(
    pki: PkiFiles,
    ends: tuple[trio.abc.Stream, trio.abc.Stream] | None = None,
    *,
    https_compatible: bool = False,
) -> tuple[trio.SSLStream, trio.SSLStream]:
    """(server end, client end), mTLS with the test PKI, ALPN h2, over ``ends`` (server's, client's;
    default: a local socket pair with room for what a test sends before the other end reads).
    ``https_compatible`` is the server end's (the proxy-server's ends are)."""
    if ends is None:
        a, b = trio.socket.socketpair()
        for end in (a, b):
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        ends = trio.SocketStream(a), trio.SocketStream(b)
    server = trio.SSLStream(
        ends[0],
        tls.server_context(pki.server.cert, pki.server.key, pki.ca, alpn=["h2"]),
        server_side=True,
        https_compatible=https_compatible,
    )
    client = trio.SSLStream(
        ends[1],
        tls.client_context(pki.client.cert, pki.client.key, pki.ca, alpn=["h2"]),
        server_hostname="localhost",
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.do_handshake)
        nursery.start_soon(client.do_handshake)
    return server, client
