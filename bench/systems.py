"""The paths a workload is measured through: direct, ours, upstream, and their variants (ours with
agents over the WebSocket transport; ours and upstream through konnectivity gRPC), and the floor
(bench/floor: our stack with nothing of ours around it).

Every system gives the loadgen the flags that reach the target through it (`dial_args`), the
processes to watch (`procs`), and for the fan-in workload a way to run many agents
(`start_fanin`). The target and the client are the same for all of them. A system runs the
workloads in its `workloads` (None: every one).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.haproxy import Place
from bench.pki import BenchPKI, CertFiles
from bench.procs import Proc, free_port, wait_port

REPO = Path(__file__).resolve().parent.parent
CLUSTER = "cluster1"
CLUSTER_HEADER = "cluster-proxy-cluster"
FANIN_BASE = "127.1.0.0"
WEBSOCKET_PATH = "/v1/tunnel"  # where the proxy-server's --agent-websocket-listen port takes tunnels
# What the konnectivity-gRPC systems are measured on (issue 16: the bulk, connect and
# request/response rows). Each stream is a single-use tunnel: its own TCP + TLS + gRPC connection.
KONNECTIVITY_WORKLOADS = ("bulk", "connect", "rr")


def fanin_ip(i: int, base: str = FANIN_BASE) -> str:
    """i-th fan-in loopback address; same formula as loadgen's and anp-multiagent's FaninIP."""
    b = ipaddress.IPv4Address(base).packed
    return str(ipaddress.IPv4Address(bytes([b[0], b[1] + i // 62500, b[2] + (i // 250) % 250, i % 250 + 1])))


class Unavailable(Exception):
    """A system cannot run here; the message says why (the run goes on without it)."""


@dataclass
class Env:
    """What every system needs: where things are and the run's certificates."""

    loadgen: Path
    run_dir: Path
    pki: BenchPKI
    server_cert: CertFiles
    client_cert: CertFiles
    target_port: int
    anp_bin: Path | None = None
    anp_version: str = ""
    venv_bin: Path = REPO / ".venv" / "bin"
    log_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def proxy_args(self, proxy_port: int) -> list[str]:
        return [
            "--proxy",
            f"127.0.0.1:{proxy_port}",
            "--ca",
            str(self.pki.ca),
            "--cert",
            str(self.client_cert.cert),
            "--key",
            str(self.client_cert.key),
        ]

    def probe(self, args: list[str], lines: list[str], timeout: float, parallel: int = 32) -> dict:
        """Dial every line's CONNECT target until each answers once (loadgen probe)."""
        f = self.run_dir / f"probe-{time.monotonic_ns()}.txt"
        f.write_text("\n".join(lines) + "\n")
        try:
            out = subprocess.run(
                [
                    str(self.loadgen),
                    "probe",
                    "--targets",
                    str(f),
                    "--timeout",
                    f"{timeout}s",
                    "--parallel",
                    str(parallel),
                    "--dial-timeout",
                    "5s",
                    *args,
                ],
                capture_output=True,
                text=True,
                timeout=timeout + 30,
                check=True,
            )
        finally:
            f.unlink(missing_ok=True)
        return json.loads(out.stdout)["result"]


class FaninHandle:
    """A proxy-server with many agents (fan-in workload). start_agents() spawns the agents."""

    def __init__(self, server: Proc, spawn_agents, n: int, probe_lines: list[str], restart) -> None:
        self.server = server
        self.agents: list[Proc] = []
        self.n = n
        self.probe_lines = probe_lines
        self._spawn = spawn_agents
        self._restart = restart

    def start_agents(self) -> None:
        self.agents = self._spawn()

    def restart_server(self) -> None:
        """SIGKILL the server (a crash), start it again on the same ports; returns once it listens."""
        self.server.kill()
        self.server = self._restart()

    def agents_rss_kib(self) -> int:
        return sum(p.rss_kib() for p in self.agents)

    def agents_cpu_seconds(self) -> float:
        return sum(p.cpu_seconds() for p in self.agents)

    def stop(self) -> None:
        for p in self.agents:
            with contextlib.suppress(Exception):
                p.popen.terminate()
        for p in self.agents:
            p.stop(grace=1.0)
        self.server.stop()


