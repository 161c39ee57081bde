"""Issue 10, finding 1, against real processes: a cert-signer, a proxy-server and two agents (cluster1,
cluster2), every certificate bootstrapped from a token. cluster1's agent certificate, presented on the
client port by curl and by the SDK, used to open a stream into cluster2; now the connection is
dropped before any request is read, the server logs why (the role found, the port) and counts it. The
hub's own server certificate is refused there too; a real hub client (curl, the SDK) still works."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from clusterproxy_protocol.certclient import CertFiles
from clusterproxy_protocol.errors import TunnelClosed
from clusterproxy_protocol.tls import client_context
from clusterproxy_sdk import open_tunnel
from tests.support import require
from tests.support.certs import ClientParty, SignedHub, SignerProcess, curl_proxy_argv
from tests.support.procs import http_get
from tests.support.targets import Target, serve_echo, serve_http
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

CLUSTERS = ("cluster1", "cluster2")


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SignedHub]:
    root = Path(tmp_path_factory.mktemp("roles"))
    hub = SignedHub(None, root, signer=SignerProcess(root / "signer", root))  # type: ignore[arg-type]

    async def start() -> None:
        assert hub.signer is not None
        await hub.signer.start()
        await hub.start_server()
        for cluster in CLUSTERS:
            hub.start_agent(cluster, "agent-a")
        for cluster in CLUSTERS:
            await hub.wait_agent(cluster, "agent-a")

    try:
        trio.run(start)
        yield hub
    finally:
        hub.stop()


def rejected_by_role(hub: SignedHub) -> float:
    status, body = http_get(f"http://127.0.0.1:{hub.admin_port}/metrics")
    assert status == 200
    found = re.search(
        rb'^cluster_proxy_server_rejected_connections_total\{port="client",reason="certificate_role"\} (\S+)$',
        body,
        re.M,
    )
    return float(found.group(1)) if found else 0.0


def refusals(hub: SignedHub) -> list[dict[str, object]]:
    assert hub.server is not None
    return [e for e in hub.server.events() if e.get("event") == "tls_peer_refused"]


async def sdk_echo(hub: SignedHub, files: CertFiles, cluster: str, echo: Target, payload: bytes) -> bytes:
    context = client_context(files.cert, files.key, files.ca, alpn=["h2"])
    async with open_tunnel(f"127.0.0.1:{hub.client_port}", context, server_hostname="localhost") as tunnel:
        stream = await tunnel.connect(cluster, "127.0.0.1", echo.port)
        async with stream, trio.open_nursery() as nursery:
            nursery.start_soon(stream.send_all, payload)
            received = b""
            while len(received) < len(payload) and (chunk := await stream.receive_some()):
                received += chunk
    return received


async def test_an_agent_certificate_cannot_reach_another_cluster_through_the_client_port(
    hub: SignedHub, tmp_path: Path, nursery: trio.Nursery
) -> None:
    require(shutil.which("curl") is not None, "the curl binary")
    assert hub.signer is not None
    secret = await serve_http(nursery, b"cluster2's secret\n")
    echo = await serve_echo(nursery)
    stolen = hub.files["agent-cluster1-agent-a"]
    before_events, before_count = len(refusals(hub)), rejected_by_role(hub)

    # curl with cluster1's agent certificate, asking for cluster2
    result = await trio.run_process(
        curl_proxy_argv(hub, stolen, "cluster2", f"http://{secret.address}/"),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode != 0 and b"secret" not in result.stdout
    # the SDK with the same certificate, into cluster2
    with trio.fail_after(10), pytest.raises((TunnelClosed, trio.BrokenResourceError)):
        await sdk_echo(hub, stolen, "cluster2", echo, b"steal")
    assert secret.connections == 0 and echo.connections == 0

    await wait_until(lambda: len(refusals(hub)) >= before_events + 2)
    found = refusals(hub)[before_events:]
    assert [(e["port"], e["role"]) for e in found] == [("client", "agent"), ("client", "agent")]
    assert found[0]["error"] == (
        "a certificate with role agent is refused on the client port, which accepts client certificates only"
    )
    assert found[0]["subject"] == "O=cluster-proxy-agents,CN=agent-a"
    assert rejected_by_role(hub) == before_count + 2

    # the hub's own server certificate, which carries clientAuth to renew over mTLS, is no client either
    server_files = hub.files["proxy-server"]
    result = await trio.run_process(
        curl_proxy_argv(hub, server_files, "cluster2", f"http://{secret.address}/"),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode != 0 and secret.connections == 0
    await wait_until(lambda: len(refusals(hub)) >= before_events + 3)
    assert refusals(hub)[-1]["role"] == "server" and rejected_by_role(hub) == before_count + 3

    # both agents' tunnels are still up, and a real hub client from a token reaches cluster2
    assert {(a["cluster"], a["agent_id"]) for a in hub.agents_connected()} == {
        ("cluster1", "agent-a"),
        ("cluster2", "agent-a"),
    }
    client = await ClientParty.bootstrap(hub.signer, tmp_path / "alice", "alice")
    result = await trio.run_process(
        curl_proxy_argv(hub, client.files, "cluster2", f"http://{secret.address}/"),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout == b"cluster2's secret\n"
    payload = os.urandom(1 << 20)
    got = await sdk_echo(hub, client.files, "cluster2", echo, payload)
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(payload).hexdigest()
