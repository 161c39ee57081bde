"""The one dial-and-relay path every client frontend uses.

A frontend adapts its connection to a :class:`ClientRequest` (what the client asked for, how to accept
and how to refuse it); :meth:`Relayer.proxy` does the rest the same way for all of them: route, authorize,
bound the client's pending dials, pick a tunnel, dial through the agent (once more on another tunnel
when the first agent failed by itself), relay, count.

A replica that has just started (one of several behind a load balancer, say the successor in a rolling
upgrade) has not heard from every agent yet: for its first ``startup_grace`` seconds, a request for a
cluster it has no usable tunnel of (unknown to it, or no agent connected) waits for the next agent to
register rather than being refused at once, within the client's dial timeout.

Likewise when a cluster's agents are being replaced: every agent of the cluster draining (or gone
after draining: a drained node, an evicted pod, whose successor is starting elsewhere), a request
for it waits up to ``replacement_grace`` from then for the next agent, rather than 503 at once.
An agent lost without a drain (a crash, a cut network) announces no successor: answered at once.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import structlog
import trio
from prometheus_client import Counter, Gauge

from clusterproxy_protocol import (
    FAULT_HEADER,
    FAULT_TARGET,
    AuditRecord,
    AuditSink,
    Budget,
    ConnectRefused,
    DialTimeout,
    Forbidden,
    MalformedTarget,
    NoAgentConnected,
    RelayResult,
    TargetUnreachable,
    TunnelClosed,
    TunnelStream,
    UnknownCluster,
    relay_streams,
)
from clusterproxy_server.authz import ClientIdentity, PolicyFile
from clusterproxy_server.control import ControlAccess
from clusterproxy_server.metrics import ServerMetrics
from clusterproxy_server.pending_dials import ConnectionDials, PendingDials, ScopedTooManyRequests
from clusterproxy_server.quotas import ClientQuotas, ConnectionQuota, Prepaid
from clusterproxy_server.registry import AgentTunnel, Registry
from clusterproxy_server.routing import Route, may_name_unknown_cluster, resolve

RETRIES_ON_AGENT_FAILURE = 1  # another tunnel of the cluster, once: a second failure is the answer
# How long a drained agent's successor has to connect: a new pod scheduled on another node, started,
# its certificate fetched, its tunnel dialed (8-15 s on the loaded real nodes of test_disruption).
# The default --dial-timeout: each request's own deadline bounds its wait anyway.
REPLACEMENT_GRACE = 30.0


def agent_fault(refused: ConnectRefused) -> bool:
    """Did the agent fail by itself (rather than answer about the request or its target)?

    4xx: the request was wrong or not allowed (bad target, egress policy): the agent did its job.
    A 5xx marked ``cluster-proxy-fault: target``: the agent dialed and the target refused, was
    unreachable or too slow. Any other answer (a 5xx without the mark, a status no agent sends) is the
    agent's own failure."""
    if 400 <= refused.status < 500:
        return False
    return refused.headers.get(FAULT_HEADER, "").strip().lower() != FAULT_TARGET


