"""The proxy-server: agent port, client port (HTTP/2 and HTTP/1.1 CONNECT), admin port."""

from __future__ import annotations

import json
import socket
import ssl
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio
from cryptography import x509

from clusterproxy_protocol.admin import Reply, serve_admin
from clusterproxy_protocol.certclient import CertFiles, SignerEndpoint
from clusterproxy_protocol.core import Role, TunnelSettings
from clusterproxy_protocol.driver import IncomingRequest, Mux, TunnelStream, open_mux
from clusterproxy_protocol.errors import (
    ConnectRefused,
    DialTimeout,
    Forbidden,
    NoAgentConnected,
    TargetUnreachable,
    TunnelClosed,
    TunnelError,
)
from clusterproxy_protocol.logs import get_logger
from clusterproxy_protocol.pki import agent_identity_from_cert
from clusterproxy_protocol.relay import relay
from clusterproxy_protocol.reloader import CertRenewer, ReloadingContext, RenewalPolicy
from clusterproxy_server import h1, sniff
from clusterproxy_server.authz import ClientIdentity, PolicyFile
from clusterproxy_server.metrics import ServerMetrics
from clusterproxy_server.registry import AgentTunnel, Registry
from clusterproxy_server.routing import Route, resolve

SERVER_ID_HEADER = "cluster-proxy-server-id"
SERVER_COUNT_HEADER = "cluster-proxy-server-count"


@dataclass
class ServerConfig:
    ca: Path
    cert: Path
    key: Path
    agent_listen: tuple[str, int] = ("0.0.0.0", 8091)
    client_listen: tuple[str, int] = ("0.0.0.0", 8090)
    admin_listen: tuple[str, int] = ("0.0.0.0", 8092)
    server_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
    server_count: int = 1
    known_clusters: set[str] = field(default_factory=set)
    dial_timeout: float = 30.0
    handshake_timeout: float = 10.0
    keepalive_interval: float = 10.0
    keepalive_timeout: float = 20.0
    drain_timeout: float = 30.0
    tunnel: TunnelSettings = field(default_factory=TunnelSettings)
    # cert-signer: bootstrap (``main.serve``) and renewal; None keeps the files as they are
    signer: str | None = None
    bootstrap_token: str | None = None
    tls_hosts: tuple[str, ...] = ()
    trust_refresh: float = 300.0
    # which clients reach which clusters (authz.py); None: every client reaches every cluster
    client_policy: Path | None = None


@dataclass(frozen=True)
class BoundAddresses:
    agent: tuple[str, int]
    client: tuple[str, int]
    admin: tuple[str, int]


