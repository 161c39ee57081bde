"""The agent port: mutual TLS, the agent's identity from its certificate, registration, and the tunnel
kept in the registry for as long as it lives."""

from __future__ import annotations

import json
from collections.abc import Callable

import structlog
import trio
from cryptography import x509

from clusterproxy_protocol.core import Role, TunnelSettings
from clusterproxy_protocol.driver import Mux, open_mux
from clusterproxy_protocol.errors import TunnelError
from clusterproxy_protocol.pki import CertRole, agent_identity_from_cert
from clusterproxy_protocol.wire import INFO_PATH, SERVER_COUNT_HEADER, SERVER_ID_HEADER, format_address
from clusterproxy_server.handshake import accept_tls
from clusterproxy_server.metrics import ServerMetrics
from clusterproxy_server.registry import AgentTunnel, Registry


class AgentPort:
    def __init__(
        self,
        *,
        context: Callable[[], object],
        registry: Registry,
        metrics: ServerMetrics,
        log: structlog.stdlib.BoundLogger,
        server_id: str,
        server_count: int,
        handshake_timeout: float,
        keepalive: tuple[float, float],
        tunnel_settings: TunnelSettings,
    ) -> None:
        self._context = context
        self.registry = registry
        self.metrics = metrics
        self.log = log
        self.server_id = server_id
        self.server_count = server_count
        self.handshake_timeout = handshake_timeout
        self.keepalive = keepalive
        self.tunnel_settings = tunnel_settings

    async def serve(self, tcp: trio.SocketStream) -> None:
        peer = format_address(tcp.socket.getpeername())
        stream = await accept_tls(
            tcp,
            self._context(),
            "agent",
            self.handshake_timeout,
            self.metrics,
            self.log,
            accepted=CertRole.AGENT,
        )
        if stream is None:
            return
        identity = agent_identity_from_cert(
            x509.load_der_x509_certificate(stream.getpeercert(binary_form=True))
        )
        async with open_mux(
            stream, Role.OPENER, settings=self.tunnel_settings, keepalive=self.keepalive
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
        headers = [(SERVER_ID_HEADER, self.server_id), (SERVER_COUNT_HEADER, str(self.server_count))]
        try:
            with trio.fail_after(self.handshake_timeout):
                response = await mux.request("GET", INFO_PATH, headers)
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