class System:
    name = "?"
    proxied = True
    # The workloads this system is measured on (None: all). A variant that changes one thing (the
    # agents' transport, the client protocol) is measured where that thing matters.
    workloads: tuple[str, ...] | None = None

    def __init__(self, env: Env) -> None:
        self.env = env
        self.server: Proc | None = None
        self.agent: Proc | None = None

    def check(self) -> None:
        """Raise Unavailable when the system cannot run here."""

    def start(self) -> None:
        raise NotImplementedError

    def dial_args(self, proxy_port: int | None = None) -> list[str]:
        """loadgen flags that reach the target through this system (through ``proxy_port`` instead of
        the system's own client port when given: a load balancer in front of it)."""
        raise NotImplementedError

    def procs(self) -> dict[str, Proc]:
        return {k: v for k, v in (("server", self.server), ("agent", self.agent)) if v is not None}

    def stop(self) -> None:
        for p in (self.agent, self.server):
            if p is not None:
                p.stop()
        self.server = self.agent = None

    def start_fanin(self, n: int, tag: str, processes: int = 1) -> FaninHandle:
        """The server and ``n`` agents (each of its own cluster) in ``processes`` processes."""
        raise Unavailable(f"{self.name}: no fan-in")

    # Replicas behind a load balancer (the failover workload, bench/failover.py). Each replica runs
    # in a Place; the agents dial the balancer's agent frontend, whose health check asks this path.
    agent_backend_check = "/readyz"

    def replica_argv(self, place: Place, server_id: str, count: int, drain_timeout: float) -> list[str]:
        """A proxy-server replica in ``place`` that tells ``count`` replicas and drains for
        ``drain_timeout`` seconds on SIGTERM."""
        raise Unavailable(f"{self.name}: no proxy-server replicas")

    def replica_agent_argv(self, index: int, server_port: int, metrics_port: int) -> list[str]:
        """Agent ``index`` of cluster1 dialing ``server_port`` (the balancer), /metrics on ``metrics_port``."""
        raise Unavailable(f"{self.name}: no proxy-server replicas")

    def replicas_held(self, metrics: str) -> int | None:
        """How many replicas an agent holds a tunnel to, from its /metrics text (None: not said)."""
        return None

    def wait_routable(self, timeout: float = 30.0) -> None:
        res = self.env.probe(self.probe_args(), [self.probe_line()], timeout)
        if res["ok"] != 1:
            raise RuntimeError(f"{self.name}: target not reachable through the proxy: {res['failed_dial']}")

    def target_authority(self) -> str:
        return f"127.0.0.1:{self.env.target_port}"

    def probe_args(self) -> list[str]:
        """loadgen flags for probe mode (the proxy; targets and headers come from the probe lines)."""
        return []

    def probe_line(self) -> str:
        """One probe line for the main target: authority, then TAB-separated CONNECT headers."""
        return self.target_authority()


class Direct(System):
    name = "direct"
    proxied = False

    def start(self) -> None:
        pass

    def dial_args(self, proxy_port: int | None = None) -> list[str]:
        return ["--target", self.target_authority()]


