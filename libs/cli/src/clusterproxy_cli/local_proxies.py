"""The two Debian programs ``cluster-proxy local up`` runs besides the services: haproxy, a real L4
load balancer in front of the proxy-server replicas (``--servers N``), and tinyproxy, a real forward
proxy that one cluster's agent reaches the hub through (``--proxied-cluster``).

Each gets a configuration file written here into the state folder and runs in the foreground as a
child of ``local up`` (its log in ``STATE/logs/``):

- haproxy in TCP mode (the TLS stays end to end between the parties): one frontend for the agents'
  port, balanced by least connections (an agent looking for a replica it lacks lands on the one with
  the fewest agent tunnels), one for the clients' port, round robin. Every replica is health-checked
  with ``GET /readyz`` on its admin port, so a draining or dead replica leaves rotation; a refused
  connect is retried on another replica (``retries`` with ``option redispatch``), so a replica killed
  a moment ago costs a new client nothing. A statistics page (HTML, and CSV at ``/;csv``) shows what
  haproxy thinks of each replica; ``local up`` reads it to know when every replica is in rotation.
- tinyproxy as a plain HTTP forward proxy on loopback that lets ``CONNECT`` reach only the hub's agent
  port and the cert-signer's port, and logs every request (``Request (file descriptor N): CONNECT
  HOST:PORT HTTP/1.1``).
"""

from __future__ import annotations

import csv
import io
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from clusterproxy_protocol import http1client
from clusterproxy_protocol.config import ConfigError

from .local_plan import LOOPBACK, ServerPorts, loopback

SBIN_FOLDERS = ("/usr/sbin", "/sbin")  # Debian installs haproxy there, often not on a user's PATH
HEALTH_CHECK = "inter 500ms fastinter 250ms downinter 500ms fall 2 rise 1"
STATS_PATH = "/"


def find_program(program: str, package: str, needed_for: str, flag: str) -> str:
    """``program`` as given (a path), else found on PATH or in the sbin folders; ConfigError naming the
    Debian package otherwise."""
    if os.sep in program:
        if os.path.isfile(program) and os.access(program, os.X_OK):
            return program
        where = f"{program} is not an executable file"
    else:
        search = os.pathsep.join([os.environ.get("PATH", ""), *SBIN_FOLDERS])
        found = shutil.which(program, path=search)
        if found is not None:
            return found
        where = f"{program} not found on PATH or in {', '.join(SBIN_FOLDERS)}"
    raise ConfigError(
        f"{where}: {needed_for}; install Debian's {package} package (`apt-get install {package}`; "
        f"scripts/bootstrap.sh installs it) or name the program with {flag}"
    )


# --- haproxy -----------------------------------------------------------------------------------------

AGENTS_BACKEND = "agents"
CLIENTS_BACKEND = "clients"


def haproxy_config(servers: Sequence[ServerPorts], client_port: int, agent_port: int, stats_port: int) -> str:
    """TCP mode in front of ``servers``: the agents' and the clients' frontends, each replica checked on
    its admin port's ``/readyz``, and the statistics page."""
    lines = [
        "# written by cluster-proxy local up; rewritten at every start",
        "global",
        "    log stdout format raw local0 info",
        "    maxconn 4000",
        "defaults",
        "    mode tcp",
        "    log global",
        "    option tcplog",
        "    timeout connect 2s",
        # agent tunnels and client streams live long; the agents' PINGs keep theirs busy anyway
        "    timeout client 1h",
        "    timeout server 1h",
        "    timeout check 1s",
        "    retries 3",
        "    option redispatch 1",
        f"    default-server {HEALTH_CHECK}",
    ]
    for backend, port, balance in (
        (AGENTS_BACKEND, agent_port, "leastconn"),
        (CLIENTS_BACKEND, client_port, "roundrobin"),
    ):
        lines += [
            f"frontend {backend}",
            f"    bind {loopback(port)}",
            f"    default_backend {backend}",
            f"backend {backend}",
            f"    balance {balance}",
            "    option httpchk GET /readyz",
            "    http-check expect status 200",
        ]
        for server in servers:
            target = server.agent if backend == AGENTS_BACKEND else server.client
            lines.append(f"    server {server.name} {loopback(target)} check port {server.admin}")
    lines += [
        "defaults",  # a second section for what follows: the page is HTTP, and not logged
        "    mode http",
        "    timeout connect 2s",
        "    timeout client 30s",
        "    timeout server 30s",
        "frontend stats",
        f"    bind {loopback(stats_port)}",
        "    stats enable",
        f"    stats uri {STATS_PATH}",
        "    stats refresh 2s",
    ]
    return "\n".join(lines) + "\n"


def haproxy_argv(program: str, config: Path) -> list[str]:
    # -db: in the foreground, logging to stdout (the child's log file)
    return [program, "-db", "-f", str(config)]


def stats_url(stats_port: int) -> str:
    return f"http://{loopback(stats_port)}{STATS_PATH}"


def parse_stats_csv(text: str) -> dict[tuple[str, str], str]:
    """(backend, server) -> haproxy's status of that server ("UP", "DOWN", "MAINT", ...)."""
    states = {}
    for row in csv.DictReader(io.StringIO(text.lstrip("# "))):
        if row.get("svname") not in (None, "FRONTEND", "BACKEND"):
            states[(row["pxname"], row["svname"])] = (row.get("status") or "").split(" ")[0]
    return states


async def backend_states(stats_port: int) -> dict[tuple[str, str], str] | None:
    """What haproxy's statistics page says of each replica, or None if it does not answer."""
    try:
        response = await http1client.get(LOOPBACK, stats_port, f"{STATS_PATH};csv", timeout=2)
    except Exception:  # not up yet: refused, reset, timeout
        return None
    if response.status != 200:
        return None
    return parse_stats_csv(response.body.decode(errors="replace"))


def down_replicas(states: dict[tuple[str, str], str] | None, servers: Sequence[ServerPorts]) -> list[str]:
    """The replicas not UP in both of haproxy's backends (all of them when haproxy does not answer)."""
    if states is None:
        return [server.name for server in servers]
    return [
        server.name
        for server in servers
        if any(states.get((backend, server.name)) != "UP" for backend in (AGENTS_BACKEND, CLIENTS_BACKEND))
    ]


# --- tinyproxy ---------------------------------------------------------------------------------------


def tinyproxy_config(port: int, connect_ports: Sequence[int]) -> str:
    """A plain HTTP forward proxy on loopback that only lets ``CONNECT`` reach ``connect_ports``."""
    lines = [
        "# written by cluster-proxy local up; rewritten at every start",
        f"Port {port}",
        f"Listen {LOOPBACK}",
        f"Allow {LOOPBACK}",
        "Timeout 600",
        "MaxClients 100",
        "LogLevel Info",
        "DisableViaHeader Yes",
        *(f"ConnectPort {p}" for p in connect_ports),
    ]
    return "\n".join(lines) + "\n"


def tinyproxy_argv(program: str, config: Path) -> list[str]:
    # -d: in the foreground, logging to stderr (the child's log file)
    return [program, "-d", "-c", str(config)]
