"""The health-collector in process against a real proxy-server and real agents (processes): rows,
probes through the tunnel, a hung target bounded by its own timeout, /metrics through
prometheus-client's own parser, a proxy-server it cannot reach."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from clusterproxy_health.collector import Collector, CollectorSettings
from clusterproxy_health.main import serve
from clusterproxy_health.probe import parse_probe_url
from clusterproxy_protocol.wire import format_authority
from tests.support.health import HOSTILE_TEXT, start_agent, start_targets
from tests.support.pki import PkiFiles
from tests.support.procs import Hub
from tests.support.targets import Target, closed_port

pytestmark = pytest.mark.slow

PROBE_TIMEOUT = 2.0


@dataclass
class Setup:
    hub: Hub
    targets: dict[str, Target]


@pytest.fixture
async def setup(pki: PkiFiles, tmp_path: Path, nursery: trio.Nursery) -> AsyncIterator[Setup]:
    """cluster1 (two agents) -> ok; cluster2 -> hung; cluster3 -> hostile; ghost: known, no agent."""
    targets = await start_targets(nursery)
    hub = Hub(pki, tmp_path)
    try:
        await hub.start_server("--known-clusters", "ghost")
        start_agent(hub, pki, "cluster1", "agent-a", targets["ok"])
        start_agent(hub, pki, "cluster1", "agent-b", targets["ok"])
        start_agent(hub, pki, "cluster2", "agent-a", targets["hung"])
        start_agent(hub, pki, "cluster3", "agent-a", targets["hostile"])
        for cluster, agent in (("cluster1", "agent-a"), ("cluster1", "agent-b"), ("cluster2", "agent-a")):
            await hub.wait_agent(cluster, agent)
        await hub.wait_agent("cluster3", "agent-a")
        yield Setup(hub, targets)
    finally:
        hub.stop()


def settings_for(hub: Hub, pki: PkiFiles, **overrides: object) -> CollectorSettings:
    values: dict[str, object] = {
        "admin_urls": [f"https://127.0.0.1:{hub.admin_port}"],
        "proxy": ("127.0.0.1", hub.client_port),
        "ca": pki.ca,
        "cert": pki.client.cert,
        "key": pki.client.key,
        "server_name": "localhost",
        "probe": parse_probe_url("http://{cluster}:443/healthz"),
        "interval": 1.0,
        "probe_timeout": PROBE_TIMEOUT,
        "listen": ("127.0.0.1", 0),
    }
    values.update(overrides)
    return CollectorSettings(**values)  # type: ignore[arg-type]


async def start_collector(nursery: trio.Nursery, settings: CollectorSettings) -> Collector:
    collector: Collector = await nursery.start(serve, settings)
    with trio.fail_after(20):
        while collector.state.rounds == 0:
            await collector.round_done.wait()
    return collector


def by_name(document: dict) -> dict[str, dict]:
    return {c["name"]: c for c in document["clusters"]}


async def test_rows_probes_and_errors_in_words(setup: Setup, pki: PkiFiles, nursery: trio.Nursery) -> None:
    collector = await start_collector(nursery, settings_for(setup.hub, pki))
    rows = by_name(collector.document())
    assert set(rows) == {"cluster1", "cluster2", "cluster3", "ghost"}

    ok = rows["cluster1"]
    assert (ok["installed"], ok["available"], ok["probed"], ok["state"]) == (True, True, True, "healthy")
    assert 0 < ok["latency_ms"] < PROBE_TIMEOUT * 1000
    assert [a["agent_id"] for a in ok["agents"]] == ["agent-a", "agent-b"]
    assert all(len(a["replicas"]) == 1 for a in ok["agents"])
    assert ok["history"] and ok["history"][-1][1] == ok["latency_ms"]

    hung = rows["cluster2"]
    assert (hung["available"], hung["probed"], hung["state"]) == (True, False, "unhealthy")
    assert "within 2s (probe timeout)" in hung["last_error"]["message"]
    assert hung["last_error"]["reason"] == "timeout"

    hostile = rows["cluster3"]
    assert hostile["probed"] is False
    assert hostile["last_error"]["reason"] == "http_500"
    assert HOSTILE_TEXT in hostile["last_error"]["message"]

    ghost = rows["ghost"]
    assert (ghost["installed"], ghost["available"], ghost["probed"]) == (True, False, False)
    assert "no agent of this cluster is connected" in ghost["last_error"]["message"]
    assert collector.document()["problems"] == []


async def test_a_hung_target_does_not_delay_the_other_probes(
    setup: Setup, pki: PkiFiles, nursery: trio.Nursery
) -> None:
    """Six clusters whose target hangs beside a healthy one: the round lasts one probe timeout (not
    six), and the healthy cluster's probe is as fast as alone."""
    for i in range(6):
        start_agent(setup.hub, pki, f"hung{i}", "a", setup.targets["hung"])
    for i in range(6):
        await setup.hub.wait_agent(f"hung{i}", "a")
    from clusterproxy_health.collector import run_with

    async def measure(collector: Collector) -> None:
        started = trio.current_time()
        await collector.round()
        elapsed = trio.current_time() - started
        rows = by_name(collector.document())
        hung = [rows[f"hung{i}"] for i in range(6)]
        assert all(r["last_error"]["reason"] == "timeout" for r in hung), hung
        assert rows["cluster1"]["probed"] is True
        assert rows["cluster1"]["latency_ms"] < PROBE_TIMEOUT * 1000 / 4, rows["cluster1"]
        assert PROBE_TIMEOUT <= elapsed < PROBE_TIMEOUT * 2, f"round took {elapsed:.2f}s"

    await run_with(settings_for(setup.hub, pki, interval=60.0), measure)


