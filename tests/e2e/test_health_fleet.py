"""1,000 simulated clusters (the benchmarks' fleet: bench/fleet.py, 1,000 real agents in one process)
behind one real proxy-server, and the health-collector as a process probing every one through its
tunnel: every round probes every cluster and finds it healthy; the round's time and the collector's
RSS per cluster are printed (the numbers go to docs/health.md). Time is not asserted (the test suite
never asserts wall time: on a loaded 2-core machine a thousand agents, the server and the collector
share the cores); the probe timeout is generous so that health does not depend on the load either."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import trio

from clusterproxy_protocol.certclient import CertFiles
from clusterproxy_protocol.pki import DevCA
from tests.support.health import CollectorProcess
from tests.support.pki import PkiFiles
from tests.support.procs import Hub, Process
from tests.support.rss import rss_kib
from tests.support.targets import serve_http
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

CLUSTERS = 1000
INTERVAL = 10.0
PROBE_TIMEOUT = "30s"  # health, not speed, is asserted here: a loaded machine must not fail a probe
REPO = Path(__file__).resolve().parents[2]


def fleet_spec(hub: Hub, pki: PkiFiles, directory: Path) -> Path:
    ca = DevCA.create_or_load(pki.ca.parent)
    leaves = directory / "fleet-leaves"
    agents = []
    for i in range(CLUSTERS):
        pair = ca.issue_agent(f"fleet-{i}", "a", leaves)
        agents.append(
            {"cluster": f"fleet-{i}", "agent_id": "a", "cert": str(pair.cert), "key": str(pair.key)}
        )
    common = {
        "server_host": "127.0.0.1",
        "server_port": hub.agent_port,
        "server_name": "localhost",
        "ca": str(pki.ca),
        "backoff_initial": 0.2,
        "backoff_max": 2.0,
    }
    spec = directory / "fleet.json"
    spec.write_text(json.dumps({"common": common, "agents": agents}))
    return spec


def connected(hub: Hub) -> int:
    try:
        status, body = hub.api_get("/api/v1/clusters", timeout=20)
    except OSError:  # busy registering a thousand agents on a loaded machine: ask again
        return 0
    assert status == 200
    return sum(1 for info in json.loads(body).values() if info["agents"] > 0)


async def test_a_thousand_clusters_in_one_round(pki: PkiFiles, tmp_path: Path, nursery: trio.Nursery) -> None:
    target = await serve_http(nursery, b"ok")
    hub = Hub(pki, tmp_path)
    fleet = baseline = collector = None
    try:
        # info, not the tests' debug: h2's per-frame debug lines for a thousand tunnels cost more than them
        files = CertFiles(pki.server.cert, pki.server.key, pki.ca)
        await hub.launch_server(hub.server_argv(files, log_level="info"))
        # the same collector with no cluster yet: its RSS is the baseline
        baseline = await CollectorProcess.start(hub, pki, tmp_path, f"--interval={INTERVAL:g}s")
        baseline_kib = rss_kib(baseline.process.pid)
        baseline.stop()
        baseline = None
        spec = await trio.to_thread.run_sync(fleet_spec, hub, pki, tmp_path)
        fleet = Process(
            "fleet",
            [sys.executable, "-m", "bench.fleet", str(spec)],
            tmp_path,
            env={"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
        )

        counts: list[tuple[float, int]] = []
        began = trio.current_time()

        async def all_connected() -> bool:
            assert fleet is not None and fleet.popen.poll() is None, fleet.tail() if fleet else ""
            counts.append((trio.current_time() - began, await trio.to_thread.run_sync(connected, hub)))
            return counts[-1][1] == CLUSTERS

        try:
            await wait_until(all_connected, timeout=180, what=f"{CLUSTERS} agents connected", interval=0.5)
        except AssertionError as exc:
            progress = ", ".join(f"{n} at {t:.0f}s" for t, n in counts[:: max(1, len(counts) // 20)])
            server = hub.server.tail(40) if hub.server else ""
            raise AssertionError(
                f"{exc}; connected: {progress}, last {counts[-1] if counts else None}\n--- fleet\n"
                f"{fleet.tail(40)}\n--- proxy-server\n{server}"
            ) from None
        print(f"\n{CLUSTERS} agents connected in {counts[-1][0]:.1f}s")

        collector = await CollectorProcess.start(
            hub,
            pki,
            tmp_path,
            f"--interval={INTERVAL:g}s",
            f"--probe-timeout={PROBE_TIMEOUT}",
            f"--probe-url=http://{target.address}/healthz",
            first_round=False,  # its first round is one of the three rounds waited for below
        )
        rounds: list[float] = []
        document: dict = {}

        async def rounds_done() -> bool:
            nonlocal document
            document = await trio.to_thread.run_sync(collector.document)  # type: ignore[union-attr]
            if document["rounds"] > len(rounds):
                rounds.append(document["last_round_seconds"])
            return len(rounds) >= 3

        await wait_until(rounds_done, timeout=300, what="three rounds", interval=1.0)
        summary = document["summary"]
        rss = rss_kib(collector.process.pid)
        latencies = sorted(c["latency_ms"] for c in document["clusters"] if c["latency_ms"] is not None)
        print(
            f"\n{CLUSTERS} clusters: rounds {', '.join(f'{r:.2f}s' for r in rounds)} (interval {INTERVAL:g}s); "
            f"probe latency p50 {latencies[len(latencies) // 2]:.1f} ms, p99 {latencies[int(len(latencies) * 0.99)]:.1f} ms; "
            f"collector RSS {rss / 1024:.1f} MiB ({rss / CLUSTERS:.1f} KiB per cluster), "
            f"{(rss - baseline_kib) / CLUSTERS:.1f} KiB per cluster above the empty collector's {baseline_kib / 1024:.1f} MiB"
        )
        assert summary == {"clusters": CLUSTERS, "healthy": CLUSTERS, "unhealthy": 0, "unknown": 0}, summary
        assert all(len(c["history"]) >= 2 for c in document["clusters"])
    finally:
        for process in (collector, baseline):
            if process is not None:
                process.stop()
        if fleet is not None:
            fleet.stop()
        hub.stop()