class Upstream(System):
    """apiserver-network-proxy in http-connect mode (or, mode="grpc", its default gRPC mode: the
    loadgen then speaks konnectivity gRPC, a CreateSingleUseGrpcTunnel per stream), mTLS on both
    ports, destHost strategy.

    The agent's identifier is host=127.0.0.1 and clients CONNECT (or DIAL_REQ) 127.0.0.1:<target
    port>: with destHost the server routes by that host and the agent dials that same host:port, so
    the identifier must be an address (or name) the agent can reach the target at.
    """

    name = "upstream"
    # Upstream's /readyz is "at least one agent connected" (DefaultBackendStorage.Ready): checked
    # for the agents' backend too, a replica would never get its first agent. /healthz is liveness.
    agent_backend_check = "/healthz"
    modes = ("http-connect", "grpc")

    def __init__(self, env: Env, mode: str = "http-connect") -> None:
        super().__init__(env)
        if mode not in self.modes:
            raise ValueError(f"upstream: unknown proxy-server mode {mode!r}; known: {self.modes}")
        self.mode = mode
        if mode == "grpc":
            self.name = "upstream-grpc"
            self.workloads = KONNECTIVITY_WORKLOADS

    def check(self) -> None:
        if self.env.anp_bin is None:
            raise Unavailable(
                "upstream: apiserver-network-proxy binaries not built (bash bench/upstream/build.sh)"
            )
        for b in ("proxy-server", "proxy-agent", "anp-multiagent"):
            if not (self.env.anp_bin / b).exists():
                raise Unavailable(f"upstream: {self.env.anp_bin / b} missing (bash bench/upstream/build.sh)")

    def _server_argv(
        self, place: Place | None = None, server_id: str = "bench-server", count: int = 1
    ) -> list[str]:
        e = self.env
        s = e.server_cert
        place = place or Place("main", self.agent_port, self.client_port, self.health_port, self.admin_port)
        return [
            str(e.anp_bin / "proxy-server"),
            f"--mode={self.mode}",
            "--proxy-strategies=destHost",
            f"--server-ca-cert={e.pki.ca}",
            f"--server-cert={s.cert}",
            f"--server-key={s.key}",
            f"--cluster-ca-cert={e.pki.ca}",
            f"--cluster-cert={s.cert}",
            f"--cluster-key={s.key}",
            f"--server-port={place.client}",
            f"--agent-port={place.agent}",
            f"--admin-port={place.admin}",
            f"--health-port={place.health}",
            "--server-bind-address=127.0.0.1",
            "--agent-bind-address=127.0.0.1",
            "--health-bind-address=127.0.0.1",
            "--admin-bind-address=127.0.0.1",
            f"--server-id={server_id}",
            f"--server-count={count}",
            "-v=0",
        ]

    def _start_server(self, tag: str) -> Proc:
        self.client_port, self.agent_port = free_port(), free_port()
        self.admin_port, self.health_port = free_port(), free_port()
        return self._launch_server(tag)

    def _launch_server(self, tag: str) -> Proc:
        p = Proc("upstream-server", self._server_argv(), self.env.log_dir / f"upstream-server-{tag}.log")
        wait_port("127.0.0.1", self.client_port, 20, p)
        wait_port("127.0.0.1", self.agent_port, 20, p)
        return p

    def _agent_argv(self, agent_id: str, server_port: int, health_port: int) -> list[str]:
        e = self.env
        agent_cert = e.pki.agent(CLUSTER, agent_id)
        return [
            str(e.anp_bin / "proxy-agent"),
            f"--agent-id={agent_id}",
            "--agent-identifiers=host=127.0.0.1",
            f"--ca-cert={e.pki.ca}",
            f"--agent-cert={agent_cert.cert}",
            f"--agent-key={agent_cert.key}",
            "--proxy-server-host=127.0.0.1",
            f"--proxy-server-port={server_port}",
            f"--admin-server-port={free_port()}",
            "--admin-bind-address=127.0.0.1",
            f"--health-server-port={health_port}",
            "--health-server-host=127.0.0.1",
            "-v=0",
        ]

    def start(self) -> None:
        e = self.env
        self.server = self._start_server("main")
        health = free_port()
        argv = self._agent_argv("bench-agent", self.agent_port, health)
        self.agent = Proc("upstream-agent", argv, e.log_dir / "upstream-agent-main.log")
        wait_port("127.0.0.1", health, 20, self.agent)
        self.wait_routable()

    def dial_args(self, proxy_port: int | None = None) -> list[str]:
        return [
            "--target",
            self.target_authority(),
            *self.env.proxy_args(proxy_port or self.client_port),
            *self._protocol_args(),
        ]

    def _protocol_args(self) -> list[str]:
        return ["--konnectivity"] if self.mode == "grpc" else []

    def replica_argv(self, place: Place, server_id: str, count: int, drain_timeout: float) -> list[str]:
        # --graceful-shutdown-timeout (v0.36.0, default 0 = stop at once): on SIGTERM the frontend
        # and health listeners close, agents get a gRPC GracefulStop, and the process exits when
        # they are done or the timeout has passed.
        return [
            *self._server_argv(place, server_id, count),
            f"--graceful-shutdown-timeout={drain_timeout:g}s",
        ]

    def replica_agent_argv(self, index: int, server_port: int, metrics_port: int) -> list[str]:
        return self._agent_argv(f"bench-agent-{index}", server_port, metrics_port)

    def replicas_held(self, metrics: str) -> int | None:
        # The agent's ClientSet sets this gauge to its number of server connections (clientset.go).
        return _gauge(metrics, "konnectivity_network_proxy_agent_open_server_connections")

    def start_fanin(self, n: int, tag: str, processes: int = 1) -> FaninHandle:
        # One process whatever ``processes`` says: Go's runtime spreads its agents over every core.
        e = self.env
        server = self._start_server(f"fanin-{tag}")
        agent_cert = e.pki.agent("fanin", "upstream-multi")
        argv = [
            str(e.anp_bin / "anp-multiagent"),
            f"--count={n}",
            f"--ip-base={FANIN_BASE}",
            f"--ca-cert={e.pki.ca}",
            f"--agent-cert={agent_cert.cert}",
            f"--agent-key={agent_cert.key}",
            "--proxy-server-host=127.0.0.1",
            f"--proxy-server-port={self.agent_port}",
            "-v=0",
        ]
        lines = [f"{fanin_ip(i)}:{e.target_port}" for i in range(n)]
        log = e.log_dir / f"upstream-multiagent-{tag}.log"
        return FaninHandle(
            server,
            lambda: [Proc("upstream-multiagent", argv, log)],
            n,
            lines,
            lambda: self._launch_server(f"fanin-{tag}"),
        )

    def probe_args(self) -> list[str]:
        return [*self.env.proxy_args(self.client_port), *self._protocol_args()]


