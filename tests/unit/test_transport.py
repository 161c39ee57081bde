"""receive_batch and send_all: several TLS records per call, same bytes, same EOF and errors as trio,
small messages without passing through the scheduler, fair to other tasks; read_in_bulk: a socket
read 256 KiB at a time, that connection only, and by relay_streams() on an end once it moves bulk."""

from __future__ import annotations

import gc
import hashlib
import os
import socket
import weakref

import pytest
import trio
import trio.testing

from clusterproxy_protocol import tls, transport, workarounds
from clusterproxy_protocol.relay import relay_streams
from clusterproxy_protocol.transport import (
    BULK_SOCKET_READ,
    FAIR_EVERY,
    read_in_bulk,
    receive_batch,
    send_all,
)
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
async def test_one_refill_takes_what_waits_in_the_socket_after_read_in_bulk(
    pki: PkiFiles, bulk: bool
) -> None:
    server, client = await tls_pair(pki)
    payload = os.urandom(WAITING)
    await server.send_all(payload)  # whole in the socket buffer before the client reads
    if bulk:
        assert read_in_bulk(client) is True
    first = await receive_batch(client, 1 << 20)
    # a refill is 64 KiB of TLS records (less plaintext) as trio's; after read_in_bulk 256 KiB
    assert len(first) == WAITING if bulk else len(first) < 64 << 10
    rest = b""
    while len(first) + len(rest) < WAITING:
        rest += await receive_batch(client, 1 << 20)
    assert hashlib.sha256(first + rest).digest() == hashlib.sha256(payload).digest()
    await trio.aclose_forcefully(server)
    await trio.aclose_forcefully(client)


async def test_read_in_bulk_changes_only_sockets_and_that_connection(pki: PkiFiles) -> None:
    left, _right = trio.testing.memory_stream_pair()
    over_memory = trio.SSLStream(
        left, tls.client_context(pki.client.cert, pki.client.key, pki.ca, alpn=["h2"]), server_hostname="x"
    )
    assert read_in_bulk(over_memory) is False
    a, b = trio.socket.socketpair()
    for end in (a, b):
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    plain, peer = trio.SocketStream(a), trio.SocketStream(b)
    payload = os.urandom(WAITING)
    await peer.send_all(payload)
    first = await receive_batch(plain, 1 << 20)
    assert len(first) == 64 << 10  # a plain socket too: 64 KiB until it moves bulk
    assert read_in_bulk(plain) is True
    assert await receive_batch(plain, 1 << 20) == payload[len(first) :]  # the rest in one read
    server, client = await tls_pair(pki)
    assert read_in_bulk(client) is True
    assert client.transport_stream in transport._bulk_sockets
    assert server.transport_stream not in transport._bulk_sockets  # the other connection keeps 64 KiB
    for stream in (plain, peer, server, client):
        await trio.aclose_forcefully(stream)


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
        await relay_streams(client=client, target=target)
    assert target.received.digest() == hashlib.sha256(payload).digest()
    assert max(target.sizes) > 64 << 10  # a 64 KiB socket read never yields more than 64 KiB at once
    assert client.transport_stream in transport._bulk_sockets


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
        await relay_streams(client=client, target=target)
    assert target.received.digest() == hashlib.sha256(b"".join(messages)).digest()
    assert client.transport_stream not in transport._bulk_sockets  # no big read, no 256 KiB buffer


