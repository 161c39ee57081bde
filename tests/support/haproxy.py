"""Several proxy-server replicas behind a real haproxy (Debian's package) on loopback, with agents
dialing it: the test harness of the HA tests (``tests/e2e/test_replicas.py``,
``test_rolling_restart.py``).

- :func:`start_haproxy`: haproxy in TCP mode with one frontend for the agents' port and one for the
  clients', over *places*. Clients are balanced round robin; agents by least connections unless said,
  so that an agent looking for a missing replica reaches the one with the fewest agent tunnels (the
  new one) at its first dial (``roundrobin`` shows the agents cope with a balancer that ignores that).
  Each place is health-checked on its replica's ``/readyz``, so a draining replica leaves rotation as
  it would behind a Kubernetes Service, and a refused connect is retried on another place (``retries
  3``, ``option redispatch 1``): ``clusterproxy_cli.haproxy``'s configuration, as ``local up`` and the
  failover benchmark run it. Its log (``option tcplog``) is in the test's log folder;
  :meth:`Haproxy.states` reads what it thinks of each place from its stats socket.
- :class:`Fleet`: a pool of places, each a fixed triple of loopback ports (agent, client, admin) in
  haproxy's configuration. A replica runs in a place; its successor takes a free place, as a new pod
  gets a new address (the predecessor keeps its admin port until it has drained). Agents dial haproxy.
  Readiness everywhere is a condition polled with a deadline, never a sleep.
- :func:`strict_h1_connect` and :class:`EchoStreams`: clients whose cut streams can never pass for
  finished ones.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import ssl
import tempfile
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from clusterproxy_cli import haproxy
from clusterproxy_cli.commands import agent_argv, server_argv
from clusterproxy_cli.local_plan import free_ports
from clusterproxy_protocol import tls
from clusterproxy_protocol.certclient import CertFiles
from clusterproxy_protocol.pki import DevCA
from clusterproxy_sdk import TLSFiles, open_tunnel
from tests.support.pki import PkiFiles, make_pki
from tests.support.procs import AGENT_FLAGS, ANY_PORT, POLL, Process, client_tls, http_get
from tests.support.proxies import accepts, binary
from tests.support.traffic import BYE
from tests.support.waiting import wait_until

HAPROXY_MISSING = "haproxy (Debian package haproxy; scripts/bootstrap.sh installs it)"
STARTUP_TIMEOUT = 20.0
CHECK_INTERVAL = "100ms"  # the tests' health checks: a draining replica leaves rotation within ~0.1 s


@dataclass(frozen=True)
class Place:
    """Where one replica can run: its three loopback ports, fixed in haproxy's configuration."""

    name: str
    agent: int
    client: int
    admin: int


def make_ha_pki(directory: Path) -> PkiFiles:
    """The tests' PKI plus a second agent of cluster2: two clusters with two agents each."""
    pki = make_pki(directory)
    pki.agents["cluster2/agent-b"] = DevCA.create_or_load(directory / "ca").issue_agent(
        "cluster2", "agent-b", directory / "leaves"
    )
    return pki


def allocate_places(count: int) -> list[Place]:
    """``count`` places on free loopback ports (bound together then released, below the kernel's
    ephemeral range: see :func:`tests.support.proxies.free_port`)."""
    ports = iter(free_ports(3 * count))
    return [Place(f"place{i}", next(ports), next(ports), next(ports)) for i in range(count)]


@dataclass
class Haproxy:
    process: Process
    agent_port: int
    client_port: int
    stats_socket: Path
    private_dir: Path

    def states(self) -> dict[tuple[str, str], str]:
        """(backend, place) -> haproxy's status of that place ("UP", "DOWN", ...), from ``show stat``."""
        return haproxy.socket_states(self.stats_socket)

    async def wait_state(self, place: str, status: str, timeout: float = 10.0) -> None:
        """Until haproxy reports ``place`` with ``status`` in both backends."""

        async def reported() -> bool:
            return haproxy.in_state(await trio.to_thread.run_sync(self.states), place, status)

        await wait_until(
            reported,
            timeout=timeout,
            interval=POLL,
            message=lambda: f"haproxy: {place} not {status} after {timeout}s: {self.states()}",
        )

    def log_lines(self) -> list[str]:
        return self.process.log_path.read_text(errors="replace").splitlines()

    def stop(self) -> None:
        self.process.stop()
        shutil.rmtree(self.private_dir, ignore_errors=True)