class ClientRequest(Protocol):
    """One client's request for a stream into a cluster, as a frontend presents it (read-only: a
    frontend may answer from its own request, as HTTP/2's does, through properties)."""

    frontend: str  # the metrics and log label: "http1", "h2", ...
    client: ClientIdentity
    early_data: bytes  # bytes for the target the client sent with its request

    @property
    def authority(self) -> str:
        """The target as the client wrote it."""
        ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Lower-case names."""
        ...

    async def accept(self) -> trio.abc.Stream:
        """Tell the client the stream is open; the stream to relay with."""
        ...

    async def refuse(self, status: int, reason: str) -> None:
        """Tell the client why not, with an HTTP status and a one-line reason."""
        ...

    def take_reserve(self) -> int:
        """Bytes reserved (and charged) with the client's own stream for the window of the stream toward
        the agent (``TunnelStream.take_reserve``), handed over; 0 when its frontend reserves none."""
        ...


class Described(Protocol):
    """What an audit record names of a request: a :class:`ClientRequest`, or a refused connection."""

    frontend: str
    client: ClientIdentity

    @property
    def authority(self) -> str: ...


@dataclass
class Audited:
    """What the audit record of one request will say (docs/protocol.md, "Audit records"), gathered as the
    request goes; written once, when it ends."""

    start: float = field(default_factory=time.time)  # unix time, for the record
    clock: float = field(default_factory=trio.current_time)  # for its duration: immune to clock steps
    cluster: str | None = None
    agents: list[str] = field(default_factory=list)  # the agents asked, in order: the last answered


class Relayer:
    def __init__(
        self,
        registry: Registry,
        metrics: ServerMetrics,
        policy: PolicyFile | None,
        dial_timeout: float,
        log: structlog.typing.FilteringBoundLogger,
        *,
        agent_answer_timeout: float | None = None,
        pending: PendingDials | None = None,
        startup_grace: float = 0.0,
        replacement_grace: float = REPLACEMENT_GRACE,
        control: ControlAccess | None = None,
        quotas: ClientQuotas | None = None,
        audit: AuditSink | None = None,
        server_id: str | None = None,
    ) -> None:
        self.registry = registry
        self.audit = audit  # one record per request that reaches this path (and per refused connection)
        self.server_id = server_id
        self.quotas = quotas
        self.control = control or ControlAccess()
        self.metrics = metrics
        self.policy = policy
        self.dial_timeout = dial_timeout  # the whole dial, retry included
        self.agent_answer_timeout = agent_answer_timeout or dial_timeout  # one agent's answer
        self.pending = pending or PendingDials(per_connection=128, per_client=512)
        self.log = log
        self.open = 0
        self._idle = trio.Event()
        self._idle.set()
        self.startup_grace = startup_grace
        self.replacement_grace = replacement_grace
        self.grace_ends = -math.inf  # trio clock; ProxyServer.run sets it when the ports open
        # Children of labelled families looked up once, not at every stream (labels() takes a lock and
        # builds its key each time).
        self._to_target = metrics.bytes.labels("to_target")
        self._to_client = metrics.bytes.labels("to_client")
        self._per_frontend: dict[str, tuple[Counter, Gauge]] = {}

    def _frontend_metrics(self, frontend: str) -> tuple[Counter, Gauge]:
        """(streams answered 200, streams open) of ``frontend``."""
        children = self._per_frontend.get(frontend)
        if children is None:
            children = (
                self.metrics.streams.labels(frontend, "200"),
                self.metrics.streams_open.labels(frontend),
            )
            self._per_frontend[frontend] = children
        return children

    def start_grace(self) -> None:
        """The replica starts serving now: its startup grace runs from here."""
        self.grace_ends = trio.current_time() + self.startup_grace

    async def _wait_for_an_agent(self, deadline: float, cluster: str | None = None) -> bool:
        """Within the startup grace, or ``cluster``'s replacement grace (and before ``deadline``): wait
        for the next agent to register and say True (ask again); else False at once (answer now)."""
        until = min(self.grace_ends, deadline)
        since = self.registry.replacement_since(cluster) if cluster is not None else None
        if since is not None:
            until = max(until, min(since + self.replacement_grace, deadline))
        if trio.current_time() >= until:
            return False
        with trio.move_on_at(until):
            await self.registry.wait_added()
        return True

    async def wait_idle(self) -> None:
        """Until no stream is being relayed."""
        await self._idle.wait()

    def connection_proxy(
        self, quota: ConnectionQuota | None = None
    ) -> Callable[[ClientRequest], Awaitable[None]]:
        """:meth:`proxy` for the requests of one client connection (its pending dials counted together,
        its streams within ``quota``)."""
        return functools.partial(self.proxy, connection=ConnectionDials(), quota=quota)

    async def proxy(
        self,
        request: ClientRequest,
        connection: ConnectionDials | None = None,
        quota: ConnectionQuota | None = None,
    ) -> None:
        with contextlib.ExitStack() as held:
            await self._proxy(request, connection, quota, held)

    async def _proxy(
        self,
        request: ClientRequest,
        connection: ConnectionDials | None,
        quota: ConnectionQuota | None,
        held: contextlib.ExitStack,
    ) -> None:
        # The log fields of this stream, given with each line (a bound logger made per stream and per
        # step cost more than the lines a stream writes at the bench's level: none).
        fields: dict[str, object] = {
            "frontend": request.frontend,
            "client": request.client.name,
            "target": request.authority,
        }
        audited = Audited()
        deadline = trio.current_time() + self.dial_timeout
        try:
            route = await self._route(request, deadline)
            audited.cluster = route.cluster
            fields["cluster"] = route.cluster
            self._authorize(request.client, route.cluster)
            prepaid = Prepaid(quota.budget if quota is not None else None, request.take_reserve())
            held.callback(prepaid.refund)  # what no stream toward an agent spent goes back at the end
            if quota is not None and self.quotas is not None:
                held.enter_context(self.quotas.stream(quota, prepaid.amount))  # counted until it ends
            marks = self.control.headers_for(request.client, route.authority, route.cluster)
            with self.pending.hold(connection or ConnectionDials(), request.client.describe()):
                self.metrics.pending_dials.inc()
                try:
                    with self.metrics.dial_seconds.time():
                        budget = quota.budget if quota is not None else None
                        upstream, tunnel = await self._dial(
                            route, fields, deadline, marks, budget, prepaid.spend, audited.agents
                        )
                finally:
                    self.metrics.pending_dials.dec()
        except ConnectRefused as exc:
            if isinstance(exc, ScopedTooManyRequests):
                self.metrics.pending_dial_refusals.labels(exc.scope).inc()
            self.metrics.streams.labels(request.frontend, str(exc.status)).inc()
            self.log.info("stream_refused", **fields, status=exc.status, error=exc.reason)
            # Written before the answer goes out: a client that reads its refusal finds the record there.
            self._audit(request, audited, "refused", exc.status, exc.reason)
            await request.refuse(exc.status, exc.reason)
            return
        except trio.Cancelled:  # the client gave up before an agent answered (or the server stopped)
            self._audit(request, audited, "failed", None, "cancelled before the dial was answered")
            raise
        answered, gauge = self._frontend_metrics(request.frontend)
        answered.inc()
        fields["agent_id"] = tunnel.agent_id
        fields["stream_id"] = upstream.stream_id
        if self.open == 0:
            self._idle = trio.Event()
        self.open += 1
        gauge.inc()
        result: RelayResult | None = None
        error: str | None = None
        try:
            downstream = await request.accept()
            if request.early_data:
                await upstream.send_all(request.early_data)
            self.log.debug("stream_opened", **fields)
            result = await relay_streams(client=downstream, target=upstream)
            self._to_target.inc(result.bytes_to_target)
            self._to_client.inc(result.bytes_to_client)
            self.log.info(
                "stream_closed",
                **fields,
                bytes_to_target=result.bytes_to_target,
                bytes_to_client=result.bytes_to_client,
                error=result.error,
            )
            error = result.error
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            error = str(exc) or type(exc).__name__
            self.log.info("stream_failed", **fields, error=error)
        except (
            trio.Cancelled
        ):  # the server is stopping (its drain timeout): relay_streams() aborted both ends
            error = "proxy-server shutting down"
            self.log.warning("stream_aborted", **fields, error=error)
            raise
        finally:
            # Bookkeeping first: under cancellation every await below would raise at once.
            gauge.dec()
            self.open -= 1
            if self.open == 0:
                self._idle.set()
            upstream.abort()  # a no-op when the relay closed it already
            if result is not None:  # what the relay moved, and the early data before it
                to_target = len(request.early_data) + result.bytes_to_target
                to_client = result.bytes_to_client
            else:  # cut short: what went through the tunnel (to the client: some may not have arrived)
                to_target, to_client = upstream.bytes_out, upstream.bytes_in
            self._audit(
                request,
                audited,
                "failed" if error else "ok",
                200,
                error,
                (to_target, to_client),
                tunnel.agent_id,
            )

    def _audit(
        self,
        request: Described,
        audited: Audited,
        outcome: str,
        status: int | None,
        reason: str | None,
        moved: tuple[int, int] = (0, 0),
        agent_id: str | None = None,
    ) -> None:
        if self.audit is None:
            return
        self.audit.write(
            AuditRecord(
                start=audited.start,
                end=audited.start + (trio.current_time() - audited.clock),
                client=request.client.describe(),
                client_kind="certificate",
                cluster=audited.cluster,
                target=request.authority,
                frontend=request.frontend,
                outcome=outcome,
                status=status,
                reason=reason,
                bytes_to_target=moved[0],
                bytes_to_client=moved[1],
                agent_id=agent_id or (audited.agents[-1] if audited.agents else None),
                server_id=self.server_id,
            )
        )

    def audit_refused_connection(
        self, client: ClientIdentity, frontend: str, status: int, reason: str
    ) -> None:
        """The record of a client connection refused as a whole (its identity over a connection bound):
        no target, no cluster."""
        self._audit(_WholeConnection(frontend, client), Audited(), "refused", status, reason)

    async def _route(self, request: ClientRequest, deadline: float) -> Route:
        """The cluster and target asked for; a bare name that may be a cluster this young replica has
        not heard of yet waits for agents within the startup grace."""
        headers = dict(request.headers)
        while True:
            try:
                return resolve(request.authority, headers, self.registry.known_clusters)
            except MalformedTarget:
                if not may_name_unknown_cluster(request.authority, headers):
                    raise
                if not await self._wait_for_an_agent(deadline):
                    raise

    def _authorize(self, client: ClientIdentity, cluster: str) -> None:
        """Raise Forbidden (403) when the client policy keeps ``client`` out of ``cluster``. Checked
        before the cluster's existence, so a refused client learns nothing about it."""
        if self.policy is None:
            return
        decision = self.policy.decide(client, cluster)
        if not decision.allowed:
            raise Forbidden(decision.reason)

    async def _dial(
        self,
        route: Route,
        fields: dict[str, object],
        deadline: float,
        headers: list[tuple[str, str]] | None = None,
        budget: Budget | None = None,
        prepaid: Callable[[], int] | None = None,
        asked: list[str] | None = None,
    ) -> tuple[TunnelStream, AgentTunnel]:
        """Open the stream on the least-loaded tunnel in routing. A tunnel that dies meanwhile makes us
        try the next; an agent that fails by itself (:func:`agent_fault`, or no answer within the agent
        answer timeout) is counted against its tunnel and the dial goes once more to another tunnel."""
        lost: set[AgentTunnel] = set()  # died while dialing
        failed: set[AgentTunnel] = set()  # failed at the agent level
        failure: ConnectRefused | None = None
        while True:
            try:
                # A retry never goes to an ejected tunnel: that would be a second failure, not a rescue.
                tunnel = self.registry.pick(
                    route.cluster, exclude=lost | failed, fall_back_to_ejected=not failed
                )
            except (NoAgentConnected, UnknownCluster):
                if not (failure or lost) and await self._wait_for_an_agent(deadline, route.cluster):
                    continue
                if failure is not None:
                    raise failure from None
                if lost:
                    names = ", ".join(sorted(t.agent_id for t in lost))
                    raise TargetUnreachable(
                        f"agent {names} of cluster {route.cluster!r} disconnected while dialing"
                    ) from None
                raise
            wait = min(self.agent_answer_timeout, deadline - trio.current_time())
            if asked is not None:
                asked.append(tunnel.agent_id)
            try:
                with trio.fail_after(max(wait, 0)):
                    # The stream's receive window (what the agent may send ahead of the client's reads)
                    # is charged to the client's budgets.
                    stream = await tunnel.mux.open_connect(route.authority, headers or [], budget, prepaid)
            except TunnelClosed:
                lost.add(tunnel)
                continue
            except trio.TooSlowError:
                failure = DialTimeout(
                    f"agent {tunnel.agent_id} of cluster {route.cluster!r} did not answer within {wait:g}s"
                )
                if failed and wait < self.agent_answer_timeout:
                    raise failure from None  # a retry cut short by the client's budget: not the agent's fault
                self._agent_failed(tunnel, "timeout", failure.reason, fields)
            except ConnectRefused as exc:
                if not agent_fault(exc):
                    self.registry.record_dial(tunnel, failed=False)
                    raise
                failure = exc
                self._agent_failed(tunnel, "status", f"{exc.status} {exc.reason}", fields)
            else:
                self.registry.record_dial(tunnel, failed=False)
                return stream, tunnel
            failed.add(tunnel)
            if len(failed) > RETRIES_ON_AGENT_FAILURE or trio.current_time() >= deadline:
                raise failure
            self.metrics.dial_retries.labels(route.cluster).inc()

    def _agent_failed(self, tunnel: AgentTunnel, kind: str, error: str, fields: dict[str, object]) -> None:
        self.metrics.agent_dial_failures.labels(tunnel.cluster, tunnel.agent_id, kind).inc()
        self.log.warning("dial_failed_at_agent", **fields, agent_id=tunnel.agent_id, kind=kind, error=error)
        ejection = self.registry.record_dial(tunnel, failed=True)
        if ejection is None:
            return
        self.metrics.agent_ejections.labels(tunnel.cluster, tunnel.agent_id).inc()
        self.log.warning(
            "agent_ejected",
            cluster=tunnel.cluster,
            agent_id=tunnel.agent_id,
            peer=tunnel.peer,
            failed=ejection.failed,
            dials=ejection.total,
            others_failed=ejection.others_failed,
            others_dials=ejection.others_total,
            cooldown=ejection.cooldown,
        )


@dataclass
class _WholeConnection:
    """A refused connection as the audit record sees it: who, on which frontend, and no target."""

    frontend: str
    client: ClientIdentity
    authority: str = ""
