"""haproxy (Debian's package), a real L4 load balancer in TCP mode in front of proxy-server replicas:
its configuration file and what it says of each replica. ``local up``'s balancer
(:mod:`.local_proxies`), the HA tests' (``tests/support/haproxy.py``) and the failover benchmark's
(``bench/haproxy.py``) are all written and read here, so the three run the same haproxy.

The configuration (docs/architecture.md "High availability"): TCP mode, so the TLS stays end to end
between the parties. One frontend for the agents' port, balanced by least connections unless said (an
agent looking for a replica it lacks lands on the one with the fewest agent tunnels), one for the
clients' port, round robin. Every replica is health-checked with ``GET /readyz`` on its own port, so a
draining or dead replica leaves rotation; a refused connect is retried on another replica (``retries``
with ``option redispatch``), so a replica killed a moment ago costs a new client nothing.

What haproxy thinks of each replica comes from its statistics as CSV, through either a UNIX stats
socket (``show stat``) or an HTTP statistics page (``/;csv``).
"""

from __future__ import annotations

import csv
import io
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from clusterproxy_protocol import http1client

AGENTS_BACKEND = "agents"
CLIENTS_BACKEND = "clients"
BACKENDS = (AGENTS_BACKEND, CLIENTS_BACKEND)
READY_PATH = "/readyz"
STATS_PATH = "/"  # of the statistics page

States = dict[tuple[str, str], str]  # (backend, server) -> "UP", "DOWN", "MAINT", ...


@dataclass(frozen=True)
class Server:
    """One replica in haproxy's backends: its agent and client ports, and the port whose ``/readyz``
    (or ``agent_check``) says whether it is in rotation."""

    name: str
    agent: int
    client: int
    check: int


def checks_every(interval: str) -> str:
    """``default-server`` arguments: every replica checked every ``interval`` in every state, out of
    rotation at its first failed check, back at its first good one."""
    return f"inter {interval} fastinter {interval} downinter {interval} fall 1 rise 1"


def config(
    servers: Iterable[Server],
    agent_port: int,
    client_port: int,
    *,
    health_check: str,
    stream_timeout: str,
    maxconn: int,
    agent_balance: str = "leastconn",
    agent_check: str = READY_PATH,
    stats_socket: Path | None = None,
    stats_port: int | None = None,
    header: str | None = None,
) -> str:
    """The configuration file: TCP mode on loopback in front of ``servers``. ``health_check``: the
    ``default-server`` arguments (:func:`checks_every`); ``stream_timeout``: how long an idle agent
    tunnel or client stream may stay; ``agent_check``: the path checked for the agents' backend (the
    clients' is always ``/readyz``); ``stats_socket`` and ``stats_port``: where the statistics are
    read (a UNIX socket at admin level, an HTTP page); ``header``: a comment line on top."""
    servers = list(servers)
    lines = [f"# {header}"] if header else []
    lines += ["global", "    log stdout format raw local0 info"]
    if stats_socket is not None:
        lines.append(f"    stats socket {stats_socket} mode 600 level admin")
    lines += [
        f"    maxconn {maxconn}",
        "defaults",
        "    mode tcp",
        "    log global",
        "    option tcplog",
        "    timeout connect 2s",
        f"    timeout client {stream_timeout}",
        f"    timeout server {stream_timeout}",
        "    timeout check 1s",
        "    retries 3",
        "    option redispatch 1",
        f"    default-server {health_check}",
    ]
    for backend, port, balance, check in (
        (AGENTS_BACKEND, agent_port, agent_balance, agent_check),
        (CLIENTS_BACKEND, client_port, "roundrobin", READY_PATH),
    ):
        lines += [
            f"frontend {backend}",
            f"    bind 127.0.0.1:{port}",
            f"    default_backend {backend}",
            f"backend {backend}",
            f"    balance {balance}",
            f"    option httpchk GET {check}",
            "    http-check expect status 200",
        ]
        for server in servers:
            target = server.agent if backend == AGENTS_BACKEND else server.client
            lines.append(f"    server {server.name} 127.0.0.1:{target} check port {server.check}")
    if stats_port is not None:
        lines += [
            "defaults",  # a second section for what follows: the page is HTTP, and not logged
            "    mode http",
            "    timeout connect 2s",
            "    timeout client 30s",
            "    timeout server 30s",
            "frontend stats",
            f"    bind 127.0.0.1:{stats_port}",
            "    stats enable",
            f"    stats uri {STATS_PATH}",
            "    stats refresh 2s",
        ]
    return "\n".join(lines) + "\n"


def argv(program: str, config_file: Path) -> list[str]:
    # -db: in the foreground, logging (tcplog lines, server state changes) to stdout
    return [program, "-db", "-f", str(config_file)]


def parse_stats_csv(text: str) -> States:
    """(backend, server) -> haproxy's status of that server ("UP", "DOWN", "MAINT", ...), from its
    statistics as CSV; the frontends' and backends' own rows left out."""
    states = {}
    for row in csv.DictReader(io.StringIO(text.lstrip("# "))):
        if row.get("svname") not in (None, "FRONTEND", "BACKEND"):
            states[(row["pxname"], row["svname"])] = (row.get("status") or "").split(" ")[0]
    return states


def socket_states(stats_socket: Path, timeout: float = 5.0) -> States:
    """The statistics through the stats socket (``show stat``); OSError when haproxy does not answer."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(str(stats_socket))
        sock.sendall(b"show stat\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return parse_stats_csv(data.decode(errors="replace"))


async def page_states(stats_port: int) -> States | None:
    """The statistics through the HTTP statistics page, or None if it does not answer."""
    try:
        response = await http1client.get("127.0.0.1", stats_port, f"{STATS_PATH};csv", timeout=2)
    except Exception:  # not up yet: refused, reset, timeout
        return None
    if response.status != 200:
        return None
    return parse_stats_csv(response.body.decode(errors="replace"))


def in_state(states: States | None, server: str, status: str) -> bool:
    """Whether haproxy reports ``server`` with ``status`` in both backends."""
    return states is not None and all(states.get((backend, server)) == status for backend in BACKENDS)