class HeaderRouted(System):
    """What ours and the floor share: a server started on fresh ports, one agent of cluster1 dialing it,
    the client's CONNECT routed by the cluster header; measured once the target is reachable through
    it. A subclass starts its own programs (``_start_server``, ``_start_agent``)."""

    client_port = 0  # the server's client port, set by _start_server

    def _start_server(self, tag: str) -> Proc:
        raise NotImplementedError

    def _start_agent(self, cert: CertFiles) -> Proc:
        """The agent of cluster1 with the certificate ``cert``."""
        raise NotImplementedError

    def wait_ready(self) -> None:
        """Until the system carries a stream to the target."""
        self.wait_routable()

    def start(self) -> None:
        self.server = self._start_server("main")
        self.agent = self._start_agent(self.env.pki.agent(CLUSTER, "agent1"))
        try:
            self.wait_ready()
        except Exception as exc:
            raise RuntimeError(
                f"{exc}\n--- server log ---\n{self.server.tail()}\n--- agent log ---\n{self.agent.tail()}"
            ) from exc

    def dial_args(self, proxy_port: int | None = None) -> list[str]:
        return [
            "--target",
            self.target_authority(),
            *self.env.proxy_args(proxy_port or self.client_port),
            *self._protocol_args(),
            "--header",
            f"{CLUSTER_HEADER}: {CLUSTER}",
        ]

    def _protocol_args(self) -> list[str]:
        """loadgen flags for the client's protocol (none: HTTP/1.1 CONNECT)."""
        return []

    def probe_line(self) -> str:
        return f"{self.target_authority()}\t{CLUSTER_HEADER}: {CLUSTER}"


