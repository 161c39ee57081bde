"""The agent's side of the tunnel: answers the streams the proxy-server opens.

``CONNECT host:port`` -> egress policy, resolve, dial, ``200`` and relay bytes (or an error status
with a reason); ``GET /v1/info`` -> who this agent is, and which proxy-server replica this tunnel
reached. One :class:`Agent` per process holds the state shared by all its tunnels (live connections,
the server identities learnt, metrics); :mod:`.replicas` decides how many tunnels to keep.

One tunnel per replica: a ``GET /v1/info`` naming a server id that another live, non-draining tunnel
already holds is answered ``409`` (the server then closes the new tunnel), unless the holder no longer
answers a PING, in which case the holder is closed and the new tunnel takes its place.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import trio

from clusterproxy_agent.control import ControlEndpoint, is_control_target
from clusterproxy_agent.dialer import ConnectFailed, Connector, ResolveFailed, Resolver, connect_any, resolve
from clusterproxy_agent.egress import EgressPolicy, Target, TargetError, normalize_name, parse_target
from clusterproxy_agent.metrics import AgentMetrics
from clusterproxy_protocol import (
    FAULT_HEADER,
    FAULT_TARGET,
    INFO_PATH,
    REASON_HEADER,
    SERVER_COUNT_HEADER,
    SERVER_ID_HEADER,
    SERVER_WORKER_HEADER,
    Budget,
    IncomingRequest,
    Mux,
    TunnelError,
    clean_reason,
    format_authority,
    get_logger,
    parse_worker,
    relay_streams,
    reset_if_process_dies,
)

__all__ = ["CAPABILITIES", "Agent", "AgentConfig", "ServerIdentity", "TunnelRecord", "agent_version"]

CAPABILITIES = ("connect", "half-close")
DUPLICATE_STATUS = 409  # the answer to /v1/info on a tunnel to a replica this agent already holds


# importlib.metadata reads the installed files at each call: a fan-in fleet of agents paid for it in its
# start (docs/benchmarks.md, "Seventh round")
@functools.cache
def agent_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("cluster-proxy-agent")
    except (ImportError, PackageNotFoundError):
        return "0.0.0+unknown"


def _seconds(value: float) -> str:
    return f"{value:g}s"


@dataclass
class AgentConfig:
    cluster: str
    agent_id: str
    kube_apiserver: tuple[str, int] = ("kubernetes.default.svc", 443)
    dial_timeout: float = 10.0
    policy: EgressPolicy = field(default_factory=EgressPolicy.build)
    version: str = field(default_factory=agent_version)
    # how long the tunnel already holding a replica gets to answer a PING before a new tunnel to the
    # same replica replaces it (one that answers keeps its place and the new one is closed)
    holder_ping_timeout: float = 5.0
    # bytes of stream windows (data from the hub its target has not read yet) held for every stream
    # together: a new stream is refused with 503 beyond it; 0: no bound
    buffer_budget: int = 256 << 20


@dataclass
class ServerIdentity:
    """What a proxy-server told us about itself with ``GET /v1/info`` (used for HA)."""

    server_id: str | None
    server_count: int | None
    address: str = ""
    worker: tuple[int, int] | None = None  # (index, workers) when the server runs several workers


@dataclass(eq=False)
class TunnelRecord:
    """One live tunnel: where it was dialed, since when, and which replica it reached."""

    mux: Mux
    address: str
    connected_at: float  # trio clock
    connected_since: float = field(default_factory=time.time)  # wall clock, for people
    identity: ServerIdentity | None = None
    duplicate: bool = False  # reached a replica another tunnel holds: being closed
    identified: trio.Event = field(default_factory=trio.Event)  # /v1/info answered (either way)

    @property
    def server_id(self) -> str | None:
        return self.identity.server_id if self.identity is not None else None

    @property
    def holds_replica(self) -> bool:
        """Live, not a duplicate, and its server is not draining: a tunnel that counts."""
        return not self.mux.dead and not self.duplicate and not self.mux.peer_draining

    def describe(self) -> dict[str, object]:
        return {
            "server_id": self.server_id,
            "server_count": self.identity.server_count if self.identity is not None else None,
            "address": self.address,
            "connected_since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.connected_since)),
            "draining": self.mux.peer_draining,
            "duplicate": self.duplicate,
            "open_streams": self.mux.open_streams,
            "last_rtt": self.mux.last_rtt,
        }


class Agent:
    """Handles tunnel streams; ``connect``/``resolve`` are injectable for tests."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        metrics: AgentMetrics | None = None,
        resolver: Resolver = resolve,
        connector: Connector = connect_any,
        control: ControlEndpoint | None = None,
    ) -> None:
        self.config = config
        # Every tunnel's streams' receive windows: what targets that stop reading can make us hold.
        self.buffers = Budget(config.buffer_budget, name=f"agent {config.agent_id} (--buffer-budget)")
        self.control = control or ControlEndpoint(config.cluster, config.kube_apiserver, None)
        self._resolve = resolver
        self._connect = connector
        self.tunnels: dict[Mux, TunnelRecord] = {}
        self._closed_bytes = [0, 0]
        self.metrics = metrics or AgentMetrics(self.byte_totals)
        self._dialled_ok = self.metrics.dials.labels("ok")  # looked up once, not per stream
        self.metrics.watch_replicas(self.replica_tunnels, lambda: self.expected_replicas)
        self.last_error: str | None = None
        self.expected_replicas = 1  # set by the replica set: how many distinct replicas it looks for
        self._changed = trio.Event()
        self.log = get_logger("clusterproxy_agent", cluster=config.cluster, agent_id=config.agent_id)
        self._kube_target = parse_target(format_authority(*config.kube_apiserver))

    # -- state ---------------------------------------------------------------------------------------

    @property
    def connected(self) -> int:
        return sum(1 for mux in self.tunnels if not mux.dead)

    @property
    def servers(self) -> dict[str, ServerIdentity]:
        """Server id -> identity, for every live tunnel whose server told us its id (duplicates aside)."""
        out: dict[str, ServerIdentity] = {}
        for mux, record in self.tunnels.items():
            if (
                record.identity is not None
                and record.identity.server_id
                and not mux.dead
                and not record.duplicate
            ):
                out[record.identity.server_id] = record.identity
        return out

    def replica_tunnels(self) -> list[TunnelRecord]:
        """Every live tunnel that is not a duplicate (draining ones included), oldest first."""
        return [r for mux, r in self.tunnels.items() if not mux.dead and not r.duplicate]

    def held_replicas(self) -> set[str]:
        """Ids of the replicas held by a live, non-draining tunnel."""
        return {r.server_id for r in self.tunnels.values() if r.holds_replica and r.server_id}

    def describe_servers(self) -> dict[str, object]:
        """For the admin API: the replicas looked for and held, and every live tunnel."""
        return {
            "expected_replicas": self.expected_replicas,
            "held_replicas": sorted(self.held_replicas()),
            "tunnels": [r.describe() for r in self.tunnels.values() if not r.mux.dead],
        }

    def notify_change(self) -> None:
        """Wake :meth:`wait_change` waiters: a tunnel came, went, was identified or began draining."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_change(self) -> None:
        await self._changed.wait()

    def byte_totals(self) -> tuple[int, int]:
        live = list(self.tunnels)
        return (
            self._closed_bytes[0] + sum(m.bytes_in for m in live),
            self._closed_bytes[1] + sum(m.bytes_out for m in live),
        )

    @contextmanager
    def tunnel(self, mux: Mux, address: str) -> Iterator[TunnelRecord]:
        """Register a live tunnel for the duration of the block (readiness, metrics, HA state)."""
        record = self.tunnels[mux] = TunnelRecord(mux, address, trio.current_time())
        self.metrics.tunnels_connected.inc()
        self.notify_change()
        try:
            yield record
        finally:
            del self.tunnels[mux]
            self._closed_bytes[0] += mux.bytes_in
            self._closed_bytes[1] += mux.bytes_out
            self.metrics.tunnels_connected.dec()
            record.identified.set()  # nobody waits for an answer that can no longer come
            self.notify_change()

    def drain(self) -> None:
        """Ask every server to open no new streams; open streams go on."""
        for mux in list(self.tunnels):
            mux.drain()

    async def wait_idle(self) -> None:
        """Wait until no tunnel has an open stream (or every tunnel is gone)."""
        while True:
            busy = [mux for mux in self.tunnels if mux.open_streams and not mux.dead]
            if not busy:
                return
            await busy[0].wait_idle()

    def close_all(self, reason: str) -> None:
        for mux in list(self.tunnels):
            mux.close(reason)

    # -- streams -------------------------------------------------------------------------------------

    async def handle(self, request: IncomingRequest) -> None:
        """The tunnel's request handler: never raises, so one stream can never take the tunnel down."""
        try:
            if request.method == "CONNECT" and is_control_target(request.authority):
                await self.control.handle(request)
            elif request.method == "CONNECT":
                await self._handle_connect(request)
            elif request.path == INFO_PATH:
                await self._handle_info(request)
            else:
                await request.refuse(
                    404,
                    f"no such endpoint {request.method} {request.path[:100]!r}; this agent serves CONNECT and GET {INFO_PATH}",
                )
        except trio.Cancelled:
            raise
        except Exception as exc:
            self.log.exception(
                "stream_handler_failed",
                stream_id=request.stream.stream_id,
                target=request.authority,
                error=repr(exc),
            )
            try:
                await request.refuse(500, f"agent error: {type(exc).__name__}")
            except Exception:
                pass

    async def _handle_info(self, request: IncomingRequest) -> None:
        if request.method != "GET":
            await request.refuse(405, f"method {request.method} not allowed on {INFO_PATH}; use GET")
            return
        identity = ServerIdentity(
            request.headers.get(SERVER_ID_HEADER),
            _int_or_none(request.headers.get(SERVER_COUNT_HEADER)),
            worker=parse_worker(request.headers.get(SERVER_WORKER_HEADER)),
        )
        record = self.tunnels.get(request.mux)
        if record is not None:
            identity.address = record.address
            holder = await self._live_holder(identity.server_id, record)
            if holder is not None:
                await self._refuse_duplicate(request, record, holder, identity)
                return
            if record.identity != identity:
                self.log.info(
                    "server_identified",
                    server=record.address,
                    server_id=identity.server_id,
                    server_count=identity.server_count,
                )
            record.identity = identity
            record.identified.set()
            self.notify_change()
        body = json.dumps(
            {
                "agent_id": self.config.agent_id,
                "cluster": self.config.cluster,
                "version": self.config.version,
                "capabilities": list(CAPABILITIES),
            }
        ).encode()
        await request.respond(200, body, [("content-type", "application/json")])

    async def _live_holder(self, server_id: str | None, record: TunnelRecord) -> TunnelRecord | None:
        """The other tunnel holding replica ``server_id``, if it still answers a PING; one that does not
        is closed (a replica restarted under the same id, a connection that died silently)."""
        if not server_id:
            return None
        for other in list(self.tunnels.values()):
            if other is record or other.server_id != server_id or not other.holds_replica:
                continue
            with trio.move_on_after(self.config.holder_ping_timeout):
                try:
                    await other.mux.ping()
                except TunnelError:
                    continue  # it died meanwhile: nothing holds the replica
                return other
            other.mux.close(
                f"replaced by a new tunnel to server {server_id}: no PING answer within "
                f"{_seconds(self.config.holder_ping_timeout)}"
            )
            self.log.warning("server_tunnel_replaced", server_id=server_id, server=other.address)
        return None

    async def _refuse_duplicate(
        self, request: IncomingRequest, record: TunnelRecord, holder: TunnelRecord, identity: ServerIdentity
    ) -> None:
        """This tunnel reached a replica another tunnel holds: say so, and let the server close it."""
        record.identity = identity
        record.duplicate = True
        record.identified.set()
        self.metrics.duplicate_dials.inc()
        self.log.info(
            "replica_already_held",
            server=record.address,
            server_id=identity.server_id,
            held_since=holder.connected_since,
        )
        self.notify_change()
        await request.refuse(
            DUPLICATE_STATUS,
            f"agent {self.config.agent_id!r} of cluster {self.config.cluster!r} already holds a tunnel "
            f"to server {identity.server_id!r}: this one is not needed",
        )

    def resolve_target(self, authority: str) -> Target:
        """Parse the ``:authority``; the bare cluster name means the kube-apiserver."""
        target = parse_target(authority)
        if target.ip is None and target.host == normalize_name(self.config.cluster):
            return self._kube_target
        return target

    async def _handle_connect(self, request: IncomingRequest) -> None:
        metrics = self.metrics
        # Given with each line rather than bound (a logger made per stream costs more than the lines
        # a stream writes at the default level: none, or one refusal).
        fields = {"stream_id": request.stream.stream_id, "target": request.authority}
        metrics.open_streams.inc()
        try:
            try:
                target = self.resolve_target(request.authority)
            except TargetError as exc:
                metrics.dials.labels("bad_target").inc()
                self.log.info("stream_refused", **fields, status=400, error=str(exc))
                await request.refuse(400, str(exc))
                return
            status, reason, stream = await self._dial(target)
            if stream is None:
                self.log.info("stream_refused", **fields, status=status, error=reason)
                if status >= 500:
                    await _refuse_for_target(request, status, reason)
                else:
                    await request.refuse(status, reason)
                return
            self._dialled_ok.inc()
            async with stream:
                try:
                    tunnel_stream = await request.accept()
                except Exception as exc:  # the stream was reset while we dialled
                    self.log.info("stream_gone_before_dial_completed", **fields, error=repr(exc))
                    return
                self.log.debug("stream_connected", **fields, dialled=str(target))
                result = await relay_streams(client=tunnel_stream, target=stream)
            self.log.debug(
                "stream_closed",
                **fields,
                bytes_to_target=result.bytes_to_target,
                bytes_to_client=result.bytes_to_client,
                error=result.error,
            )
        finally:
            metrics.open_streams.dec()

    async def _dial(self, target: Target) -> tuple[int, str, trio.abc.Stream | None]:
        """``(0, "", stream)`` on success, else ``(status, reason, None)`` (and counts the dial)."""
        policy = self.config.policy
        timeout = self.config.dial_timeout
        dials = self.metrics.dials
        denied = policy.precheck(target)
        if denied is not None:
            dials.labels("forbidden").inc()
            return 403, denied.reason, None
        stream: trio.abc.Stream | None = None
        phase = "resolving the name"
        with trio.move_on_after(timeout if math.isfinite(timeout) else math.inf):
            try:
                if target.ip is not None:
                    addresses = [target.ip]
                else:
                    addresses = await self._resolve(target.host, target.port)
                decision = policy.evaluate(target, addresses)
                if not decision.allowed:
                    dials.labels("forbidden").inc()
                    return 403, decision.reason, None
                phase = "connecting"
                stream = await self._connect(decision.addresses, target.port)
            except ResolveFailed as exc:
                dials.labels("refused").inc()
                return 502, f"dial to {target} failed: {exc.strerror or exc}", None
            except ConnectFailed as exc:
                dials.labels("refused").inc()
                return 502, f"dial to {target} failed: {exc}", None
            except OSError as exc:
                dials.labels("refused").inc()
                return 502, f"dial to {target} failed: {exc}", None
        if stream is None:
            dials.labels("timeout").inc()
            return 504, f"dial to {target} timed out after {_seconds(timeout)} ({phase})", None
        # A target is often a plain TCP service: it cannot tell the FIN the kernel sends for a killed
        # agent from the end of an upload. Armed, this socket ends with RST unless the relay ends it
        # cleanly (closing.close_cleanly); a half-close (send_eof) is a FIN as before.
        reset_if_process_dies(stream)
        return 0, "", stream


async def _refuse_for_target(request: IncomingRequest, status: int, reason: str) -> None:
    """A refusal that is the target's own failure (refused, unreachable, unresolved, too slow), marked
    so: the proxy-server neither retries it on another agent nor holds it against this one."""
    text = clean_reason(reason)
    head = [(REASON_HEADER, text), (FAULT_HEADER, FAULT_TARGET), ("content-type", "text/plain")]
    try:
        await request.respond(status, (text + "\n").encode(), head)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the server reset the stream (its client went away): nobody is left to tell
    finally:
        await request.stream.aclose()


def _int_or_none(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None
