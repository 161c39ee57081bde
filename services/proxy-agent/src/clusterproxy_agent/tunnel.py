"""Dial out to the proxy-server and keep a tunnel up, reconnecting forever with jittered backoff.

The transport is a parameter (:data:`Opener`): TLS over TCP by default (:func:`tls_opener`), whose
byte stream under the TLS may come from a forward proxy (its ``dial``) and may be carried in a
WebSocket (its ``carrier``, :func:`websocket_carrier`); the HTTP/2 tunnel on top is the same.
"""

from __future__ import annotations

import random
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
from cryptography import x509

from clusterproxy_agent.agent import Agent, TunnelRecord
from clusterproxy_protocol import (
    CertRole,
    Role,
    TunnelSettings,
    WebSocketFailed,
    certificate_role,
    describe_exception,
    format_authority,
    host_header,
    limit_reporter,
    open_mux,
    open_websocket,
    read_in_bulk,
)

__all__ = [
    "Backoff",
    "HandshakeError",
    "Opener",
    "TunnelOptions",
    "TunnelRunner",
    "check_server_role",
    "tls_opener",
    "websocket_carrier",
]

ALPN = "h2"
# A tunnel that reached a replica the agent already holds is closed by the server once it reads our
# 409; should it not (an older server), the agent closes it itself after this long.
DUPLICATE_CLOSE_GRACE = 5.0
# The first wait after a dial reached a replica already held; it doubles with every such answer in a
# row, up to the search ceiling (``search_backoff_max``).
DUPLICATE_REDIAL = 0.05

# Opens the tunnel's transport; the nursery runs the transport's own tasks (a WebSocket's reader) and
# lives as long as the tunnel.
Opener = Callable[[trio.Nursery], Awaitable[trio.abc.Stream]]
Dial = Callable[[str, int], Awaitable[trio.abc.Stream]]  # a byte stream to HOST:PORT
# What the tunnel's TLS runs on, made from the dialed byte stream (e.g. a WebSocket inside it).
Carrier = Callable[[trio.Nursery, trio.abc.Stream], Awaitable[trio.abc.Stream]]


class HandshakeError(Exception):
    """The server answered, but not as a proxy-server tunnel endpoint (e.g. no ALPN h2)."""


@dataclass
class TunnelOptions:
    server: tuple[str, int]
    connect_timeout: float = 10.0
    keepalive: tuple[float, float] | None = (30.0, 20.0)
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    # A dial that reached a replica this agent already holds (a replica is missing, or its successor not
    # up yet) backs off at most this long, whatever the backoff has grown to: the missing replica is
    # found within it once it is up, at the cost of one handshake per slot per this period meanwhile.
    search_backoff_max: float = 2.0
    stable_after: float = 10.0  # a tunnel that lived longer resets the backoff
    settings: TunnelSettings | None = None
    proxy: str | None = None  # the forward proxy dialed through (redacted URL), for the log lines
    url: str | None = None  # the WebSocket URL the tunnel is carried to, when it is

    @property
    def address(self) -> str:
        return self.url or format_authority(*self.server)


class Backoff:
    """Exponential backoff with full jitter: the n-th delay is uniform in ``[0, min(max, initial * 2**n)]``."""

    def __init__(self, initial: float, maximum: float, rng: Callable[[], float] = random.random) -> None:
        if initial <= 0 or maximum < initial:
            raise ValueError(f"backoff needs 0 < initial <= max, got initial={initial} max={maximum}")
        self.initial = initial
        self.maximum = maximum
        self._rng = rng
        self.attempt = 0

    def ceiling(self) -> float:
        return min(self.maximum, self.initial * 2.0 ** min(self.attempt, 64))

    def next(self) -> float:
        delay = self._rng() * self.ceiling()
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0


def nothing_listening(exc: BaseException) -> bool:
    """Whether a dial failed only because every address refused the TCP connection (RST: no listener),
    as trio's ``open_tcp_stream`` reports it (an OSError caused by a group of the attempts' errors)."""
    if isinstance(exc, ConnectionRefusedError):
        return True
    attempts = exc.__cause__
    if not isinstance(attempts, BaseExceptionGroup):
        return False
    _, others = attempts.split(ConnectionRefusedError)
    return others is None


def check_server_role(der_cert: bytes | None) -> None:
    """Raise :class:`HandshakeError` unless the hub's certificate has the server role: an agent or
    client certificate with a forged serverAuth, or one from before roles, is not a proxy-server."""
    if der_cert is None:
        raise HandshakeError("the server presented no certificate")
    check = certificate_role(x509.load_der_x509_certificate(der_cert))
    if check.role is not CertRole.SERVER:
        found = f"role {check.role}" if check.role is not None else f"no role ({check.problem})"
        raise HandshakeError(
            f"the server presented a certificate with {found}; a proxy-server's certificate has the "
            "server role"
        )


