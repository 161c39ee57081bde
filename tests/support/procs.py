"""Real proxy-server and proxy-agent processes for end-to-end tests.

Processes log JSON lines to a file; readiness is read from those logs and the admin API, always
with a deadline, never with a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from clusterproxy_cli.commands import agent_argv, server_argv
from clusterproxy_protocol.certclient import CertFiles
from clusterproxy_protocol.forward_proxy import without_proxy_variables
from clusterproxy_protocol.pki import PemPair
from clusterproxy_protocol.tls import client_context
from clusterproxy_protocol.wire import ALPN_HTTP1
from tests.support.pki import PkiFiles
from tests.support.waiting import wait_until

BIN = Path(sys.executable).parent
POLL = 0.02
ANY_PORT = "127.0.0.1:0"
# The tests' processes: free ports, a short drain, agents that retry fast.
SERVER_FLAGS: dict[str, Any] = {
    "agent_listen": ANY_PORT,
    "client_listen": ANY_PORT,
    "admin_listen": ANY_PORT,
    "drain_timeout": "2s",
}
AGENT_FLAGS: dict[str, Any] = {
    "admin_listen": ANY_PORT,
    "backoff_initial": "0.1s",
    "backoff_max": "1s",
    "drain_timeout": "2s",
}


def json_lines(text: str, event: str | None = None) -> list[dict[str, Any]]:
    """The JSON-lines records in a log's text (other lines are skipped), those of ``event`` if given."""
    found = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if event is None or record.get("event") == event:
            found.append(record)
    return found


