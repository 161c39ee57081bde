"""The client policy in a running proxy-server (in-process, real TLS, real agents): 403 with a reason
on both frontends, checked before the cluster's existence, and followed when the file changes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio

from clusterproxy_agent.app import Service
from clusterproxy_agent.config import AgentSettings
from clusterproxy_agent.egress import parse_rule
from clusterproxy_protocol.pki import DevCA, PemPair
from clusterproxy_protocol.tls import client_context
from clusterproxy_sdk import Forbidden, open_tunnel
from clusterproxy_server.app import ProxyServer
from tests.support.clients import h1_connect
from tests.support.inprocess import start_server
from tests.support.pki import PkiFiles
from tests.support.targets import serve_echo
from tests.support.waiting import wait_until

POLICY = {
    "rules": [
        {"subject": "CN=alice", "clusters": ["cluster1"]},
        {"subject": "O=ops", "clusters": ["*"]},
        {"san": "URI:spiffe://hub/robots/*", "clusters": ["cluster2"]},
    ],
    "default": "deny",
}


class Clients:
    def __init__(self, pki: PkiFiles, directory: Path) -> None:
        ca = DevCA.create_or_load(pki.ca.parent)
        self.ca = pki.ca
        self.pairs: dict[str, PemPair] = {
            "alice": ca.issue_client("alice", directory),
            "bob": ca.issue_client("bob", directory),
            "opsbot": ca.issue_client("opsbot", directory, organization="ops"),
            # a certificate named by its SAN only
            "robot": ca.issue_client(None, directory, uris=["spiffe://hub/robots/r2"], stem="robot"),
        }

    def context(self, name: str, alpn: list[str]):  # type: ignore[no-untyped-def]
        pair = self.pairs[name]
        return client_context(pair.cert, pair.key, self.ca, alpn=alpn)


async def start_hub(
    nursery: trio.Nursery, pki: PkiFiles, policy: Path | None
) -> tuple[ProxyServer, int, int]:
    server, bound = await start_server(nursery, pki, client_policy=policy)
    for cluster in ("cluster1", "cluster2"):
        pair = pki.agent(cluster, "agent-a")
        settings = AgentSettings(
            server=bound.agent,
            server_name="localhost",
            cluster=cluster,
            agent_id="agent-a",
            ca=pki.ca,
            cert=pair.cert,
            key=pair.key,
            admin_listen=("127.0.0.1", 0),
            allow=[parse_rule("127.0.0.0/8")],
        )
        await nursery.start(Service(settings).run)
    await wait_until(lambda: server.registry.tunnels("cluster1") and server.registry.tunnels("cluster2"))
    echo = (await serve_echo(nursery)).port
    return server, bound.client[1], echo


async def sdk_echo(port: int, ctx, cluster: str, echo: int) -> bytes:  # type: ignore[no-untyped-def]
    async with open_tunnel(f"127.0.0.1:{port}", ctx, server_hostname="localhost") as tunnel:
        stream = await tunnel.connect(cluster, "127.0.0.1", echo)
        async with stream:
            await stream.send_all(b"ping " + cluster.encode())
            await stream.send_eof()
            data = b""
            while chunk := await stream.receive_some():
                data += chunk
    return data


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(POLICY))
    return path


async def test_policy_allows_and_refuses_on_both_frontends(
    nursery: trio.Nursery, pki: PkiFiles, tmp_path: Path, policy_file: Path
) -> None:
    clients = Clients(pki, tmp_path / "clients")
    server, port, echo = await start_hub(nursery, pki, policy_file)

    allowed = [("alice", "cluster1"), ("opsbot", "cluster1"), ("opsbot", "cluster2"), ("robot", "cluster2")]
    for name, cluster in allowed:
        assert (
            await sdk_echo(port, clients.context(name, ["h2"]), cluster, echo) == f"ping {cluster}".encode()
        )

    refused = [
        ("alice", "cluster2", "CN=alice"),
        ("bob", "cluster1", "CN=bob"),
        ("robot", "cluster1", "URI:"),
    ]
    for name, cluster, who in refused:
        with pytest.raises(Forbidden) as info:
            await sdk_echo(port, clients.context(name, ["h2"]), cluster, echo)
        assert info.value.status == 403
        assert who in info.value.reason and f"'{cluster}'" in info.value.reason, info.value.reason

        reply = await h1_connect(
            port, clients.context(name, ["http/1.1"]), f"127.0.0.1:{echo}", {"cluster-proxy-cluster": cluster}
        )
        assert reply.status == 403, reply.head
        assert who in reply.head and f"'{cluster}'" in reply.head
        assert who.encode() in reply.body

    # the proxy URL's user name and the bare cluster name are checked too
    reply = await h1_connect(port, clients.context("alice", ["http/1.1"]), "cluster2:443")
    assert reply.status == 403 and "'cluster2'" in reply.head
    ok = await h1_connect(port, clients.context("alice", ["http/1.1"]), f"127.0.0.1:{echo}",
                          {"proxy-authorization": "Basic Y2x1c3RlcjE6"})  # fmt: skip
    assert ok.status == 200 and ok.stream is not None
    await ok.stream.aclose()

    # authorization comes before the cluster's existence: a refused client learns nothing about it
    with pytest.raises(Forbidden):
        await sdk_echo(port, clients.context("alice", ["h2"]), "no-such-cluster", echo)
    refused_metric = server.metrics.registry.get_sample_value(
        "cluster_proxy_server_streams_total", {"frontend": "h2", "status": "403"}
    )
    assert refused_metric == 4


async def test_policy_file_change_applies_without_restart(
    nursery: trio.Nursery, pki: PkiFiles, tmp_path: Path, policy_file: Path
) -> None:
    clients = Clients(pki, tmp_path / "clients")
    server, port, echo = await start_hub(nursery, pki, policy_file)
    bob = clients.context("bob", ["h2"])
    with pytest.raises(Forbidden):
        await sdk_echo(port, bob, "cluster2", echo)

    changed = {**POLICY, "rules": [*POLICY["rules"], {"subject": "CN=bob", "clusters": ["cluster2"]}]}
    policy_file.write_text(json.dumps(changed))
    stat = policy_file.stat()
    os.utime(policy_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a visibly newer mtime

    async def bob_allowed() -> bool:
        try:
            return await sdk_echo(port, bob, "cluster2", echo) == b"ping cluster2"
        except Forbidden:
            return False

    await wait_until(bob_allowed, timeout=10, what="bob to be allowed into cluster2", interval=0.1)
    assert server.policy is not None and server.policy.reloads == 1


async def test_without_a_policy_every_client_reaches_every_cluster(
    nursery: trio.Nursery, pki: PkiFiles, tmp_path: Path
) -> None:
    clients = Clients(pki, tmp_path / "clients")
    _, port, echo = await start_hub(nursery, pki, None)
    for name in ("alice", "bob"):
        for cluster in ("cluster1", "cluster2"):
            assert (
                await sdk_echo(port, clients.context(name, ["h2"]), cluster, echo)
                == f"ping {cluster}".encode()
            )