async def test_one_probe_slot_still_bounds_each_probe(setup: Setup, pki: PkiFiles) -> None:
    """With one probe at a time the hung cluster costs exactly its timeout, then the next runs."""
    from clusterproxy_health.collector import run_with

    async def measure(collector: Collector) -> None:
        started = trio.current_time()
        await collector.round()
        elapsed = trio.current_time() - started
        rows = by_name(collector.document())
        assert rows["cluster1"]["probed"] is True and rows["cluster2"]["probed"] is False
        assert PROBE_TIMEOUT <= elapsed < PROBE_TIMEOUT + 1.5, f"round took {elapsed:.2f}s"

    await run_with(settings_for(setup.hub, pki, max_concurrent_probes=1, interval=60.0), measure)


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return answer.status, dict(answer.headers), answer.read()


async def test_metrics_parse_and_carry_per_cluster_series(
    setup: Setup, pki: PkiFiles, nursery: trio.Nursery
) -> None:
    collector = await start_collector(nursery, settings_for(setup.hub, pki))
    base = f"http://{collector.address}"
    status, headers, body = await trio.to_thread.run_sync(_get, f"{base}/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    probe = families["cluster_proxy_health_probe_seconds"]
    counts = {s.labels["cluster"]: s.value for s in probe.samples if s.name.endswith("_count")}
    assert counts["cluster1"] >= 1
    failures = {
        (s.labels["cluster"], s.labels["reason"])
        for s in families["cluster_proxy_health_probe_failures"].samples
        if s.name.endswith("_total")
    }
    assert {("cluster2", "timeout"), ("cluster3", "http_500"), ("ghost", "refused_503")} <= failures
    agents = {s.labels["cluster"]: s.value for s in families["cluster_proxy_health_agents_connected"].samples}
    assert agents == {"cluster1": 2, "cluster2": 1, "cluster3": 1, "ghost": 0}
    healthy = {s.labels["cluster"]: s.value for s in families["cluster_proxy_health_cluster_healthy"].samples}
    assert healthy == {"cluster1": 1, "cluster2": 0, "cluster3": 0, "ghost": 0}
    up = families["cluster_proxy_health_proxy_server_up"].samples
    assert [(s.labels["url"], s.value) for s in up] == [(f"https://127.0.0.1:{setup.hub.admin_port}", 1)]

    status, headers, body = await trio.to_thread.run_sync(_get, f"{base}/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "script-src 'sha256-" in headers["content-security-policy"]
    # self-contained: no external script, style, image or font
    assert b"<script>" in body and b"<style>" in body
    assert not any(marker in body for marker in (b" src=", b"@import", b"url("))
    assert body.count(b" href=") == 1 and b'href="data:,"' in body  # no favicon request either


async def test_a_proxy_server_it_cannot_reach_is_a_problem_not_an_omission(
    setup: Setup, pki: PkiFiles, nursery: trio.Nursery
) -> None:
    dead = f"https://127.0.0.1:{closed_port()}"
    settings = settings_for(setup.hub, pki)
    settings.admin_urls.append(dead)
    collector = await start_collector(nursery, settings)
    document = collector.document()
    servers = {s["url"]: s for s in document["proxy_servers"]}
    assert servers[dead]["reachable"] is False and servers[dead]["error"]
    assert any(dead in p and "did not answer" in p for p in document["problems"]), document["problems"]
    assert by_name(document)["cluster1"]["state"] == "healthy"  # the other replica still answers

    only_dead = settings_for(setup.hub, pki, admin_urls=[dead], proxy=("127.0.0.1", closed_port()))
    from clusterproxy_health.collector import run_with

    async def check(collector: Collector) -> None:
        await collector.round()
        document = collector.document()
        assert document["clusters"] == []
        assert len(document["problems"]) == 1 and dead in document["problems"][0]

    await run_with(only_dead, check)


async def test_probes_through_an_unreachable_client_port_say_so(
    setup: Setup, pki: PkiFiles, nursery: trio.Nursery
) -> None:
    port = closed_port()
    collector = await start_collector(nursery, settings_for(setup.hub, pki, proxy=("127.0.0.1", port)))
    document = collector.document()
    row = by_name(document)["cluster1"]
    assert row["probed"] is False and row["last_error"]["reason"] == "proxy_server"
    assert f"127.0.0.1:{port}" in row["last_error"]["message"]
    assert any("client port" in p for p in document["problems"]), document["problems"]
    assert format_authority("127.0.0.1", port) in json.dumps(document["problems"])


async def test_the_client_certificate_from_the_signer(tmp_path: Path, nursery: trio.Nursery) -> None:
    """``--signer``: without a token the collector runs with probes off and says what to do; with a
    token bound to its name it bootstraps and probes; a used token, or one for another name, is a
    refusal in words (never a crash). Without the certificate the proxy-servers' agents and clusters
    cannot be read either (mutual TLS only): each replica is a problem naming why."""
    from clusterproxy_health.collector import run_with
    from tests.support.certs import SignedHub, SignerProcess

    targets = await start_targets(nursery)
    signer = await SignerProcess(tmp_path / "signer", tmp_path).start()
    hub = SignedHub(pki=None, log_dir=tmp_path, signer=signer)  # type: ignore[arg-type]
    try:
        await hub.start_server()
        hub.start_agent("cluster1", "agent-a")
        await hub.wait_agent("cluster1", "agent-a")

        async def one_round(directory: str, token: str | None, name: str = "health-collector") -> dict:
            files = signer.party(tmp_path / directory)
            settings = CollectorSettings(
                admin_urls=[f"https://127.0.0.1:{hub.admin_port}"],
                proxy=("127.0.0.1", hub.client_port),
                ca=files.ca,
                cert=files.cert,
                key=files.key,
                server_name="localhost",
                signer=signer.url,
                bootstrap_token=token,
                client_name=name,
                probe=parse_probe_url(f"http://{targets['ok'].address}/healthz"),
                probe_timeout=PROBE_TIMEOUT,
            )
            document: dict = {}

            async def body(collector: Collector) -> None:
                await collector.round()
                document.update(collector.document())

            await run_with(settings, body)
            return document

        without = await one_round("no-token", None)
        assert "cluster1" not in by_name(without)  # no source could be read
        assert without["probe"]["enabled"] is False
        probes, server = sorted(without["problems"])  # "probes are off: ...", "proxy-server ..."
        assert "did not answer: no hub client certificate for the admin API yet" in server, server
        assert "no --bootstrap-token" in probes and "token create --client health-collector" in probes

        token = signer.client_token("health-collector")
        with_token = await one_round("with-token", token)
        assert with_token["problems"] == [] and by_name(with_token)["cluster1"]["state"] == "healthy"
        assert signer.issued()["bootstrap"] >= 1

        used = await one_round("used-token", token)
        problem = next(p for p in used["problems"] if "bootstrap" in p)
        assert "refused the bootstrap token" in problem and "token_used" in problem, problem
        assert "cluster1" not in by_name(used)

        other = await one_round("other-name", signer.client_token("someone-else"))
        problem = next(p for p in other["problems"] if "bootstrap" in p)
        assert "refused the bootstrap token" in problem and "name_mismatch" in problem, problem
    finally:
        hub.stop()
