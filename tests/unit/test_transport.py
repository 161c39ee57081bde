"""receive_batch: several TLS records per call, same bytes, same EOF; read_socket_in: TLS refilled
256 KiB at a time, on that connection only, and by relay() on a TLS end once it moves bulk."""

from __future__ import annotations

import gc
import hashlib
import os
import weakref

import pytest
import trio
import trio.testing

from clusterproxy_protocol import tls, workarounds
from clusterproxy_protocol.relay import relay
from clusterproxy_protocol.transport import receive_batch
from clusterproxy_protocol.workarounds import BULK_SOCKET_READ, read_socket_in
from tests.support.pki import PkiFiles
from tests.support.tls_streams import tls_pair


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


WAITING = 200 << 10  # in the socket at once: more than trio's 64 KiB refill, less than ours


@pytest.mark.parametrize("bulk", [False, True])
async def test_one_refill_takes_what_waits_in_the_socket_after_read_socket_in(
    pki: PkiFiles, bulk: bool
) -> None:
    server, client = await tls_pair(pki)
    payload = os.urandom(WAITING)
    await server.send_all(payload)  # whole in the socket buffer before the client reads
    if bulk:
        assert read_socket_in(client) is True
    first = await receive_batch(client, 1 << 20)
    # trio refills 64 KiB of TLS records (less plaintext); after read_socket_in one refill is 256 KiB
    assert len(first) == WAITING if bulk else len(first) < 64 << 10
    rest = b""
    while len(first) + len(rest) < WAITING:
        rest += await receive_batch(client, 1 << 20)
    assert hashlib.sha256(first + rest).digest() == hashlib.sha256(payload).digest()
    await trio.aclose_forcefully(server)
    await trio.aclose_forcefully(client)


async def test_read_socket_in_changes_only_tls_on_a_socket(pki: PkiFiles) -> None:
    left, _right = trio.testing.memory_stream_pair()
    over_memory = trio.SSLStream(
        left, tls.client_context(pki.client.cert, pki.client.key, pki.ca, alpn=["h2"]), server_hostname="x"
    )
    a, b = trio.socket.socketpair()
    plain = trio.SocketStream(a)
    assert read_socket_in(over_memory) is False
    assert read_socket_in(plain) is False
    assert "receive_some" not in vars(plain)
    server, client = await tls_pair(pki)
    assert read_socket_in(client) is True
    assert "receive_some" in vars(client.transport_stream)
    assert "receive_some" not in vars(server.transport_stream)  # the other connection: trio's own
    for stream in (plain, server, client):
        await trio.aclose_forcefully(stream)
    b.close()


class SizesSeen(trio.abc.HalfCloseableStream):
    """A relay's target that records the size of each write and hands nothing back."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.received = hashlib.sha256()
        self.ended = trio.Event()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.sizes.append(len(data))
        self.received.update(data)

    async def wait_send_all_might_not_block(self) -> None:
        pass

    async def send_eof(self) -> None:
        self.ended.set()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await self.ended.wait()
        return b""

    async def aclose(self) -> None:
        self.ended.set()


async def test_a_relay_reads_its_tls_end_in_bulk(pki: PkiFiles) -> None:
    server, client = await tls_pair(pki)
    target = SizesSeen()
    payload = os.urandom(4 * BULK_SOCKET_READ)

    async def send() -> None:
        await server.send_all(payload)
        await server.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        await relay(client=client, target=target)
    assert target.received.digest() == hashlib.sha256(payload).digest()
    assert max(target.sizes) > 64 << 10  # trio's refill alone never yields more than 64 KiB at once
    assert "receive_some" in vars(client.transport_stream)


async def test_a_relay_of_small_messages_keeps_trios_reads(pki: PkiFiles) -> None:
    server, client = await tls_pair(pki)
    target = SizesSeen()
    messages = [os.urandom(1024) for _ in range(20)]

    async def send() -> None:
        for message in messages:
            await server.send_all(message)
            await trio.testing.wait_all_tasks_blocked()  # the relay took it before the next one
        await server.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        await relay(client=client, target=target)
    assert target.received.digest() == hashlib.sha256(b"".join(messages)).digest()
    assert "receive_some" not in vars(client.transport_stream)  # no big read, no 256 KiB buffer


async def test_a_stream_read_in_bulk_goes_with_its_last_reference(pki: PkiFiles) -> None:
    workarounds.apply()  # as the services run: trio's handshake holds no stream after it ran
    server, client = await tls_pair(pki)
    assert read_socket_in(client) is True
    await server.send_all(b"pong")
    assert await client.receive_some(4) == b"pong"
    gone = weakref.ref(client.transport_stream)
    gc.disable()  # freed by its last reference going, not by a collection
    try:
        for stream in (client, server):
            await stream.aclose()
        del client, server, stream
        assert gone() is None
    finally:
        gc.enable()
