"""The children of ``cluster-proxy local up``: starting them (each with its log file), noticing one
die (restarting it if it has a restart policy: the proxy-server replicas, as their Deployment would),
stopping them all in order, and waiting until they are ready."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import trio

from clusterproxy_protocol import (
    RestartPolicy,
    SignerEndpoint,
    SignerRequestError,
    certclient,
    http1client,
    without_proxy_variables,
)

STOP_GRACE = 10.0
POLL = 0.1
TAIL_LINES = 20


REPLICA_RESTART = RestartPolicy(delay=1.0, limit=5, window=60.0)
AGENT_RESTART_DELAY = 5.0  # an agent's cluster is unreachable meanwhile, so not sooner than a replica


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    process: trio.Process | None = None
    restart: RestartPolicy | None = None
    restarted_at: deque[float] = field(default_factory=deque)  # trio clock, within the policy's window

    @property
    def restarts(self) -> int:
        return len(self.restarted_at)

    def may_restart(self, now: float) -> bool:
        # a crash loop stops everything, as the death of a child without a policy does
        return self.restart is not None and self.restart.may_restart(self.restarted_at, now)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode

    def tail(self, lines: int = TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


@dataclass
class Supervisor:
    """Children as processes of their own session (a Ctrl-C in the terminal reaches only local up,
    which stops them in order). A child with a restart policy that dies on its own is started again
    with the same command line (``on_restart`` is called with it then); the first other child to die,
    or one in a crash loop, sets ``failed`` and ``died``."""

    log_dir: Path
    out: TextIO
    children: dict[str, Child] = field(default_factory=dict)
    failed: Child | None = None
    stopping: bool = False
    died: trio.Event = field(default_factory=trio.Event)
    on_restart: Callable[[Child], None] | None = None

    async def start(
        self, nursery: trio.Nursery, name: str, argv: list[str], restart: RestartPolicy | None = None
    ) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        child = Child(name, argv, self.log_dir / f"{name}.log", restart=restart)
        self.children[name] = child
        await self._spawn(child)
        nursery.start_soon(self._watch, child)
        return child

    async def _spawn(self, child: Child) -> None:
        with child.log_path.open("ab") as log:
            log.write(f"--- {' '.join(child.argv)}\n".encode())
            log.flush()
            child.process = await trio.lowlevel.open_process(
                child.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**without_proxy_variables(os.environ), "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )

    async def _watch(self, child: Child) -> None:
        while True:
            assert child.process is not None
            await child.process.wait()
            if self.stopping:
                return
            if not child.may_restart(trio.current_time()):
                if self.failed is None:
                    self.failed = child
                    self.died.set()
                return
            assert child.restart is not None
            print(
                f"{child.name} {describe_exit(child.returncode)}: restarting it in {child.restart.delay:g}s "
                f"(log {child.log_path})",
                file=self.out,
                flush=True,
            )
            await trio.sleep(child.restart.delay)
            if self.stopping:
                return
            child.restarted_at.append(trio.current_time())
            await self._spawn(child)
            print(f"{child.name} restarted (pid {child.pid})", file=self.out, flush=True)
            if self.on_restart is not None:
                self.on_restart(child)

    async def stop_all(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM every child still running, wait up to ``grace`` seconds, then SIGKILL."""
        self.stopping = True
        running = [
            (c, c.process) for c in self.children.values() if c.process is not None and c.returncode is None
        ]
        for _, process in reversed(running):  # agents before the server, the server before the signer
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        with trio.move_on_after(grace):
            for _, process in running:
                await process.wait()
        for child, process in running:
            if child.returncode is None:
                print(f"{child.name} did not stop within {grace:g}s: killing it", file=self.out, flush=True)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        with trio.move_on_after(5):
            for _, process in running:
                await process.wait()

    def report_failure(self, child: Child, problem: str | None = None) -> None:
        if problem is None:
            problem = describe_exit(child.returncode)
            if child.restarts and child.restart is not None:
                problem += f" after {child.restarts} restarts within {child.restart.window:g}s"
        print(f"error: {child.name} {problem}; last lines of {child.log_path}:", file=self.out, flush=True)
        for line in child.tail().splitlines():
            print(f"  | {line}", file=self.out)
        self.out.flush()


# --- readiness ---------------------------------------------------------------------------------------


async def port_open(host: str, port: int) -> bool:
    try:
        with trio.fail_after(1):
            stream = await trio.open_tcp_stream(host, port)
    except (OSError, trio.TooSlowError):
        return False
    await stream.aclose()
    return True


async def signer_healthy(endpoint: SignerEndpoint) -> bool:
    """Whether the cert-signer answers ``GET /healthz`` over TLS (verified with ``endpoint.ca``)."""
    try:
        await certclient.request_json(endpoint, "GET", "/healthz")
    except SignerRequestError:
        return False
    return True


async def connected_clusters(
    host: str, admin_port: int, tls: Callable[[], ssl.SSLContext]
) -> set[str] | None:
    """Clusters with at least one agent on the server's admin API (mutual TLS with the hub client
    certificate ``tls()`` presents), or None if it does not answer."""
    try:
        response = await http1client.get(host, admin_port, "/api/v1/agents", timeout=2, tls=tls())
    except Exception:  # not up yet: refused, reset, timeout, garbage
        return None
    if response.status != 200:
        return None
    try:
        agents = json.loads(response.body)
    except ValueError:
        return None
    if isinstance(agents, dict):  # tolerate {"agents": [...]}
        agents = agents.get("agents", [])
    return {a["cluster"] for a in agents if isinstance(a, dict) and isinstance(a.get("cluster"), str)}


async def wait_signer(endpoint: SignerEndpoint) -> None:
    """Wait until the cert-signer answers (the caller sets the deadline)."""
    while not await signer_healthy(endpoint):
        await trio.sleep(POLL)


async def wait_agents(
    host: str,
    echo_ports: dict[str, int],
    admin_ports: Sequence[int],
    clusters: Sequence[str],
    out: TextIO,
    tls: Callable[[], ssl.SSLContext],
) -> None:
    """Wait until the echo services listen and every cluster has an agent on every proxy-server (each
    one's admin API at ``admin_ports``), showing the count of clusters so connected as it changes (the
    caller sets the deadline)."""
    for cluster in clusters:
        while not await port_open(host, echo_ports[cluster]):
            await trio.sleep(POLL)
    shown = -1
    while True:
        views = [await connected_clusters(host, port, tls) or set() for port in admin_ports]
        ready = [c for c in clusters if all(c in view for view in views)]
        if len(ready) != shown:
            shown = len(ready)
            where = "" if len(admin_ports) == 1 else f" (on each of {len(admin_ports)} proxy-servers)"
            print(f"waiting for agents: {shown}/{len(clusters)}{where}", file=out, flush=True)
        if shown == len(clusters):
            return
        await trio.sleep(POLL)
