"""A frame deadline cuts a peer that stopped sending, never one whose bytes arrived while this process
was busy elsewhere.

The frame deadline ("a frame started arriving and did not finish within T") is timed from when the
reader took the frame's first bytes. In a process busy elsewhere (the rapid-reset flood of another
connection, a loaded machine) the rest of the frame can already sit in the socket, unread, when the
deadline passes: the connection is then an honest one and must live. Played here with a real TLS
connection on loopback: a client thread sends the start of a PING, the reader takes it, and while the
server's whole process is blocked past the deadline (``time.sleep``: nothing runs, as in a process
starved of CPU) the client sends the rest.
Without the look at the socket (``transport.input_waiting``) the watchdog and the reader wake in the
same scheduling batch in either order, and about every other round the connection was cut.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time

import trio
import trio.testing
from hyperframe.frame import Frame, GoAwayFrame, PingFrame, SettingsFrame

from clusterproxy_protocol import tls
from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import Mux, open_mux
from clusterproxy_protocol.framing import PREFACE
from clusterproxy_protocol.settings import TunnelSettings
from clusterproxy_protocol.transport import input_waiting
from tests.support.h2_attacker import Attacker
from tests.support.pki import PkiFiles
from tests.support.waiting import wait_until

FRAME_TIMEOUT = 0.15
ROUNDS = 10


async def serve_one(nursery: trio.Nursery, pki: PkiFiles) -> tuple[int, trio.MemoryReceiveChannel[Mux]]:
    """A TLS listener on loopback whose first connection runs a tunnel acceptor with ``FRAME_TIMEOUT``;
    its port, and a channel that hands over the acceptor's Mux."""
    context = tls.server_context(pki.server.cert, pki.server.key, pki.ca, alpn=["h2"])
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    send, receive = trio.open_memory_channel[Mux](1)

    async def accept() -> None:
        tcp = await listeners[0].accept()
        stream = trio.SSLStream(tcp, context, server_side=True)
        await stream.do_handshake()
        settings = TunnelSettings(frame_timeout=FRAME_TIMEOUT)
        async with open_mux(stream, Role.ACCEPTOR, settings=settings) as mux:
            await send.send(mux)
            await mux.closed.wait()

    nursery.start_soon(accept)
    return listeners[0].socket.getsockname()[1], receive


class LateClient(threading.Thread):
    """An honest HTTP/2 peer in a thread of its own (blocking TLS): per round, the start of a PING;
    once told the reader took it, the rest at once; then it reads the PING's ACK. It closes when told."""

    def __init__(self, port: int, pki: PkiFiles) -> None:
        super().__init__(daemon=True)
        self.port, self.pki = port, pki
        self.start_taken = threading.Event()
        self.rest_sent = threading.Event()
        self.may_close = threading.Event()  # the test has looked at the server side after the last round
        self.acks: list[bytes] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            context = tls.client_context(self.pki.client.cert, self.pki.client.key, self.pki.ca, alpn=["h2"])
            with (
                socket.create_connection(("127.0.0.1", self.port), timeout=10) as tcp,
                context.wrap_socket(tcp, server_hostname="localhost") as tls_socket,
            ):
                tls_socket.sendall(PREFACE + SettingsFrame(0).serialize())
                received = b""
                for round_ in range(ROUNDS):
                    ping = PingFrame(0, opaque_data=f"late{round_:04d}".encode()).serialize()
                    tls_socket.sendall(ping[:-4])
                    assert self.start_taken.wait(10), "the reader never took the start"
                    self.start_taken.clear()
                    tls_socket.sendall(ping[-4:])  # while the server's process is blocked
                    self.rest_sent.set()
                    while True:
                        frame, received = next_frame(tls_socket, received)
                        if isinstance(frame, PingFrame) and "ACK" in frame.flags:
                            self.acks.append(frame.opaque_data)
                            break
                self.may_close.wait(10)
        except BaseException as exc:  # handed to the test
            self.error = exc


def next_frame(sock: ssl.SSLSocket, buffer: bytes) -> tuple[Frame, bytes]:
    while True:
        if len(buffer) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(buffer[:9]))
            if len(buffer) >= 9 + length:
                frame.parse_body(memoryview(buffer[9 : 9 + length]))
                return frame, buffer[9 + length :]
        data = sock.recv(1 << 16)
        if not data:
            raise AssertionError("the server closed the connection")
        buffer += data


async def test_a_frame_whose_rest_waits_unread_is_not_cut(nursery: trio.Nursery, pki: PkiFiles) -> None:
    port, muxes = await serve_one(nursery, pki)
    client = LateClient(port, pki)
    client.start()
    mux = await muxes.receive()
    for round_ in range(ROUNDS):
        await wait_until(lambda: mux.core.partial_frame_since is not None or client.error, what="the start")
        assert client.error is None, client.error
        client.start_taken.set()
        time.sleep(FRAME_TIMEOUT * 2)  # the whole process busy past the deadline; the rest arrives
        assert client.rest_sent.wait(10)  # still blocked: on a loaded machine the thread may be late
        client.rest_sent.clear()
        await wait_until(lambda n=round_: len(client.acks) > n or client.error, timeout=10, what="the ACK")
        assert client.error is None and not mux.dead, f"round {round_}: {client.error!r} {mux.dead_reason}"
        assert client.acks[round_] == f"late{round_:04d}".encode()
    client.may_close.set()
    await trio.to_thread.run_sync(client.join, 10)


async def test_a_frame_that_stops_is_still_cut_at_the_deadline(nursery: trio.Nursery, pki: PkiFiles) -> None:
    port, muxes = await serve_one(nursery, pki)
    attacker = await Attacker.connect(port, pki, preface=False)
    await attacker.send(PREFACE + SettingsFrame(0).serialize())
    await muxes.receive()
    started = trio.current_time()
    await attacker.send(PingFrame(0, opaque_data=b"stopped!").serialize()[:-4])
    with trio.fail_after(10):
        goaway = await attacker.until(GoAwayFrame)
    assert f"did not finish within {FRAME_TIMEOUT:g}s".encode() in goaway.additional_data
    assert trio.current_time() - started >= FRAME_TIMEOUT


async def test_input_waiting_sees_unread_bytes_in_a_socket() -> None:
    left, _right = trio.testing.lockstep_stream_pair()
    assert not input_waiting(left)  # a transport it cannot look into: False, the deadline as before
    a, b = trio.socket.socketpair()
    receiver, sender = trio.SocketStream(a), trio.SocketStream(b)
    assert not input_waiting(receiver)
    await sender.send_all(b"x")
    assert input_waiting(receiver)
    assert await receiver.receive_some(10) == b"x"
    assert not input_waiting(receiver)
