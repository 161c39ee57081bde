"""bench.steps counts, in a process it did not change, the scheduler's rounds and each task's steps by
where the task waited; only in the services' programs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.steps import OUT_ENV, SITECUSTOMIZE, per_stream, read_counts

# A trio program that steps one task a known number of times at a checkpoint and parks another on
# an event, with a dump (SIGUSR2 to itself) before and after.
PROGRAM = textwrap.dedent(
    """
    import os, signal, trio

    if signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL:  # not counted: say so, and do not die of it
        print("trio.run is", trio.run.__name__)
        raise SystemExit(0)

    async def spin(times):
        for _ in range(times):
            await trio.sleep(0)

    async def main():
        os.kill(os.getpid(), signal.SIGUSR2)
        event = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(event.wait)
            await spin(40)
            event.set()
        os.kill(os.getpid(), signal.SIGUSR2)

    trio.run(main)
    """
)


def run_counted(tmp_path: Path, program_name: str) -> tuple[Path, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE % {"env": OUT_ENV, "depth": 8})
    program = tmp_path / program_name
    program.write_text(PROGRAM)
    out = tmp_path / "counts"
    env = {**os.environ, OUT_ENV: str(out), "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, str(program)], env=env, check=True, timeout=60, capture_output=True, text=True
    )
    return Path(f"{out}-{program_name}.txt"), done.stdout


def test_each_tasks_steps_are_counted_by_where_it_waited(tmp_path: Path) -> None:
    counts, output = run_counted(tmp_path, "cluster-proxy-fake")
    assert output == ""
    before, after = read_counts(counts, 2)
    rounds, steps = per_stream(before, after, 2)
    spinning = sum(n for where, n in steps.items() if where.startswith("main @ ") and "spin:" in where)
    assert spinning == 20  # 40 checkpoints, per "stream" of 2
    waiting = [where for where in steps if where.startswith("wait @ ")]
    assert waiting, steps  # the parked task, stepped when it started and when the event was set
    assert rounds >= 20  # every checkpoint is a round of its own: nothing else is runnable


def test_other_programs_are_left_alone(tmp_path: Path) -> None:
    counts, output = run_counted(tmp_path, "not-ours")
    assert output == "trio.run is run\n"
    assert not counts.exists()
    with pytest.raises(RuntimeError, match="0 of 1 counts"):
        read_counts(counts, 1, wait=0.1)
