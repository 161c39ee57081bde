"""The agent port: mutual TLS, the agent's identity from its certificate, registration, and the tunnel
kept in the registry for as long as it lives.

Registration is ``GET /v1/info`` on the new tunnel, telling the agent this replica's id and the replica
count. An agent that already holds a tunnel to this replica (its dial through a load balancer landed
here again) answers ``409``: the tunnel is closed, counted in
``cluster_proxy_server_agent_duplicate_dials_total`` and logged at debug level only, since agents
looking for a missing replica do this by design."""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable

import structlog
import trio

from clusterproxy_protocol import (
    CANCEL,
    INFO_PATH,
    REASON_HEADER,
    SERVER_COUNT_HEADER,
    SERVER_ID_HEADER,
    SERVER_WORKER_HEADER,
    CertRole,
    Mux,
    Role,
    TunnelClosed,
    TunnelError,
    TunnelSettings,
    agent_identity_from_cert,
    format_address,
    format_worker,
    limit_reporter,
    open_mux,
)
from clusterproxy_server.handshake import HandshakeGate, accept_tls, peer_gone
from clusterproxy_server.metrics import ServerMetrics
from clusterproxy_server.registry import AgentTunnel, Registry

REPLICA_ALREADY_HELD = 409  # the agent's answer to /v1/info: it holds a tunnel to this replica already


