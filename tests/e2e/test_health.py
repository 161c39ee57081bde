"""`cluster-proxy health` and the health-collector's page, as a user meets them: a real proxy-server,
real agents and the collector as processes; the CLI as a process; the page in Debian's chromium
(headless, driven by Playwright).

Set ``CLUSTER_PROXY_UPDATE_SCREENSHOT=1`` to write the page's screenshot to docs/health-page.png.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from tests.support import require
from tests.support.health import HOSTILE_TEXT, CollectorProcess, start_agent, start_targets
from tests.support.pki import PkiFiles
from tests.support.procs import BIN, Hub
from tests.support.targets import Target
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "docs" / "health-page.png"
DEADLINE = 15.0  # the bound for a row to follow an agent's death and return


@dataclass
class System:
    hub: Hub
    pki: PkiFiles
    targets: dict[str, Target]
    collector: CollectorProcess
    log_dir: Path


@pytest.fixture
async def system(pki: PkiFiles, tmp_path: Path, nursery: trio.Nursery) -> AsyncIterator[System]:
    targets = await start_targets(nursery)
    hub = Hub(pki, tmp_path)
    collector = None
    try:
        await hub.start_server()
        for cluster in ("cluster1", "cluster2"):
            start_agent(hub, pki, cluster, "agent-a", targets["ok"])
        for cluster in ("cluster1", "cluster2"):
            await hub.wait_agent(cluster, "agent-a")
        collector = await CollectorProcess.start(
            hub,
            pki,
            tmp_path,
            "--interval=1s",
            "--probe-timeout=2s",
            "--probe-url=http://{cluster}:443/healthz",
        )
        yield System(hub, pki, targets, collector, tmp_path)
    finally:
        if collector is not None:
            collector.stop()
        hub.stop()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "cluster-proxy"), "health", *args], capture_output=True, text=True, timeout=60, check=False
    )


def rows(stdout: str) -> dict[str, list[str]]:
    """Table rows by cluster: INSTALLED, AVAILABLE, PROBED HEALTH, LATENCY."""
    lines = stdout.splitlines()
    assert lines[0].split() == ["CLUSTER", "NAME", "INSTALLED", "AVAILABLE", "PROBED", "HEALTH", "LATENCY"], (
        stdout
    )
    return {line.split()[0]: line.split()[1:] for line in lines[1:]}


def all_true(row: list[str]) -> bool:
    return row[:3] == ["True", "True", "True"] and row[3].endswith("ms") and float(row[3][:-2]) > 0


async def test_cli_rows_follow_an_agents_death_and_return(system: System) -> None:
    collector = ["--collector", system.collector.url]
    done = await trio.to_thread.run_sync(cli, *collector)
    assert done.returncode == 0, done.stdout + done.stderr
    table = rows(done.stdout)
    assert set(table) == {"cluster1", "cluster2"} and all(all_true(r) for r in table.values()), done.stdout

    # no collector: straight from the proxy-server (one round of the collector's own command)
    hub, pki = system.hub, system.pki
    direct = [
        f"--admin-url=https://127.0.0.1:{hub.admin_port}",
        f"--proxy=127.0.0.1:{hub.client_port}",
        f"--ca={pki.ca}",
        f"--cert={pki.client.cert}",
        f"--key={pki.client.key}",
        "--server-name=localhost",
        "--probe-url=http://{cluster}:443/healthz",
    ]
    done = await trio.to_thread.run_sync(cli, *direct)
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(all_true(r) for r in rows(done.stdout).values()), done.stdout

    agent = hub.agents["agent-cluster1-agent-a"]
    agent.kill(signal.SIGKILL)
    killed = trio.current_time()
    last: list[subprocess.CompletedProcess[str]] = []

    async def cluster1_is(want: list[str]) -> bool:
        done = await trio.to_thread.run_sync(cli, *collector)
        last[:] = [done]
        return rows(done.stdout)["cluster1"][:3] == want

    await wait_until(
        lambda: cluster1_is(["True", "False", "False"]),
        timeout=DEADLINE,
        what="cluster1 unavailable",
        interval=0.2,
    )
    print(f"cluster1 False after {trio.current_time() - killed:.1f}s")
    assert last[0].returncode == 1, last[0].stdout + last[0].stderr
    assert all_true(rows(last[0].stdout)["cluster2"])
    wide = await trio.to_thread.run_sync(cli, *collector, "-o", "wide", "cluster1")
    assert wide.returncode == 1 and "no agent of this cluster is connected" in wide.stdout, wide.stdout

    start_agent(hub, pki, "cluster1", "agent-a", system.targets["ok"])
    back = trio.current_time()
    await wait_until(
        lambda: cluster1_is(["True", "True", "True"]), timeout=DEADLINE, what="cluster1 back", interval=0.2
    )
    print(f"cluster1 True again after {trio.current_time() - back:.1f}s")
    assert last[0].returncode == 0

    done = await trio.to_thread.run_sync(cli, "--collector", "http://127.0.0.1:9")
    assert done.returncode == 3 and "does not answer" in done.stderr, done.stderr


def _browse(url: str, kill: Callable[[], None], screenshot: Path) -> dict[str, object]:
    """Load the page, check its rows, kill an agent, wait (no reload) for its row to turn red."""
    from playwright.sync_api import sync_playwright

    seen: dict[str, object] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless=new"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 420})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(url)
            page.wait_for_selector("body[data-loaded=true]", timeout=15_000)
            seen["rows"] = page.eval_on_selector_all(
                "tr[data-cluster]", "rs => rs.map(r => r.dataset.cluster)"
            )
            page.wait_for_function(
                "() => document.querySelectorAll('tr[data-cluster] svg.spark polyline').length >= 2",
                timeout=15_000,
            )
            hostile = page.locator('tr[data-cluster="cluster3"] td.error')
            seen["hostile_text"] = hostile.inner_text()
            seen["hostile_elements"] = page.eval_on_selector_all(
                "td.error img, td.error script", "es => es.length"
            )
            page.screenshot(path=str(screenshot))
            kill()
            page.wait_for_selector(
                'tr[data-cluster="cluster1"][data-state="unhealthy"]', timeout=DEADLINE * 1000
            )
            seen["red"] = page.eval_on_selector(
                'tr[data-cluster="cluster1"]', "r => getComputedStyle(r).backgroundColor"
            )
            seen["cluster2"] = page.eval_on_selector('tr[data-cluster="cluster2"]', "r => r.dataset.state")
            seen["title"] = page.title()
            seen["console_errors"] = errors
        finally:
            browser.close()
    return seen


async def test_the_page_in_a_real_browser(system: System) -> None:
    require(
        shutil.which("chromium") is not None or Path(CHROMIUM).exists(), "chromium (apt-get install chromium)"
    )
    try:
        import playwright  # noqa: F401
    except ImportError:
        require(False, "playwright (pip install playwright; requirements-dev.txt)")
    start_agent(system.hub, system.pki, "cluster3", "agent-a", system.targets["hostile"])
    await system.hub.wait_agent("cluster3", "agent-a")
    await wait_until(
        lambda: (c := system.collector.cluster("cluster3")) is not None and c["last_error"] is not None,
        timeout=10,
        what="cluster3 probed",
    )
    shot = system.log_dir / "health-page.png"
    agent = system.hub.agents["agent-cluster1-agent-a"]
    seen = await trio.to_thread.run_sync(
        _browse, system.collector.url + "/", lambda: agent.kill(signal.SIGKILL), shot
    )
    assert sorted(seen["rows"]) == ["cluster1", "cluster2", "cluster3"]  # type: ignore[arg-type]
    assert HOSTILE_TEXT in str(seen["hostile_text"]) and seen["hostile_elements"] == 0
    assert seen["title"] == "cluster-proxy health"  # the hostile script never ran
    assert seen["red"] == "rgb(255, 235, 233)" and seen["cluster2"] == "healthy"
    assert seen["console_errors"] == [], seen["console_errors"]
    assert shot.stat().st_size > 10_000
    if os.environ.get("CLUSTER_PROXY_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, SCREENSHOT)
