"""``--workers 2`` as real processes: streams through the one client port land on both workers and are
answered by the right cluster (sha256-checked); every agent holds a tunnel to each worker; a worker
SIGKILLed is restarted and its agents come back while new streams keep working; SIGTERM drains and
exits 0; the certificate is bootstrapped once for the pod."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import trio

from clusterproxy_sdk import open_tunnel
from tests.support.certs import SignedHub, SignerProcess, count_events
from tests.support.pki import PkiFiles
from tests.support.procs import Hub, alive, http_get
from tests.support.targets import Target, digest_transfer as transfer, serve_digest
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

CLUSTERS = ("cluster1", "cluster2")
STREAMS = 20
SIZE = 256 << 10


def admin_json(hub: Hub, path: str) -> Any:
    status, body = (
        http_get(f"http://127.0.0.1:{hub.admin_port}{path}")
        if path == "/api/v1/workers"
        else hub.api_get(path)
    )
    assert status == 200, body
    return json.loads(body)


def labelled_total(metrics: str, name: str) -> float:
    """The sum of a labelled metric's samples in a /metrics text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{"))


def worker_ids(hub: Hub) -> list[str]:
    return [w["server_id"] for w in admin_json(hub, "/api/v1/workers")]


async def every_agent_on_every_worker(hub: Hub, agents: int, timeout: float = 20.0) -> float:
    """Seconds until each of ``agents`` agents holds a tunnel to each running worker (by their ids)."""
    started = time.monotonic()
    ids: set[str] = set()
    held: dict[tuple[str, str], set[str]] = {}

    async def everywhere() -> bool:
        nonlocal ids, held
        ids = set(await trio.to_thread.run_sync(worker_ids, hub))
        held = {}
        for entry in await trio.to_thread.run_sync(admin_json, hub, "/api/v1/agents"):
            held.setdefault((entry["cluster"], entry["agent_id"]), set()).add(entry["server_id"])
        return len(held) == agents and all(servers >= ids for servers in held.values())

    await wait_until(
        everywhere,
        timeout=timeout,
        interval=0.02,
        message=lambda: f"agents not on every worker after {timeout}s: {held} (workers {ids})",
    )
    return time.monotonic() - started


def search_times(hub: Hub) -> str:
    """Per agent, from its first tunnel registered to the first on the last worker (the workers' log)."""
    assert hub.server is not None
    first: dict[tuple[str, str], dict[str, float]] = {}
    for record in hub.server.named("agent_connected"):
        at = datetime.fromisoformat(record["timestamp"]).timestamp()
        first.setdefault((record["cluster"], record["agent_id"]), {}).setdefault(record["server_id"], at)
    spans = [max(at.values()) - min(at.values()) for at in first.values()]
    return "first to last worker held: " + ", ".join(f"{span:.2f}s" for span in spans)


async def one_stream(hub: Hub, pki: PkiFiles, cluster: str, target: Target, token: str) -> None:
    """One stream on its own client connection (so the kernel picks a worker for it), SIZE bytes each
    way, both digests checked."""
    async with open_tunnel(
        f"127.0.0.1:{hub.client_port}", pki.sdk_files(), server_hostname="localhost"
    ) as tunnel:
        await transfer(tunnel, target, token, SIZE, SIZE, cluster)


async def streams_to_both_clusters(hub: Hub, pki: PkiFiles, targets: dict[str, Target], prefix: str) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i in range(STREAMS):
                cluster = CLUSTERS[i % 2]
                nursery.start_soon(one_stream, hub, pki, cluster, targets[cluster], f"{prefix}-{cluster}-{i}")


