"""TunnelStream honours the same contract as a socket: trio's generic stream checks."""

from __future__ import annotations

import hashlib

import trio
import trio.testing

from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import IncomingRequest, Mux, open_mux
from clusterproxy_protocol.settings import TunnelSettings
from clusterproxy_protocol.tunnel_stream import TunnelStream
from tests.support.waiting import wait_until

SMALL = TunnelSettings(stream_window=65535, connection_window=1 << 20, max_frame_size=16384)


async def _serve(
    transport: trio.abc.Stream,
    role: Role,
    settings: TunnelSettings,
    handler,
    task_status: trio.TaskStatus[Mux] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with open_mux(transport, role, settings=settings, handler=handler) as mux:
        task_status.started(mux)
        await trio.sleep_forever()


async def connected_muxes(nursery: trio.Nursery, settings: TunnelSettings = SMALL):
    """An opener and an acceptor Mux over an in-memory transport; accepted streams arrive on a channel."""
    left, right = trio.testing.memory_stream_pair()
    send, receive = trio.open_memory_channel[TunnelStream](100)

    async def accept_all(request: IncomingRequest) -> None:
        await send.send(await request.accept())
        await trio.sleep_forever()

    opener = await nursery.start(_serve, left, Role.OPENER, settings, None)
    acceptor = await nursery.start(_serve, right, Role.ACCEPTOR, settings, accept_all)
    return opener, acceptor, receive


async def test_half_closeable_stream_contract(nursery: trio.Nursery) -> None:
    opener, _, accepted = await connected_muxes(nursery)

    async def stream_maker() -> tuple[TunnelStream, TunnelStream]:
        mine = await opener.open_connect("target:80")
        return mine, await accepted.receive()

    async def clogged_stream_maker() -> tuple[TunnelStream, TunnelStream]:
        left, right = await stream_maker()
        # Fill both stream windows exactly: the next send must wait for the reader.
        await left.send_all(b"x" * SMALL.stream_window)
        await right.send_all(b"x" * SMALL.stream_window)
        assert opener.core.send_window(left.stream_id) == 0
        return left, right

    await trio.testing.check_half_closeable_stream(stream_maker, clogged_stream_maker)


async def test_bulk_both_ways_digest(nursery: trio.Nursery) -> None:
    opener, _, accepted = await connected_muxes(nursery, TunnelSettings())
    up = bytes(range(256)) * 4096 * 4  # 4 MiB
    down = up[::-1]
    mine = await opener.open_connect("target:80")
    theirs = await accepted.receive()
    got: dict[str, str] = {}

    async def send(stream: TunnelStream, data: bytes) -> None:
        await stream.send_all(data)
        await stream.send_eof()

    async def drain(stream: TunnelStream, key: str) -> None:
        digest = hashlib.sha256()
        while chunk := await stream.receive_some():
            digest.update(chunk)
        got[key] = digest.hexdigest()

    async with trio.open_nursery() as inner:
        inner.start_soon(send, mine, up)
        inner.start_soon(send, theirs, down)
        inner.start_soon(drain, mine, "down")
        inner.start_soon(drain, theirs, "up")
    assert got == {"up": hashlib.sha256(up).hexdigest(), "down": hashlib.sha256(down).hexdigest()}


async def test_accepting_a_stream_the_peer_already_reset_is_a_broken_stream(nursery: trio.Nursery) -> None:
    left, right = trio.testing.memory_stream_pair()
    requests = trio.open_memory_channel[IncomingRequest](1)

    async def hold(request: IncomingRequest) -> None:
        await requests[0].send(request)
        await trio.sleep_forever()

    opener = await nursery.start(_serve, left, Role.OPENER, SMALL, None)
    await nursery.start(_serve, right, Role.ACCEPTOR, SMALL, hold)

    async def connect_then_give_up() -> None:
        with trio.move_on_after(0.5):
            await opener.open_connect("target:80")  # cancelled while pending: the stream is reset

    nursery.start_soon(connect_then_give_up)
    request = await requests[1].receive()
    await wait_until(lambda: not request.stream.answerable, timeout=5, what="the reset to arrive")
    try:
        await request.accept()
    except trio.BrokenResourceError as exc:
        assert "reset by peer" in str(exc)
    else:
        raise AssertionError("accept() on a reset stream must fail")