def tls_opener(
    server: tuple[str, int],
    ctx: ssl.SSLContext | Callable[[], ssl.SSLContext],
    server_name: str,
    *,
    dial: Dial = trio.open_tcp_stream,
    carrier: Carrier | None = None,
) -> Opener:
    """TCP to ``server``, TLS handshake (the agent certificate in ``ctx``), ALPN ``h2`` and a
    server-role certificate required.

    ``ctx`` may be a callable (e.g. a :class:`~clusterproxy_protocol.reloader.ReloadingContext`),
    called at each dial: a renewed certificate or a changed trust bundle applies to the next tunnel.
    ``dial`` opens the byte stream the TLS runs on: TCP, or a forward proxy's ``CONNECT`` tunnel
    (:meth:`~clusterproxy_protocol.forward_proxy_trio.ForwardProxy.open`), which then sees only TLS.
    ``carrier`` turns that byte stream into the one the TLS runs on (:func:`websocket_carrier`).
    """
    host, port = server

    async def open_tls(nursery: trio.Nursery) -> trio.abc.Stream:
        tcp = await dial(host, port)
        try:
            carried = await carrier(nursery, tcp) if carrier is not None else tcp
            context = ctx() if callable(ctx) else ctx
            tls = trio.SSLStream(carried, context, server_hostname=server_name)
            await tls.do_handshake()
            selected = tls.selected_alpn_protocol()
            if selected != ALPN:
                raise HandshakeError(f"server did not select ALPN {ALPN!r} (selected {selected!r})")
            check_server_role(tls.getpeercert(binary_form=True))
            read_in_bulk(tls)  # a tunnel carries its streams' bulk
        except BaseException:
            await trio.aclose_forcefully(tcp)
            raise
        return tls

    return open_tls


def websocket_carrier(
    host: str, port: int, path: str, outer: ssl.SSLContext | Callable[[], ssl.SSLContext] | None
) -> Carrier:
    """A WebSocket to ``host:port`` + ``path`` (``wss://`` with the ``outer`` TLS context, verifying
    the ingress in front of the hub; ``ws://`` without), on the dialed byte stream."""
    authority = host_header(host, port, secure=outer is not None)

    async def carry(nursery: trio.Nursery, stream: trio.abc.Stream) -> trio.abc.Stream:
        if outer is not None:
            context = outer() if callable(outer) else outer
            stream = trio.SSLStream(stream, context, server_hostname=host)
            try:
                await stream.do_handshake()
            except (ssl.SSLError, trio.BrokenResourceError) as exc:
                raise WebSocketFailed(
                    f"TLS with the WebSocket endpoint {authority} failed: {describe_exception(exc)}"
                ) from exc
        return await open_websocket(nursery, stream, authority, path)

    return carry


