"""The children of ``cluster-proxy local up``: starting them (each with its log file), noticing one
die, stopping them all in order, and waiting until they are ready."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import trio

from clusterproxy_protocol import certclient
from clusterproxy_protocol.certclient import SignerEndpoint, SignerRequestError
from clusterproxy_protocol.forward_proxy import without_proxy_variables

from . import _http

STOP_GRACE = 10.0
POLL = 0.1
TAIL_LINES = 20


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    process: trio.Process | None = None

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
    which stops them in order); the first to die on its own sets ``failed`` and ``died``."""

    log_dir: Path
    out: TextIO
    children: dict[str, Child] = field(default_factory=dict)
    failed: Child | None = None
    stopping: bool = False
    died: trio.Event = field(default_factory=trio.Event)

    async def start(self, nursery: trio.Nursery, name: str, argv: list[str]) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        child = Child(name, argv, self.log_dir / f"{name}.log")
        self.children[name] = child
        with child.log_path.open("ab") as log:
            log.write(f"--- {' '.join(argv)}\n".encode())
            log.flush()
            child.process = await trio.lowlevel.open_process(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**without_proxy_variables(os.environ), "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        nursery.start_soon(self._watch, child)
        return child

    async def _watch(self, child: Child) -> None:
        assert child.process is not None
        await child.process.wait()
        if not self.stopping and self.failed is None:
            self.failed = child
            self.died.set()

    async def stop_all(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM every child still running, wait up to ``grace`` seconds, then SIGKILL."""
        self.stopping = True
        running = [c for c in self.children.values() if c.process is not None and c.returncode is None]
        for child in reversed(running):  # agents before the server, the server before the signer
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        with trio.move_on_after(grace):
            for child in running:
                await child.process.wait()  # type: ignore[union-attr]
        for child in running:
            if child.returncode is None:
                print(f"{child.name} did not stop within {grace:g}s: killing it", file=self.out, flush=True)
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()  # type: ignore[union-attr]
        with trio.move_on_after(5):
            for child in running:
                await child.process.wait()  # type: ignore[union-attr]

    def report_failure(self, child: Child, problem: str | None = None) -> None:
        problem = problem or describe_exit(child.returncode)
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


async def connected_clusters(host: str, admin_port: int) -> set[str] | None:
    """Clusters with at least one agent on the server's admin API, or None if it does not answer."""
    try:
        response = await _http.get(host, admin_port, "/api/v1/agents", timeout=2)
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
    host: str, echo_ports: dict[str, int], admin_port: int, clusters: Sequence[str], out: TextIO
) -> None:
    """Wait until the echo services listen and every cluster has an agent on the server, showing the
    count of connected agents as it changes (the caller sets the deadline)."""
    for cluster in clusters:
        while not await port_open(host, echo_ports[cluster]):
            await trio.sleep(POLL)
    shown = -1
    while True:
        connected = await connected_clusters(host, admin_port) or set()
        ready = [c for c in clusters if c in connected]
        if len(ready) != shown:
            shown = len(ready)
            print(f"waiting for agents: {shown}/{len(clusters)}", file=out, flush=True)
        if shown == len(clusters):
            return
        await trio.sleep(POLL)
