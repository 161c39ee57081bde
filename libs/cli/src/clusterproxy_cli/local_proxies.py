"""The two Debian programs ``cluster-proxy local up`` runs besides the services: haproxy, a real L4
load balancer in front of the proxy-server replicas (``--servers N``), and tinyproxy, a real forward
proxy that one cluster's agent reaches the hub through (``--proxied-cluster``).

Each gets a configuration file written here into the state folder and runs in the foreground as a
child of ``local up`` (its log in ``STATE/logs/``):

- haproxy as :mod:`.haproxy` writes it (TCP mode, the agents' frontend by least connections, the
  clients' round robin, every replica health-checked with ``GET /readyz`` on its admin port), with
  local up's choices: checks every 500 ms (out after two failures), streams idle up to an hour, and a
  statistics page (HTML, and CSV at ``/;csv``) that shows what haproxy thinks of each replica; ``local
  up`` reads it to know when every replica is in rotation.
- tinyproxy as a plain HTTP forward proxy on loopback that lets ``CONNECT`` reach only the hub's agent
  port and the cert-signer's port, and logs every request (``Request (file descriptor N): CONNECT
  HOST:PORT HTTP/1.1``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from clusterproxy_protocol import ConfigError

from . import haproxy
from .local_plan import LOOPBACK, ServerPorts, loopback

SBIN_FOLDERS = ("/usr/sbin", "/sbin")  # Debian installs haproxy there, often not on a user's PATH
HEALTH_CHECK = "inter 500ms fastinter 250ms downinter 500ms fall 2 rise 1"


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


def _servers(servers: Sequence[ServerPorts]) -> list[haproxy.Server]:
    return [haproxy.Server(s.name, s.agent, s.client, s.admin) for s in servers]  # checked on the admin port


def haproxy_config(servers: Sequence[ServerPorts], client_port: int, agent_port: int, stats_port: int) -> str:
    """TCP mode in front of ``servers``: the agents' and the clients' frontends, each replica checked on
    its admin port's ``/readyz``, and the statistics page."""
    return haproxy.config(
        _servers(servers),
        agent_port,
        client_port,
        health_check=HEALTH_CHECK,
        # agent tunnels and client streams live long; the agents' PINGs keep theirs busy anyway
        stream_timeout="1h",
        maxconn=4000,
        stats_port=stats_port,
        header="written by cluster-proxy local up; rewritten at every start",
    )


def haproxy_argv(program: str, config: Path) -> list[str]:
    return haproxy.argv(program, config)


def stats_url(stats_port: int) -> str:
    return f"http://{loopback(stats_port)}{haproxy.STATS_PATH}"


async def backend_states(stats_port: int) -> haproxy.States | None:
    """What haproxy's statistics page says of each replica, or None if it does not answer."""
    return await haproxy.page_states(stats_port)


def down_replicas(states: haproxy.States | None, servers: Sequence[ServerPorts]) -> list[str]:
    """The replicas not UP in both of haproxy's backends (all of them when haproxy does not answer)."""
    return [server.name for server in servers if not haproxy.in_state(states, server.name, "UP")]


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
