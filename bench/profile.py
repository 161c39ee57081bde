"""Profile ours' server and agent under one loadgen workload: py-spy on both while the client runs.

    python -m bench.profile --out /tmp/prof/up -- bulk --streams 1 --direction up --duration 9s
    python -m bench.profile --out /tmp/prof/rr -- rr --rate 2000 --conns 16 --duration 9s

Starts a loadgen target and ours (the bench's own set-up: certificates, one worker, one agent), runs
the workload once to warm up, then again under ``py-spy record -f raw`` of the server's worker and the
agent. Writes ``OUT-server.txt`` and ``OUT-agent.txt`` (folded stacks, one per line with its sample
count) and prints the loadgen's result and, per process, the functions with the most samples. With
``--compare A B`` it instead prints two existing profiles side by side, each normalised by the work
its run did (samples per Gbit, per 1,000 requests or per 1,000 new streams): what one direction costs more.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
from pathlib import Path

from bench.systems import ours_alone

PY_SPY = Path(sys.executable).parent / "py-spy"
RATE = 200  # samples per second
_PATH_PREFIX = re.compile(r"\(/.*?/(site-packages|src|lib/python3\.\d+)/")
_LINE = re.compile(r":\d+\)")


def folded(path: Path) -> tuple[collections.Counter[str], collections.Counter[str], int]:
    """(self samples, inclusive samples, total) per function of a py-spy raw profile."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        samples = int(count)
        total += samples
        frames = [_LINE.sub(")", _PATH_PREFIX.sub("(", frame)) for frame in stack.split(";")]
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    return own, inclusive, total


def _work(result: dict) -> tuple[float, str]:
    """The work a loadgen result reports, and its unit."""
    if "bytes" in result:
        return result["bytes"] * 8 / 1e9, "Gbit"
    if "completed" in result:
        return result["completed"] / 1000, "1,000 requests"
    return result.get("ok", result.get("established", 0)) / 1000, "1,000 new streams"  # connect, idle


def _top(path: Path, count: int) -> None:
    own, inclusive, total = folded(path)
    print(f"== {path.name}: {total} samples ({total / RATE:.1f} s of CPU at {RATE}/s)")
    for label, table in (("self", own), ("inclusive", inclusive)):
        print(f"-- {label}")
        for name, samples in table.most_common(count):
            print(f"{100 * samples / total:5.1f} %  {name}")


def compare(a: Path, work_a: float, b: Path, work_b: float, count: int) -> None:
    own_a, _, total_a = folded(a)
    own_b, _, total_b = folded(b)
    print(f"samples per unit of work: {a.name} {total_a / work_a:.0f}, {b.name} {total_b / work_b:.0f}")
    names = {n for n, _ in own_a.most_common(40)} | {n for n, _ in own_b.most_common(40)}
    rows = sorted(names, key=lambda n: own_b[n] / work_b - own_a[n] / work_a)
    for name in rows[:count]:
        print(f"{own_a[name] / work_a:8.1f} {own_b[name] / work_b:8.1f}  {name}")


def profile(out: Path, workload: list[str], seconds: int, count: int) -> None:
    run = out.parent / f"{out.name}-run"
    run.mkdir(parents=True, exist_ok=True)
    with ours_alone(run) as (ours, loadgen):
        argv = [str(loadgen), workload[0], *ours.dial_args(), *workload[1:]]
        subprocess.run(argv, capture_output=True, check=True)  # warm-up: TLS, pools, the JIT-less caches
        pids = {"server": ours.server.pid, "agent": ours.agent.pid}
        spies = [
            subprocess.Popen(
                [
                    str(PY_SPY),
                    "record",
                    "-r",
                    str(RATE),
                    "-f",
                    "raw",
                    "-d",
                    str(seconds),
                    "-p",
                    str(pid),
                    "-o",
                    str(out.parent / f"{out.name}-{role}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=(run / "logs" / f"py-spy-{role}.log").open("wb"),
            )
            for role, pid in pids.items()
        ]
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        for spy in spies:
            spy.wait()
    result = json.loads(done.stdout)["result"]
    work, unit = _work(result)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, (dict, list))}))
    print(f"work: {work:.3f} {unit}; load average {Path('/proc/loadavg').read_text().split()[:3]}")
    for role in pids:
        _top(out.parent / f"{out.name}-{role}.txt", count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("/tmp/bench-profile/run"), help="prefix of the files"
    )
    parser.add_argument("--seconds", type=int, default=10, help="py-spy's recording time")
    parser.add_argument("--top", type=int, default=25, help="functions to print per table")
    parser.add_argument(
        "--compare", nargs=4, metavar=("A", "WORK_A", "B", "WORK_B"), help="two profiles and their work"
    )
    parser.add_argument("workload", nargs="*", help="loadgen mode and its flags (after --)")
    args = parser.parse_args(argv)
    if args.compare:
        a, work_a, b, work_b = args.compare
        compare(Path(a), float(work_a), Path(b), float(work_b), args.top)
        return 0
    if not args.workload:
        parser.error("give a loadgen workload after --, e.g. -- bulk --direction up --duration 9s")
    if not PY_SPY.exists():
        print(
            f"{PY_SPY} missing: run `bash scripts/bootstrap.sh` (py-spy is a bench dependency)",
            file=sys.stderr,
        )
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    profile(args.out, args.workload, args.seconds, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
