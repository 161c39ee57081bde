"""The proxy-server takes a burst of connections out of the kernel's accept queue at once, not one per
pass of its scheduler.

trio's ``accept()`` yields to the scheduler after each connection, and a pass is as long as every
other task's work in it: on a busy server, 200 Go konnectivity clients dialing at once waited in the
kernel's queue (where neither the server's handshake timeout nor the agent handshake gate sees them)
while the server spent each pass on established connections' traffic; gRPC's 20 s connect deadline
expired there for up to half of them (tests/e2e/test_konnectivity_grpc.py's 200 single-use tunnels at
load 36-40). What is counted here is passes of the scheduler, which load does not change, not time.
"""

from __future__ import annotations

import socket

import trio

from tests.support.inprocess import start_server
from tests.support.pki import PkiFiles

BURST = 50


def accept_queue(port: int) -> int:
    """Connections waiting in the accept queue of the loopback listener on ``port`` (for a listening
    socket, /proc/net/tcp's rx_queue is its accept queue's length)."""
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                return int(queues.split(":")[1], 16)
    raise AssertionError(f"no listener on port {port}")


async def test_a_burst_of_connections_leaves_the_accept_queue_within_a_few_passes(pki: PkiFiles) -> None:
    async with trio.open_nursery() as nursery:
        _server, bound = await start_server(nursery, pki)
        for port in (bound.client[1], bound.agent[1]):
            # Connected by the kernel while this task holds the scheduler: all wait in the queue.
            peers = [socket.create_connection(("127.0.0.1", port)) for _ in range(BURST)]
            try:
                assert accept_queue(port) == BURST
                passes = 0
                while accept_queue(port) and passes < BURST:
                    await trio.sleep(0)  # one pass of the scheduler
                    passes += 1
                assert accept_queue(port) == 0 and passes <= 3, f"port {port}: {passes} passes"
            finally:
                for peer in peers:
                    peer.close()
        nursery.cancel_scope.cancel()
