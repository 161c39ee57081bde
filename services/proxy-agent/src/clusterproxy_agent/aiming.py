"""Aimed dials to a proxy-server with several workers (``clusterproxy_protocol.steering``): the next
tunnel dial to an address goes from a source port that reaches the worker held least there.

Only for a plain TCP dial: through a forward proxy or in a WebSocket the hub sees the proxy's or the
ingress's connection, not ours, and the replica search finds the workers as before."""

from __future__ import annotations

import errno
import random
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

import trio

from clusterproxy_agent.agent import Agent, TunnelRecord
from clusterproxy_protocol import format_authority, source_port_for

__all__ = ["aim", "aimed_dial"]

PORT_ATTEMPTS = 8  # source ports tried (each taken or its 4-tuple in use) before an unaimed dial
AIMED_CONNECT_TIMEOUT = 1.0  # an aimed connect slower than this (SYNs lost, a dead first IP): unaimed


def aim(
    records: Iterable[TunnelRecord], address: str, rng: Callable[[], float] = random.random
) -> tuple[int, int] | None:
    """(worker index, workers) for the next dial to ``address``: of the indexes the live tunnels
    there were told, one held by the fewest (several servers behind one address each have an index
    0..N-1); None until a tunnel there has told its worker."""
    told = [
        r.identity.worker
        for r in records
        if r.address == address
        and r.holds_replica
        and r.identity is not None
        and r.identity.worker is not None
    ]
    if not told:
        return None
    workers = max(count for _, count in told)
    held = Counter(index for index, count in told if count == workers)
    fewest = min(held[i] for i in range(workers))
    candidates = [i for i in range(workers) if held[i] == fewest]
    return candidates[int(rng() * len(candidates))], workers


def aimed_dial(
    agent: Agent, rng: Callable[[], float] = random.random
) -> Callable[[str, int], Awaitable[trio.SocketStream]]:
    """A dial for :func:`~clusterproxy_agent.tunnel.tls_opener`: when :func:`aim` names a worker, a
    connection to the address's first IP from a source port that reaches it; else, or when that does
    not connect within :data:`AIMED_CONNECT_TIMEOUT`, ``trio.open_tcp_stream`` as before (every IP,
    happy eyeballs, its errors): aiming only ever saves dials."""

    async def dial(host: str, port: int) -> trio.SocketStream:
        target = aim(agent.replica_tunnels(), format_authority(host, port), rng)
        if target is not None:
            with trio.move_on_after(AIMED_CONNECT_TIMEOUT):
                stream = await _connect_aimed(host, port, target, rng)
                if stream is not None:
                    return stream
        return await trio.open_tcp_stream(host, port)

    return dial


async def _connect_aimed(
    host: str, port: int, target: tuple[int, int], rng: Callable[[], float]
) -> trio.SocketStream | None:
    try:
        family, kind, proto, _, address = (
            await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        )[0]
    except OSError:
        return None
    for _ in range(PORT_ATTEMPTS):
        sock = trio.socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            await sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", source_port_for(*target, rng)))
            await sock.connect(address)
        except OSError as exc:
            sock.close()
            if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                continue  # that port is taken here: another one
            return None
        except BaseException:
            sock.close()
            raise
        return trio.SocketStream(sock)
    return None
