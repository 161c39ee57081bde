"""Aimed dials: the kernel, running the server's BPF program, hands a connection to the listening
socket its source port names (IPv4, IPv6, IPv4 on a dual-stack socket); ports the kernel picks itself
(even ones first) still spread over every worker; the agent aims at the worker it holds least."""

from __future__ import annotations

import errno
import functools
import select
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from clusterproxy_agent.aiming import aim, aimed_dial
from clusterproxy_agent.tunnel import nothing_listening
from clusterproxy_protocol.steering import (
    attach_steering,
    local_port_range,
    parse_worker,
    source_port_for,
    worker_of_port,
)


def group(family: int, host: str, workers: int, *, dual_stack: bool = False) -> list[socket.socket]:
    """``workers`` listening sockets sharing one port, the first with the steering program."""
    socks: list[socket.socket] = []
    port = 0
    for _ in range(workers):
        sock = socket.socket(family)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if dual_stack:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        port = sock.getsockname()[1]
        sock.listen(64)
        socks.append(sock)
    attach_steering(socks[0], workers)
    return socks


def accepted_by(socks: list[socket.socket]) -> int:
    """Which socket of the group got the connection just made."""
    ready, _, _ = select.select(socks, [], [], 5)
    assert len(ready) == 1, ready
    conn, _ = ready[0].accept()
    conn.close()
    return socks.index(ready[0])


def connect_from(family: int, host: str, port: int, source_port: Callable[[], int] | None) -> socket.socket:
    """A connection from a port ``source_port`` gives (another one while a port is taken here)."""
    for _ in range(20):
        client = socket.socket(family)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            if source_port is not None:
                client.bind((host, source_port()))
            client.connect((host, port))
        except OSError as exc:
            client.close()
            if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                continue
            raise
        return client
    raise AssertionError("no free source port in 20 tries")


@pytest.mark.parametrize("workers", [2, 3, 5])
@pytest.mark.parametrize(
    ("family", "listen_on", "connect_to", "dual_stack"),
    [
        (socket.AF_INET, "127.0.0.1", "127.0.0.1", False),
        (socket.AF_INET6, "::1", "::1", False),
        (socket.AF_INET6, "::", "127.0.0.1", True),
    ],
    ids=["ipv4", "ipv6", "ipv4-on-dual-stack"],
)
def test_the_kernel_hands_each_aimed_connection_to_the_worker_its_port_names(
    workers: int, family: int, listen_on: str, connect_to: str, dual_stack: bool
) -> None:
    socks = group(family, listen_on, workers, dual_stack=dual_stack)
    port = socks[0].getsockname()[1]
    client_family = socket.AF_INET if connect_to == "127.0.0.1" else socket.AF_INET6
    try:
        for attempt in range(6 * workers):
            wanted = attempt % workers
            client = connect_from(
                client_family, connect_to, port, functools.partial(source_port_for, wanted, workers)
            )
            try:
                assert accepted_by(socks) == wanted
            finally:
                client.close()
    finally:
        for sock in socks:
            sock.close()


def test_ports_the_kernel_picks_still_reach_every_worker() -> None:
    workers = 2
    socks = group(socket.AF_INET, "127.0.0.1", workers)
    port = socks[0].getsockname()[1]
    reached: Counter[int] = Counter()
    try:
        for _ in range(60):
            client = connect_from(socket.AF_INET, "127.0.0.1", port, None)
            assert worker_of_port(client.getsockname()[1], workers) == accepted_by(socks)
            reached[worker_of_port(client.getsockname()[1], workers)] += 1
            client.close()
    finally:
        for sock in socks:
            sock.close()
    assert set(reached) == {0, 1}, reached


@pytest.mark.parametrize("workers", [2, 3, 4, 8, 16])
def test_even_ports_alone_spread_evenly(workers: int) -> None:
    # Linux hands outgoing connections even ports first: a port % N steering would send them all to
    # the even workers; the mixed port spreads them within 3 % of an even share.
    low, high = local_port_range()
    counts = Counter(worker_of_port(port, workers) for port in range(low + low % 2, high + 1, 2))
    share = sum(counts.values()) / workers
    assert len(counts) == workers
    assert all(abs(n - share) / share < 0.03 for n in counts.values()), counts


def test_a_worker_header_is_an_index_below_its_count() -> None:
    assert parse_worker("1/2") == (1, 2)
    assert parse_worker(" 0/16 ") == (0, 16)
    for bad in (None, "", "2/2", "-1/2", "1", "a/b", "1/0", "1/5000"):
        assert parse_worker(bad) is None, bad
    with pytest.raises(ValueError, match="not one of"):
        source_port_for(2, 2)


@dataclass
class Identity:
    worker: tuple[int, int] | None


@dataclass
class Record:
    address: str
    worker: tuple[int, int] | None
    holds_replica: bool = True
    identity: Identity = field(init=False)

    def __post_init__(self) -> None:
        self.identity = Identity(self.worker)


def test_the_agent_aims_at_the_worker_it_holds_least_at_that_address() -> None:
    here, there = "hub:8091", "other:8091"
    assert aim([], here) is None
    assert aim([Record(here, None)], here) is None  # a server without workers says nothing
    assert aim([Record(here, (0, 2))], here) == (1, 2)
    assert aim([Record(here, (0, 3)), Record(here, (2, 3))], here) == (1, 3)
    # two servers of 2 workers behind one address: worker 1 held once, worker 0 twice
    records = [Record(here, (0, 2)), Record(here, (1, 2)), Record(here, (0, 2))]
    assert aim(records, here) == (1, 2)
    # a draining tunnel does not count; another address's do not either
    assert aim([Record(here, (0, 2)), Record(here, (1, 2), holds_replica=False)], here) == (1, 2)
    assert aim([Record(there, (0, 2))], here) is None
    # all held as often: any of them, as the random number says
    held = [Record(here, (0, 2)), Record(here, (1, 2))]
    assert {aim(held, here, rng=lambda x=x: x)[0] for x in (0.0, 0.99)} == {0, 1}  # type: ignore[index]


class Tunnels:
    """What aimed_dial reads of the agent: its live tunnels."""

    def __init__(self, records: list[Record]) -> None:
        self.records = records

    def replica_tunnels(self) -> list[Record]:
        return self.records


async def test_an_aimed_dial_reaches_the_worker_the_agent_lacks() -> None:
    socks = group(socket.AF_INET, "127.0.0.1", 3)
    port = socks[0].getsockname()[1]
    address = f"127.0.0.1:{port}"
    try:
        for held, lacking in (((0, 1), 2), ((1, 2), 0), ((0, 2), 1)):
            tunnels = Tunnels([Record(address, (index, 3)) for index in held])
            stream = await aimed_dial(tunnels)("127.0.0.1", port)  # type: ignore[arg-type]
            try:
                assert accepted_by(socks) == lacking
            finally:
                await stream.aclose()
    finally:
        for sock in socks:
            sock.close()


async def test_an_aimed_dial_to_nothing_listening_fails_as_a_plain_dial_does() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # bound, never listening: connections are refused
        tunnels = Tunnels([Record(f"127.0.0.1:{port}", (0, 2))])
        with pytest.raises(OSError) as failure:
            await aimed_dial(tunnels)("127.0.0.1", port)  # type: ignore[arg-type]
        assert nothing_listening(failure.value)  # the agent's search reads it: the hub is restarting
