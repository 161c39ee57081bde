"""`cluster-proxy local up` runs the health-collector and prints its URL; `cluster-proxy health` with
no flags (from the folder where local up keeps `.state/local`) finds it: one True/True/True row per
cluster with a latency in ms. (local up stops everything when an agent dies, so an agent's death is
played in tests/e2e/test_health.py on the same processes started by hand.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import trio

from tests.support.localup import LocalUp
from tests.support.procs import BIN
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


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
    local = await LocalUp.start(state, tmp_path / "local-up.out")
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
    finally:
        await local.stop()
