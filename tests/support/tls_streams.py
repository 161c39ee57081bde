"""A TLS connection over a local socket pair, both ends in this process, handshake done."""

from __future__ import annotations

import socket

import trio

from clusterproxy_protocol import tls
from tests.support.pki import PkiFiles


async def tls_pair(pki: PkiFiles) -> tuple[trio.SSLStream, trio.SSLStream]:
    """(server end, client end), mTLS with the test PKI, ALPN h2."""
    a, b = trio.socket.socketpair()
    for end in (a, b):  # room for what a test sends before the other end reads
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    server = trio.SSLStream(
        trio.SocketStream(a),
        tls.server_context(pki.server.cert, pki.server.key, pki.ca, alpn=["h2"]),
        server_side=True,
    )
    client = trio.SSLStream(
        trio.SocketStream(b),
        tls.client_context(pki.client.cert, pki.client.key, pki.ca, alpn=["h2"]),
        server_hostname="localhost",
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.do_handshake)
        nursery.start_soon(client.do_handshake)
    return server, client
