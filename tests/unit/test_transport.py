"""receive_batch: several TLS records per call, same bytes, same EOF."""

from __future__ import annotations

import hashlib
import os

import trio
import trio.testing

from clusterproxy_protocol import tls
from clusterproxy_protocol.transport import receive_batch
from tests.support.pki import PkiFiles


async def tls_pair(pki: PkiFiles) -> tuple[trio.SSLStream, trio.SSLStream]:
    a, b = trio.socket.socketpair()
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


async def test_batches_hold_several_records_and_bytes_are_intact(pki: PkiFiles) -> None:
    server, client = await tls_pair(pki)
    payload = os.urandom(4 << 20)
    sizes: list[int] = []
    received = hashlib.sha256()

    async def send() -> None:
        await server.send_all(payload)
        await server.aclose()  # close_notify

    async def receive() -> None:
        while data := await receive_batch(client, 256 << 10):
            sizes.append(len(data))
            received.update(data)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        nursery.start_soon(receive)
    assert received.digest() == hashlib.sha256(payload).digest()
    assert max(sizes) > 16 << 10  # more than one TLS record in a call
    assert all(size <= 256 << 10 for size in sizes)


async def test_plain_streams_are_read_as_they_are(nursery: trio.Nursery) -> None:
    left, right = trio.testing.memory_stream_pair()
    await left.send_all(b"abc")
    assert await receive_batch(right, 2) == b"ab"
    assert await receive_batch(right, 10) == b"c"
