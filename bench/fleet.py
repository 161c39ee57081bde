"""Many proxy-agents in one Python process, for the fan-in workload.

One process per agent measures the Python interpreter (~50 MB each), not the tunnel: upstream's
harness runs its agents in one process too. Each agent here is a full ``clusterproxy_agent.Service``
(its own TLS connection, tunnel, reconnect loop and admin port), exactly as the CLI runs it.

    python -m bench.fleet SPEC.json     # [{"cluster", "agent_id", "cert", "key"}, ...] plus "common"

An agent may name its admin address (``"admin": "HOST:PORT"``; default 127.0.0.1:0): a listener on
port 0 takes a port of the ephemeral range, which thousands of agents would share with their own
tunnels (bench/fleet_scale.py puts each on its own loopback address and one port below that range).
With ``common["status_file"]`` the fleet writes, every ``status_interval`` seconds, what its agents
hold (:func:`status`), so a bench can follow 10,000 agents without asking the server.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import Counter
from pathlib import Path

import trio

from bench.procs import rss_kib
from clusterproxy_agent.app import Service
from clusterproxy_agent.config import AgentSettings
from clusterproxy_agent.egress import parse_rule
from clusterproxy_protocol import configure_logging, parse_authority, workarounds


def server_base(server_id: str) -> str:
    """The server a worker's replica id belongs to: ``hub-1.w0`` and ``hub-1.w1.r2`` are ``hub-1``."""
    return server_id.split(".w", 1)[0]


def admin_address(agent: dict) -> tuple[str, int]:
    """Where an agent's admin port listens: its ``admin`` (HOST:PORT), else any free loopback port."""
    return parse_authority(agent["admin"]) if "admin" in agent else ("127.0.0.1", 0)


def status(services: list[Service], expect: int, base_rss_kib: int) -> dict:
    """What the agents hold now. ``registered[S]``: tunnels registered with a worker of server S;
    ``routable[S]``: agents holding ``expect`` distinct replicas (the workers) of S, so that any
    worker of S can route to them."""
    routable: Counter[str] = Counter()
    registered: Counter[str] = Counter()
    tunnels = 0
    for service in services:
        tunnels += service.agent.connected
        held = Counter(server_base(replica) for replica in service.agent.held_replicas())
        registered.update(held)
        for base, count in held.items():
            if count >= expect:
                routable[base] += 1
    return {
        "time": time.time(),
        "pid": os.getpid(),
        "agents": len(services),
        "tunnels": tunnels,  # live connections, registered or not yet
        "registered": dict(registered),  # server -> tunnels registered with (held by) its workers
        "routable": dict(routable),
        "rss_kib": rss_kib(os.getpid()),
        "base_rss_kib": base_rss_kib,
    }


async def write_status(services: list[Service], path: Path, interval: float, expect: int, base: int) -> None:
    scratch = path.with_suffix(".tmp")
    while True:
        scratch.write_text(json.dumps(status(services, expect, base)))
        os.replace(scratch, path)  # a reader never sees half a file
        await trio.sleep(interval)


async def run_fleet(spec: dict) -> None:
    common = spec["common"]
    base_rss = rss_kib(os.getpid())  # the interpreter and its imports, before any agent
    services = [
        Service(
            AgentSettings(
                server=(common["server_host"], common["server_port"]),
                server_name=common["server_name"],
                cluster=agent["cluster"],
                agent_id=agent["agent_id"],
                ca=Path(common["ca"]),
                cert=Path(agent["cert"]),
                key=Path(agent["key"]),
                allow=[parse_rule("127.0.0.0/8")],
                admin_listen=admin_address(agent),
                backoff_initial=common.get("backoff_initial", 0.5),
                backoff_max=common.get("backoff_max", 30.0),
                log_level="warning",
            )
        )
        for agent in spec["agents"]
    ]
    async with trio.open_nursery() as nursery:
        for service in services:
            nursery.start_soon(service.run)
        if common.get("status_file"):
            nursery.start_soon(
                write_status,
                services,
                Path(common["status_file"]),
                common.get("status_interval", 1.0),
                common.get("expect_replicas", 1),
                base_rss,
            )


def main() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    workarounds.apply()
    configure_logging("warning", json=True)
    trio.run(run_fleet, json.loads(Path(sys.argv[1]).read_text()))


if __name__ == "__main__":
    main()