class TunnelRunner:
    """One tunnel slot: connect, serve the mux until it closes, back off, again; until :meth:`stop`.

    :attr:`record` is the slot's live tunnel (None while it connects or backs off); the replica set
    (:mod:`.replicas`) reads it to decide how many slots to run."""

    def __init__(
        self,
        agent: Agent,
        options: TunnelOptions,
        opener: Opener,
        *,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.agent = agent
        self.options = options
        self._open = opener
        self.backoff = Backoff(options.backoff_initial, options.backoff_max, rng)
        search_max = min(options.backoff_max, options.search_backoff_max)
        self.duplicate_backoff = Backoff(min(DUPLICATE_REDIAL, search_max), search_max, rng)
        self.log = agent.log.bind(server=options.address)
        if options.proxy is not None:
            self.log = self.log.bind(proxy=options.proxy)
        self.stopped = trio.Event()
        self._stopping = False
        self._wait_scope: trio.CancelScope | None = None
        self.attempts = 0
        self.record: TunnelRecord | None = None
        self.opening = False  # the transport is up, the tunnel not yet recorded (see replicas.slot_state)
        self._last_duplicate = False  # the last tunnel reached a replica held by another slot
        self._last_refused = False  # the last dial found nothing listening (the hub restarting)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self) -> None:
        """Connect no more; a connect or backoff in progress is abandoned, a live tunnel stays up."""
        self._stopping = True
        if self._wait_scope is not None:
            self._wait_scope.cancel()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while not self._stopping:
                lived = await self._once()
                if self._stopping:
                    break
                if lived > self.options.stable_after:
                    self.backoff.reset()
                if self._last_duplicate:
                    # The hub is up and answered; its balancer chose a replica this agent holds. The
                    # failure backoff is not the measure of that: dial again soon, a little later each
                    # time it happens again, never later than the search ceiling.
                    delay = self.duplicate_backoff.next()
                else:
                    self.duplicate_backoff.reset()
                    delay = self.backoff.next()
                    if self._last_refused:  # nothing listening: costs the hub nothing (a restart)
                        delay = min(delay, self.options.search_backoff_max)
                self.log.info(
                    "tunnel_reconnect_scheduled", delay=round(delay, 3), attempt=self.backoff.attempt
                )
                with self._interruptible():
                    await trio.sleep(delay)
        finally:
            self.stopped.set()
            self.agent.notify_change()

    def _interruptible(self) -> trio.CancelScope:
        scope = trio.CancelScope()
        if self._stopping:
            scope.cancel()
        self._wait_scope = scope
        return scope

    async def _connect(self, transport_tasks: trio.Nursery) -> trio.abc.Stream | None:
        timeout = self.options.connect_timeout
        error: str | None = None
        transport: trio.abc.Stream | None = None
        self._last_refused = False
        with self._interruptible():
            try:
                with trio.fail_after(timeout):
                    transport = await self._open(transport_tasks)
            except trio.TooSlowError:
                error = f"connect to {self.options.address} timed out after {timeout:g}s"
            except (OSError, trio.BrokenResourceError, ssl.SSLError, HandshakeError) as exc:
                error = describe_exception(exc)
                self._last_refused = nothing_listening(exc)
        self._wait_scope = None
        if error is not None:
            self.agent.last_error = error
            self.log.warning("tunnel_connect_failed", error=error)
        return transport

    async def _once(self) -> float:
        """One connect and, when it works, one tunnel's life; returns how long the tunnel lived."""
        if self.attempts:
            self.agent.metrics.tunnel_reconnects.inc()
        self.attempts += 1
        self.log.debug("tunnel_connecting", attempt=self.attempts)
        async with trio.open_nursery() as transport_tasks:
            lived = await self._connect_and_serve(transport_tasks)
            transport_tasks.cancel_scope.cancel()  # the transport is closed: its tasks have nothing left
        return lived

    async def _connect_and_serve(self, transport_tasks: trio.Nursery) -> float:
        transport = await self._connect(transport_tasks)
        if transport is None:
            return 0.0
        if self._stopping:  # stopped while the connect finished: it is not wanted any more
            await trio.aclose_forcefully(transport)
            return 0.0
        self.opening = True
        started = trio.current_time()
        reason = "closed"
        duplicate = False
        try:
            async with open_mux(
                transport,
                Role.ACCEPTOR,
                settings=self.options.settings,
                handler=self.agent.handle,
                keepalive=self.options.keepalive,
                ping_when_quiet=True,  # the hub PINGs every tunnel; ours only when it has gone quiet
                on_limit=limit_reporter(self.log, self.agent.metrics.count_limit),
                budget=self.agent.buffers,
            ) as mux:
                with self.agent.tunnel(mux, self.options.address) as record:
                    self.record = record
                    self.opening = False
                    self.log.info("tunnel_connected")
                    try:
                        async with trio.open_nursery() as watchers:
                            watchers.start_soon(self._watch_drain, record)
                            watchers.start_soon(self._close_if_duplicate, record)
                            await mux.closed.wait()
                            watchers.cancel_scope.cancel()
                    finally:
                        self.record = None
                        duplicate = record.duplicate
                reason = mux.dead_reason or reason
        except Exception as exc:
            reason = f"tunnel failed: {describe_exception(exc)}"
            self.log.exception("tunnel_error", error=reason)
        finally:
            self.opening = False
        lived = trio.current_time() - started
        self._last_duplicate = duplicate
        if duplicate:  # counted and logged as replica_already_held; the backoff grows, capped (search)
            self.log.debug("tunnel_disconnected", error=reason, lived=round(lived, 3), duplicate=True)
            return 0.0
        self.agent.last_error = f"tunnel disconnected: {reason}"
        self.log.info("tunnel_disconnected", error=reason, lived=round(lived, 3))
        return lived

    async def _watch_drain(self, record: TunnelRecord) -> None:
        """The server announced its drain: this tunnel no longer counts, and the replica set dials for
        the replica's successor while the open streams finish here."""
        await record.mux.peer_drain_started.wait()
        self.log.info("server_draining", server_id=record.server_id)
        self.agent.notify_change()

    async def _close_if_duplicate(self, record: TunnelRecord) -> None:
        await record.identified.wait()
        if not record.duplicate:
            return
        with trio.move_on_after(DUPLICATE_CLOSE_GRACE):
            await record.mux.closed.wait()
            return
        record.mux.close(f"this agent already holds a tunnel to server {record.server_id}")
