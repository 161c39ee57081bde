"""The proxy-server: its three listeners (agent, client, admin), its lifecycle and drain.

The agent port is :mod:`.agent_port`; the client port hands each connection, once authenticated and
its protocol told by the first bytes, to a frontend (:mod:`.frontends`), which adapts it to the one
dial-and-relay path (:mod:`.relaying`); the admin port's routes are :mod:`.admin`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
from cryptography import x509

from clusterproxy_protocol.admin import serve_admin
from clusterproxy_protocol.certclient import CertFiles, SignerEndpoint
from clusterproxy_protocol.closing import close_cleanly
from clusterproxy_protocol.driver import limit_reporter
from clusterproxy_protocol.logs import get_logger
from clusterproxy_protocol.pki import CertRole
from clusterproxy_protocol.reloader import CertRenewer, ReloadingContext, RenewalPolicy
from clusterproxy_protocol.wire import ALPN_H2, ALPN_HTTP1, format_address
from clusterproxy_server.admin import admin_routes
from clusterproxy_server.agent_port import AgentPort
from clusterproxy_server.authz import ClientIdentity, PolicyFile
from clusterproxy_server.config import ServerConfig
from clusterproxy_server.ejection import OutlierEjection
from clusterproxy_server.frontends import FRONTENDS, ClientConnection
from clusterproxy_server.frontends.connection import send_and_close
from clusterproxy_server.frontends.http1_messages import error_response
from clusterproxy_server.frontends.sniff import client_protocol
from clusterproxy_server.handshake import accept_tls
from clusterproxy_server.metrics import ServerMetrics
from clusterproxy_server.pending_dials import PendingDials
from clusterproxy_server.registry import Registry
from clusterproxy_server.relaying import Relayer

__all__ = ["BoundAddresses", "ProxyServer", "ServerConfig"]


@dataclass(frozen=True)
class BoundAddresses:
    agent: tuple[str, int]
    client: tuple[str, int]
    admin: tuple[str, int]


class ProxyServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
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
        self.policy = PolicyFile(config.client_policy) if config.client_policy is not None else None
        self.renewer: CertRenewer | None = None
        if config.signer:
            self.renewer = CertRenewer(
                SignerEndpoint.parse(config.signer, config.ca),
                CertFiles(config.cert, config.key, config.ca),
                [self._agent_tls, self._client_tls],
                RenewalPolicy(trust_refresh=config.trust_refresh),
            )
            self.metrics.watch_renewer(self.renewer)
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
        )
        self.agent_port = AgentPort(
            context=lambda: self._agent_tls.context,
            registry=self.registry,
            metrics=self.metrics,
            log=self.log,
            server_id=config.server_id,
            server_count=config.server_count,
            handshake_timeout=config.handshake_timeout,
            keepalive=(config.keepalive_interval, config.keepalive_timeout),
            tunnel_settings=config.tunnel,
        )
        self.ready = False

    async def run(self, *, task_status: trio.TaskStatus[BoundAddresses] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        agent_listeners = await trio.open_tcp_listeners(cfg.agent_listen[1], host=cfg.agent_listen[0])
        client_listeners = await trio.open_tcp_listeners(cfg.client_listen[1], host=cfg.client_listen[0])
        admin_listeners = await trio.open_tcp_listeners(cfg.admin_listen[1], host=cfg.admin_listen[0])
        bound = BoundAddresses(
            *(ls[0].socket.getsockname()[:2] for ls in (agent_listeners, client_listeners, admin_listeners))
        )
        async with trio.open_nursery() as nursery:
            routes = admin_routes(self.registry, self.metrics, lambda: self.ready)
            await nursery.start(serve_admin, admin_listeners, routes)
            if self.renewer is not None:
                await nursery.start(self.renewer.run)
            async with trio.open_nursery() as ports:
                self._ports = ports
                ports.start_soon(trio.serve_listeners, self.handle_agent, agent_listeners)
                ports.start_soon(trio.serve_listeners, self.handle_client, client_listeners)
                self.ready = True
                self.log.info(
                    "server_started",
                    agent_port=format_address(bound.agent),
                    client_port=format_address(bound.client),
                    admin_port=format_address(bound.admin),
                    known_clusters=sorted(cfg.known_clusters),
                    signer=cfg.signer,
                    certificate_serial=format(self._certificate().serial_number, "x"),
                    client_policy=str(cfg.client_policy) if cfg.client_policy else None,
                )
                task_status.started(bound)
            nursery.cancel_scope.cancel()

    def _certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.config.cert.read_bytes())

    @property
    def open_relays(self) -> int:
        return self.relayer.open

    async def shutdown(self) -> None:
        """Stop accepting, let open streams finish (up to the drain timeout), then stop."""
        self.ready = False
        self.log.info("server_draining", open_streams=self.relayer.open)
        for tunnel in self.registry.tunnels():
            tunnel.mux.drain()
        with trio.move_on_after(self.config.drain_timeout):
            await self.relayer.wait_idle()
        self._ports.cancel_scope.cancel()

    async def handle_agent(self, tcp: trio.SocketStream) -> None:
        await self._guarded("agent", tcp, self.agent_port.serve)

    async def handle_client(self, tcp: trio.SocketStream) -> None:
        await self._guarded("client", tcp, self._serve_client)

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
        peer = format_address(tcp.socket.getpeername())
        stream = await accept_tls(
            tcp,
            self._client_tls.context,
            "client",
            cfg.handshake_timeout,
            self.metrics,
            self.log,
            accepted=CertRole.CLIENT,
        )
        if stream is None:
            return
        client = ClientIdentity.from_der(stream.getpeercert(binary_form=True))
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
        connection = ClientConnection(
            stream,
            client,
            received,
            self.relayer.connection_proxy(),
            cfg.handshake_timeout,
            cfg.client_tunnel,
            on_limit,
        )
        await FRONTENDS[protocol](connection)
