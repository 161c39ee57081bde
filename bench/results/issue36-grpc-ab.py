"""Issue 36 point 3's A/B: ours' server (and agent) CPU per unit of work through HTTP/1.1 CONNECT and
through konnectivity gRPC, for several builds of ours at once (bench/results/issue36-grpc-*.md).

    .venv/bin/python bench/results/issue36-grpc-ab.py --builds base=/tmp/base/bin,new= --repeats 3

A build is NAME=DIR with DIR holding cluster-proxy-server and cluster-proxy-agent programs (empty: this
worktree's .venv).
Every build runs its own server and agent against one loadgen target; workloads are interleaved
(repeat > workload > build > frontend). CPU = utime+stime of the server (and agent) around one
loadgen run, divided by its work. Prints one JSON line per run and a median table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.systems import Ours, Proc, tool_env

TICK = os.sysconf("SC_CLK_TCK")

WORKLOADS = {
    "rr": ["rr", "--rate", "1500", "--conns", "16", "--duration", "5s"],
    "connect": ["connect", "--count", "150"],
    "up": ["bulk", "--streams", "1", "--direction", "up", "--duration", "4s"],
    "down": ["bulk", "--streams", "1", "--direction", "down", "--duration", "4s"],
}


def cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def unit(workload: str, result: dict) -> tuple[float, str, dict]:
    if workload == "rr":
        return (
            result["completed"] / 1000,
            "ms/req",
            {
                "p50": result["latency"].get("p50_ms"),
                "rps": result["achieved_rps"],
            },
        )
    if workload == "connect":
        return (
            result["ok"] / 1000,
            "ms/dial",
            {
                "c200_p50": result["connect_200"].get("p50_ms"),
                "tls_p50": result["tls_handshake"].get("p50_ms"),
                "fb_p50": result["first_byte"].get("p50_ms"),
            },
        )
    return result["bytes"] / (1 << 30), "s/GiB", {"mbit": result["mbit_s"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--builds", default="new=")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="rr,connect,up,down")
    parser.add_argument("--frontends", default="connect,grpc")
    parser.add_argument("--out", default="/tmp/issue36-grpc-ab.jsonl")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="grpc-ab-"))
    env = tool_env(run_dir)
    target = Proc(
        "target",
        [str(env.loadgen), "target", "--listen", f"127.0.0.1:{env.target_port}"],
        env.log_dir / "t.log",
    )
    systems: dict[str, Ours] = {}
    try:
        for spec in args.builds.split(","):
            name, _, folder = spec.partition("=")
            s = Ours(env, build=(name, Path(folder))) if folder else Ours(env)
            s.name = name
            s.check()
            s.start()
            systems[name] = s
        rows: list[dict] = []
        for rep in range(args.repeats):
            for workload in args.only.split(","):
                for name, s in systems.items():
                    for frontend in args.frontends.split(","):
                        argv = [
                            str(env.loadgen),
                            WORKLOADS[workload][0],
                            *s.dial_args(),
                            *WORKLOADS[workload][1:],
                        ]
                        if frontend == "grpc":
                            argv.append("--konnectivity")
                        before = (cpu(s.server.pid), cpu(s.agent.pid))
                        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
                        after = (cpu(s.server.pid), cpu(s.agent.pid))
                        if done.returncode != 0:
                            print(done.stderr[-2000:], file=sys.stderr)
                            continue
                        result = json.loads(done.stdout)["result"]
                        work, label, extra = unit(workload, result)
                        row = {
                            "rep": rep,
                            "workload": workload,
                            "build": name,
                            "frontend": frontend,
                            "server": round((after[0] - before[0]) / work, 4),
                            "agent": round((after[1] - before[1]) / work, 4),
                            "unit": "s per " + ("GiB" if label == "s/GiB" else "1000"),
                            **extra,
                            "errors": result.get("errors", {}).get("count", 0)
                            if isinstance(result.get("errors"), dict)
                            else result.get("errors"),
                            "load": load(),
                        }
                        rows.append(row)
                        with open(args.out, "a") as out:
                            out.write(json.dumps(row) + "\n")
                        print(json.dumps(row), flush=True)
        print("\nmedians (server CPU; per 1000 units = ms per unit):")
        for workload in args.only.split(","):
            for name in systems:
                cells = []
                for frontend in args.frontends.split(","):
                    vals = [
                        r["server"]
                        for r in rows
                        if (r["workload"], r["build"], r["frontend"]) == (workload, name, frontend)
                    ]
                    cells.append(f"{frontend} {statistics.median(vals):.3f}" if vals else f"{frontend} -")
                print(f"{workload:8} {name:6} " + "  ".join(cells))
    finally:
        for s in systems.values():
            s.stop()
        target.stop()


if __name__ == "__main__":
    main()
