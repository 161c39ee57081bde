"""The one dial-and-relay path every client frontend uses.

A frontend adapts its connection to a :class:`ClientRequest` (what the client asked for, how to accept
and how to refuse it); :meth:`Relayer.proxy` does the rest the same way for all of them: route, authorize,
pick a tunnel, dial through the agent, relay, count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import structlog
import trio

from clusterproxy_protocol.driver import TunnelStream
from clusterproxy_protocol.errors import (
    ConnectRefused,
    DialTimeout,
    Forbidden,
    NoAgentConnected,
    TargetUnreachable,
    TunnelClosed,
)
from clusterproxy_protocol.relay import relay
from clusterproxy_server.authz import ClientIdentity, PolicyFile
from clusterproxy_server.metrics import ServerMetrics
from clusterproxy_server.registry import AgentTunnel, Registry
from clusterproxy_server.routing import Route, resolve


class ClientRequest(Protocol):
    """One client's request for a stream into a cluster, as a frontend presents it."""

    frontend: str  # the metrics and log label: "http1", "h2", ...
    client: ClientIdentity
    authority: str  # the target as the client wrote it
    headers: Mapping[str, str]  # lower-case names
    early_data: bytes  # bytes for the target the client sent with its request

    async def accept(self) -> trio.abc.Stream:
        """Tell the client the stream is open; the stream to relay with."""
        ...

    async def refuse(self, status: int, reason: str) -> None:
        """Tell the client why not, with an HTTP status and a one-line reason."""
        ...


class Relayer:
    def __init__(
        self,
        registry: Registry,
        metrics: ServerMetrics,
        policy: PolicyFile | None,
        dial_timeout: float,
        log: structlog.stdlib.BoundLogger,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.policy = policy
        self.dial_timeout = dial_timeout
        self.log = log
        self.open = 0
        self._idle = trio.Event()
        self._idle.set()

    async def wait_idle(self) -> None:
        """Until no stream is being relayed."""
        await self._idle.wait()

    async def proxy(self, request: ClientRequest) -> None:
        log = self.log.bind(frontend=request.frontend, client=request.client.name, target=request.authority)
        try:
            route = resolve(request.authority, dict(request.headers), self.registry.known_clusters)
            log = log.bind(cluster=route.cluster)
            self._authorize(request.client, route.cluster)
            with self.metrics.dial_seconds.time():
                upstream, tunnel = await self._dial(route)
        except ConnectRefused as exc:
            self.metrics.streams.labels(request.frontend, str(exc.status)).inc()
            log.info("stream_refused", status=exc.status, error=exc.reason)
            await request.refuse(exc.status, exc.reason)
            return
        self.metrics.streams.labels(request.frontend, "200").inc()
        log = log.bind(agent_id=tunnel.agent_id, stream_id=upstream.stream_id)
        if self.open == 0:
            self._idle = trio.Event()
        self.open += 1
        gauge = self.metrics.streams_open.labels(request.frontend)
        gauge.inc()
        try:
            downstream = await request.accept()
            if request.early_data:
                await upstream.send_all(request.early_data)
            log.debug("stream_opened")
            result = await relay(client=downstream, target=upstream)
            self.metrics.bytes.labels("to_target").inc(result.bytes_to_target)
            self.metrics.bytes.labels("to_client").inc(result.bytes_to_client)
            log.info(
                "stream_closed",
                bytes_to_target=result.bytes_to_target,
                bytes_to_client=result.bytes_to_client,
                error=result.error,
            )
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("stream_failed", error=str(exc))
        finally:
            # Bookkeeping first: under cancellation every await below would raise at once.
            gauge.dec()
            self.open -= 1
            if self.open == 0:
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
                with trio.fail_after(self.dial_timeout):
                    return await tunnel.mux.open_connect(route.authority), tunnel
            except TunnelClosed:
                lost.add(tunnel)
            except trio.TooSlowError:
                raise DialTimeout(
                    f"agent {tunnel.agent_id} of cluster {route.cluster!r} did not answer within "
                    f"{self.dial_timeout:g}s"
                ) from None