def json_records(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    """The JSON-lines records of a log file (see :func:`json_lines`)."""
    return json_lines(path.read_text(errors="replace"), event)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


class Process:
    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**without_proxy_variables(os.environ), "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def events(self) -> list[dict[str, Any]]:
        return json_records(self.log_path)

    def named(self, event: str) -> list[dict[str, Any]]:
        """Every logged record of ``event``, in order."""
        return [record for record in self.events() if record.get("event") == event]

    async def wait_count(self, event: str, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        """At least ``count`` records of ``event`` (AssertionError with the log tail after ``timeout``,
        or at once when the process exited)."""

        def enough() -> list[dict[str, Any]] | None:
            if len(found := self.named(event)) >= count:
                return found
            assert self.popen.poll() is None, f"{self.name} exited:\n{self.tail()}"
            return None

        return await wait_until(
            enough,
            timeout=timeout,
            interval=POLL,
            message=lambda: f"{self.name}: fewer than {count} {event!r} after {timeout}s:\n{self.tail()}",
        )

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def wait_event(self, event: str, timeout: float = 20.0, **match: Any) -> dict[str, Any]:

        def logged() -> dict[str, Any] | None:
            for record in self.events():
                if record.get("event") == event and all(record.get(k) == v for k, v in match.items()):
                    return record
            if self.popen.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited ({self.popen.returncode}) before {event}:\n{self.tail()}"
                )
            return None

        return await wait_until(
            logged,
            timeout=timeout,
            interval=POLL,
            message=lambda: f"{self.name}: no {event!r} {match} within {timeout}s:\n{self.tail()}",
        )

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    async def wait_exit(self, timeout: float = 15.0) -> int:
        await wait_until(
            lambda: self.popen.poll() is not None, timeout=timeout, what=f"{self.name} to exit", interval=POLL
        )
        return self.popen.returncode

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()


def client_tls(pair: PemPair, ca: Path) -> ssl.SSLContext:
    """A hub client's TLS (verifies the server with ``ca``, presents ``pair``): what a proxy-server's
    admin port wants for its agents and clusters (``https://`` on the same port)."""
    return client_context(pair.cert, pair.key, ca, alpn=[ALPN_HTTP1])


def http_get(url: str, timeout: float = 5.0, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@dataclass
class Hub:
    """A running proxy-server process and the agents attached to it."""

    pki: PkiFiles
    log_dir: Path
    server: Process | None = None
    agent_port: int = 0
    client_port: int = 0
    admin_port: int = 0
    agents: dict[str, Process] = field(default_factory=dict)

    async def start_server(self, *extra: str) -> None:
        p = self.pki
        files = CertFiles(p.server.cert, p.server.key, p.ca)
        await self.launch_server(self.server_argv(files, log_level="debug", options=extra))

    def server_argv(self, files: CertFiles, **flags: Any) -> list[str]:
        """The proxy-server's command line (:func:`clusterproxy_cli.commands.server_argv`, as
        ``local up`` builds it) on free loopback ports; ``flags`` add to or override the tests'."""
        return server_argv(files, **(SERVER_FLAGS | flags))

    async def launch_server(self, argv: list[str]) -> None:
        """Run the proxy-server and learn its ports from its ``server_started`` log line."""
        self.server = Process("proxy-server", argv, self.log_dir)
        started = await self.server.wait_event("server_started")
        self.agent_port = int(started["agent_port"].rsplit(":", 1)[1])
        self.client_port = int(started["client_port"].rsplit(":", 1)[1])
        self.admin_port = int(started["admin_port"].rsplit(":", 1)[1])

    def start_agent(
        self,
        cluster: str,
        agent_id: str,
        *extra: str,
        cert_for: tuple[str, str] | None = None,
        name: str | None = None,
    ) -> Process:
        pair = self.pki.agent(*(cert_for or (cluster, agent_id)))
        files = CertFiles(pair.cert, pair.key, self.pki.ca)
        argv = self.agent_argv(files, cluster, agent_id, log_level="debug", options=extra)
        return self.launch_agent(name or f"agent-{cluster}-{agent_id}", argv)

    def agent_argv(self, files: CertFiles, cluster: str, agent_id: str, **flags: Any) -> list[str]:
        """An agent's command line (:func:`clusterproxy_cli.commands.agent_argv`, as ``local up``
        builds it) dialing this hub's server, retrying fast; ``flags`` add to or override the tests'."""
        server = f"127.0.0.1:{self.agent_port}"
        return agent_argv(
            files, cluster=cluster, agent_id=agent_id, **({"server": server} | AGENT_FLAGS | flags)
        )

    def launch_agent(self, name: str, argv: list[str]) -> Process:
        process = Process(name, argv, self.log_dir)
        self.agents[name] = process
        return process

    def api_tls(self) -> ssl.SSLContext:
        """The hub client's TLS toward the admin port's agents and clusters."""
        return client_tls(self.pki.client, self.pki.ca)

    def api_get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """``path`` of the admin port over mutual TLS, as the hub client (the agents and clusters)."""
        return http_get(f"https://127.0.0.1:{self.admin_port}{path}", timeout, self.api_tls())

    def agents_connected(self) -> list[dict[str, Any]]:
        status, body = self.api_get("/api/v1/agents")
        assert status == 200, body
        return json.loads(body)

    async def wait_agent(
        self, cluster: str, agent_id: str, timeout: float = 20.0, *, present: bool = True
    ) -> None:

        async def as_wanted() -> bool:
            found = any(
                a["cluster"] == cluster and a["agent_id"] == agent_id
                for a in await trio.to_thread.run_sync(self.agents_connected)
            )
            return found == present

        def failure() -> str:
            logs = "\n".join(f"--- {n}\n{p.tail()}" for n, p in self.agents.items())
            return (
                f"agent {cluster}/{agent_id} {'not connected' if present else 'still connected'} "
                f"after {timeout}s\n{logs}\n--- server\n{self.server.tail() if self.server else ''}"
            )

        await wait_until(as_wanted, timeout=timeout, interval=POLL, message=failure)

    def stop(self) -> None:
        for process in self.agents.values():
            process.stop()
        if self.server is not None:
            self.server.stop()


@contextmanager
def running_hub(pki: PkiFiles, log_dir: Path, *server_options: str) -> Iterator[Hub]:
    """A proxy-server process (``server_options`` added to the tests' flags) for a module's tests,
    stopped with every agent the tests attached to it."""
    hub = Hub(pki, log_dir)
    try:
        trio.run(hub.start_server, *server_options)
        yield hub
    finally:
        hub.stop()
