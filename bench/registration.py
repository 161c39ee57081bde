"""How long ours' agents take to register with no client asking for them, and what each registration
costs the server and the agents: the fan-in row without its probe.

    python -m bench.registration               # 1,000 agents (one fleet process), one worker
    python -m bench.registration --agents 500

The fan-in row's "routable" time is that of a probe that dials every cluster through the client port
until each answers (32 at a time, a failed one again after 100 ms): every attempt is a new mTLS
connection, so the row carries the client port's cost per connection beside the agents'. This starts
the same server and fleet (``Ours.start_fanin``), reads the server's
``cluster_proxy_server_agent_tunnels`` gauge every ``--interval`` seconds, and prints the seconds until
the first and until every agent is registered, after the agents start and after the server is
SIGKILLed and started again, with the CPU-seconds the server and the fleet used meanwhile.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.systems import FaninHandle, Ours, tool_env

# The plain /metrics (what this reads) has the cluster label summed away, one unlabelled total; the
# mutual-TLS face keeps a series per cluster (docs/architecture.md, "The admin port"). Either sums.
_TUNNELS = re.compile(r"^cluster_proxy_server_agent_tunnels(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


def tunnels_held(metrics: str) -> int:
    """Live agent tunnels in a server's /metrics text (the gauge summed over its clusters)."""
    return round(sum(float(v) for v in _TUNNELS.findall(metrics)))


def _cpu_seconds(handle: FaninHandle) -> tuple[float, float]:
    return handle.server.cpu_seconds(), handle.agents_cpu_seconds()


def until_registered(ours: Ours, handle: FaninHandle, interval: float, timeout: float) -> dict[str, float]:
    """Poll the server until every agent is registered: seconds to the first and to all, CPU used."""
    start, cpu = time.monotonic(), _cpu_seconds(handle)
    first: float | None = None
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ours.admin_port}/metrics", timeout=5) as r:
                held = tunnels_held(r.read().decode())
        except OSError:
            held = 0  # a server that does not answer yet has registered nobody
        elapsed = time.monotonic() - start
        if held and first is None:
            first = elapsed
        if held >= handle.n:
            break
        if elapsed > timeout:
            raise TimeoutError(f"{held} of {handle.n} agents registered after {timeout:g} s")
        time.sleep(interval)
    server, agents = (after - before for after, before in zip(_cpu_seconds(handle), cpu, strict=True))
    return {"first_s": first or elapsed, "all_s": elapsed, "server_cpu_s": server, "agents_cpu_s": agents}


def _line(label: str, n: int, m: dict[str, float]) -> str:
    return (
        f"{label:28s} first {m['first_s']:6.2f} s, all {m['all_s']:6.2f} s; CPU per registration: "
        f"server {1000 * m['server_cpu_s'] / n:.2f} ms, agents {1000 * m['agents_cpu_s'] / n:.2f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.registration", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--agents", type=int, default=1000, help="agents, each of its own cluster")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between two reads of the gauge")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for every agent")
    args = parser.parse_args(argv)
    if args.agents < 1 or args.interval <= 0:
        parser.error("--agents takes a number >= 1 and --interval one > 0")
    with tempfile.TemporaryDirectory(prefix="bench-registration-") as scratch:
        env = tool_env(Path(scratch))  # its target is never started: no client dials through
        ours = Ours(env)
        ours.check()
        handle = ours.start_fanin(args.agents, "registration")
        try:
            handle.start_agents()
            started = until_registered(ours, handle, args.interval, args.timeout)
            handle.restart_server()  # returns once the new server listens
            restarted = until_registered(ours, handle, args.interval, args.timeout)
        except TimeoutError as exc:
            print(f"bench.registration: {exc}", file=sys.stderr)
            return 1
        finally:
            handle.stop()
    print(f"{args.agents} agents in one fleet process, one server worker, no client probing:")
    print(_line("after the agents start", args.agents, started))
    print(_line("after SIGKILL + restart", args.agents, restarted))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
