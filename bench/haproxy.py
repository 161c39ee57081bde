"""A real haproxy (Debian's package) in TCP mode in front of proxy-server replicas, for the failover
workload. Written for bench/ on its own (the benchmarks do not import the tests).

The configuration is the one docs/architecture.md "High availability" describes and the HA tests run:
one frontend for the agents' port (``leastconn``: an agent looking for a missing replica reaches the
one with the fewest agent tunnels) and one for the clients' (``roundrobin``), every replica
health-checked with ``GET /readyz`` on its health port, and a refused connect retried on another
replica (``retries 3``, ``option redispatch 1``).
"""

from __future__ import annotations

import csv
import io
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.procs import Proc, free_port, wait_port

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
    lines = [
        "global",
        "    log stdout format raw local0 info",
        f"    stats socket {stats_socket} mode 600 level admin",
        "    maxconn 8000",
        "defaults",
        "    mode tcp",
        "    log global",
        "    option tcplog",
        "    timeout connect 2s",
        "    timeout client 10m",
        "    timeout server 10m",
        "    timeout check 1s",
        "    retries 3",
        "    option redispatch 1",
        f"    default-server inter {check_interval} fastinter {check_interval} downinter {check_interval}"
        " fall 1 rise 1",
    ]
    for role, port, balance, check in (
        ("agents", agent_port, "leastconn", agent_check),
        ("clients", client_port, "roundrobin", "/readyz"),
    ):
        lines += [
            f"frontend {role}",
            f"    bind 127.0.0.1:{port}",
            f"    default_backend {role}",
            f"backend {role}",
            f"    balance {balance}",
            f"    option httpchk GET {check}",
            "    http-check expect status 200",
        ]
        for place in places:
            target = place.agent if role == "agents" else place.client
            lines.append(f"    server {place.name} 127.0.0.1:{target} check port {place.health}")
    return "\n".join(lines) + "\n"


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
        # -db: foreground, tcplog lines and server state changes to stdout (the log file)
        self.proc = Proc("haproxy", [binary, "-db", "-f", str(self.config)], log_dir / f"haproxy-{tag}.log")
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
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(self.stats_socket))
            sock.sendall(b"show stat\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        states = {}
        for row in csv.DictReader(io.StringIO(data.decode().lstrip("# "))):
            if row["svname"] not in ("FRONTEND", "BACKEND"):
                states[(row["pxname"], row["svname"])] = row["status"].split()[0]
        return states

    def wait_state(self, place: str, status: str, timeout: float) -> float:
        """Seconds until haproxy reports ``place`` with ``status`` in both backends."""
        began = time.monotonic()
        states: dict[tuple[str, str], str] = {}
        while time.monotonic() - began < timeout:
            states = self.states()
            if all(states.get((backend, place)) == status for backend in ("agents", "clients")):
                return time.monotonic() - began
            time.sleep(0.05)
        raise RuntimeError(f"haproxy: {place} not {status} after {timeout}s: {states}")

    def stop(self) -> None:
        self.proc.stop()
        shutil.rmtree(self._private, ignore_errors=True)