class StepCounter(trio.abc.Instrument):
    """Counts how often one task is scheduled: each pass through trio's scheduler is one step."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


async def round_trips(sender: trio.abc.Stream, receiver: trio.abc.Stream, count: int) -> tuple[int, bytes]:
    """``count`` 1 KiB messages each sent and then received in this task: the scheduler passes it
    took, and the sha256 of what arrived."""
    messages = [os.urandom(1024) for _ in range(count)]
    received = hashlib.sha256()
    counter = StepCounter(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(counter)
    try:
        for message in messages:
            await send_all(sender, message)
            got = b""
            while len(got) < len(message):
                got += await receive_batch(receiver, 1 << 20)
            received.update(got)
    finally:
        trio.lowlevel.remove_instrument(counter)
    assert received.digest() == hashlib.sha256(b"".join(messages)).digest()
    return counter.steps, received.digest()


async def test_small_messages_cross_tls_without_passing_through_the_scheduler(pki: PkiFiles) -> None:
    server, client = await tls_pair(pki)
    steps, _ = await round_trips(server, client, 160)
    # trio's SSLStream passes through the scheduler three times per send and per receive (~960 here)
    assert steps <= 2 * 160 // FAIR_EVERY + 2
    steps, _ = await round_trips(client, server, 160)
    assert steps <= 2 * 160 // FAIR_EVERY + 2


async def test_small_messages_cross_a_socket_without_passing_through_the_scheduler() -> None:
    a, b = trio.socket.socketpair()
    left, right = trio.SocketStream(a), trio.SocketStream(b)
    steps, _ = await round_trips(left, right, 160)
    assert steps <= 2 * 160 // FAIR_EVERY + 2  # trio's: one pass per send and per receive
    await left.aclose()
    await right.aclose()


@pytest.mark.parametrize("kind", ["tls", "socket"])
async def test_more_than_the_socket_holds_arrives_whole_through_a_slow_reader(
    pki: PkiFiles, kind: str
) -> None:
    if kind == "tls":
        sender, receiver = await tls_pair(pki)
    else:
        a, b = trio.socket.socketpair()
        sender, receiver = trio.SocketStream(a), trio.SocketStream(b)
    sender.transport_stream.socket.setsockopt(
        socket.SOL_SOCKET, socket.SO_SNDBUF, 4096
    ) if kind == "tls" else None
    payload = os.urandom(3 << 20)
    received = hashlib.sha256()
    total = 0

    async def send() -> None:
        for start in range(0, len(payload), 300 << 10):  # each far more than the socket buffer
            await send_all(sender, payload[start : start + (300 << 10)])
        await sender.aclose()

    async def receive() -> None:
        nonlocal total
        while data := await receive_batch(receiver, 8 << 10):
            received.update(data)
            total += len(data)
            await trio.sleep(0)  # a reader that lets the sender fill the socket again

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        nursery.start_soon(receive)
    assert total == len(payload)
    assert received.digest() == hashlib.sha256(payload).digest()


async def test_a_send_cancelled_with_part_of_a_record_out_breaks_the_stream_as_trios_does(
    pki: PkiFiles,
) -> None:
    server, client = await tls_pair(pki)
    with trio.move_on_after(5) as scope:
        async with trio.open_nursery() as nursery:

            async def stuff() -> None:
                await send_all(server, os.urandom(8 << 20))  # nobody reads: it waits for room

            nursery.start_soon(stuff)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    assert not scope.cancelled_caught
    with pytest.raises(trio.BrokenResourceError):
        await send_all(server, b"after")
    with pytest.raises(trio.BrokenResourceError):
        await server.send_all(b"after")  # trio's own path agrees
    await trio.aclose_forcefully(server)
    await trio.aclose_forcefully(client)


async def test_close_notify_ends_the_data_and_a_cut_connection_is_an_error(pki: PkiFiles) -> None:
    server, client = await tls_pair(pki)
    await send_all(server, b"last words")
    await server.aclose()  # close_notify, then the socket closes
    assert await receive_batch(client, 1024) == b"last words"
    assert await receive_batch(client, 1024) == b""
    await client.aclose()
    server, client = await tls_pair(pki)
    await send_all(server, b"cut")
    server.transport_stream.socket.close()  # no close_notify: an attacker or a crash
    assert await receive_batch(client, 1024) == b"cut"
    with pytest.raises(trio.BrokenResourceError):
        await receive_batch(client, 1024)
    await trio.aclose_forcefully(client)


async def test_a_second_reader_while_one_waits_is_refused(pki: PkiFiles) -> None:
    server, client = await tls_pair(pki)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive_batch, client, 1024)
        await trio.testing.wait_all_tasks_blocked()  # the first reader waits for the socket
        with pytest.raises(trio.BusyResourceError):
            await client.receive_some(1024)
        with pytest.raises(trio.BusyResourceError):
            await receive_batch(client, 1024)
        await send_all(server, b"x")
    await trio.aclose_forcefully(server)
    await trio.aclose_forcefully(client)


async def test_a_reader_that_always_finds_data_lets_other_tasks_run(pki: PkiFiles) -> None:
    server, client = await tls_pair(pki)
    await server.send_all(os.urandom(512 << 10))  # all waits in the socket before the reader starts
    others_ran = 0
    reads = 0
    done = False

    async def other() -> None:
        nonlocal others_ran
        while not done:
            others_ran += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        await trio.lowlevel.checkpoint()  # other starts
        start = others_ran
        while reads < 8 * FAIR_EVERY:
            await receive_batch(client, 1024)  # a KiB at a time: the reader never has to wait
            reads += 1
        done = True
    assert others_ran - start >= reads // FAIR_EVERY - 1
    await trio.aclose_forcefully(server)
    await trio.aclose_forcefully(client)


async def test_a_stream_read_in_bulk_goes_with_its_last_reference(pki: PkiFiles) -> None:
    workarounds.apply()  # as the services run: trio's handshake holds no stream after it ran
    server, client = await tls_pair(pki)
    assert read_in_bulk(client) is True
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


async def test_a_tls_end_is_read_directly_whatever_its_sending_side_is_doing(pki: PkiFiles) -> None:
    # trio's own receive can yield with bytes taken from the socket and not yet decrypted, where a
    # frame deadline's look (transport.input_waiting) cannot see them: the reader must not fall back
    # to it because of the sending side (tests/integration/test_late_reader.py cut an honest peer).
    server, client = await tls_pair(pki)
    assert server._delayed_outgoing is not None  # TLS 1.3: trio holds the server's last flight until it sends
    received_by_trio = server._inner_recv_count
    await client.send_all(b"first")
    assert await receive_batch(server, 100) == b"first"
    async with server._inner_send_lock:  # as a writer whose send the socket took only in part
        await client.send_all(b"second")
        assert await receive_batch(server, 100) == b"second"
    assert server._inner_recv_count == received_by_trio
    for stream in (client, server):
        await trio.aclose_forcefully(stream)
