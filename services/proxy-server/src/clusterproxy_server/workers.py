"""``--workers N``: one proxy-server pod uses N cores.

The parent process binds every port once per worker, bootstraps and renews the certificate, starts N
worker processes (each a whole :class:`~clusterproxy_server.app.ProxyServer`), restarts one that dies,
forwards SIGTERM for the drain, and serves the admin port for the whole pod by asking each worker over
a private loopback admin socket. Each worker is a replica to the agents: its own server id
(``<server-id>.w<i>``, ``.r<n>`` added at its n-th restart) and the server count ``--server-count`` x
N, so every agent holds a tunnel to every worker through the agents' usual replica search, and a
client's stream is served by the worker that accepted its connection (docs/architecture.md,
"Workers").

**Sockets.** For each of the agent, client and WebSocket ports the parent opens N listening sockets on
the same address with ``SO_REUSEPORT`` and hands worker i the i-th (``pass_fds``): the kernel spreads
new connections over the N accept queues by a hash of the connection's addresses, so a dial lands on
each worker with the same chance whatever their load (an agent missing one of two workers finds it in
two dials on average). The parent keeps its copy of every socket: a worker that dies leaves its queue
to its successor (connections queued meanwhile wait for the restart instead of being reset, which is
what closing the last descriptor of a listening socket does to them). On SIGTERM the parent closes its
copies first, so that each worker's drain closes its queue for good, as a single process does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import socket
import sys
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import h11
import trio
from cryptography import x509
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from clusterproxy_protocol.admin import Authenticated, PeerRoute, Response, Route, serve_admin
from clusterproxy_protocol.certclient import CertFiles, SignerEndpoint
from clusterproxy_protocol.config import ConfigError
from clusterproxy_protocol.logs import get_logger
from clusterproxy_protocol.reloader import ReloadingContext
from clusterproxy_protocol.renewal_metrics import RenewerCollector
from clusterproxy_protocol.renewer import CertRenewer, RenewalPolicy
from clusterproxy_protocol.steering import attach_steering
from clusterproxy_protocol.wire import ALPN_HTTP1, format_address
from clusterproxy_server.admin import metrics_routes, visibility
from clusterproxy_server.authz import PolicyFile
from clusterproxy_server.config import ServerConfig

__all__ = ["WORKER_ENV", "Supervisor", "WorkerSpec", "default_workers", "worker_server_id"]

WORKER_ENV = "_CLUSTER_PROXY_SERVER_WORKER"  # set by the parent for its workers only: what they inherit
LISTEN_BACKLOG = 0xFFFF  # the kernel caps it at net.core.somaxconn
RESTART_DELAY = 0.5  # seconds before a dead worker is started again
CRASH_LOOP_DEATHS = 5  # this many deaths of one worker within CRASH_LOOP_WINDOW stop the pod
CRASH_LOOP_WINDOW = 60.0
WORKER_ANSWER_TIMEOUT = 5.0  # a worker's admin answer to the parent
READY_POLL = 0.05
FILE_POLL = 2.0  # a worker notices the parent's renewal of the certificate files within this


def default_workers(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may use: its CPU affinity, and no more than its cgroup's CPU quota
    rounded up (a container limited to 2 CPUs on a 64-core node gets 2 workers, not 64)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota to read: the affinity alone
    return cores


def worker_server_id(base: str, index: int, restarts: int = 0) -> str:
    """A worker's replica id: a restarted worker is a new replica to the agents (as a restarted
    process is), so that an agent whose old tunnel is not yet known dead is not refused (409)."""
    return f"{base}.w{index}" + (f".r{restarts}" if restarts else "")


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process inherits from its parent (in :data:`WORKER_ENV`, as JSON)."""

    index: int
    workers: int
    server_id: str
    server_count: int  # told to agents: replicas x workers
    agent: tuple[int, ...]  # inherited listening descriptors
    client: tuple[int, ...]
    websocket: tuple[int, ...]
    admin: int  # the private admin socket (loopback) the parent asks
    parent_alive: int  # read end of a pipe: EOF when the parent is gone

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        raw = json.loads(text)
        for name in ("agent", "client", "websocket"):
            raw[name] = tuple(raw[name])
        return cls(**raw)

    def fds(self) -> tuple[int, ...]:
        return (*self.agent, *self.client, *self.websocket, self.admin, self.parent_alive)


def listeners_from_fds(fds: Iterable[int]) -> list[trio.SocketListener]:
    return [trio.SocketListener(trio.socket.from_stdlib_socket(socket.socket(fileno=fd))) for fd in fds]


