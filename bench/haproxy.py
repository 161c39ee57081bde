"""A real haproxy (Debian's package) in TCP mode in front of proxy-server replicas, for the failover
workload: its configuration and statistics are ``clusterproxy_cli.haproxy``'s, the HA tests' and
``local up``'s too.

The configuration is the one docs/architecture.md "High availability" describes and the HA tests run:
one frontend for the agents' port (``leastconn``: an agent looking for a missing replica reaches the
one with the fewest agent tunnels) and one for the clients' (``roundrobin``), every replica
health-checked with ``GET /readyz`` on its health port, and a refused connect retried on another
replica (``retries 3``, ``option redispatch 1``).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.procs import Proc, free_port, wait_port
from clusterproxy_cli import haproxy

HAPROXY_MISSING = "haproxy is not installed (Debian package haproxy; scripts/bootstrap.sh installs it)"


@dataclass(frozen=True)
class Place:
    """Where one replica runs: its loopback ports, fixed in haproxy's configuration. ``health`` serves
    ``/readyz`` (ours: the admin port; upstream: its health port); ``admin`` is upstream's admin port."""

    name: str
    agent: int
    client: int
    health: int
    admin: int


def allocate_places(count: int) -> list[Place]:
    return [Place(f"replica{i}", free_port(), free_port(), free_port(), free_port()) for i in range(count)]


def haproxy_config(
    places: list[Place],
    agent_port: int,
    client_port: int,
    stats_socket: Path,
    check_interval: str,
    agent_check: str = "/readyz",
) -> str:
    """``agent_check``: the path checked for the agents' backend (the clients' is always /readyz)."""
    return haproxy.config(
        [haproxy.Server(p.name, p.agent, p.client, p.health) for p in places],
        agent_port,
        client_port,
        health_check=haproxy.checks_every(check_interval),
        stream_timeout="10m",
        maxconn=8000,
        agent_check=agent_check,
        stats_socket=stats_socket,
    )


class Haproxy:
    """One haproxy process; ``agent_port`` and ``client_port`` are its two frontends."""

    def __init__(
        self, places: list[Place], log_dir: Path, tag: str, check_interval: str, agent_check: str = "/readyz"
    ) -> None:
        binary = shutil.which("haproxy") or next(
            (p for p in ("/usr/sbin/haproxy", "/sbin/haproxy") if Path(p).exists()), None
        )
        if binary is None:
            raise RuntimeError(HAPROXY_MISSING)
        self.places = places
        self.agent_port, self.client_port = free_port(), free_port()
        self._private = Path(tempfile.mkdtemp(prefix="bench-haproxy-"))  # a short path for the socket
        self.stats_socket = self._private / "stats.sock"
        self.config = log_dir / f"haproxy-{tag}.cfg"
        self.config.write_text(
            haproxy_config(
                places, self.agent_port, self.client_port, self.stats_socket, check_interval, agent_check
            )
        )
        self.proc = Proc("haproxy", haproxy.argv(binary, self.config), log_dir / f"haproxy-{tag}.log")
        try:
            wait_port("127.0.0.1", self.client_port, 20, self.proc)
            wait_port("127.0.0.1", self.agent_port, 20, self.proc)
            deadline = time.monotonic() + 20
            while not self.stats_socket.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"haproxy: no stats socket after 20 s; see {self.proc.log}")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    def states(self) -> dict[tuple[str, str], str]:
        """(backend, place) -> haproxy's status of that place ("UP", "DOWN", ...), from ``show stat``."""
        return haproxy.socket_states(self.stats_socket)

    def wait_state(self, place: str, status: str, timeout: float) -> float:
        """Seconds until haproxy reports ``place`` with ``status`` in both backends."""
        began = time.monotonic()
        states: dict[tuple[str, str], str] = {}
        while time.monotonic() - began < timeout:
            states = self.states()
            if haproxy.in_state(states, place, status):
                return time.monotonic() - began
            time.sleep(0.05)
        raise RuntimeError(f"haproxy: {place} not {status} after {timeout}s: {states}")

    def stop(self) -> None:
        self.proc.stop()
        shutil.rmtree(self._private, ignore_errors=True)
