"""What one small message costs to send and receive over TLS on a socket, through trio's
``SSLStream`` and through :mod:`clusterproxy_protocol.transport`'s direct path.

    python -m bench.message_cost [--count 20000] [--size 1024]

One process, one task, a connected socket pair with TLS 1.3 on it (the bench's certificates, mTLS as
the tunnel has it): each message is sent on one end and received on the other. Prints the mean
microseconds per message and the passes through trio's scheduler per message of each way (counted
with an instrument: every pass is a scheduling round with its ``epoll_wait``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from bench.pki import BenchPKI
from clusterproxy_protocol import client_context, receive_batch, send_all, server_context


class _Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.count += 1


async def _pair(pki: BenchPKI) -> tuple[trio.SSLStream, trio.SSLStream]:
    server_cert, client_cert = pki.server(), pki.client()
    a, b = trio.socket.socketpair()
    server = trio.SSLStream(
        trio.SocketStream(a),
        server_context(server_cert.cert, server_cert.key, pki.ca, alpn=["h2"]),
        server_side=True,
    )
    client = trio.SSLStream(
        trio.SocketStream(b),
        client_context(client_cert.cert, client_cert.key, pki.ca, alpn=["h2"]),
        server_hostname="localhost",
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.do_handshake)
        nursery.start_soon(client.do_handshake)
    return server, client


async def _measure(
    send: Callable[[bytes], Awaitable[None]], receive: Callable[[], Awaitable[bytes]], count: int, size: int
) -> tuple[float, float]:
    message = os.urandom(size)
    steps = _Steps()
    trio.lowlevel.add_instrument(steps)
    started = time.perf_counter()
    for _ in range(count):
        await send(message)
        got = 0
        while got < size:
            got += len(await receive())
    elapsed = time.perf_counter() - started
    trio.lowlevel.remove_instrument(steps)
    return elapsed / count * 1e6, steps.count / count


async def run(count: int, size: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        pki = BenchPKI(Path(folder))
        server, client = await _pair(pki)
        ways = {
            "trio SSLStream": (server.send_all, lambda: client.receive_some(1 << 16)),
            "transport (direct)": (
                lambda data: send_all(server, data),
                lambda: receive_batch(client, 1 << 16),
            ),
        }
        for name, (send, receive) in ways.items():
            await _measure(send, receive, count // 10, size)  # warm-up
            micros, steps = await _measure(send, receive, count, size)
            print(
                f"{name:20} {micros:6.1f} µs per {size}-byte message sent and received, {steps:.2f} scheduler passes"
            )
        await server.aclose()
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--size", type=int, default=1024)
    args = parser.parse_args()
    trio.run(run, args.count, args.size)


if __name__ == "__main__":
    main()
