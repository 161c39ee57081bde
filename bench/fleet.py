"""Many proxy-agents in one Python process, for the fan-in workload.

One process per agent measures the Python interpreter (~50 MB each), not the tunnel: upstream's
harness runs its agents in one process too. Each agent here is a full ``clusterproxy_agent.Service``
(its own TLS connection, tunnel, reconnect loop and admin port), exactly as the CLI runs it.

    python -m bench.fleet SPEC.json     # [{"cluster", "agent_id", "cert", "key"}, ...] plus "common"
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import trio

from clusterproxy_agent.app import Service
from clusterproxy_agent.config import AgentSettings
from clusterproxy_agent.egress import parse_rule
from clusterproxy_protocol import workarounds
from clusterproxy_protocol.logs import configure_logging


async def run_fleet(spec: dict) -> None:
    common = spec["common"]
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
                admin_listen=("127.0.0.1", 0),
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


def main() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    workarounds.apply()
    configure_logging("warning", json=True)
    trio.run(run_fleet, json.loads(Path(sys.argv[1]).read_text()))


if __name__ == "__main__":
    main()