@pytest.fixture(scope="module")
def hub(pki: PkiFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    hub = Hub(pki, Path(tmp_path_factory.mktemp("workers")))
    try:
        trio.run(hub.start_server, "--workers", "2", "--dial-timeout", "15s")
        yield hub
    finally:
        hub.stop()


async def test_streams_spread_over_workers_each_agent_holds_both(hub: Hub, pki: PkiFiles) -> None:
    async with trio.open_nursery() as nursery:
        # each cluster's agent may reach only its own target: a stream routed to the wrong cluster fails
        targets = {cluster: await serve_digest(nursery) for cluster in CLUSTERS}
        for cluster in CLUSTERS:
            hub.start_agent(cluster, "agent-a", "--allow", f"127.0.0.1/32:{targets[cluster].port}")
        found = await every_agent_on_every_worker(hub, len(CLUSTERS))
        assert hub.server is not None
        print(
            f"\nboth agents hold both workers {found:.2f}s after their start (one address); {search_times(hub)}"
        )
        listing = admin_json(hub, "/api/v1/workers")
        assert [w["worker"] for w in listing] == [0, 1]
        assert len({w["server_id"] for w in listing}) == 2
        assert all(w["tunnels"] == len(CLUSTERS) for w in listing), listing
        before = [w["streams_total"] for w in listing]

        await streams_to_both_clusters(hub, pki, targets, "spread")
        after = [w["streams_total"] for w in admin_json(hub, "/api/v1/workers")]
        served = [a - b for a, b in zip(after, before, strict=True)]
        print(f"20 streams served per worker: {served}")
        assert sum(served) == STREAMS and all(n > 0 for n in served), served

        merged = admin_json(hub, "/api/v1/clusters")
        assert merged["cluster1"] == {"agents": 1} and merged["cluster2"] == {"agents": 1}, merged
        status, metrics = hub.api_get("/metrics")  # every label: the hub client's view
        assert status == 200
        text = metrics.decode()
        # summed over the workers, as one process counts: 2 tunnels per cluster, the 20 streams once
        assert 'cluster_proxy_server_agent_tunnels{cluster="cluster1"} 2.0' in text, text
        status, plain = http_get(f"http://127.0.0.1:{hub.admin_port}/metrics")  # the probes' view
        assert status == 200 and b'cluster="' not in plain, plain
        assert b"\ncluster_proxy_server_agent_tunnels 4.0\n" in plain, plain
        # each agent's second dial aimed at the worker it lacked (clusterproxy_protocol.steering):
        # none reached the worker it held (by the kernel's hash alone, each had 1 chance in 2)
        assert "cluster_proxy_server_agent_duplicate_dials_total" in text, text
        assert labelled_total(text, "cluster_proxy_server_agent_duplicate_dials_total") == 0, text
        opened = labelled_total(text, "cluster_proxy_server_streams_total")
        assert opened == sum(after), text
        assert http_get(f"http://127.0.0.1:{hub.admin_port}/readyz") == (200, b"ready\n")

        # the wrong cluster for a target is refused by that agent's egress rule
        async with open_tunnel(
            f"127.0.0.1:{hub.client_port}", pki.sdk_files(), server_hostname="localhost"
        ) as tunnel:
            with pytest.raises(Exception, match=r"403|egress|not allowed"):
                await tunnel.connect("cluster1", "127.0.0.1", targets["cluster2"].port)
        nursery.cancel_scope.cancel()


async def test_sigkill_of_a_worker_restarted_agents_return(hub: Hub, pki: PkiFiles) -> None:
    async with trio.open_nursery() as nursery:
        targets = {cluster: await serve_digest(nursery) for cluster in CLUSTERS}
        for process in hub.agents.values():  # again, allowed to this test's targets
            process.stop()
        hub.agents.clear()
        for cluster in CLUSTERS:
            await hub.wait_agent(cluster, "agent-a", present=False)
            hub.start_agent(cluster, "agent-a", "--allow", f"127.0.0.1/32:{targets[cluster].port}")
        await every_agent_on_every_worker(hub, len(CLUSTERS))
        listing = admin_json(hub, "/api/v1/workers")
        victim = listing[1]
        killed = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        # new streams right after the kill: each lands on the live worker or waits in the dead one's
        # queue, which the parent keeps for its successor
        await streams_to_both_clusters(hub, pki, targets, "after-kill")
        print(f"\n20 streams after the SIGKILL done {time.monotonic() - killed:.2f}s after it")
        assert hub.server is not None
        restarted = await hub.server.wait_event(
            "worker_spawned", worker=1, worker_server_id=f"{victim['server_id']}.r1"
        )
        assert restarted["pid"] != victim["pid"]
        back = await every_agent_on_every_worker(hub, len(CLUSTERS))
        print(f"agents hold the restarted worker {time.monotonic() - killed:.2f}s after the kill")
        assert back >= 0
        listing = admin_json(hub, "/api/v1/workers")
        assert listing[1]["restarts"] == 1 and listing[1]["running"], listing
        assert count_events(hub.server, "worker_died", worker=1) == 1
        _, metrics = http_get(f"http://127.0.0.1:{hub.admin_port}/metrics")
        assert 'cluster_proxy_server_worker_restarts_total{worker="1"} 1.0' in metrics.decode()
        await streams_to_both_clusters(hub, pki, targets, "after-restart")
        nursery.cancel_scope.cancel()


async def test_sigterm_drains_every_worker_and_exits_0(hub: Hub) -> None:
    assert hub.server is not None
    pids = [w["pid"] for w in admin_json(hub, "/api/v1/workers")]
    hub.server.kill(signal.SIGTERM)
    assert await hub.server.wait_exit(30) == 0, hub.server.tail()
    assert not any(alive(pid) for pid in pids)
    exits = hub.server.named("worker_exited")
    assert sorted(e["worker"] for e in exits) == [0, 1] and {e["status"] for e in exits} == {"exit status 0"}
    assert {r["worker"] for r in hub.server.named("server_draining")} == {0, 1}
    assert hub.server.named("server_drained")


def test_certificate_bootstrapped_once_renewed_once_for_all_workers(tmp_path: Path) -> None:
    signer = SignerProcess(tmp_path / "signer", tmp_path, "--cert-ttl", "12s")
    hub = SignedHub(None, tmp_path, signer=signer)  # type: ignore[arg-type]

    async def run() -> None:
        assert hub.signer is not None
        await hub.signer.start()
        await hub.start_server("--workers", "2")
        assert hub.server is not None
        assert count_events(hub.server, "cert_bootstrapped") == 1
        serials = {r["certificate_serial"] for r in hub.server.named("worker_started")}
        assert len(hub.server.named("worker_started")) == 2 and len(serials) == 1, serials
        hub.start_agent("cluster1", "agent-a")
        await every_agent_on_every_worker(hub, 1)
        issued = [p.read_text() for p in (hub.signer.store_dir / "issued").glob("*.json")]
        assert len([text for text in issued if '"proxy-server"' in text]) == 1, issued
        # one renewer (the parent's) at ~80 % of the 12 s; each worker loads what it wrote
        renewed = await hub.server.wait_event("cert_renewed", timeout=30)
        for worker in (0, 1):
            reloaded = await hub.server.wait_event("certificate_reloaded", timeout=15, worker=worker)
            assert reloaded["serial"] == renewed["serial"], (reloaded, renewed)
        assert count_events(hub.server, "cert_renewed") == 1
        issued = [p.read_text() for p in (hub.signer.store_dir / "issued").glob("*.json")]
        assert len([text for text in issued if '"proxy-server"' in text]) == 2, issued

    try:
        trio.run(run)
    finally:
        hub.stop()


def test_a_worker_in_a_crash_loop_stops_the_pod_with_exit_1(pki: PkiFiles, tmp_path: Path) -> None:
    hub = Hub(pki, tmp_path)

    async def run() -> None:
        await hub.start_server("--workers", "2")
        assert hub.server is not None
        for death in range(5):
            spawned = await hub.server.wait_count("worker_spawned", 2 + death)
            victim = [r for r in spawned if r["worker"] == 1][-1]
            os.kill(victim["pid"], signal.SIGKILL)
        assert await hub.server.wait_exit(30) == 1
        log = hub.server.log_path.read_text()
        assert "worker 1 died 5 times within 60s (last: killed by SIGKILL)" in log, hub.server.tail()
        assert not any(alive(r["pid"]) for r in hub.server.named("worker_spawned"))

    try:
        trio.run(run)
    finally:
        hub.stop()