def reuseport_sockets(host: str, port: int, count: int) -> list[list[socket.socket]]:
    """``count`` groups of listening sockets on ``host:port`` (one socket per address it resolves to,
    as ``trio.open_tcp_listeners`` binds), all sharing the port through ``SO_REUSEPORT``; port 0 takes
    the port the first bind got."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    groups: list[list[socket.socket]] = [[] for _ in range(count)]
    try:
        for family, kind, proto, _, address in dict.fromkeys((i[0], i[1], i[2], i[3], i[4]) for i in infos):
            for group in groups:
                sock = socket.socket(family, kind, proto)
                group.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if port == 0:
                    sock.bind(address)
                    port = sock.getsockname()[1]
                else:
                    sock.bind((address[0], port, *address[2:]))
                sock.listen(LISTEN_BACKLOG)
    except OSError:
        for group in groups:
            for sock in group:
                sock.close()
        raise
    return groups


async def admin_get(port: int, path: str, timeout: float = WORKER_ANSWER_TIMEOUT) -> tuple[int, bytes]:
    """GET ``path`` from a worker's private admin socket on 127.0.0.1."""
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            conn = h11.Connection(h11.CLIENT)
            request = h11.Request(
                method="GET", target=path, headers=[("host", "worker"), ("connection", "close")]
            )
            await stream.send_all(conn.send(request) + (conn.send(h11.EndOfMessage()) or b""))
            status, body = 0, bytearray()
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(256 << 10))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    return status, bytes(body)


