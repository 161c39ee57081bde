"""``--workers N``: one proxy-server pod uses N cores.

The parent process binds every port once per worker, bootstraps and renews the certificate, starts N
worker processes (each a whole :class:`~clusterproxy_server.app.ProxyServer`), restarts one that dies,
forwards SIGTERM for the drain, and serves the admin port for the whole pod by asking each worker over
a private loopback admin socket. Each worker is a replica to the agents: its own server id
(``<server-id>.w<i>``, ``.r<n>`` added at its n-th restart) and the server count ``--server-count`` x
N, so every agent holds a tunnel to every worker through the agents' usual replica search, and a
client's stream is served by the worker that accepted its connection (docs/architecture.md,
"Workers").

The module's neighbours hold its other jobs: the shared ports and what a worker inherits
(:mod:`.worker_sockets`), the merged metrics (:mod:`.worker_metrics`), and the worker's side of the
bond (:mod:`.worker_process`); the restart rule is clusterproxy_protocol.restart_policy, the one of
``local up`` too.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio
from cryptography import x509
from prometheus_client import CollectorRegistry, Counter, Gauge

from clusterproxy_protocol import (
    ALPN_HTTP1,
    AdminRoute,
    Authenticated,
    CertFiles,
    CertRenewer,
    PeerRoute,
    ReloadingContext,
    RenewalPolicy,
    RenewerCollector,
    Response,
    RestartPolicy,
    SignerEndpoint,
    attach_steering,
    format_address,
    get_logger,
    http1client,
    serve_admin,
    watch_signals,
)
from clusterproxy_server.admin import metrics_routes, visibility
from clusterproxy_server.authz import PolicyFile
from clusterproxy_server.config import ServerConfig
from clusterproxy_server.worker_metrics import MergedMetrics, sum_samples
from clusterproxy_server.worker_process import follow_cert_files, watch_parent
from clusterproxy_server.worker_sockets import WORKER_ENV, WorkerSpec, reuseport_sockets

# WORKER_ENV, WorkerSpec, follow_cert_files, watch_parent: main.py starts a worker with them from here
__all__ = [
    "WORKER_ENV",
    "Supervisor",
    "WorkerSpec",
    "default_workers",
    "follow_cert_files",
    "watch_parent",
    "worker_server_id",
]

# A dead worker is started again after half a second; its fifth death within a minute (four restarts
# already) stops the pod.
WORKER_RESTART = RestartPolicy(delay=0.5, limit=4, window=60.0)
WORKER_ANSWER_TIMEOUT = 5.0  # a worker's admin answer to the parent
WORKER_ANSWER_MAX = 256 << 20  # its /metrics or /api/v1/agents, with room for every tunnel it may hold
READY_POLL = 0.05


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


@dataclass
class WorkerState:
    index: int
    server_id: str = ""
    pid: int | None = None
    process: trio.Process | None = None
    restarts: int = 0
    restarted_at: deque[float] = field(default_factory=deque)  # trio clock, within WORKER_RESTART.window
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
            async with trio.open_nursery() as nursery:
                # first thing: from here on no signal is lost, and none kills the parent before its drain
                await nursery.start(
                    partial(
                        watch_signals,
                        self.log.bind(workers=self.count),
                        self._first_signal,
                        partial(self._signal_workers, signal.SIGTERM),
                    )
                )
                plain, private = self.routes()
                api = Authenticated(private, lambda: admin_tls.context)
                await nursery.start(partial(serve_admin, admin_listeners, plain, authenticated=api))
                if self.renewer is not None:
                    await nursery.start(self.renewer.run)
                async with trio.open_nursery() as workers:
                    for state in self.states:
                        workers.start_soon(self._keep, state)
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

    def _first_signal(self) -> None:
        """The first SIGTERM/SIGINT starts the drain (each later one cuts it: ``watch_signals``). When a
        worker's crash loop has started the drain already, the first signal cuts it, as a second would."""
        if self.stopping:
            self._signal_workers(signal.SIGTERM)
        else:
            self._stop.set()

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
            restarting = WORKER_RESTART.may_restart(state.restarted_at, now)
            deaths = len(state.restarted_at) + 1  # within the window, this one included
            self.log.error(
                "worker_died",
                worker=state.index,
                pid=state.pid,
                worker_server_id=state.server_id,
                status=_describe_status(status),
                deaths_in_window=deaths,
            )
            if not restarting:
                self.failure = (
                    f"worker {state.index} died {deaths} times within {WORKER_RESTART.window:g}s "
                    f"(last: {_describe_status(status)}); its log lines carry worker={state.index}"
                )
                self.log.error("workers_stopping", error=self.failure)
                self._stop.set()
                return
            await trio.sleep(WORKER_RESTART.delay)
            if self.stopping:
                return
            state.restarted_at.append(trio.current_time())
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
            agent_port=format_address(a) if (a := self._port("agent")) else None,
            agent_websocket_port=format_address(p) if (p := self._port("websocket")) else None,
            client_port=format_address(c) if (c := self._port("client")) else None,
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
                answer = await http1client.get(
                    "127.0.0.1",
                    self.admin_port(index),
                    path,
                    timeout=WORKER_ANSWER_TIMEOUT,
                    max_body=WORKER_ANSWER_MAX,
                )
                answers[index] = (answer.status, answer.body)
            except (OSError, trio.TooSlowError, trio.BrokenResourceError, http1client.HTTPClientError) as exc:
                answers[index] = (0, f"no answer: {type(exc).__name__}: {exc}".encode())

        async with trio.open_nursery() as nursery:
            for index in range(self.count):
                nursery.start_soon(ask, index)
        return answers

    def routes(self) -> tuple[dict[str, AdminRoute], dict[str, PeerRoute]]:
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
                        "streams_total": sum_samples(body, "cluster_proxy_server_streams_total")
                        if status == 200
                        else None,
                        "tunnels": len(json.loads(agents_answers[state.index][1]))
                        if agents_answers[state.index][0] == 200
                        else None,
                    }
                )
            return Response.json(listing)

        plain: dict[str, AdminRoute] = {
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


def _describe_status(status: int | None) -> str:
    if status is None:
        return "not started"
    if status < 0:
        return f"killed by {signal.Signals(-status).name}"
    return f"exit status {status}"