class Ours(HeaderRouted):
    """This project's Python proxy-server and proxy-agent, HTTP/1.1 CONNECT frontend with mTLS (or,
    frontend="konnectivity", the client port's konnectivity gRPC: the loadgen then makes a
    CreateSingleUseGrpcTunnel per stream and sends the cluster header as gRPC metadata)."""

    name = "ours"
    # How agents reach the server. "tls": the plain tunnel (TCP, mTLS, HTTP/2) to the agent port.
    # "websocket": the same tunnel inside a WebSocket, to the server's --agent-websocket-listen port
    # with ws:// (plain HTTP, no ingress in front: what is measured is the carrier, not an ingress).
    transports = ("tls", "websocket")
    frontends = ("connect", "konnectivity")

    def __init__(
        self,
        env: Env,
        transport: str = "tls",
        frontend: str = "connect",
        workers: int = 1,
        build: tuple[str, Path] | None = None,
    ) -> None:
        """``build``: (NAME, DIR), ours from another build, its server and agent programs in DIR (another
        python3's virtualenv, or the wrappers bench/python_root.sh writes), named ``ours-NAME``."""
        super().__init__(env)
        # --workers of the server (1 unless a variant says: the server's own default is one per core)
        self.workers = workers
        if transport not in self.transports:
            raise ValueError(f"ours: unknown agent transport {transport!r}; known: {self.transports}")
        if frontend not in self.frontends:
            raise ValueError(f"ours: unknown client frontend {frontend!r}; known: {self.frontends}")
        self.transport = transport
        self.frontend = frontend
        self.websocket_port = 0
        if transport != "tls":
            self.name = f"ours-{transport}"
            # No fan-in (bench/fleet.py dials TCP), no failover (haproxy's agent frontend is TCP), no
            # idle (memory per stream does not depend on the agent's carrier; it would add minutes).
            self.workloads = ("bulk", "connect", "rr", "hol")
        if frontend == "konnectivity":
            self.name = f"{self.name}-grpc"
            self.workloads = KONNECTIVITY_WORKLOADS
        if workers != 1:
            self.name = f"{self.name}-w{workers}"
            self.workloads = ("bulk", "connect", "rr", "hol", "idle", "fanin")
        bin_dir = env.venv_bin
        if build is not None:
            self.name, bin_dir = f"ours-{build[0]}", build[1]
        self.server_bin = bin_dir / "cluster-proxy-server"
        self.agent_bin = bin_dir / "cluster-proxy-agent"

    def agent_server_address(self, host: str, port: int) -> str:
        """The agent's ``--server`` for the server's agent-facing port at host:port, in this transport."""
        if self.transport == "websocket":
            return f"ws://{host}:{port}{WEBSOCKET_PATH}"
        return f"{host}:{port}"

    def agent_facing_port(self) -> int:
        """The port this transport's agents dial: the WebSocket port or the agent port."""
        return self.websocket_port if self.transport == "websocket" else self.agent_port

    def check(self) -> None:
        for b in (self.server_bin, self.agent_bin):
            if not b.exists():
                raise Unavailable(f"ours: {b} missing (run `bash scripts/bootstrap.sh` first)")
        server_flags = ["--agent-listen", "--client-listen", "--admin-listen"]
        if self.transport == "websocket":
            server_flags.append("--agent-websocket-listen")
        for b, flags in (
            (self.server_bin, tuple(server_flags)),
            (self.agent_bin, ("--server", "--cluster", "--agent-id", "--allow", "--admin-listen")),
        ):
            try:
                out = subprocess.run([str(b), "--help"], capture_output=True, text=True, timeout=30).stdout
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise Unavailable(f"ours: {b} --help failed: {exc}") from exc
            missing = [f for f in flags if f not in out]
            if missing:
                raise Unavailable(f"ours: {b.name} lacks the flags {missing} this harness uses")

    def _server_argv(self, place: Place | None = None) -> list[str]:
        e = self.env
        websocket: list[str] = []
        if place is None and self.transport == "websocket":
            websocket = ["--agent-websocket-listen", f"127.0.0.1:{self.websocket_port}"]
        place = place or Place("main", self.agent_port, self.client_port, self.admin_port, 0)
        return [
            str(self.server_bin),
            "--agent-listen",
            f"127.0.0.1:{place.agent}",
            "--client-listen",
            f"127.0.0.1:{place.client}",
            "--admin-listen",
            f"127.0.0.1:{place.health}",
            "--ca",
            str(e.pki.ca),
            "--cert",
            str(e.server_cert.cert),
            "--key",
            str(e.server_cert.key),
            "--log-level",
            "warning",
            "--log-format",
            "json",
            "--workers",
            str(self.workers),
            *websocket,
        ]

    def _agent_argv(
        self, cluster: str, agent_id: str, cert: CertFiles, server_port: int = 0, admin: str = "127.0.0.1:0"
    ) -> list[str]:
        e = self.env
        return [
            str(self.agent_bin),
            "--server",
            self.agent_server_address("127.0.0.1", server_port or self.agent_facing_port()),
            "--cluster",
            cluster,
            "--agent-id",
            agent_id,
            "--ca",
            str(e.pki.ca),
            "--cert",
            str(cert.cert),
            "--key",
            str(cert.key),
            "--admin-listen",
            admin,
            "--allow",
            "127.0.0.0/8",
            "--log-level",
            "warning",
            "--log-format",
            "json",
        ]

    def _start_server(self, tag: str) -> Proc:
        self.client_port, self.agent_port, self.admin_port = free_port(), free_port(), free_port()
        if self.transport == "websocket":
            self.websocket_port = free_port()
        return self._launch_server(tag)

    def _launch_server(self, tag: str) -> Proc:
        p = Proc(
            f"{self.name}-server", self._server_argv(), self.env.log_dir / f"{self.name}-server-{tag}.log"
        )
        wait_port("127.0.0.1", self.client_port, 30, p)
        wait_port("127.0.0.1", self.agent_facing_port(), 30, p)
        return p

    def _start_agent(self, cert: CertFiles) -> Proc:
        return Proc(
            f"{self.name}-agent",
            self._agent_argv(CLUSTER, "agent1", cert),
            self.env.log_dir / f"{self.name}-agent-main.log",
        )

    def wait_ready(self) -> None:
        self.wait_routable()
        self.wait_every_worker_held()

    def _protocol_args(self) -> list[str]:
        return ["--konnectivity"] if self.frontend == "konnectivity" else []

    def wait_every_worker_held(self, timeout: float = 30.0) -> None:
        """With workers, the agent finds each through the one agent port (a replica search): measure
        only once it holds them all, or the first streams wait in a worker's startup grace."""
        if self.workers == 1:
            return
        # the agents' list is the admin port's over mutual TLS only, to a hub client certificate
        # (docs/architecture.md, "The admin port"); the server's certificate names 127.0.0.1
        e = self.env
        context = ssl.create_default_context(cafile=str(e.pki.ca))
        context.load_cert_chain(str(e.client_cert.cert), str(e.client_cert.key))
        deadline = time.monotonic() + timeout
        held: set[str] = set()
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(
                    f"https://127.0.0.1:{self.admin_port}/api/v1/agents", timeout=5, context=context
                ) as r:
                    held = {entry["server_id"] for entry in json.load(r)}
            except OSError:
                pass
            if len(held) >= self.workers:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{self.name}: the agent holds {sorted(held)}, not {self.workers} workers")

    def replica_argv(self, place: Place, server_id: str, count: int, drain_timeout: float) -> list[str]:
        return [
            *self._server_argv(place),
            "--server-id",
            server_id,
            "--server-count",
            str(count),
            "--drain-timeout",
            f"{drain_timeout:g}s",
        ]

    def replica_agent_argv(self, index: int, server_port: int, metrics_port: int) -> list[str]:
        agent_id = f"agent{index}"
        cert = self.env.pki.agent(CLUSTER, agent_id)
        return self._agent_argv(CLUSTER, agent_id, cert, server_port, f"127.0.0.1:{metrics_port}")

    def replicas_held(self, metrics: str) -> int | None:
        return _gauge(metrics, "cluster_proxy_agent_replicas_held")

    def start_fanin(self, n: int, tag: str, processes: int = 1) -> FaninHandle:
        """The n agents run in ``processes`` processes (bench/fleet.py; upstream's in one Go process,
        which uses every core)."""
        e = self.env
        server = self._start_server(f"fanin-{tag}")
        agents, lines = [], []
        for i in range(n):
            cluster = f"fanin-{i}"
            cert = e.pki.agent(cluster, "a")
            agents.append({"cluster": cluster, "agent_id": "a", "cert": str(cert.cert), "key": str(cert.key)})
            lines.append(f"{self.target_authority()}\t{CLUSTER_HEADER}: {cluster}")
        common = {
            "server_host": "127.0.0.1",
            "server_port": self.agent_port,
            "server_name": "localhost",
            "ca": str(e.pki.ca),
        }
        fleets = []
        for part in range(processes):
            spec = e.log_dir / f"ours-fanin-{tag}-fleet{part}.json"
            spec.write_text(json.dumps({"common": common, "agents": agents[part::processes]}))
            argv = [str(e.venv_bin / "python"), "-m", "bench.fleet", str(spec)]
            fleets.append((argv, e.log_dir / f"ours-fanin-{tag}-agents{part}.log"))
        return FaninHandle(
            server,
            lambda: [Proc("ours-fleet", argv, log, env={"PYTHONPATH": str(REPO)}) for argv, log in fleets],
            n,
            lines,
            lambda: self._launch_server(f"fanin-{tag}"),
        )

    def probe_args(self) -> list[str]:
        return [*self.env.proxy_args(self.client_port), *self._protocol_args()]


