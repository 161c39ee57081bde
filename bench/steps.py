"""Passes through trio's scheduler per new stream in ours' server and agent: a count this machine's
noise does not move, where CPU time per stream varies by ±10 % from run to run.

    python -m bench.steps                 # 1,000 new streams, one after the other
    python -m bench.steps --count 300 --top 20

Starts ours as ``bench.profile`` does (certificates, one worker, one agent, a loadgen target), each
service with a trio ``Instrument`` loaded through a ``sitecustomize`` on ``PYTHONPATH`` (the services
themselves are not changed), runs ``loadgen connect`` once to warm up and once measured, and prints
per new stream: the scheduler's rounds (each one ``epoll_wait``) and the steps of each task, by where
the task had been waiting (the innermost frames of its await chain). A step that waited for the peer
(``wait_readable``, an event) is the protocol's; one at a ``checkpoint`` is trio's bookkeeping.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.systems import ours_alone

OUT_ENV = "CLUSTER_PROXY_BENCH_STEPS_OUT"
DUMP_WAIT = 5.0  # seconds for a process to write its counts after SIGUSR2

# Loaded by every Python process started with the folder on PYTHONPATH; active only in the services
# (OUT_ENV set, a cluster-proxy program). Writes one line per SIGUSR2: rounds so far, and steps so far
# by "task @ await chain" (then reset), as a Python literal.
SITECUSTOMIZE = """
import os, signal, sys
from collections import Counter
_out = os.environ.get("%(env)s")
if _out and os.path.basename(sys.argv[0]).startswith("cluster-proxy-"):
    import trio

    def _chain(coro, depth):
        frames = []
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                frames.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        return " > ".join(frames[-depth:])

    class _Steps(trio.abc.Instrument):
        def __init__(self):
            self.rounds = 0
            self.steps = Counter()

        def before_io_wait(self, timeout):
            self.rounds += 1

        def before_task_step(self, task):
            name = (task.name or "?").rsplit(".", 1)[-1]
            self.steps[name + " @ " + _chain(task.coro, %(depth)d)] += 1

    _steps = _Steps()
    _run = trio.run

    def _run_counted(*args, **kwargs):
        kwargs["instruments"] = [*kwargs.get("instruments", ()), _steps]
        return _run(*args, **kwargs)

    def _dump(*_):
        with open(f"{_out}-{os.path.basename(sys.argv[0])}.txt", "a") as f:
            f.write(repr((_steps.rounds, dict(_steps.steps))) + "\\n")
        _steps.steps.clear()

    trio.run = _run_counted
    signal.signal(signal.SIGUSR2, _dump)
"""


def read_counts(path: Path, dumps: int, wait: float = DUMP_WAIT) -> list[tuple[int, dict[str, int]]]:
    """The first ``dumps`` lines a process wrote, waiting up to ``wait`` seconds for them."""
    deadline = time.monotonic() + wait
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= dumps:
            return [ast.literal_eval(line) for line in lines[:dumps]]
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path}: {len(lines)} of {dumps} counts written after {wait:g}s")
        time.sleep(0.05)


def per_stream(
    before: tuple[int, dict[str, int]], after: tuple[int, dict[str, int]], count: int
) -> tuple[float, Counter[str]]:
    """Rounds and steps per stream between two dumps (the steps are reset at each dump)."""
    return (after[0] - before[0]) / count, Counter({k: v / count for k, v in after[1].items()})


def report(role: str, rounds: float, steps: Counter[str], top: int) -> None:
    by_task: Counter[str] = Counter()
    for where, n in steps.items():
        by_task[where.split(" @ ", 1)[0]] += n
    tasks = ", ".join(f"{task} {n:.1f}" for task, n in by_task.most_common(6))
    print(f"== {role}: {rounds:.1f} scheduler rounds per new stream; steps per task: {tasks}")
    for where, n in steps.most_common(top):
        print(f"{n:6.2f}  {where}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.steps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000, help="new streams measured (one after the other)")
    parser.add_argument("--top", type=int, default=25, help="places printed per process")
    parser.add_argument("--depth", type=int, default=6, help="frames of each await chain kept")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count takes a number >= 1")
    with tempfile.TemporaryDirectory(prefix="bench-steps-") as scratch:
        folder = Path(scratch)
        (folder / "site").mkdir()
        (folder / "site" / "sitecustomize.py").write_text(
            SITECUSTOMIZE % {"env": OUT_ENV, "depth": args.depth}
        )
        out = folder / "counts"
        os.environ[OUT_ENV] = str(out)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(folder / "site"), os.environ.get("PYTHONPATH")])
        )
        with ours_alone(folder) as (ours, loadgen):
            roles = {
                "server": (ours.server.pid, "cluster-proxy-server"),
                "agent": (ours.agent.pid, "cluster-proxy-agent"),
            }
            connect = [str(loadgen), "connect", *ours.dial_args()]
            subprocess.run([*connect, "--count", "100"], capture_output=True, check=True)
            for pid, _ in roles.values():
                os.kill(pid, signal.SIGUSR2)
            for _, program in roles.values():
                read_counts(Path(f"{out}-{program}.txt"), 1)
            done = subprocess.run(
                [*connect, "--count", str(args.count)], capture_output=True, text=True, check=True
            )
            for pid, _ in roles.values():
                os.kill(pid, signal.SIGUSR2)
            counts = {
                role: read_counts(Path(f"{out}-{program}.txt"), 2) for role, (_, program) in roles.items()
            }
    result = json.loads(done.stdout)["result"]
    streams = result.get("ok", 0)
    print(f"{streams} new streams, first byte p50 {result['first_byte']['p50_ms']} ms")
    if not streams:
        print(f"no stream worked: {result}", file=sys.stderr)
        return 1
    for role, (before, after) in counts.items():
        report(role, *per_stream(before, after, streams), args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