class MergedMetrics(Collector):
    """The workers' metrics as one process would count them: every sample summed over the workers
    (counters, gauges of what each holds, histogram buckets), the ``_created`` times the earliest."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for text in self.texts:
            for family in text_string_to_metric_families(text):
                families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                samples = values.setdefault(family.name, {})
                for sample in family.samples:
                    key = (sample.name, tuple(sample.labels.items()))
                    if key not in samples:
                        samples[key] = sample.value
                    elif sample.name.endswith("_created"):
                        samples[key] = min(samples[key], sample.value)
                    else:
                        samples[key] += sample.value
        for name, family in families.items():
            for (sample_name, labels), value in values[name].items():
                family.add_sample(sample_name, dict(labels), value)
            yield family


@dataclass
class WorkerState:
    index: int
    server_id: str = ""
    pid: int | None = None
    process: trio.Process | None = None
    restarts: int = 0
    deaths: deque[float] = field(default_factory=deque)
    last_status: int | None = None


class Supervisor:
    """The parent of ``--workers N`` (see the module): binds, spawns, restarts, drains, answers."""

    def __init__(self, config: ServerConfig, argv: Sequence[str], workers: int) -> None:
        self.config = config
        self.argv = list(argv)
        self.count = workers
        self.log = get_logger("proxy-server", server_id=config.server_id, role="parent")
        self.states = [WorkerState(i) for i in range(workers)]
        self.stopping = False
        self.ready = False
        self.failure: str | None = None  # why the pod stops on its own (a worker's crash loop)
        self._stop = trio.Event()
        self._sockets: dict[str, list[list[socket.socket]]] = {}
        self._admin_sockets: list[socket.socket] = []
        self._pipes: list[tuple[int, int]] = []
        self.metrics = CollectorRegistry()
        self.merged = MergedMetrics()
        self.metrics.register(self.merged)
        self.worker_up = Gauge(
            "cluster_proxy_server_worker_up",
            "1 while the worker process runs, 0 while it is restarted (--workers)",
            ["worker"],
            registry=self.metrics,
        )
        self.worker_restarts = Counter(
            "cluster_proxy_server_worker_restarts_total",
            "Worker processes started again after they died",
            ["worker"],
            registry=self.metrics,
        )
        self.renewer: CertRenewer | None = None
        self.visible = visibility(PolicyFile(config.client_policy) if config.client_policy else None)

    def _start_renewer(self, contexts: list[ReloadingContext]) -> None:
        """One renewer for the pod (after the bootstrap): it writes the files, each worker reloads
        them (``follow_cert_files``); N renewers would race the signer with the same certificate."""
        config = self.config
        if config.signer:
            self.renewer = CertRenewer(
                SignerEndpoint.parse(config.signer, config.ca),
                CertFiles(config.cert, config.key, config.ca),
                contexts,
                RenewalPolicy(trust_refresh=config.trust_refresh),
            )
            self.metrics.register(RenewerCollector(self.renewer, "cluster_proxy_server_"))

    # -- sockets ------------------------------------------------------------------------------------

    def _bind(self) -> None:
        cfg = self.config
        ports = {"agent": cfg.agent_listen, "client": cfg.client_listen}
        if cfg.agent_websocket_listen is not None:
            ports["websocket"] = cfg.agent_websocket_listen
        try:
            for name, (host, port) in ports.items():
                self._sockets[name] = reuseport_sockets(host, port, self.count)
            if self.count > 1:
                self._steer_agent_port()
            for _ in range(self.count):
                admin = socket.socket()
                self._admin_sockets.append(admin)
                admin.bind(("127.0.0.1", 0))
                admin.listen(64)
        except OSError:
            self._close_sockets()
            raise

    def _steer_agent_port(self) -> None:
        """Aimed dials (clusterproxy_protocol.steering); without them (a kernel or a seccomp policy
        that refuses the program) agents find the workers by chance, as before: worth a warning only."""
        try:
            for first_worker_socket in self._sockets["agent"][0]:  # one group per address
                attach_steering(first_worker_socket, self.count)
        except OSError as exc:
            self.log.warning(
                "agent_port_not_steered",
                error=str(exc),
                hint="agents find each worker by redialing (HTTP 409 on a worker they hold)",
            )

    def _close_sockets(self) -> None:
        """The parent's copies: after this a worker's drain closes its queue for good."""
        for groups in self._sockets.values():
            for group in groups:
                for sock in group:
                    sock.close()
        self._sockets.clear()

    def _port(self, name: str) -> tuple[str, int] | None:
        groups = self._sockets.get(name)
        return groups[0][0].getsockname()[:2] if groups else None

    def _spec(self, state: WorkerState) -> WorkerSpec:
        def fds(name: str) -> tuple[int, ...]:
            return tuple(s.fileno() for s in self._sockets.get(name, [[]] * self.count)[state.index])

        return WorkerSpec(
            index=state.index,
            workers=self.count,
            server_id=state.server_id,
            server_count=self.config.server_count * self.count,
            agent=fds("agent"),
            client=fds("client"),
            websocket=fds("websocket"),
            admin=self._admin_sockets[state.index].fileno(),
            parent_alive=self._pipes[state.index][0],
        )

    def admin_port(self, index: int) -> int:
        return self._admin_sockets[index].getsockname()[1]

    # -- running ------------------------------------------------------------------------------------

    async def run(self) -> int:
        """Until SIGTERM/SIGINT (drained: 0) or a worker's crash loop (1)."""
        # the pod's admin port serves the inventory over mutual TLS (clusterproxy_server.admin)
        admin_tls = ReloadingContext.server(
            self.config.cert, self.config.key, self.config.ca, alpn=[ALPN_HTTP1]
        )
        self._start_renewer([admin_tls])
        self._bind()
        self._pipes = [os.pipe() for _ in range(self.count)]
        admin_listeners = await trio.open_tcp_listeners(
            self.config.admin_listen[1], host=self.config.admin_listen[0]
        )
        try:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async with trio.open_nursery() as nursery:
                    plain, private = self.routes()
                    api = Authenticated(private, lambda: admin_tls.context)
                    await nursery.start(partial(serve_admin, admin_listeners, plain, authenticated=api))
                    if self.renewer is not None:
                        await nursery.start(self.renewer.run)
                    async with trio.open_nursery() as workers:
                        for state in self.states:
                            workers.start_soon(self._keep, state)
                        nursery.start_soon(self._watch_signals, signals)
                        nursery.start_soon(self._announce_when_ready, admin_listeners[0])
                        await self._stop.wait()
                        self._begin_stop()
                    nursery.cancel_scope.cancel()
        finally:
            for state in self.states:
                if state.process is not None and state.process.returncode is None:
                    state.process.kill()
            for read_end, write_end in self._pipes:
                for fd in (read_end, write_end):
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._close_sockets()
            for admin in self._admin_sockets:
                admin.close()
        if self.failure:
            return 1
        bad = [s for s in self.states if s.last_status not in (0, None)]
        if bad:
            self.failure = "; ".join(
                f"worker {s.index} (pid {s.pid}) {_describe_status(s.last_status)} during the drain"
                for s in bad
            )
            return 1
        self.log.info("server_drained", workers=self.count)
        return 0

    async def _watch_signals(self, signals: trio.abc.ReceiveChannel[int]) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not self.stopping:
                self.log.info("signal_received", signal=name, workers=self.count)
                self._stop.set()
            else:
                self.log.warning("drain_cut_by_signal", signal=name)
                self._signal_workers(signal.SIGTERM)

    def _begin_stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.ready = False
        self._close_sockets()
        self._signal_workers(signal.SIGTERM)

    def _signal_workers(self, signum: int) -> None:
        for state in self.states:
            if state.process is not None and state.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    state.process.send_signal(signum)

    async def _keep(self, state: WorkerState) -> None:
        """Run worker ``state.index``; start it again when it dies (unless the pod stops)."""
        while True:
            state.server_id = worker_server_id(self.config.server_id, state.index, state.restarts)
            spec = self._spec(state)
            command = [sys.executable, "-m", "clusterproxy_server.main", *self.argv]
            process = await trio.lowlevel.open_process(
                command,
                env={**os.environ, WORKER_ENV: spec.to_json()},
                pass_fds=spec.fds(),
                start_new_session=True,  # a terminal's Ctrl-C reaches the parent, which forwards it once
            )
            state.process, state.pid = process, process.pid
            self.worker_up.labels(str(state.index)).set(1)
            self.log.info(
                "worker_spawned", worker=state.index, pid=process.pid, worker_server_id=state.server_id
            )
            status = await process.wait()
            state.process, state.last_status = None, status
            self.worker_up.labels(str(state.index)).set(0)
            if self.stopping:
                log = self.log.info if status == 0 else self.log.error
                log("worker_exited", worker=state.index, pid=state.pid, status=_describe_status(status))
                return
            now = trio.current_time()
            state.deaths.append(now)
            while state.deaths and now - state.deaths[0] > CRASH_LOOP_WINDOW:
                state.deaths.popleft()
            self.log.error(
                "worker_died",
                worker=state.index,
                pid=state.pid,
                worker_server_id=state.server_id,
                status=_describe_status(status),
                deaths_in_window=len(state.deaths),
            )
            if len(state.deaths) >= CRASH_LOOP_DEATHS:
                self.failure = (
                    f"worker {state.index} died {len(state.deaths)} times within {CRASH_LOOP_WINDOW:g}s "
                    f"(last: {_describe_status(status)}); its log lines carry worker={state.index}"
                )
                self.log.error("workers_stopping", error=self.failure)
                self._stop.set()
                return
            await trio.sleep(RESTART_DELAY)
            if self.stopping:
                return
            state.restarts += 1
            self.worker_restarts.labels(str(state.index)).inc()

    async def _announce_when_ready(self, admin: trio.SocketListener) -> None:
        while not self.stopping:
            answers = await self._ask_all("/readyz")
            if all(status == 200 for status, _ in answers):
                break
            await trio.sleep(READY_POLL)
        else:
            return
        self.ready = True
        self.log.info(
            "server_started",
            agent_port=format_address(self._port("agent")),
            agent_websocket_port=format_address(p) if (p := self._port("websocket")) else None,
            client_port=format_address(self._port("client")),
            admin_port=format_address(admin.socket.getsockname()[:2]),
            workers=self.count,
            worker_server_ids=[s.server_id for s in self.states],
            worker_pids=[s.pid for s in self.states],
            server_id=self.config.server_id,
            server_count=self.config.server_count,
            signer=self.config.signer,
        )

    # -- the pod's admin port -----------------------------------------------------------------------

    async def _ask_all(self, path: str) -> list[tuple[int, bytes]]:
        """Every worker's answer (status 0 and the error when it gave none), in worker order."""
        answers: list[tuple[int, bytes]] = [(0, b"")] * self.count

        async def ask(index: int) -> None:
            try:
                answers[index] = await admin_get(self.admin_port(index), path)
            except (OSError, trio.TooSlowError, h11.ProtocolError) as exc:
                answers[index] = (0, f"no answer: {type(exc).__name__}: {exc}".encode())

        async with trio.open_nursery() as nursery:
            for index in range(self.count):
                nursery.start_soon(ask, index)
        return answers

    def routes(self) -> tuple[dict[str, Route], dict[str, PeerRoute]]:
        async def ready() -> Response:
            if self.stopping:
                return Response.text("not ready: draining", 503)
            problems = [
                f"worker {i}: {body.decode('utf-8', 'replace').strip() or 'no answer'}"
                for i, (status, body) in enumerate(await self._ask_all("/readyz"))
                if status != 200
            ]
            return (
                Response.text(f"not ready: {'; '.join(problems)}", 503)
                if problems
                else Response.text("ready")
            )

        # The workers answer everything on their private channel; the pod's port authenticates and
        # filters as one process does (clusterproxy_server.admin).
        plain_metrics, full_metrics = metrics_routes(self.metrics, self.visible)

        async def merge_metrics() -> None:
            self.merged.texts = [
                body.decode() for status, body in await self._ask_all("/metrics") if status == 200
            ]

        async def metrics() -> Response:
            await merge_metrics()
            return plain_metrics()

        async def authenticated_metrics(cert: x509.Certificate | None) -> Response:
            await merge_metrics()
            return full_metrics(cert)

        async def agents(cert: x509.Certificate | None) -> Response:
            shown = self.visible(cert)
            merged: list[object] = []
            for status, body in await self._ask_all("/api/v1/agents"):
                if status == 200:
                    merged.extend(entry for entry in json.loads(body) if shown(entry["cluster"]))
            return Response.json(merged)

        async def clusters(cert: x509.Certificate | None) -> Response:
            shown = self.visible(cert)
            agents_of: dict[str, set[str]] = {}
            for status, body in await self._ask_all("/api/v1/clusters"):
                if status == 200:
                    for name in json.loads(body):
                        agents_of.setdefault(name, set())
            for status, body in await self._ask_all("/api/v1/agents"):
                if status == 200:
                    for entry in json.loads(body):
                        agents_of.setdefault(entry["cluster"], set()).add(entry["agent_id"])
            return Response.json(
                {name: {"agents": len(ids)} for name, ids in sorted(agents_of.items()) if shown(name)}
            )

        async def workers() -> Response:
            metrics_answers = await self._ask_all("/metrics")
            agents_answers = await self._ask_all("/api/v1/agents")
            listing = []
            for state in self.states:
                status, body = metrics_answers[state.index]
                listing.append(
                    {
                        "worker": state.index,
                        "pid": state.pid,
                        "server_id": state.server_id,
                        "running": state.process is not None,
                        "restarts": state.restarts,
                        "admin_answered": status == 200,
                        "streams_total": _sum_samples(body, "cluster_proxy_server_streams_total")
                        if status == 200
                        else None,
                        "tunnels": len(json.loads(agents_answers[state.index][1]))
                        if agents_answers[state.index][0] == 200
                        else None,
                    }
                )
            return Response.json(listing)

        plain: dict[str, Route] = {
            "/healthz": lambda: Response.text("ok"),
            "/readyz": ready,
            "/metrics": metrics,
            "/api/v1/workers": workers,
        }
        private: dict[str, PeerRoute] = {
            "/api/v1/agents": agents,
            "/api/v1/clusters": clusters,
            "/metrics": authenticated_metrics,
        }
        return plain, private