class Floor(HeaderRouted):
    """bench/floor: the shortest correct proxy-server and agent on ours' stack (trio, ssl, h11, h2, the
    same certificates, windows and settings) with nothing of ours around it: the ceiling ours is
    measured against (issue 36). Started like ours (ports, certificates, the cluster header)."""

    name = "floor"
    workloads = ("bulk", "connect", "rr", "idle", "fanin", "hol")

    def check(self) -> None:
        if not (self.env.venv_bin / "python").exists():
            raise Unavailable(
                f"floor: {self.env.venv_bin / 'python'} missing (run `bash scripts/bootstrap.sh`)"
            )

    def _proc(self, role: str, argv: list[str], tag: str) -> Proc:
        command = [str(self.env.venv_bin / "python"), "-m", f"bench.floor.{role}", *argv]
        log = self.env.log_dir / f"floor-{role}-{tag}.log"
        return Proc(f"floor-{role}", command, log, env={"PYTHONPATH": str(REPO)})

    def _start_server(self, tag: str) -> Proc:
        self.client_port, self.agent_port = free_port(), free_port()
        return self._launch_server(tag)

    def _launch_server(self, tag: str) -> Proc:
        e = self.env
        p = self._proc(
            "server",
            [
                *("--agent-listen", f"127.0.0.1:{self.agent_port}"),
                *("--client-listen", f"127.0.0.1:{self.client_port}"),
                *("--ca", str(e.pki.ca), "--cert", str(e.server_cert.cert), "--key", str(e.server_cert.key)),
            ],
            tag,
        )
        wait_port("127.0.0.1", self.client_port, 30, p)
        wait_port("127.0.0.1", self.agent_port, 30, p)
        return p

    def _agent_argv(self, *identity: str) -> list[str]:
        return ["--server", f"127.0.0.1:{self.agent_port}", "--ca", str(self.env.pki.ca), *identity]

    def _start_agent(self, cert: CertFiles) -> Proc:
        identity = ("--cluster", CLUSTER, "--cert", str(cert.cert), "--key", str(cert.key))
        return self._proc("agent", self._agent_argv(*identity), "main")

    def probe_args(self) -> list[str]:
        return self.env.proxy_args(self.client_port)

    def start_fanin(self, n: int, tag: str, processes: int = 1) -> FaninHandle:
        """The n agents (each its own cluster and certificate) in ``processes`` processes, as ours'."""
        e = self.env
        server = self._start_server(f"fanin-{tag}")
        certs = [e.pki.agent(f"fanin-{i}", "a") for i in range(n)]
        lines = [f"{self.target_authority()}\t{CLUSTER_HEADER}: fanin-{i}" for i in range(n)]
        fleets = []
        for part in range(processes):
            fleet = e.log_dir / f"floor-fanin-{tag}-fleet{part}.txt"
            fleet.write_text("".join(f"{c.cert} {c.key}\n" for c in certs[part::processes]))
            fleets.append((self._agent_argv("--fleet", str(fleet)), f"fanin-{tag}-agents{part}"))
        return FaninHandle(
            server,
            lambda: [self._proc("agent", argv, log) for argv, log in fleets],
            n,
            lines,
            lambda: self._launch_server(f"fanin-{tag}"),
        )


