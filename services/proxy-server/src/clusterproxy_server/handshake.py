"""The TLS handshake both the agent port and the client port start with, and the role each port
accepts: agent certificates on the agent port, client certificates on the client port, nothing else
(see :func:`clusterproxy_protocol.pki.certificate_role`).

:class:`HandshakeGate` bounds how many agent handshakes compute at once. Without it, a reconnect
storm (every agent of a restarted server dialing within a few seconds) had thousands of handshakes
in flight in one process: each of their two steps waited behind all the others, so all of them
slowed together past the agents' 10 s connect timeout, the agents gave up and redialed, and the
server's work on them was lost (10,000 agents: 15,719 handshakes ended in ``SSLEOFError``, all
routable only after 88 s; docs/benchmarks.md, "10,000 clusters"). Through the gate the first to come
are the first served, at the rate the core allows, and a connection whose agent gave up while it
waited (its FIN or RST arrived) is closed without a handshake."""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import NamedTuple

import structlog
import trio
from cryptography import x509

from clusterproxy_protocol import CertRole, certificate_role, role_refusal
from clusterproxy_server.metrics import ServerMetrics

TCP_ESTABLISHED = 1  # tcp_info.tcpi_state (include/net/tcp_states.h)

# Agent handshakes computing at once per process: enough to keep a core busy with agents 200 ms away
# (two round trips each), few enough that each step of one waits at most a few hundred milliseconds.
HANDSHAKES_AT_ONCE = 256
# A handshake holds its place this long at most: a peer that sends a ClientHello and then stalls
# (or one far away) cannot keep the gate shut; past this it goes on outside the bound.
HANDSHAKE_PLACE_HOLD = 1.0
# A connection waits this long for a place at most, then is closed unserved: half an agent's connect
# timeout (10 s), so that the handshake of one that got a place has time to finish before its agent
# gives up. Without this bound, a server whose core cannot keep up serves its queue in order while
# every connection in it is older than its agent's patience: all work, no tunnel.
HANDSHAKE_PLACE_WAIT = 5.0


def peer_gone(sock: socket.socket | trio.socket.SocketType) -> bool:
    """Whether the peer of a TCP connection has already closed or reset it (its agent stopped waiting
    while the connection sat in a queue): the kernel's state of the connection is no longer
    ESTABLISHED. False when the state cannot be read (not TCP, not Linux)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
    except (OSError, AttributeError):
        return False
    return struct.unpack_from("B", info)[0] != TCP_ESTABLISHED


class HandshakeGate:
    """At most ``limit`` handshakes at once, served in arrival order; each holds its place for at
    most ``hold`` seconds, and waits for one at most ``wait`` seconds (see the module)."""

    def __init__(
        self,
        limit: int = HANDSHAKES_AT_ONCE,
        hold: float = HANDSHAKE_PLACE_HOLD,
        wait: float = HANDSHAKE_PLACE_WAIT,
    ) -> None:
        self._places = trio.CapacityLimiter(limit)
        self.hold = hold
        self.wait = wait

    @property
    def busy(self) -> int:
        return int(self._places.borrowed_tokens)

    @property
    def waiting(self) -> int:
        return self._places.statistics().tasks_waiting

    @asynccontextmanager
    async def place(self) -> AsyncIterator[None]:
        """A place for one handshake; ``trio.TooSlowError`` when none came within ``wait``."""
        token = object()
        with trio.fail_after(self.wait):
            await self._places.acquire_on_behalf_of(token)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._places.release_on_behalf_of(token)

        async def release_later() -> None:
            await trio.sleep(self.hold)
            release()

        try:
            async with trio.open_nursery() as timer:
                timer.start_soon(release_later)
                try:
                    yield
                finally:
                    timer.cancel_scope.cancel()
        finally:
            release()


class Peer(NamedTuple):
    """A peer through the handshake: its stream and its certificate, parsed once."""

    stream: trio.SSLStream[trio.abc.Stream]
    cert: x509.Certificate


async def accept_tls(
    transport: trio.abc.Stream,
    context: ssl.SSLContext,
    port: str,
    timeout: float,
    metrics: ServerMetrics,
    log: structlog.typing.FilteringBoundLogger,
    accepted: CertRole,
    peer: str,
) -> Peer | None:
    """The mutually authenticated peer whose certificate has the ``accepted`` role, or
    None (counted, logged, connection closed) on failure. ``transport``: TCP, or a WebSocket's byte
    stream; ``peer`` names it in the logs."""
    stream = trio.SSLStream(transport, context, server_side=True, https_compatible=True)
    try:
        with trio.fail_after(timeout):
            await stream.do_handshake()
    except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        cause = exc.__cause__ or exc
        reason = "handshake timeout" if isinstance(exc, trio.TooSlowError) else type(cause).__name__
        metrics.rejected.labels(port, reason).inc()
        log.info("tls_handshake_failed", port=port, peer=peer, error=str(cause) or reason)
        await trio.aclose_forcefully(transport)
        return None
    cert = x509.load_der_x509_certificate(stream.getpeercert(binary_form=True))
    check = certificate_role(cert)
    refusal = role_refusal(check, port, accepted)
    if refusal is None:
        return Peer(stream, cert)
    metrics.rejected.labels(port, "certificate_role").inc()
    log.warning(
        "tls_peer_refused",
        port=port,
        peer=peer,
        role=check.found,
        accepted=accepted.value,
        subject=cert.subject.rfc4514_string(),
        error=refusal,
    )
    await trio.aclose_forcefully(stream)
    return None
