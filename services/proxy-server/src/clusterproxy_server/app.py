"""The proxy-server: its listeners (agent, client, admin, and optionally agent-over-WebSocket), its
lifecycle and drain.

The agent port is :mod:`.agent_port` (its WebSocket twin :mod:`.agent_websocket`); the client port hands each connection, once authenticated and
its protocol told by the first bytes, to a frontend (:mod:`.frontends`), which adapts it to the one
dial-and-relay path (:mod:`.relaying`); the admin port's routes are :mod:`.admin`.

Drain (:meth:`ProxyServer.shutdown`, on SIGTERM), for rolling upgrades behind a load balancer:

1. ``/readyz`` fails at once (with ``--shutdown-delay``, the ports keep serving that long first, for a
   balancer that learns only from the readiness check); then the agent and client ports stop
   accepting: connections the kernel already completed are still accepted and served, then the
   listening sockets close, so a load balancer's next connection attempt is refused and goes to
   another replica (a refused connect is safe to retry; a reset after the connection was established
   would not be).
2. Agents are told (``SETTINGS_MAX_CONCURRENT_STREAMS 0`` on their tunnels): each dials for this
   replica's successor and keeps its other tunnels; this replica still opens streams on their tunnels
   for the client connections it has. HTTP/2 clients are told the same way (:mod:`.frontends.http2`)
   and their connections closed with a GOAWAY once idle; an HTTP/1.1 connection carries one request and
   ends with it.
3. Open client connections get ``--drain-timeout`` to finish; the streams still open then are cut
   (HTTP/2: GOAWAY ``CANCEL`` naming the drain timeout; HTTP/1.1: RST; never a clean end: the client
   can tell), logged as ``drain_timeout``. A second signal ends the delay or the wait at once.
4. Agent tunnels are closed with a GOAWAY naming the reason, and the process exits.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import trio
from cryptography import x509

from clusterproxy_protocol import (
    ALPN_H2,
    ALPN_HTTP1,
    Authenticated,
    CertFiles,
    CertRenewer,
    CertRole,
    ReloadingContext,
    RenewalPolicy,
    SignerEndpoint,
    close_cleanly,
    format_address,
    get_logger,
    limit_reporter,
    open_sink,
    serve_admin,
)
from clusterproxy_server.admin import admin_routes, visibility
from clusterproxy_server.agent_port import AgentPort
from clusterproxy_server.agent_websocket import AgentWebSocketPort
from clusterproxy_server.authz import ClientIdentity, PolicyFile
from clusterproxy_server.config import ServerConfig
from clusterproxy_server.control import ControlAccess
from clusterproxy_server.ejection import OutlierEjection
from clusterproxy_server.frontends import FRONTENDS, REFUSALS, ClientConnection
from clusterproxy_server.frontends.connection import Drain, send_and_close
from clusterproxy_server.frontends.http1_messages import error_response
from clusterproxy_server.frontends.sniff import client_protocol
from clusterproxy_server.handshake import accept_tls
from clusterproxy_server.metrics import ServerMetrics
from clusterproxy_server.pending_dials import PendingDials
from clusterproxy_server.quotas import ClientQuotas, ConnectionQuota, QuotaExceeded
from clusterproxy_server.registry import Registry
from clusterproxy_server.relaying import Relayer
from clusterproxy_server.worker_sockets import WorkerSpec, listeners_from_fds

__all__ = ["BoundAddresses", "ProxyServer", "ServerConfig"]

# accept(2) errors that mean "overloaded, try again shortly" (as trio.serve_listeners treats them)
ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
ACCEPT_RETRY = 0.1
# Connections the accept loop takes from the kernel's queue at each wake, beside the one trio's accept()
# returns: accept() yields to the scheduler after each connection, and a pass is as long as every other
# task's work in it, so one a pass let a burst wait in the kernel's queue on a busy server, where no
# handshake timeout or gate of ours sees it while the client's own connect deadline runs (200 Go
# konnectivity clients at load 36-40: gRPC's 20 s expired there for up to half of them). Bounded, so
# that a queue that never empties still lets the loop yield.
ACCEPT_BATCH = 256
CUT_GRACE = 1.0  # seconds HTTP/2 client connections get to send their GOAWAY at the drain's end


@dataclass(frozen=True)
class BoundAddresses:
    agent: tuple[str, int]
    client: tuple[str, int]
    admin: tuple[str, int]
    agent_websocket: tuple[str, int] | None = None


class ProxyServer:
    def __init__(self, config: ServerConfig, worker: WorkerSpec | None = None) -> None:
        """``worker``: this server is one of ``--workers`` (:mod:`.workers`): its listening sockets are
        inherited from the parent, and its admin port is the parent's private channel to it."""
        self.config = config
        self.worker = worker
        self.registry = Registry(config.known_clusters, OutlierEjection(config.ejection))
        self.metrics = ServerMetrics()
        self.log = get_logger("proxy-server", server_id=config.server_id)
        # Read at each handshake: a renewed certificate or a changed trust bundle applies to new
        # connections only; live tunnels and streams keep the session they have.
        self._agent_tls = ReloadingContext.server(config.cert, config.key, config.ca, alpn=[ALPN_H2])
        # http/1.1 first (OpenSSL picks by the server's order): a client that offers both can speak
        # either, and Go's transport, offering both, speaks HTTP/1.1 to a proxy whatever ALPN says;
        # for a forward request (an http:// URL) it even refuses an h2 answer. The first bytes
        # decide the protocol anyway (frontends/sniff.py); ALPN h2 goes to clients offering only h2.
        self._client_tls = ReloadingContext.server(
            config.cert, config.key, config.ca, alpn=[ALPN_HTTP1, ALPN_H2]
        )
        # The admin port's authenticated API (the inventory) speaks TLS to hub clients on the same
        # port as the plain probes (clusterproxy_protocol.admin); a worker's admin port is the
        # parent's private channel and needs none.
        self._admin_tls = ReloadingContext.server(config.cert, config.key, config.ca, alpn=[ALPN_HTTP1])
        self.policy = PolicyFile(config.client_policy) if config.client_policy is not None else None
        self.renewer: CertRenewer | None = None
        if config.signer:
            self.renewer = CertRenewer(
                SignerEndpoint.parse(config.signer, config.ca),
                CertFiles(config.cert, config.key, config.ca),
                [self._agent_tls, self._client_tls, self._admin_tls],
                RenewalPolicy(trust_refresh=config.trust_refresh),
            )
            self.metrics.watch_renewer(self.renewer)
        self.quotas = ClientQuotas(config.quotas, self.metrics, self.log, config.tunnel.first_window)
        # Opened now, so that a path that cannot be written stops the start (ConfigError); closed when
        # run() ends.
        self.audit = open_sink(config.audit_log)
        self.relayer = Relayer(
            self.registry,
            self.metrics,
            self.policy,
            config.dial_timeout,
            self.log,
            agent_answer_timeout=config.agent_answer_timeout,
            pending=PendingDials(
                config.max_pending_dials_per_connection, config.max_pending_dials_per_client
            ),
            startup_grace=config.startup_grace,
            control=ControlAccess(config.control_clients),
            quotas=self.quotas,
            audit=self.audit,
            server_id=config.server_id,
        )
        self.drain = Drain()
        self.agent_port = AgentPort(
            context=lambda: self._agent_tls.context,
            registry=self.registry,
            metrics=self.metrics,
            log=self.log,
            server_id=config.server_id,
            server_count=config.server_count,
            worker=config.worker,
            handshake_timeout=config.handshake_timeout,
            keepalive=(config.keepalive_interval, config.keepalive_timeout),
            tunnel_settings=config.tunnel,
            draining=self.drain.started,
        )
        self.agent_websocket_port = AgentWebSocketPort(
            self.agent_port, metrics=self.metrics, log=self.log, handshake_timeout=config.handshake_timeout
        )
        self.ready = False
        self.stopping = False  # SIGTERM received: /readyz fails from now on
        self._accepting: list[trio.CancelScope] = []
        self._client_connections = 0
        self._clients_gone = trio.Event()
        self._clients_gone.set()
        self._drain_cut = trio.Event()  # a second signal: stop waiting for open streams

    async def run(self, *, task_status: trio.TaskStatus[BoundAddresses] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._run(task_status)
        finally:
            self.audit.close()  # every connection's handler has ended: no record is still to come

    async def _run(self, task_status: trio.TaskStatus[BoundAddresses]) -> None:
        cfg = self.config
        if self.worker is not None:
            agent_listeners = listeners_from_fds(self.worker.agent)
            client_listeners = listeners_from_fds(self.worker.client)
            admin_listeners = listeners_from_fds([self.worker.admin])
            websocket_listeners = listeners_from_fds(self.worker.websocket)
        else:
            agent_listeners = await trio.open_tcp_listeners(cfg.agent_listen[1], host=cfg.agent_listen[0])
            client_listeners = await trio.open_tcp_listeners(cfg.client_listen[1], host=cfg.client_listen[0])
            admin_listeners = await trio.open_tcp_listeners(cfg.admin_listen[1], host=cfg.admin_listen[0])
            websocket_listeners = []
        if cfg.agent_websocket_listen is not None and self.worker is None:
            host, port = cfg.agent_websocket_listen
            websocket_listeners = await trio.open_tcp_listeners(port, host=host)
        agent_at, client_at, admin_at = (
            ls[0].socket.getsockname()[:2] for ls in (agent_listeners, client_listeners, admin_listeners)
        )
        bound = BoundAddresses(
            agent_at,
            client_at,
            admin_at,
            agent_websocket=websocket_listeners[0].socket.getsockname()[:2] if websocket_listeners else None,
        )
        async with trio.open_nursery() as nursery:
            plain, private = admin_routes(
                self.registry, self.metrics, self._not_ready, cfg.server_id, visibility(self.policy)
            )
            if self.worker is None:
                api = Authenticated(private, lambda: self._admin_tls.context)
                await nursery.start(partial(serve_admin, admin_listeners, plain, authenticated=api))
            else:  # the parent asks for everything and answers for the pod (workers.Supervisor.routes)
                everything = {**plain, **{path: partial(route, None) for path, route in private.items()}}
                await nursery.start(serve_admin, admin_listeners, everything)
            if self.renewer is not None:
                await nursery.start(self.renewer.run)
            async with trio.open_nursery() as agents, trio.open_nursery() as clients:
                self._agents, self._clients = agents, clients
                for listener in agent_listeners:
                    agents.start_soon(self._accept, listener, self.handle_agent, agents)
                for listener in websocket_listeners:
                    agents.start_soon(self._accept, listener, self.handle_agent_websocket, agents)
                for listener in client_listeners:
                    clients.start_soon(self._accept, listener, self.handle_client, clients)
                self.relayer.start_grace()
                self.ready = True
                self.log.info(
                    "server_started" if self.worker is None else "worker_started",
                    agent_port=format_address(bound.agent),
                    agent_websocket_port=format_address(bound.agent_websocket)
                    if bound.agent_websocket
                    else None,
                    client_port=format_address(bound.client),
                    admin_port=format_address(bound.admin),
                    known_clusters=sorted(cfg.known_clusters),
                    signer=cfg.signer,
                    certificate_serial=format(self._certificate().serial_number, "x"),
                    client_policy=str(cfg.client_policy) if cfg.client_policy else None,
                    server_id=cfg.server_id,
                    server_count=cfg.server_count,
                    startup_grace=cfg.startup_grace,
                )
                task_status.started(bound)
            nursery.cancel_scope.cancel()

    def _not_ready(self) -> str | None:
        if self.stopping:
            return "draining"
        return None if self.ready else "starting"

    async def _accept(
        self,
        listener: trio.SocketListener,
        handler: Callable[[trio.SocketStream], Awaitable[None]],
        handlers: trio.Nursery,
    ) -> None:
        """Accept connections until the drain; then take those the kernel has already completed (their
        clients believe they are connected) and close the listening socket, so that later attempts are
        refused and a load balancer sends them elsewhere."""
        async with listener:
            queue = _queue_of(listener)
            try:
                with trio.CancelScope() as accepting:
                    self._accepting.append(accepting)
                    if self.drain.started.is_set():
                        accepting.cancel()
                    while True:
                        try:
                            stream = await listener.accept()
                        except OSError as exc:
                            if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                                raise
                            self.log.error(
                                "accept_failed", error=os.strerror(exc.errno or 0), retry=ACCEPT_RETRY
                            )
                            await trio.sleep(ACCEPT_RETRY)
                            continue
                        handlers.start_soon(_handle, handler, stream)
                        for stream in _take_queued(queue, ACCEPT_BATCH):
                            handlers.start_soon(_handle, handler, stream)
                for stream in _take_queued(queue):
                    handlers.start_soon(_handle, handler, stream)
            finally:
                if queue is not None:
                    queue.close()

    def _certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.config.cert.read_bytes())

    @property
    def open_relays(self) -> int:
        return self.relayer.open

    def cut_drain(self) -> None:
        """Stop waiting for open streams (a second signal): they are aborted now."""
        self._drain_cut.set()

    async def shutdown(self) -> None:
        """Drain (see the module): stop accepting, tell agents and clients, give open streams up to the
        drain timeout, then close every tunnel and stop."""
        self.ready = False
        self.stopping = True
        if self.config.shutdown_delay:
            self.log.info("shutdown_delayed", delay=self.config.shutdown_delay)
            with trio.move_on_after(self.config.shutdown_delay):
                await self._drain_cut.wait()  # a second signal skips the rest of the delay
        self.drain.started.set()
        started = trio.current_time()
        self.log.info(
            "server_draining",
            open_streams=self.relayer.open,
            client_connections=self._client_connections,
            drain_timeout=self.config.drain_timeout,
        )
        for scope in self._accepting:
            scope.cancel()
        for tunnel in self.registry.tunnels():
            tunnel.mux.drain()
        with trio.move_on_after(self.config.drain_timeout) as waiting:
            async with trio.open_nursery() as wait:

                async def cut() -> None:
                    await self._drain_cut.wait()
                    wait.cancel_scope.cancel()

                wait.start_soon(cut)
                await self._clients_gone.wait()
                wait.cancel_scope.cancel()
        if self._client_connections:
            waited = trio.current_time() - started
            self.log.warning(
                "drain_timeout" if waiting.cancelled_caught else "drain_cut_short",
                open_streams=self.relayer.open,
                client_connections=self._client_connections,
                waited=round(waited, 3),
                error="aborting the streams still open (their clients see a reset, not an end)",
            )
            self.drain.cut(
                f"proxy-server shut down: streams still open after {waited:.3g}s of drain "
                f"(--drain-timeout {self.config.drain_timeout:g}s)"
            )
            # Their GOAWAY (and its reason) goes out before the connections are torn down; cancelling
            # a connection's writer could lose it.
            with trio.move_on_after(CUT_GRACE):
                await self.drain.wait_http2_closed()
        self._clients.cancel_scope.cancel()  # what is left (HTTP/1.1 relays) is aborted: RST
        for tunnel in self.registry.tunnels():
            tunnel.mux.close("proxy-server shutting down")
        with trio.move_on_after(CUT_GRACE):  # as above: their GOAWAY goes out first
            await self.registry.wait_empty()
        self._agents.cancel_scope.cancel()
        self.log.info("server_drained", waited=round(trio.current_time() - started, 3))

    async def handle_agent(self, tcp: trio.SocketStream) -> None:
        await self._guarded("agent", tcp, self.agent_port.serve)

    async def handle_agent_websocket(self, tcp: trio.SocketStream) -> None:
        await self._guarded("agent-websocket", tcp, self.agent_websocket_port.serve)

    async def handle_client(self, tcp: trio.SocketStream) -> None:
        if self._client_connections == 0:
            self._clients_gone = trio.Event()
        self._client_connections += 1
        try:
            await self._guarded("client", tcp, self._serve_client)
        finally:
            self._client_connections -= 1
            if self._client_connections == 0:
                self._clients_gone.set()

    async def _guarded(
        self, port: str, tcp: trio.SocketStream, serve: Callable[[trio.SocketStream], Awaitable[None]]
    ) -> None:
        """A bug in one connection's handling must cost that connection only, never the server."""
        try:
            await serve(tcp)
        except Exception:
            self.log.exception("connection_handler_failed", port=port)
            await trio.aclose_forcefully(tcp)

    async def _serve_client(self, tcp: trio.SocketStream) -> None:
        cfg = self.config
        try:
            peer = format_address(tcp.socket.getpeername())
        except OSError:  # reset before we got to it: nothing to serve (not a handler failure)
            self.metrics.rejected.labels("client", "gone before the handshake").inc()
            return
        peer_tls = await accept_tls(
            tcp,
            self._client_tls.context,
            "client",
            cfg.handshake_timeout,
            self.metrics,
            self.log,
            accepted=CertRole.CLIENT,
            peer=peer,
        )
        if peer_tls is None:
            return
        stream, client = peer_tls.stream, ClientIdentity.from_cert(peer_tls.cert)
        del peer_tls  # its parsed certificate (~4 KiB) is not kept for the connection's life
        try:
            with trio.fail_after(cfg.handshake_timeout):
                protocol, received = await client_protocol(stream)
        except trio.TooSlowError:
            await send_and_close(stream, error_response(408, "request not received in time"))
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await trio.aclose_forcefully(stream)
            return
        if protocol == "unknown":
            self.metrics.rejected.labels("client", "unknown protocol").inc()
            self.log.info(
                "client_protocol_unknown",
                peer=peer,
                client=client.name,
                error="neither the HTTP/2 preface nor an HTTP/1.1 request line: closed without a reply",
                first_bytes=received[:32].hex(),
            )
            await close_cleanly(stream)
            return
        on_limit = limit_reporter(
            self.log,
            self.metrics.count_limit("client"),
            port="client",
            peer=peer,
            client=client.name,
        )
        quota: ConnectionQuota | None = None
        try:
            quota = self.quotas.open_connection(client)
        except QuotaExceeded as exc:
            refusal = exc.reason
        connection = ClientConnection(
            stream,
            client,
            received,
            self.relayer.connection_proxy(quota),
            cfg.handshake_timeout,
            cfg.client_tunnel,
            on_limit,
            self.drain,
            quota,
            cfg.tunnel.first_window,
        )
        if quota is None:
            self.metrics.rejected.labels("client", "client quota").inc()
            self.relayer.audit_refused_connection(client, protocol, 429, refusal)
            await REFUSALS[protocol](connection, refusal)
            return
        try:
            await FRONTENDS[protocol](connection)
        finally:
            self.quotas.close_connection(quota)


async def _handle(handler: Callable[[trio.SocketStream], Awaitable[None]], stream: trio.SocketStream) -> None:
    try:
        await handler(stream)
    finally:
        await trio.aclose_forcefully(stream)


def _queue_of(listener: trio.SocketListener) -> socket.socket | None:
    """A non-blocking duplicate of ``listener``'s descriptor (it shares the accept queue), to take the
    connections waiting there without a pass through the scheduler for each; None if none can be made."""
    try:
        queue = socket.socket(fileno=os.dup(listener.socket.fileno()))
    except OSError:
        return None
    queue.setblocking(False)
    return queue


def _take_queued(queue: socket.socket | None, limit: int | None = None) -> list[trio.SocketStream]:
    """Connections waiting in ``queue`` (see :func:`_queue_of`), up to ``limit``, taken without waiting."""
    found: list[trio.SocketStream] = []
    while queue is not None and (limit is None or len(found) < limit):
        try:
            sock, _ = queue.accept()
        except OSError:  # BlockingIOError: the queue is empty (another error: the next accept() has it)
            break
        found.append(trio.SocketStream(trio.socket.from_stdlib_socket(sock)))
    return found