def _gauge(metrics: str, name: str) -> int | None:
    """The value of an unlabelled gauge (or the only series of one with labels) in Prometheus text."""
    for line in metrics.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            return int(float(line.rsplit(" ", 1)[1]))
    return None


def anp_bin_dir(version: str) -> Path:
    """Where bench/upstream/build.sh puts the upstream binaries (same rule as the script)."""
    cache = os.environ.get("CLUSTER_PROXY_BENCH_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cluster-proxy"
    )
    return Path(cache) / f"anp-{version}" / "bin"


def find_anp(version: str, build: bool) -> tuple[Path | None, str]:
    """The upstream bin folder (built or refreshed by build.sh unless build=False), or (None, why)."""
    if not build:
        b = anp_bin_dir(version)
        return (b, "") if (b / "proxy-server").exists() else (None, f"not built in {b} (and --no-build)")
    if not shutil.which("go"):
        return None, "go is not installed"
    script = REPO / "bench" / "upstream" / "build.sh"
    try:
        out = subprocess.run(
            ["bash", str(script)],
            capture_output=True,
            text=True,
            timeout=1200,
            check=True,
            env={**os.environ, "ANP_VERSION": version},
        )
    except subprocess.CalledProcessError as exc:
        return None, f"build failed: {exc.stderr[-2000:]}"
    return Path(out.stdout.strip().splitlines()[-1]), ""


