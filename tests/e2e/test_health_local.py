"""`cluster-proxy local up` runs the health-collector and prints its URL; `cluster-proxy health` with
no flags (from the folder where local up keeps `.state/local`) finds it: one True/True/True row per
cluster with a latency in ms; an agent SIGKILLed under local up turns its row False (exit 1) until
local up has restarted it, then True again."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import trio

from tests.support.localup import LocalUp
from tests.support.procs import BIN
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

DEADLINE = 15.0  # the bound for each change of state to show
# local up restarts a dead agent after --agent-restart-delay; 20 s here keeps it dead well past
# DEADLINE, so the test sees the False rows however loaded the machine is, instead of racing the restart
RESTART_DELAY = "20s"


def health(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "cluster-proxy"), "health", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def table(stdout: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    assert lines and lines[0].startswith("CLUSTER NAME"), stdout
    return {line.split()[0]: line.split()[1:] for line in lines[1:]}


async def test_local_up_runs_the_collector_and_health_finds_it(tmp_path: Path) -> None:
    state = tmp_path / ".state" / "local"
    local = await LocalUp.start(state, tmp_path / "local-up.out", "--agent-restart-delay", RESTART_DELAY)
    try:
        doc = local.description()
        url = doc["health"]["url"]
        assert f"{url}/" in local.text()

        async def all_healthy() -> bool:
            done = await trio.to_thread.run_sync(health, tmp_path)
            rows = table(done.stdout)
            return done.returncode == 0 and sorted(rows) == ["cluster1", "cluster2"]

        await wait_until(all_healthy, timeout=30, what="every cluster healthy", interval=0.5)
        done = await trio.to_thread.run_sync(health, tmp_path)
        for row in table(done.stdout).values():
            assert row[:3] == ["True", "True", "True"] and row[3].endswith("ms"), done.stdout

        wide = await trio.to_thread.run_sync(health, tmp_path, "-o", "wide")
        assert wide.returncode == 0 and "cluster1-agent-1(1)" in wide.stdout, wide.stdout

        last: list[subprocess.CompletedProcess[str]] = []

        async def cluster1_is(want: list[str]) -> bool:
            done = await trio.to_thread.run_sync(health, tmp_path)
            last[:] = [done]
            return table(done.stdout)["cluster1"][:3] == want

        os.kill(doc["pids"]["cluster1-agent"], signal.SIGKILL)
        killed = trio.current_time()
        await wait_until(
            lambda: cluster1_is(["True", "False", "False"]),
            timeout=DEADLINE,
            what="cluster1 unavailable and unhealthy after its agent was killed",
            interval=0.2,
        )
        print(f"\ncluster1 False after {trio.current_time() - killed:.1f}s")
        assert last[0].returncode == 1, last[0].stdout + last[0].stderr
        assert table(last[0].stdout)["cluster2"][:3] == ["True", "True", "True"], last[0].stdout
        assert "cluster1-agent killed by SIGKILL: restarting it in 20s" in local.text()

        await wait_until(
            lambda: "cluster1-agent restarted" in local.text(),
            timeout=60,
            what="local up to restart the agent",
        )
        back = trio.current_time()
        await wait_until(
            lambda: cluster1_is(["True", "True", "True"]),
            timeout=DEADLINE,
            what="cluster1 healthy again after its agent was restarted",
            interval=0.2,
        )
        print(f"cluster1 True again {trio.current_time() - back:.1f}s after its agent was restarted")
        assert last[0].returncode == 0, last[0].stdout + last[0].stderr
        assert local.description()["pids"]["cluster1-agent"] != doc["pids"]["cluster1-agent"]
    finally:
        await local.stop()
