"""Real proxy-server and proxy-agent processes for end-to-end tests.

Processes log JSON lines to a file; readiness is read from those logs and the admin API, always
with a deadline, never with a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from tests.support.pki import PkiFiles

BIN = Path(sys.executable).parent
POLL = 0.02


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
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def wait_event(self, event: str, timeout: float = 20.0, **match: Any) -> dict[str, Any]:
        with trio.move_on_after(timeout):
            while True:
                for record in self.events():
                    if record.get("event") == event and all(record.get(k) == v for k, v in match.items()):
                        return record
                if self.popen.poll() is not None:
                    raise AssertionError(
                        f"{self.name} exited ({self.popen.returncode}) before {event}:\n{self.tail()}"
                    )
                await trio.sleep(POLL)
        raise AssertionError(f"{self.name}: no {event!r} {match} within {timeout}s:\n{self.tail()}")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    async def wait_exit(self, timeout: float = 15.0) -> int:
        with trio.fail_after(timeout):
            while (code := self.popen.poll()) is None:
                await trio.sleep(POLL)
        return code

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
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
        self.server = Process(
            "proxy-server",
            [
                str(BIN / "cluster-proxy-server"),
                "--agent-listen",
                "127.0.0.1:0",
                "--client-listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--ca",
                str(p.ca),
                "--cert",
                str(p.server.cert),
                "--key",
                str(p.server.key),
                "--log-level",
                "debug",
                "--drain-timeout",
                "2s",
                "--log-format",
                "json",
                *extra,
            ],
            self.log_dir,
        )
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
        name = name or f"agent-{cluster}-{agent_id}"
        process = Process(
            name,
            [
                str(BIN / "cluster-proxy-agent"),
                "--server",
                f"127.0.0.1:{self.agent_port}",
                "--server-name",
                "localhost",
                "--cluster",
                cluster,
                "--agent-id",
                agent_id,
                "--ca",
                str(self.pki.ca),
                "--cert",
                str(pair.cert),
                "--key",
                str(pair.key),
                "--admin-listen",
                "127.0.0.1:0",
                "--backoff-initial",
                "0.1s",
                "--backoff-max",
                "1s",
                "--log-level",
                "debug",
                "--drain-timeout",
                "2s",
                "--log-format",
                "json",
                *extra,
            ],
            self.log_dir,
        )
        self.agents[name] = process
        return process

    def agents_connected(self) -> list[dict[str, Any]]:
        status, body = http_get(f"http://127.0.0.1:{self.admin_port}/api/v1/agents")
        assert status == 200, body
        return json.loads(body)

    async def wait_agent(
        self, cluster: str, agent_id: str, timeout: float = 20.0, *, present: bool = True
    ) -> None:
        with trio.move_on_after(timeout):
            while True:
                found = any(
                    a["cluster"] == cluster and a["agent_id"] == agent_id
                    for a in await trio.to_thread.run_sync(self.agents_connected)
                )
                if found == present:
                    return
                await trio.sleep(POLL)
        logs = "\n".join(f"--- {n}\n{p.tail()}" for n, p in self.agents.items())
        raise AssertionError(
            f"agent {cluster}/{agent_id} {'not connected' if present else 'still connected'} "
            f"after {timeout}s\n{logs}\n--- server\n{self.server.tail() if self.server else ''}"
        )

    def stop(self) -> None:
        for process in self.agents.values():
            process.stop()
        if self.server is not None:
            self.server.stop()
