"""Resolve a target and connect to the addresses the egress policy approved.

The policy checks the addresses a name resolves to; the dialer then connects to exactly those
addresses (never resolving the name a second time, which would reopen the DNS-rebinding hole).
Several addresses are tried Happy-Eyeballs style: the next attempt starts when the previous one
failed or after a short stagger, the first connection wins.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence

import trio

from clusterproxy_agent.egress import IPAddress

__all__ = ["ConnectFailed", "Connector", "ResolveFailed", "Resolver", "connect_any", "resolve"]

STAGGER = 0.25  # seconds between Happy Eyeballs attempts (RFC 8305 recommends 250 ms)

Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]
Connector = Callable[[Sequence[IPAddress], int], Awaitable[trio.abc.Stream]]


class ResolveFailed(OSError):
    """The name did not resolve (or resolved to nothing usable)."""


class ConnectFailed(OSError):
    """Every address refused or was unreachable."""

    def __init__(self, errors: list[tuple[IPAddress, OSError]]) -> None:
        self.errors = errors
        parts = [f"{addr}: {_os_error_text(exc)}" for addr, exc in errors]
        super().__init__("; ".join(parts) or "no address to connect to")


def _os_error_text(exc: OSError) -> str:
    if exc.errno is not None and exc.strerror:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        return f"{exc.strerror} ({name})"
    return str(exc) or type(exc).__name__


async def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address of ``host`` for TCP, in the resolver's preference order, without duplicates."""
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise ResolveFailed(exc.errno, f"cannot resolve {host!r}: {exc.strerror or exc}") from None
    out: list[IPAddress] = []
    for family, _type, _proto, _canon, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        host_text = str(sockaddr[0]).split("%", 1)[0]
        try:
            address = ipaddress.ip_address(host_text)
        except ValueError:
            continue
        if address not in out:
            out.append(address)
    if not out:
        raise ResolveFailed(errno.EADDRNOTAVAIL, f"{host!r} resolved to no IPv4 or IPv6 address")
    return out


async def connect_one(address: IPAddress, port: int) -> trio.SocketStream:
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await sock.connect((str(address), port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def connect_any(
    addresses: Sequence[IPAddress], port: int, *, stagger: float = STAGGER
) -> trio.SocketStream:
    """Connect to the first of ``addresses`` that answers; raises :class:`ConnectFailed` when none does.

    Not bounded in time by itself: the caller wraps it in its dial timeout.
    """
    if len(addresses) == 1:  # the common case (an IP, a service's cluster IP) needs no race
        try:
            return await connect_one(addresses[0], port)
        except OSError as exc:
            raise ConnectFailed([(addresses[0], exc)]) from None
    errors: list[tuple[IPAddress, OSError]] = []
    winner: trio.SocketStream | None = None
    try:
        async with trio.open_nursery() as nursery:

            async def attempt(address: IPAddress, failed: trio.Event) -> None:
                nonlocal winner
                try:
                    stream = await connect_one(address, port)
                except OSError as exc:
                    errors.append((address, exc))
                    failed.set()
                    return
                if winner is None:
                    winner = stream
                    nursery.cancel_scope.cancel()
                else:
                    await trio.aclose_forcefully(stream)

            for address in addresses:
                failed = trio.Event()
                nursery.start_soon(attempt, address, failed)
                with trio.move_on_after(stagger):
                    await failed.wait()
    except BaseException:
        if winner is not None:
            await trio.aclose_forcefully(winner)
        raise
    if winner is None:
        raise ConnectFailed(errors)
    return winner