def _sum_samples(text: bytes, name: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
        if sample.name == name
    )


def _describe_status(status: int | None) -> str:
    if status is None:
        return "not started"
    if status < 0:
        return f"killed by {signal.Signals(-status).name}"
    return f"exit status {status}"


# -- inside a worker --------------------------------------------------------------------------------


async def watch_parent(fd: int, on_gone: Callable[[], None]) -> None:
    """Call ``on_gone()`` when the parent's end of the pipe closes (the parent died: SIGKILL, a crash):
    an orphaned worker would keep its ports and take connections nobody supervises."""
    pipe = trio.lowlevel.FdStream(fd)
    while await pipe.receive_some(64):
        pass
    on_gone()


async def follow_cert_files(contexts: Sequence[ReloadingContext], files: Sequence[os.PathLike[str]]) -> None:
    """Reload ``contexts`` when the parent's renewer changes the certificate, key or trust bundle."""
    log = get_logger("proxy-server")

    def stamp() -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for path in files:
            try:
                info = os.stat(path)
                stamps.append((info.st_mtime_ns, info.st_size, info.st_ino))
            except OSError:
                stamps.append((0, 0, 0))
        return tuple(stamps)

    seen = stamp()
    while True:
        await trio.sleep(FILE_POLL)
        now = stamp()
        if now == seen:
            continue
        seen = now
        for context in contexts:
            try:
                outcome = context.reload()
            except ConfigError as exc:  # a half-written file: the next poll sees it whole
                log.warning("certificate_reload_failed", error=str(exc))
                seen = ()
                break
            else:
                log.info("certificate_reloaded", outcome=outcome, serial=context.presenting)
