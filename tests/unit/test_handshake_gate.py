"""The agent port's handshake gate: a reconnect storm is served first come, first served, at most
``limit`` handshakes at once, each holding its place for ``hold`` seconds at most; a connection whose
agent gave up while it waited is closed without a handshake; one reset before it was served costs a
counter, not a logged traceback."""

from __future__ import annotations

import socket
import struct
import time

import structlog
import trio
import trio.testing

from clusterproxy_protocol import TunnelSettings
from clusterproxy_server.agent_port import AgentPort
from clusterproxy_server.handshake import HandshakeGate, peer_gone
from clusterproxy_server.metrics import ServerMetrics
from clusterproxy_server.registry import Registry


async def test_at_most_limit_at_once_in_arrival_order(autojump_clock: trio.testing.MockClock) -> None:
    gate = HandshakeGate(limit=2, hold=100.0)
    entered: list[tuple[int, float]] = []
    peak = 0

    async def handshake(i: int) -> None:
        nonlocal peak
        async with gate.place():
            entered.append((i, trio.current_time()))
            peak = max(peak, gate.busy)
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(handshake, i)
            await trio.sleep(0.01)  # they arrive in this order
    assert peak == 2
    assert [i for i, _ in entered] == list(range(6))
    assert [round(t) for _, t in entered] == [0, 0, 1, 1, 2, 2]
    assert gate.busy == 0 and gate.waiting == 0


async def test_a_stalled_handshake_gives_its_place_up_after_hold(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = HandshakeGate(limit=1, hold=1.0)
    second_in = trio.Event()

    async def stalled() -> None:
        async with gate.place():
            await trio.sleep(10.0)

    async def next_one() -> None:
        async with gate.place():
            second_in.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stalled)
        await trio.sleep(0.01)
        nursery.start_soon(next_one)
        with trio.fail_after(1.5):
            await second_in.wait()
        assert trio.current_time() < 1.5  # not after the stalled one's 10 s
    assert gate.busy == 0


async def test_a_connection_that_waits_too_long_for_a_place_is_not_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = HandshakeGate(limit=1, hold=100.0, wait=2.0)
    outcomes: list[str] = []

    async def handshake(seconds: float) -> None:
        try:
            async with gate.place():
                await trio.sleep(seconds)
                outcomes.append("served")
        except trio.TooSlowError:
            outcomes.append(f"waited too long at {trio.current_time():g}")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(handshake, 10.0)
        await trio.sleep(0.01)
        nursery.start_soon(handshake, 0.0)
    assert outcomes == ["waited too long at 2.01", "served"]
    assert gate.busy == 0 and gate.waiting == 0


def test_peer_gone_reads_the_connection_state() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        with server:
            assert not peer_gone(server)
            client.sendall(b"\x16\x03\x01")  # a ClientHello's start, then the agent gives up
            client.close()
            for _ in range(100):
                if peer_gone(server):
                    break
                time.sleep(0.01)  # the FIN crosses loopback
            assert peer_gone(server)


def test_peer_gone_is_false_when_the_state_cannot_be_read() -> None:
    a, b = socket.socketpair()  # not TCP: no tcp_info
    with a, b:
        assert not peer_gone(a)


def _agent_port(metrics: ServerMetrics) -> AgentPort:
    return AgentPort(
        context=lambda: None,  # type: ignore[arg-type,return-value]  # never reached in these tests
        registry=Registry(),
        metrics=metrics,
        log=structlog.get_logger("test"),
        server_id="s",
        server_count=1,
        handshake_timeout=5.0,
        keepalive=(10.0, 20.0),
        tunnel_settings=TunnelSettings(),
    )


def _rejected(metrics: ServerMetrics, reason: str) -> float:
    return metrics.rejected.labels("agent", reason)._value.get()


async def test_a_connection_its_agent_left_is_closed_without_a_handshake() -> None:
    metrics = ServerMetrics()
    port = _agent_port(metrics)
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    async with listener:
        client = socket.create_connection(listener.socket.getsockname())
        server = await listener.accept()
        client.sendall(b"\x16\x03\x01\x00\x05hello")
        client.close()  # FIN after its ClientHello: gone while it waited
        await trio.sleep(0.05)
        async with server:
            with trio.fail_after(5):
                await port.serve(server)
    assert _rejected(metrics, "gone before the handshake") == 1


async def test_a_connection_reset_before_it_is_served_is_counted_not_raised() -> None:
    metrics = ServerMetrics()
    port = _agent_port(metrics)
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    async with listener:
        client = socket.create_connection(listener.socket.getsockname())
        server = await listener.accept()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # RST
        await trio.sleep(0.05)
        async with server:
            with trio.fail_after(5):
                await port.serve(server)  # getpeername fails: ENOTCONN
    assert _rejected(metrics, "gone before the handshake") == 1