def haproxy_config(
    places: Iterable[Place],
    agent_port: int,
    client_port: int,
    stats_socket: Path,
    agent_balance: str = "leastconn",
) -> str:
    """TCP mode; each place health-checked with ``GET /readyz`` on its admin port."""
    return haproxy.config(
        [haproxy.Server(p.name, p.agent, p.client, p.admin) for p in places],
        agent_port,
        client_port,
        health_check=haproxy.checks_every(CHECK_INTERVAL),
        stream_timeout="10m",
        maxconn=4000,
        agent_balance=agent_balance,
        stats_socket=stats_socket,
    )


async def start_haproxy(
    log_dir: Path, places: list[Place], name: str = "haproxy", *, agent_balance: str = "leastconn"
) -> Haproxy:
    program = binary("haproxy")
    assert program, HAPROXY_MISSING
    private = Path(tempfile.mkdtemp(prefix="cpx-haproxy-"))  # a short path for the UNIX socket
    agent_port, client_port = free_ports(2)
    config = log_dir / f"{name}.cfg"
    config.write_text(haproxy_config(places, agent_port, client_port, private / "stats.sock", agent_balance))
    process = Process(name, haproxy.argv(program, config), log_dir)
    proxy = Haproxy(process, agent_port, client_port, private / "stats.sock", private)
    try:

        async def listening() -> bool:
            if (
                await trio.to_thread.run_sync(accepts, client_port)
                and proxy.stats_socket.exists()
                and await trio.to_thread.run_sync(accepts, agent_port)
            ):
                return True
            if process.popen.poll() is not None:
                raise AssertionError(f"haproxy exited ({process.popen.returncode}):\n{process.tail()}")
            return False

        await wait_until(
            listening, timeout=STARTUP_TIMEOUT, what="haproxy's frontends and stats socket", interval=POLL
        )
    except BaseException:
        proxy.stop()
        raise
    return proxy


@dataclass
class Replica:
    server_id: str
    place: Place
    process: Process
    sigterm_at: float | None = None  # trio clock


