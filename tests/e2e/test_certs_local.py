"""``cluster-proxy local up`` with its cert-signer: every party bootstraps from a token, renews on its
own, and ``cluster-proxy certs`` rotates the CA of the running system; a restart needs no token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from clusterproxy_cli.state import proxy_settings, read_local_json
from clusterproxy_protocol import certclient, http1client
from clusterproxy_sdk import TLSFiles, open_tunnel
from tests.support.localup import LocalUp
from tests.support.procs import BIN
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.clock_bound, pytest.mark.timeout(300)]

AGENTS = ("cluster1-agent", "cluster2-agent")


async def certs(store: Path, *args: str) -> str:
    result = await trio.run_process(
        [str(BIN / "cluster-proxy"), "certs", *args, "--store", str(store)], capture_stdout=True
    )
    return result.stdout.decode()


async def status(store: Path) -> dict:
    return json.loads(await certs(store, "status", "--json"))


async def echo_through(state: Path, cluster: str) -> dict:
    """GET the cluster's echo service through the proxy with the client files of local.json (read
    anew: they are renewed in place)."""
    doc = read_local_json(state)
    proxy = proxy_settings(doc)
    host, port = doc["clusters"][cluster]["targets"][0]["address"].rsplit(":", 1)
    tls = TLSFiles(proxy.ca, proxy.cert, proxy.key)
    async with open_tunnel((proxy.host, proxy.port), tls, server_hostname="localhost") as tunnel:
        stream = await tunnel.connect(cluster, host, int(port))
        async with stream:
            response = await http1client.request(stream, "GET", "/certs", f"{host}:{port}")
    assert response.status == 200
    return json.loads(response.body)


async def test_local_up_restart_needs_no_token(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = state / "pki" / "store"
    for run in ("first", "second"):
        local = await LocalUp.start(state, tmp_path / f"{run}.out")
        try:
            assert (await status(store))["tokens"] == {"unused": 0, "used": 4, "expired": 0}
            assert (await echo_through(state, "cluster1"))["cluster"] == "cluster1"
            bootstrapped = len(local.events("cluster1-agent", "cert_bootstrapped"))
            assert bootstrapped == 1  # the log holds both runs: only the first one bootstrapped
        finally:
            await local.stop()
        assert local.process.returncode == 0, local.text()


async def test_local_up_bootstraps_renews_and_rotates_with_the_signer(tmp_path: Path) -> None:
    local = await LocalUp.start(
        tmp_path / "state", tmp_path / "first.out", "--cert-ttl", "20s", "--trust-refresh", "2s"
    )
    store = local.state / "pki" / "store"
    try:
        doc = read_local_json(local.state)
        assert doc["signer"]["store"] == str(store) and doc["signer"]["url"].startswith("https://127.0.0.1:")
        assert "cert-signer   https://127.0.0.1:" in local.text()
        first = await status(store)
        identities = sorted(p["identity"] for p in first["parties"])
        assert identities == [
            "agent:cluster1/cluster1-agent-1",
            "agent:cluster2/cluster2-agent-1",
            "client:local-admin",
            "server:proxy-server",
        ]
        assert first["tokens"]["used"] == 4 and first["tokens"]["unused"] == 0
        for agent in AGENTS:
            assert len(local.events(agent, "cert_bootstrapped")) == 1
        assert (await echo_through(local.state, "cluster1"))["cluster"] == "cluster1"

        # every party renews on its own (20 s certificates renew within about 16 s)
        async def all_renewed() -> bool:
            serials = {p["identity"]: p["serial"] for p in (await status(store))["parties"]}
            return all(serials[p["identity"]] != p["serial"] for p in first["parties"])

        await wait_until(all_renewed, timeout=40, what="every party to renew", interval=0.5)
        assert (await echo_through(local.state, "cluster2"))["cluster"] == "cluster2"

        # a CA rotation of the running system, step by step with `cluster-proxy certs`; each wait is
        # for what `status` reports, and each step is taken as soon as it says the step is safe
        async def ready() -> bool:
            return (await status(store))["ready_for_next_step"]

        print(await certs(store, "rotate-ca", "start"))
        await wait_until(
            ready, timeout=30, what="every party and the signer to trust the new CA", interval=0.5
        )
        print(await certs(store, "rotate-ca", "activate"))
        await wait_until(ready, timeout=30, what="every party to present a leaf of the new CA", interval=0.5)
        moved = await status(store)
        assert moved["phase"] == "moving-leaves" and all(p["presents_active_ca"] for p in moved["parties"])
        print(await certs(store, "rotate-ca", "retire"))
        # what `status` promised: every party presents a new-CA leaf, so fresh handshakes work at once,
        # before and after each party drops the old CA from its bundle
        done = await status(store)
        new_ca = [a["id"] for a in done["authorities"] if a["state"] == "active"]
        assert done["phase"] == "stable" and {p["ca_id"] for p in done["parties"]} == set(new_ca)
        for cluster in ("cluster1", "cluster2"):
            assert (await echo_through(local.state, cluster))["cluster"] == cluster

        async def old_ca_dropped() -> bool:
            bundles = [local.state / "pki" / "ca.crt"] + [
                local.state / "pki" / name / "ca.crt" for name in ("proxy-server", *AGENTS)
            ]
            return all(len(certclient.bundle_fingerprints(b.read_bytes())) == 1 for b in bundles)

        await wait_until(
            old_ca_dropped, timeout=30, what="every party to drop the old CA from its bundle", interval=0.5
        )
        for cluster in ("cluster1", "cluster2"):
            assert (await echo_through(local.state, cluster))["cluster"] == cluster
        print(await certs(store, "status"))
        for agent in AGENTS:  # the tunnels lived through it all
            assert len(local.events(agent, "tunnel_connected")) == 1
            assert len(local.events(agent, "tunnel_disconnected")) == 0
        assert len(local.events("proxy-server", "agent_disconnected")) == 0
    finally:
        await local.stop()
    assert local.process.returncode == 0, local.text()
