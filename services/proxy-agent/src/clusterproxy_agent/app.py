"""The running agent: its tunnels to the hub, its admin port, its certificate kept fresh, its drain.

``main.py`` parses the flags into :class:`~clusterproxy_agent.config.AgentSettings`; :func:`serve`
bootstraps the certificate (with a signer), runs a :class:`Service` and drains it at the first
SIGTERM/SIGINT (``clusterproxy_protocol.service_runtime``).
"""

from __future__ import annotations

import trio

from clusterproxy_agent.agent import Agent, AgentConfig
from clusterproxy_agent.aiming import aimed_dial
from clusterproxy_agent.config import AgentSettings
from clusterproxy_agent.control import ControlEndpoint
from clusterproxy_agent.replicas import ReplicaSet
from clusterproxy_agent.tunnel import Opener, TunnelOptions, tls_opener, websocket_carrier
from clusterproxy_protocol import (
    CertRenewer,
    Response,
    certclient,
    get_logger,
    listen_on,
    metrics_response,
    serve_admin,
    serve_until_signalled,
    web_client_context,
)

__all__ = ["Service", "bootstrap", "serve"]


async def bootstrap(settings: AgentSettings) -> None:
    """With a signer: trade the bootstrap token for a first certificate when the files hold no valid
    one. A refused token (used, expired, for another cluster) is final: ConfigError with the signer's
    reason. A signer that does not answer yet is retried (``bootstrap_with_retry``)."""
    signer = settings.signer_settings()
    if signer is None:
        return
    await signer.bootstrap(
        settings.cert_files(),
        lambda key: certclient.agent_csr(key, settings.cluster, settings.agent_id),
        get_logger("clusterproxy_agent", cluster=settings.cluster, agent_id=settings.agent_id),
        endpoint=settings.signer_endpoint(),
    )


class Service:
    """A running agent: tunnel, admin server; :meth:`shutdown` drains it."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.agent = Agent(
            AgentConfig(
                cluster=settings.cluster,
                agent_id=settings.agent_id,
                kube_apiserver=settings.kube_apiserver,
                dial_timeout=settings.dial_timeout,
                policy=settings.policy(),
                buffer_budget=settings.buffer_budget,
            ),
            control=ControlEndpoint(settings.cluster, settings.kube_apiserver, settings.serviceaccounts),
        )
        self.tls = settings.reloading_context()
        self.replicas = ReplicaSet(self.agent, [self._target(address) for address in settings.servers])
        self.renewer: CertRenewer | None = None
        signer = settings.signer_settings()
        if signer is not None:
            self.renewer = signer.renewer(
                settings.cert_files(), [self.tls], endpoint=settings.signer_endpoint()
            )
            self.agent.metrics.watch_renewer(self.renewer)
        self.log = self.agent.log
        self.admin_address = ""
        self.draining = False
        self.stop_requested = trio.Event()  # run() drains and returns once it is set
        self.stopped = trio.Event()  # run() has returned

    def _target(self, address: tuple[str, int]) -> tuple[TunnelOptions, Opener]:
        """How to reach one --server address: its tunnel options and its TLS opener (through the
        forward proxy that applies to it, if any; in a WebSocket with a wss:// --server)."""
        settings = self.settings
        proxy, _route = settings.forward_proxy(*address)
        options = TunnelOptions(
            server=address,
            url=settings.websocket.url(*address) if settings.websocket is not None else None,
            connect_timeout=settings.connect_timeout,
            keepalive=(settings.keepalive_interval, settings.keepalive_timeout),
            backoff_initial=settings.backoff_initial,
            backoff_max=settings.backoff_max,
            search_backoff_max=settings.replica_search_backoff_max,
            settings=settings.tunnel,
            proxy=str(proxy) if proxy is not None else None,
        )
        carrier = None
        if settings.websocket is not None:
            ca_file = settings.websocket_ca_file
            outer = (lambda: web_client_context(ca_file)) if settings.websocket.secure else None
            carrier = websocket_carrier(*address, settings.websocket.path, outer)
        opener = tls_opener(
            address,
            self.tls,
            settings.server_name,
            dial=proxy.open if proxy else aimed_dial(self.agent),
            carrier=carrier,
        )
        return options, opener

    # admin routes
    def healthz(self) -> Response:
        return Response.text("ok")

    def readyz(self) -> Response:
        if self.draining:
            return Response.text("not ready: shutting down", 503)
        connected = self.agent.connected
        if connected:
            return Response.text(f"ok: {connected} tunnel(s) connected to {self.settings.server_list}")
        last = self.agent.last_error or "still connecting"
        return Response.text(f"not ready: no tunnel connected to {self.settings.server_list} ({last})", 503)

    def metrics(self) -> Response:
        return metrics_response(self.agent.metrics.registry)

    def servers(self) -> Response:
        return Response.json(self.agent.describe_servers())

    async def run(self, *, task_status: trio.TaskStatus[Service] = trio.TASK_STATUS_IGNORED) -> None:
        listeners, self.admin_address = await listen_on("--admin-listen", self.settings.admin_listen)
        async with trio.open_nursery() as nursery:
            await nursery.start(
                serve_admin,
                listeners,
                {
                    "/healthz": self.healthz,
                    "/readyz": self.readyz,
                    "/metrics": self.metrics,
                    "/api/v1/servers": self.servers,
                },
            )
            if self.renewer is not None:
                await nursery.start(self.renewer.run)
            await nursery.start(self.replicas.run)
            self.log.info("agent_started", admin_port=self.admin_address, server=self.settings.server_list)
            task_status.started(self)
            await self.stop_requested.wait()
            await self.shutdown()
            nursery.cancel_scope.cancel()
        self.stopped.set()

    async def shutdown(self) -> None:
        """Drain: no new streams, open ones get up to --drain-timeout, then every tunnel closes."""
        self.draining = True
        self.replicas.stop()
        self.agent.drain()
        open_streams = sum(m.open_streams for m in self.agent.tunnels)
        self.log.info("draining", open_streams=open_streams, drain_timeout=self.settings.drain_timeout)
        with trio.move_on_after(self.settings.drain_timeout) as scope:
            await self.agent.wait_idle()
        if scope.cancelled_caught:
            left = sum(m.open_streams for m in self.agent.tunnels)
            self.log.warning("drain_timeout", open_streams=left)
        self.agent.close_all("agent shutting down")
        with trio.move_on_after(5):
            await self.replicas.stopped.wait()
        self.log.info("agent_stopped")


async def serve(
    settings: AgentSettings, *, task_status: trio.TaskStatus[Service] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run until SIGTERM/SIGINT, then drain (a second signal cuts the drain short)."""
    await bootstrap(settings)
    service = Service(settings)
    await serve_until_signalled(
        service.run,
        service.log,
        stop=service.stop_requested,  # run() drains by itself once it is set
        drain=service.stopped.wait,
        cut=lambda: service.agent.close_all("agent stopped"),
        first_event="shutdown_requested",
        cut_event="shutdown_forced",
        task_status=task_status,
    )