@dataclass
class Fleet:
    """proxy-server replicas in places behind one haproxy, and agents dialing it."""

    pki: PkiFiles
    log_dir: Path
    places: list[Place]
    agent_balance: str = "leastconn"
    haproxy: Haproxy | None = None
    replicas: dict[str, Replica] = field(default_factory=dict)  # live ones, by server id
    gone: list[Replica] = field(default_factory=list)
    agents: dict[str, Process] = field(default_factory=dict)  # by "cluster/agent-id"
    agent_admin: dict[str, str] = field(default_factory=dict)

    async def start(self) -> None:
        """haproxy, once it has checked every place (none runs a replica yet: all DOWN)."""
        self.haproxy = await start_haproxy(self.log_dir, self.places, agent_balance=self.agent_balance)
        for place in self.places:
            await self.haproxy.wait_state(place.name, "DOWN")

    # -- replicas ------------------------------------------------------------------------------------

    def free_place(self) -> Place:
        taken = {r.place.name for r in self.replicas.values()}
        taken |= {r.place.name for r in self.gone if r.process.popen.poll() is None}
        for place in self.places:
            if place.name not in taken:
                return place
        raise AssertionError(f"no free place among {len(self.places)}")

    async def start_replica(
        self, server_id: str, count: int, *extra: str, place: Place | None = None
    ) -> Replica:
        place = place or self.free_place()
        files = CertFiles(self.pki.server.cert, self.pki.server.key, self.pki.ca)
        argv = server_argv(
            files,
            agent_listen=f"127.0.0.1:{place.agent}",
            client_listen=f"127.0.0.1:{place.client}",
            admin_listen=f"127.0.0.1:{place.admin}",
            log_level="debug",
            options=["--server-id", server_id, "--server-count", str(count), *extra],
        )
        process = Process(f"server-{server_id}", argv, self.log_dir)
        await process.wait_event("server_started")
        replica = Replica(server_id, place, process)
        self.replicas[server_id] = replica
        if self.haproxy is not None:
            await self.haproxy.wait_state(place.name, "UP")
        return replica

    def sigterm(self, server_id: str) -> Replica:
        replica = self.replicas.pop(server_id)
        replica.sigterm_at = trio.current_time()
        replica.process.kill(signal.SIGTERM)
        self.gone.append(replica)
        return replica

    def sigkill(self, server_id: str) -> Replica:
        replica = self.replicas.pop(server_id)
        replica.process.kill(signal.SIGKILL)
        self.gone.append(replica)
        return replica

    def agents_of(self, server_id: str) -> list[dict[str, Any]]:
        """``/api/v1/agents`` of a live replica."""
        status, body = http_get(
            f"https://127.0.0.1:{self.replicas[server_id].place.admin}/api/v1/agents",
            context=client_tls(self.pki.client, self.pki.ca),
        )
        assert status == 200, body
        return json.loads(body)

    # -- agents --------------------------------------------------------------------------------------

    def start_agent(self, cluster: str, agent_id: str, *extra: str, server: str | None = None) -> Process:
        """An agent dialing haproxy (or ``server``: another address, a list of them)."""
        assert self.haproxy is not None
        pair = self.pki.agent(cluster, agent_id)
        files = CertFiles(pair.cert, pair.key, self.pki.ca)
        argv = agent_argv(
            files,
            cluster=cluster,
            agent_id=agent_id,
            **(
                {"server": server or f"127.0.0.1:{self.haproxy.agent_port}"}
                | AGENT_FLAGS
                | {"admin_listen": ANY_PORT, "log_level": "debug", "options": extra}
            ),
        )
        process = Process(f"agent-{cluster}-{agent_id}", argv, self.log_dir)
        self.agents[f"{cluster}/{agent_id}"] = process
        return process

    async def agent_servers(self, key: str) -> dict[str, Any]:
        """An agent's ``/api/v1/servers``."""
        if key not in self.agent_admin:
            started = await self.agents[key].wait_event("agent_started")
            self.agent_admin[key] = started["admin_port"]
        status, body = await trio.to_thread.run_sync(
            http_get, f"http://{self.agent_admin[key]}/api/v1/servers"
        )
        assert status == 200, body
        return json.loads(body)

    async def mesh(self) -> dict[str, Any]:
        """What every side sees: per agent, the ids it holds and its live tunnels; per replica, the
        agents connected to it."""
        agents = {key: await self.agent_servers(key) for key in self.agents}
        servers = {sid: await trio.to_thread.run_sync(self.agents_of, sid) for sid in list(self.replicas)}
        return {"agents": agents, "servers": servers}

    def converged(self, mesh: dict[str, Any]) -> bool:
        """Exactly one tunnel from every agent to every live replica, seen from both ends, and nothing
        else held."""
        live = set(self.replicas)
        for view in mesh["agents"].values():
            tunnels = [t for t in view["tunnels"] if not t["duplicate"] and not t["draining"]]
            if (
                sorted(str(t["server_id"]) for t in tunnels) != sorted(live)
                or set(view["held_replicas"]) != live
            ):
                return False
        for server_id, agents in mesh["servers"].items():
            keys = sorted(f"{a['cluster']}/{a['agent_id']}" for a in agents)
            if keys != sorted(self.agents) or any(a["server_id"] != server_id for a in agents):
                return False
        return True

    async def wait_converged(self, timeout: float = 20.0) -> float:
        """Seconds until :meth:`converged`; AssertionError with every view after ``timeout``."""
        started = trio.current_time()
        mesh: dict[str, Any] = {}

        async def converged() -> bool:
            nonlocal mesh
            mesh = await self.mesh()
            return self.converged(mesh)

        await wait_until(
            converged,
            timeout=timeout,
            interval=POLL,
            message=lambda: (
                f"agents not converged on {sorted(self.replicas)} after {timeout}s:\n"
                + json.dumps(mesh, indent=1)[:6000]
            ),
        )
        return trio.current_time() - started

    def stop(self) -> None:
        for process in self.agents.values():
            process.stop()
        for replica in [*self.replicas.values(), *self.gone]:
            replica.process.stop()
        if self.haproxy is not None:
            self.haproxy.stop()