class AgentPort:
    def __init__(
        self,
        *,
        context: Callable[[], ssl.SSLContext],
        registry: Registry,
        metrics: ServerMetrics,
        log: structlog.typing.FilteringBoundLogger,
        server_id: str,
        server_count: int,
        worker: tuple[int, int] | None = None,
        handshake_timeout: float,
        keepalive: tuple[float, float],
        tunnel_settings: TunnelSettings,
        draining: trio.Event | None = None,
        handshakes: HandshakeGate | None = None,
    ) -> None:
        self._context = context
        self.registry = registry
        self.metrics = metrics
        self.log = log
        self.server_id = server_id
        self.server_count = server_count
        self.worker = worker
        self.handshake_timeout = handshake_timeout
        self.keepalive = keepalive
        self.tunnel_settings = tunnel_settings
        self.draining = draining if draining is not None else trio.Event()  # set on SIGTERM
        self.handshakes = handshakes or HandshakeGate()

    async def serve(self, tcp: trio.SocketStream) -> None:
        try:
            peer = format_address(tcp.socket.getpeername())
        except OSError:  # reset before we got to it (an agent that stopped waiting): nothing to serve
            self.metrics.rejected.labels("agent", "gone before the handshake").inc()
            return
        # Its place at the gate once its ClientHello is here: a connection that sends nothing holds
        # no place (it ends at the handshake timeout, as before).
        with trio.move_on_after(self.handshake_timeout) as silent:
            await trio.lowlevel.wait_readable(tcp.socket)
        if silent.cancelled_caught:  # as accept_tls counts and logs a handshake that does not finish
            self.metrics.rejected.labels("agent", "handshake timeout").inc()
            self.log.info("tls_handshake_failed", port="agent", peer=peer, error="handshake timeout")
            return
        await self.serve_transport(tcp, peer, "agent")

    async def serve_transport(self, transport: trio.abc.Stream, peer: str, port: str) -> None:
        """An agent's tunnel on ``transport`` (TCP, or a WebSocket's byte stream from
        :mod:`.agent_websocket`, whose ``port`` label its refusals are counted under)."""
        try:
            async with self.handshakes.place():
                if isinstance(transport, trio.SocketStream) and peer_gone(transport.socket):
                    self.metrics.rejected.labels(port, "gone before the handshake").inc()
                    return
                peer_tls = await accept_tls(
                    transport,
                    self._context(),
                    port,
                    self.handshake_timeout,
                    self.metrics,
                    self.log,
                    accepted=CertRole.AGENT,
                    peer=peer,
                )
        except trio.TooSlowError:  # no place in time: its agent redials after its backoff
            self.metrics.rejected.labels(port, "handshake queue").inc()
            return
        if peer_tls is None:
            return
        stream = peer_tls.stream
        identity = agent_identity_from_cert(peer_tls.cert)
        del peer_tls  # its parsed certificate (~4 KiB) is not kept for the tunnel's life
        assert identity is not None  # accept_tls admits agent-role certificates only, which carry it
        on_limit = limit_reporter(
            self.log, self.metrics.count_limit("agent"), port="agent", peer=peer, identity=identity
        )
        async with open_mux(
            stream, Role.OPENER, settings=self.tunnel_settings, keepalive=self.keepalive, on_limit=on_limit
        ) as mux:
            tunnel = await self._register(mux, identity, peer)
            if tunnel is None:
                return
            if self.draining.is_set():  # registered while this replica drains: the agent moves on
                mux.drain()
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

    async def _register(self, mux: Mux, identity: tuple[str, str], peer: str) -> AgentTunnel | None:
        def refuse(reason: str, label: str = "registration") -> None:
            self.metrics.rejected.labels("agent", label).inc()
            self.log.warning("agent_refused", peer=peer, error=reason)
            mux.close(reason)

        cert_cluster, cert_agent = identity
        headers = [(SERVER_ID_HEADER, self.server_id), (SERVER_COUNT_HEADER, str(self.server_count))]
        if self.worker is not None:
            headers.append((SERVER_WORKER_HEADER, format_worker(*self.worker)))
        try:
            with trio.fail_after(self.handshake_timeout):
                response = await mux.request("GET", INFO_PATH, headers)
            if response.status == REPLICA_ALREADY_HELD:
                reason = response.headers.get(REASON_HEADER) or "the agent holds a tunnel to this server"
                self.metrics.agent_duplicate_dials.labels(cert_cluster).inc()
                self.log.debug(
                    "agent_tunnel_not_needed",
                    cluster=cert_cluster,
                    agent_id=cert_agent,
                    peer=peer,
                    error=reason,
                )
                mux.close(f"closed at the agent's request: {reason}")
                return None
            if response.status != 200:
                raise ValueError(f"status {response.status}: {response.body[:200]!r}")
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
        taken = await self._claim_identity(cert_cluster, cert_agent, peer)
        if taken is not None:
            refuse(taken, "duplicate_identity")
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

    async def _claim_identity(self, cluster: str, agent_id: str, peer: str) -> str | None:
        """None when no live tunnel holds this agent identity (one that does not answer a PING within
        the keepalive timeout is closed and replaced); else why the new tunnel is refused.

        Refused rather than replaced while the old one is alive: a second process with a copied
        certificate, or a misconfigured replica, must not take a working agent's place (or run beside
        it, taking half its streams). Replaced when the old one is dead: an agent that lost its
        connection and dialed again must not wait for our keepalive to notice."""
        existing = self.registry.find(cluster, agent_id)
        if existing is None:
            return None
        timeout = self.keepalive[1]
        with trio.move_on_after(timeout):
            try:
                await existing.mux.ping()
            except TunnelClosed:
                pass
            else:
                return (
                    f"agent {agent_id!r} of cluster {cluster!r} is already connected from {existing.peer} and "
                    "its tunnel answers PINGs: a second tunnel with the same identity is refused"
                )
        existing.mux.close(
            f"replaced by a new tunnel of the same agent from {peer}: no PING answer within {timeout:g}s",
            error_code=CANCEL,
        )
        self.registry.remove(existing)
        self.metrics.agent_replacements.labels(cluster).inc()
        self.log.warning(
            "agent_replaced", cluster=cluster, agent_id=agent_id, old_peer=existing.peer, peer=peer
        )
        if self.registry.find(cluster, agent_id) is not None:  # another dial won while we waited
            return f"agent {agent_id!r} of cluster {cluster!r} registered another tunnel meanwhile"
        return None