def _address(sock_name: tuple[str, int] | tuple[str, int, int, int]) -> str:
    host, port = sock_name[0], sock_name[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ProxyServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.registry = Registry(config.known_clusters)
        self.metrics = ServerMetrics()
        self.log = get_logger("proxy-server", server_id=config.server_id)
        # Read at each handshake: a renewed certificate or a changed trust bundle applies to new
        # connections only; live tunnels and streams keep the session they have.
        self._agent_tls = ReloadingContext.server(config.cert, config.key, config.ca, alpn=["h2"])
        self._client_tls = ReloadingContext.server(
            config.cert, config.key, config.ca, alpn=["h2", "http/1.1"]
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
        self._relays = 0
        self._idle = trio.Event()
        self._idle.set()
        self.ready = False

    # -- running ----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[BoundAddresses] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        agent_listeners = await trio.open_tcp_listeners(cfg.agent_listen[1], host=cfg.agent_listen[0])
        client_listeners = await trio.open_tcp_listeners(cfg.client_listen[1], host=cfg.client_listen[0])
        admin_listeners = await trio.open_tcp_listeners(cfg.admin_listen[1], host=cfg.admin_listen[0])
        bound = BoundAddresses(
            *(ls[0].socket.getsockname()[:2] for ls in (agent_listeners, client_listeners, admin_listeners))
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_admin, admin_listeners, self._admin_routes())
            if self.renewer is not None:
                await nursery.start(self.renewer.run)
            async with trio.open_nursery() as ports:
                self._ports = ports
                ports.start_soon(trio.serve_listeners, self.handle_agent, agent_listeners)
                ports.start_soon(trio.serve_listeners, self.handle_client, client_listeners)
                self.ready = True
                self.log.info(
                    "server_started",
                    agent_port=_address(bound.agent),
                    client_port=_address(bound.client),
                    admin_port=_address(bound.admin),
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
        return self._relays

    async def shutdown(self) -> None:
        """Stop accepting, let open streams finish (up to the drain timeout), then stop."""
        self.ready = False
        self.log.info("server_draining", open_streams=self._relays)
        for tunnel in self.registry.tunnels():
            tunnel.mux.drain()
        with trio.move_on_after(self.config.drain_timeout):
            await self._idle.wait()
        self._ports.cancel_scope.cancel()

    # -- agent port -------------------------------------------------------------------------------

    async def _handshake(
        self, tcp: trio.SocketStream, context: ssl.SSLContext, port: str
    ) -> trio.SSLStream | None:
        peer = _address(tcp.socket.getpeername())
        stream = trio.SSLStream(tcp, context, server_side=True, https_compatible=True)
        try:
            with trio.fail_after(self.config.handshake_timeout):
                await stream.do_handshake()
            return stream
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            cause = exc.__cause__ or exc
            reason = "handshake timeout" if isinstance(exc, trio.TooSlowError) else type(cause).__name__
            self.metrics.rejected.labels(port, reason).inc()
            self.log.info("tls_handshake_failed", port=port, peer=peer, error=str(cause) or reason)
            await trio.aclose_forcefully(tcp)
            return None

    async def handle_agent(self, tcp: trio.SocketStream) -> None:
        await self._guarded("agent", tcp, self._serve_agent)

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

    async def _serve_agent(self, tcp: trio.SocketStream) -> None:
        peer = _address(tcp.socket.getpeername())
        stream = await self._handshake(tcp, self._agent_tls.context, "agent")
        if stream is None:
            return
        identity = agent_identity_from_cert(
            x509.load_der_x509_certificate(stream.getpeercert(binary_form=True))
        )
        cfg = self.config
        async with open_mux(
            stream,
            Role.OPENER,
            settings=cfg.tunnel,
            keepalive=(cfg.keepalive_interval, cfg.keepalive_timeout),
        ) as mux:
            tunnel = await self._register(mux, identity, peer)
            if tunnel is None:
                return
            try:
                await mux.closed.wait()
            finally:
                self.registry.remove(tunnel)
                self.metrics.tunnels.labels(tunnel.cluster).dec()
                self.log.info(
                    "agent_disconnected",
                    cluster=tunnel.cluster,
                    agent_id=tunnel.agent_id,
                    peer=peer,
                    error=mux.dead_reason,
                    bytes_in=mux.bytes_in,
                    bytes_out=mux.bytes_out,
                )

    async def _register(self, mux: Mux, identity: tuple[str, str] | None, peer: str) -> AgentTunnel | None:
        def refuse(reason: str) -> None:
            self.metrics.rejected.labels("agent", "registration").inc()
            self.log.warning("agent_refused", peer=peer, error=reason)
            mux.close(reason)

        if identity is None:
            refuse(
                "client certificate carries no cluster-proxy agent identity (URI SAN cluster-proxy://cluster/...)"
            )
            return None
        cert_cluster, cert_agent = identity
        headers = [
            (SERVER_ID_HEADER, self.config.server_id),
            (SERVER_COUNT_HEADER, str(self.config.server_count)),
        ]
        try:
            with trio.fail_after(self.config.handshake_timeout):
                response = await mux.request("GET", "/v1/info", headers)
            info = json.loads(response.body)
            claimed_cluster, claimed_agent = str(info["cluster"]), str(info["agent_id"])
        except (TunnelError, trio.TooSlowError, ValueError, KeyError, TypeError) as exc:
            refuse(f"agent info request failed: {type(exc).__name__}: {exc}")
            return None
        if (claimed_cluster, claimed_agent) != (cert_cluster, cert_agent):
            refuse(
                f"agent claims cluster {claimed_cluster!r} agent {claimed_agent!r} but its certificate is for "
                f"cluster {cert_cluster!r} agent {cert_agent!r}"
            )
            return None
        tunnel = AgentTunnel(cert_cluster, cert_agent, mux, peer)
        self.registry.add(tunnel)
        self.metrics.tunnels.labels(tunnel.cluster).inc()
        self.metrics.tunnel_connects.labels(tunnel.cluster).inc()
        self.log.info(
            "agent_connected",
            cluster=tunnel.cluster,
            agent_id=tunnel.agent_id,
            peer=peer,
            version=info.get("version"),
        )
        return tunnel

    # -- client port ------------------------------------------------------------------------------

    async def _serve_client(self, tcp: trio.SocketStream) -> None:
        stream = await self._handshake(tcp, self._client_tls.context, "client")
        if stream is None:
            return
        client = ClientIdentity.from_der(stream.getpeercert(binary_form=True))
        try:
            with trio.fail_after(self.config.handshake_timeout):
                protocol, received = await sniff.client_protocol(stream)
        except trio.TooSlowError:
            await self._send_and_close(stream, h1.error_response(408, "request not received in time"))
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await trio.aclose_forcefully(stream)
            return
        if protocol == "h2":
            await self._serve_h2_client(stream, client, received)
        else:
            await self._serve_h1_client(stream, client, received)

    async def _serve_h2_client(self, stream: trio.SSLStream, client: ClientIdentity, received: bytes) -> None:
        async def handle(request: IncomingRequest) -> None:
            if request.method != "CONNECT":
                await request.refuse(405, f"method {request.method} not served: open CONNECT streams here")
                return
            await self._proxy(
                "h2", client, request.authority, request.headers, request.accept, request.refuse
            )

        async with open_mux(
            stream, Role.ACCEPTOR, settings=self.config.tunnel, handler=handle, received=received
        ) as mux:
            await mux.closed.wait()

    async def _serve_h1_client(self, stream: trio.SSLStream, client: ClientIdentity, received: bytes) -> None:
        try:
            with trio.fail_after(self.config.handshake_timeout):
                request = await h1.read_request(stream, received)
        except trio.TooSlowError:
            await self._send_and_close(stream, h1.error_response(408, "request head not received in time"))
            return
        except h1.BadRequest as exc:
            await self._send_and_close(stream, h1.error_response(exc.status, exc.reason))
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await trio.aclose_forcefully(stream)
            return
        if request is None:
            await trio.aclose_forcefully(stream)
            return
        authority, early_data = request.target, request.early_data
        if request.method != "CONNECT":  # plain HTTP proxying: GET http://host/path (curl -x without -p)
            try:
                authority, head = h1.forward_form(request)
            except h1.BadRequest as exc:
                await self._send_and_close(stream, h1.error_response(exc.status, exc.reason))
                return
            early_data = head + early_data

        async def accept() -> trio.abc.Stream:
            if request.method == "CONNECT":
                await stream.send_all(h1.established())
            return stream

        async def refuse(status: int, reason: str) -> None:
            await self._send_and_close(stream, h1.error_response(status, reason))

        await self._proxy("http1", client, authority, request.headers, accept, refuse, early_data)

    async def _send_and_close(self, stream: trio.SSLStream, data: bytes) -> None:
        try:
            with trio.move_on_after(5):
                await stream.send_all(data)
                await stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        await trio.aclose_forcefully(stream)

    # -- proxying ---------------------------------------------------------------------------------

    async def _proxy(
        self,
        frontend: str,
        client: ClientIdentity,
        authority: str,
        headers: dict[str, str],
        accept: Callable[[], Awaitable[trio.abc.Stream]],
        refuse: Callable[[int, str], Awaitable[None]],
        early_data: bytes = b"",
    ) -> None:
        log = self.log.bind(frontend=frontend, client=client.name, target=authority)
        try:
            route = resolve(authority, headers, self.registry.known_clusters)
            log = log.bind(cluster=route.cluster)
            self._authorize(client, route.cluster)
            with self.metrics.dial_seconds.time():
                upstream, tunnel = await self._dial(route)
        except ConnectRefused as exc:
            self.metrics.streams.labels(frontend, str(exc.status)).inc()
            log.info("stream_refused", status=exc.status, error=exc.reason)
            await refuse(exc.status, exc.reason)
            return
        self.metrics.streams.labels(frontend, "200").inc()
        log = log.bind(agent_id=tunnel.agent_id, stream_id=upstream.stream_id)
        if self._relays == 0:
            self._idle = trio.Event()
        self._relays += 1
        gauge = self.metrics.streams_open.labels(frontend)
        gauge.inc()
        try:
            downstream = await accept()
            if early_data:
                await upstream.send_all(early_data)
            log.debug("stream_opened")
            result = await relay(downstream, upstream)
            self.metrics.bytes.labels("to_cluster").inc(result.bytes_a_to_b)
            self.metrics.bytes.labels("from_cluster").inc(result.bytes_b_to_a)
            log.info(
                "stream_closed",
                bytes_out=result.bytes_a_to_b,
                bytes_in=result.bytes_b_to_a,
                error=result.error,
            )
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("stream_failed", error=str(exc))
        finally:
            # Bookkeeping first: under cancellation every await below would raise at once.
            gauge.dec()
            self._relays -= 1
            if self._relays == 0:
                self._idle.set()
            upstream.abort()  # a no-op when the relay closed it already

    def _authorize(self, client: ClientIdentity, cluster: str) -> None:
        """Raise Forbidden (403) when the client policy keeps ``client`` out of ``cluster``. Checked
        before the cluster's existence, so a refused client learns nothing about it."""
        if self.policy is None:
            return
        decision = self.policy.decide(client, cluster)
        if not decision.allowed:
            raise Forbidden(decision.reason)

    async def _dial(self, route: Route) -> tuple[TunnelStream, AgentTunnel]:
        """Open the stream on the least-loaded tunnel; a tunnel that dies meanwhile makes us try the next."""
        lost: set[AgentTunnel] = set()
        while True:
            try:
                tunnel = self.registry.pick(route.cluster, exclude=lost)
            except NoAgentConnected:
                if lost:
                    names = ", ".join(sorted(t.agent_id for t in lost))
                    raise TargetUnreachable(
                        f"agent {names} of cluster {route.cluster!r} disconnected while dialing"
                    ) from None
                raise
            try:
                with trio.fail_after(self.config.dial_timeout):
                    return await tunnel.mux.open_connect(route.authority), tunnel
            except TunnelClosed:
                lost.add(tunnel)
            except trio.TooSlowError:
                raise DialTimeout(
                    f"agent {tunnel.agent_id} of cluster {route.cluster!r} did not answer within "
                    f"{self.config.dial_timeout:g}s"
                ) from None

    # -- admin ------------------------------------------------------------------------------------

    def _admin_routes(self) -> dict[str, Callable[[], Reply]]:
        def ready() -> Reply:
            return Reply.text("ready") if self.ready else Reply.text("not ready: starting or draining", 503)

        def clusters() -> Reply:
            return Reply.json(
                {
                    name: {"agents": len(self.registry.tunnels(name))}
                    for name in sorted(self.registry.known_clusters)
                }
            )

        return {
            "/healthz": lambda: Reply.text("ok"),
            "/readyz": ready,
            "/metrics": lambda: Reply.metrics(self.metrics.registry),
            "/api/v1/agents": lambda: Reply.json([t.describe() for t in self.registry.tunnels()]),
            "/api/v1/clusters": clusters,
        }