async def strict_h1_connect(port: int, pki: PkiFiles, cluster: str, target: str) -> trio.SSLStream:
    """An HTTP/1.1 CONNECT to ``target`` in ``cluster`` through the client port ``port``, answered 200
    (target bytes that came with the answer are dropped: use a target that waits to be spoken to). Its
    TLS takes only ``close_notify`` as an end: a reset or a bare FIN raises, so a stream that was
    cut can never pass for one that finished."""
    context: ssl.SSLContext = tls.client_context(pki.client.cert, pki.client.key, pki.ca, alpn=["http/1.1"])
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(tcp, context, server_hostname="localhost")
    try:
        request = f"CONNECT {target} HTTP/1.1\r\nhost: {target}\r\ncluster-proxy-cluster: {cluster}\r\n\r\n"
        await stream.send_all(request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            data = await stream.receive_some(4096)
            if not data:
                raise AssertionError(f"closed before answering: {head!r}")
            head += data
        if head.split(b" ", 2)[1] != b"200":
            raise AssertionError(f"CONNECT answered {head!r}")
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return stream


@dataclass
class EchoStreams:
    """Long-lived streams to an echo target (``tests.support.traffic.serve_bye_echo``) through a client
    port, each on a connection of its own, with when and how each ended."""

    port: int
    pki: PkiFiles
    echo_address: str
    sessions_ok: int = 0
    failures: list[str] = field(default_factory=list)  # sessions that did not complete
    endless_exchanges: int = 0
    cuts: list[tuple[float, str, str]] = field(default_factory=list)  # (when, which, how)
    clean_ends: list[str] = field(default_factory=list)  # endless streams that ended cleanly: a bug
    session_seconds: float = 1.0

    @asynccontextmanager
    async def stream(self, frontend: str, cluster: str) -> AsyncIterator[trio.abc.Stream]:
        """A stream to the echo target on a connection of its own (so its replica is the connection's)."""
        if frontend == "http1":
            async with await strict_h1_connect(self.port, self.pki, cluster, self.echo_address) as stream:
                yield stream
            return
        host, port = self.echo_address.rsplit(":", 1)
        files = TLSFiles(self.pki.ca, self.pki.client.cert, self.pki.client.key)
        async with open_tunnel(f"127.0.0.1:{self.port}", files, server_hostname="localhost") as tunnel:
            stream = await tunnel.connect(cluster, host, int(port))
            async with stream:
                yield stream

    @staticmethod
    async def exchange(stream: trio.abc.Stream, rng: random.Random) -> None:
        message = rng.randbytes(4096)
        with trio.fail_after(20):
            await stream.send_all(message)
            echoed = b""
            while len(echoed) < len(message):
                chunk = await stream.receive_some(len(message) - len(echoed))
                if not chunk:
                    raise AssertionError(f"clean end after {len(echoed)} of {len(message)} echoed bytes")
                echoed += chunk
        if echoed != message:
            raise AssertionError("echo mismatch")

    @staticmethod
    async def bye(stream: trio.abc.Stream) -> None:
        with trio.fail_after(20):
            await stream.send_all(BYE)
            if await stream.receive_some(len(BYE)) != BYE or await stream.receive_some(1) != b"":
                raise AssertionError("no BYE echoed and clean end")

    async def sessions(self, frontend: str, cluster: str, stop: trio.Event) -> None:
        """Sessions of ``session_seconds`` back to back (a message echoed every 100 ms): each must
        complete (BYE echoed, then a clean end)."""
        rng = random.Random(f"{frontend}-{cluster}")
        while not stop.is_set():
            try:
                async with self.stream(frontend, cluster) as stream:
                    ends = trio.current_time() + self.session_seconds
                    while trio.current_time() < ends:
                        await self.exchange(stream, rng)
                        await trio.sleep(0.1)
                    await self.bye(stream)
                self.sessions_ok += 1
            except Exception as exc:
                self.failures.append(f"{frontend} {cluster} session: {type(exc).__name__}: {exc}")

    async def endless(self, frontend: str, cluster: str, stop: trio.Event, name: str = "") -> None:
        """A stream kept until ``stop`` (a message echoed every 200 ms); when it breaks, record when and
        how (``cuts``) and open another; a clean end before ``stop`` is recorded in ``clean_ends``."""
        rng = random.Random(f"endless-{frontend}-{cluster}-{name}")
        which = f"{frontend} {cluster} {name}".strip()
        while not stop.is_set():
            opened = False
            try:
                async with self.stream(frontend, cluster) as stream:
                    opened = True
                    while not stop.is_set():
                        await self.exchange(stream, rng)
                        self.endless_exchanges += 1
                        with trio.move_on_after(0.2):
                            await stop.wait()
                    await self.bye(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                if not opened:
                    self.failures.append(f"{which} endless stream did not open: {exc}")
                else:
                    how = f"{type(exc).__name__}: {str(exc) or repr(exc.__cause__)}"
                    self.cuts.append((trio.current_time(), which, how))
            except AssertionError as exc:
                self.clean_ends.append(f"{which}: {exc}")
            except Exception as exc:
                self.failures.append(f"{which} endless stream: {type(exc).__name__}: {exc}")