def build_loadgen() -> Path:
    script = REPO / "bench" / "loadgen" / "build.sh"
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"loadgen build failed:\n{out.stderr}")
    return Path(out.stdout.strip().splitlines()[-1])


def tool_env(run_dir: Path) -> Env:
    """The bench's set-up for a tool that drives ours itself: the loadgen built, certificates issued
    into ``run_dir``, a free port for the loadgen target (not started)."""
    pki = BenchPKI(run_dir / "pki")
    return Env(
        loadgen=build_loadgen(),
        run_dir=run_dir,
        pki=pki,
        server_cert=pki.server(),
        client_cert=pki.client(),
        target_port=free_port(),
    )


@contextlib.contextmanager
def ours_alone(run_dir: Path) -> Iterator[tuple[Ours, Path]]:
    """Ours (the bench's certificates, one worker, one agent) and a loadgen target, started for a tool
    that drives one workload itself (``bench.profile``, ``bench.steps``): (ours, the loadgen binary);
    both stopped at the end."""
    env = tool_env(run_dir)
    target = Proc(
        "target",
        [str(env.loadgen), "target", "--listen", f"127.0.0.1:{env.target_port}"],
        env.log_dir / "target.log",
    )
    ours = Ours(env)
    try:
        ours.check()
        ours.start()
        yield ours, env.loadgen
    finally:
        ours.stop()
        target.stop()
