"""``compose.yaml`` on a real Docker engine: the hub reaches each cluster's web service only through the
tunnel, over networks that really cannot route to each other.

One stack for the module (``compose_stack``: ``docker compose up --wait``, ~30-60 s). The tests that
break something (kill a replica, pause an agent) come last and put it back before they end.
Timings are printed (``pytest -s``) for docs/containers.md.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.compose.stack import CLUSTERS, REPLICAS, ComposeStack, wait_for

SIZE = 64 << 20  # the digest-checked transfer, each way

HUB_CLIENT = "/var/lib/cluster-proxy"  # the toolbox's hub client certificate (hub_client.py renews it)
CURL_PROXY = (
    "--proxytunnel --proxy https://{cluster}@proxy-server:8090 --proxy-cacert "
    + f"{HUB_CLIENT}/ca.crt --proxy-cert {HUB_CLIENT}/tls.crt --proxy-key {HUB_CLIENT}/tls.key"
)

# In the toolbox: 64 MiB of random bytes POSTed to the cluster's web service (an echo) through the
# proxy with curl; the digests of what went and what came back, and the size that came back.
CURL_TRANSFER = f"""
set -euo pipefail
cd /tmp
head -c {SIZE} /dev/urandom > sent-$1
curl -sS --fail --max-time 120 {CURL_PROXY.format(cluster="$1")} \\
     -H 'Content-Type: application/octet-stream' --data-binary @sent-$1 -o back-$1 http://web:8080/curl
echo $(sha256sum < sent-$1 | cut -c1-64) $(sha256sum < back-$1 | cut -c1-64) $(stat -c %s back-$1)
rm -f sent-$1 back-$1
"""

# In the toolbox: the same with the SDK (one HTTP/2 stream through the proxy, an HTTP/1.1 request on
# it, sent while the answer is read).
SDK_TRANSFER = f"""
import hashlib, json, os, sys
import trio
from clusterproxy_sdk import TLSFiles, open_tunnel

SIZE = {SIZE}
CHUNK = 1 << 20

async def main(cluster):
    body = os.urandom(SIZE)
    tls = TLSFiles(ca="ca.crt", cert="tls.crt", key="tls.key")
    received = bytearray()
    async with open_tunnel("proxy-server:8090", tls) as tunnel:
        stream = await tunnel.connect(cluster, "web", 8080)

        async def send():
            head = f"POST /sdk HTTP/1.1\\r\\nHost: web\\r\\nContent-Length: {{SIZE}}\\r\\nConnection: close\\r\\n\\r\\n"
            await stream.send_all(head.encode())
            view = memoryview(body)
            for offset in range(0, SIZE, CHUNK):
                await stream.send_all(view[offset : offset + CHUNK])
            await stream.send_eof()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            while data := await stream.receive_some(CHUNK):
                received.extend(data)
    head, _, answer = bytes(received).partition(b"\\r\\n\\r\\n")
    print(json.dumps({{
        "status": head.split(b"\\r\\n")[0].decode(),
        "sent": hashlib.sha256(body).hexdigest(),
        "back": hashlib.sha256(answer).hexdigest(),
        "size": len(answer),
    }}))

trio.run(main, sys.argv[1])
"""

# Connect to HOST:PORT within 3 s: exit 0, or the error on stderr and exit 1.
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
except OSError as exc:
    sys.exit(f"{type(exc).__name__}: {exc}")
"""

RESOLVE = """
import socket, sys
try:
    print(socket.gethostbyname(sys.argv[1]))
except OSError as exc:
    sys.exit(f"{type(exc).__name__}: {exc}")
"""


def curl_get(stack: ComposeStack, cluster: str, path: str) -> dict:
    """A GET of the cluster's web service through the proxy from the toolbox (a new connection)."""
    done = stack.exec(
        "toolbox",
        [
            "bash",
            "-c",
            f"curl -sS --fail --max-time 20 {CURL_PROXY.format(cluster=cluster)} http://web:8080{path}",
        ],
    )
    assert done.exit_code == 0, f"curl through the proxy to {cluster}: {done.stderr}"
    return json.loads(done.stdout)


def test_every_party_bootstrapped_from_a_token(compose_stack: ComposeStack) -> None:
    """The signer issued each party's certificate from its token: both replicas, the two hub clients
    (the toolbox's, the health-collector's) and one agent per cluster (the stack came up with every
    service healthy)."""
    print(f"\ncompose up --wait: {compose_stack.up_seconds:.1f}s")
    done = compose_stack.exec(
        "cert-signer",
        ["cluster-proxy-cert-signer", "status", "--store", "/var/lib/cluster-proxy/store", "--json"],
    )
    assert done.exit_code == 0, done.stderr
    identities = sorted(party["identity"] for party in json.loads(done.stdout)["parties"])
    assert identities == [
        "agent:cluster1/cluster1-agent",
        "agent:cluster2/cluster2-agent",
        "client:health-collector",
        "client:hub-admin",
        "server:proxy-server",
        "server:proxy-server",
    ]
    tokens = compose_stack.exec(
        "cert-signer",
        ["cluster-proxy-cert-signer", "token", "list", "--store", "/var/lib/cluster-proxy/store"],
    )
    assert tokens.stdout.count(" used") >= 6, tokens.stdout


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_64mib_through_the_proxy_with_curl(compose_stack: ComposeStack, cluster: str) -> None:
    started = time.monotonic()
    done = compose_stack.exec("toolbox", ["bash", "-c", CURL_TRANSFER, "curl-transfer", cluster], timeout=180)
    took = time.monotonic() - started
    assert done.exit_code == 0, f"exit {done.exit_code}: {done.stderr}"
    sent, back, size = done.stdout.split()
    assert int(size) == SIZE
    assert back == sent
    print(f"\ncurl {cluster}: 64 MiB each way in {took:.1f}s (random data made in the toolbox included)")


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_64mib_through_the_proxy_with_the_sdk(compose_stack: ComposeStack, cluster: str) -> None:
    started = time.monotonic()
    done = compose_stack.python("toolbox", SDK_TRANSFER, cluster, timeout=180)
    took = time.monotonic() - started
    assert done.exit_code == 0, f"exit {done.exit_code}: {done.stderr[-3000:]}"
    result = json.loads(done.stdout)
    assert result["status"].split()[:2] == ["HTTP/1.1", "200"], result["status"]
    assert result["size"] == SIZE
    assert result["back"] == result["sent"]
    print(f"\nSDK {cluster}: 64 MiB each way in {took:.1f}s")


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_the_hub_cannot_reach_a_cluster_directly(compose_stack: ComposeStack, cluster: str) -> None:
    """The web service answers on its address inside its cluster, and not from the hub network: not
    from the toolbox (hub only: no route at all), not from the health-collector (whose other network
    routes to the outside world), not by name."""
    web = compose_stack.address(f"{cluster}-web", cluster)
    inside = compose_stack.python(f"{cluster}-agent", CONNECT, web, "8080")
    assert inside.exit_code == 0, f"the control failed: {cluster}'s agent cannot reach {web}: {inside.stderr}"

    toolbox = compose_stack.exec("toolbox", ["curl", "-sS", "--max-time", "5", f"http://{web}:8080/"])
    assert toolbox.exit_code in (7, 28), f"curl exit {toolbox.exit_code}: {toolbox.stdout}{toolbox.stderr}"
    collector = compose_stack.python("health-collector", CONNECT, web, "8080")
    assert collector.exit_code != 0, f"the health-collector reached {cluster}'s web service at {web}"
    by_name = compose_stack.python("toolbox", RESOLVE, "web")
    assert by_name.exit_code != 0, f"'web' resolves on the hub network: {by_name.stdout}"
    print(
        f"\n{cluster} web {web}: toolbox {toolbox.stderr.strip()!r}; collector {collector.stderr.strip()!r}"
    )


def test_cluster2_leaves_its_network_only_through_the_forward_proxy(compose_stack: ComposeStack) -> None:
    assert compose_stack.networks("cluster2-agent") == {"cluster2"}
    assert compose_stack.networks("forward-proxy") == {"cluster2", "outside"}

    requests = [line for line in compose_stack.logs("forward-proxy").splitlines() if "Request (file" in line]
    assert any("CONNECT proxy-server:8091 " in line for line in requests), requests
    assert any("CONNECT cert-signer:8443 " in line for line in requests), requests
    assert compose_stack.agent_replicas("cluster2") == set(REPLICAS)

    # no other way out: the hub's agent port and the signer, by address and by name, from the agent
    for service, port in (("proxy-server", "8091"), ("cert-signer", "8443")):
        address = compose_stack.address(service, "outside")
        control = compose_stack.python("cluster1-agent", CONNECT, address, port)
        assert control.exit_code == 0, (
            f"the control failed: cluster1's agent cannot reach {service}: {control.stderr}"
        )
        direct = compose_stack.python("cluster2-agent", CONNECT, address, port)
        assert direct.exit_code != 0, f"cluster2's agent reached {service} at {address} directly"
        by_name = compose_stack.python("cluster2-agent", RESOLVE, service)
        assert by_name.exit_code != 0, f"{service} resolves in cluster2: {by_name.stdout}"


def test_health_page_and_cli_show_every_cluster(compose_stack: ComposeStack) -> None:
    compose_stack.wait_all_tunnels()
    page = httpx.get(compose_stack.health_url + "/", timeout=5)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    done = compose_stack.exec(
        "toolbox", ["cluster-proxy", "health", "--collector", "http://health-collector:8080"]
    )
    assert done.exit_code == 0, done.stdout + done.stderr
    rows = {line.split()[0]: line.split()[1:4] for line in done.stdout.splitlines()[1:] if line.strip()}
    assert rows == {cluster: ["True", "True", "True"] for cluster in CLUSTERS}, done.stdout


def test_the_replicas_list_their_agents_to_a_hub_client_only(compose_stack: ComposeStack) -> None:
    """A replica's admin port answers its agents' list over mutual TLS to the toolbox's hub client
    certificate and refuses it in plain HTTP (403 naming the https:// URL), where its probes stay; the
    health-collector reads both replicas that way with its own certificate."""
    compose_stack.wait_all_tunnels()
    for replica in REPLICAS:
        url = f"http://{replica}:8092/api/v1/agents"
        plain = compose_stack.exec("toolbox", ["curl", "-sS", "--max-time", "5", "-w", "\n%{http_code}", url])
        body, _, status = plain.stdout.rpartition("\n")
        assert status == "403", plain
        assert f"https://{replica}:8092/api/v1/agents" in body and "mutual TLS" in body, body
        assert "cluster1" not in body, body
        ready = compose_stack.exec(
            "toolbox", ["curl", "-sS", "--fail", "--max-time", "5", f"http://{replica}:8092/readyz"]
        )
        assert ready.exit_code == 0, ready.stderr
        listed = compose_stack.exec(
            "toolbox",
            ["curl", "-sS", "--fail", "--max-time", "5", "--cacert", f"{HUB_CLIENT}/ca.crt", "--cert",
             f"{HUB_CLIENT}/tls.crt", "--key", f"{HUB_CLIENT}/tls.key",
             f"https://{replica}:8092/api/v1/agents"],
        )  # fmt: skip
        assert listed.exit_code == 0, listed.stderr
        assert sorted(a["cluster"] for a in json.loads(listed.stdout)) == sorted(CLUSTERS), listed.stdout
    document = httpx.get(f"{compose_stack.health_url}/api/v1/clusters", timeout=5).json()
    servers = {s["url"]: (s["reachable"], s["error"], s["tunnels"]) for s in document["proxy_servers"]}
    assert servers == {f"https://{r}:8092": (True, None, len(CLUSTERS)) for r in REPLICAS}, servers


def test_killed_replica_new_streams_go_through_the_other(compose_stack: ComposeStack) -> None:
    compose_stack.wait_all_tunnels()
    killed = compose_stack.container("proxy-server-1")
    killed.kill()
    try:
        killed.reload()
        assert killed.status == "exited"
        started = time.monotonic()
        for i in range(10):  # each a new connection to the one address, right after the kill
            cluster = CLUSTERS[i % 2]
            answer = curl_get(compose_stack, cluster, f"/after-kill-{i}")
            assert (answer["cluster"], answer["path"]) == (cluster, f"/after-kill-{i}")
        print(
            f"\nafter docker kill proxy-server-1: 10 new streams in {time.monotonic() - started:.1f}s, none failed"
        )
    finally:
        killed.start()
    took = compose_stack.wait_all_tunnels()
    print(f"proxy-server-1 started again: every agent holds both replicas {took:.1f}s later")


def test_paused_agent_turns_unavailable_then_available(compose_stack: ComposeStack) -> None:
    compose_stack.wait_all_tunnels()
    agent = compose_stack.container("cluster1-agent")
    agent.pause()
    try:

        def cluster1_unavailable() -> dict | None:
            rows = compose_stack.clusters()
            row = rows["cluster1"]
            return rows if not row["available"] and not row["healthy"] else None

        rows, took_down = wait_for("the collector shows cluster1 unavailable", cluster1_unavailable, 60)
        assert rows["cluster2"]["available"] and rows["cluster2"]["healthy"]
        done = compose_stack.exec(
            "toolbox", ["cluster-proxy", "health", "--collector", "http://health-collector:8080"]
        )
        assert done.exit_code == 1, done.stdout + done.stderr
        table = {line.split()[0]: line.split()[1:4] for line in done.stdout.splitlines()[1:] if line.strip()}
        assert table["cluster1"] == ["True", "False", "False"], done.stdout
        assert table["cluster2"] == ["True", "True", "True"], done.stdout
    finally:
        agent.unpause()

    def cluster1_back() -> bool | None:
        row = compose_stack.clusters()["cluster1"]
        return True if row["available"] and row["healthy"] else None

    _, took_up = wait_for("the collector shows cluster1 available again", cluster1_back, 60)
    done = compose_stack.exec(
        "toolbox", ["cluster-proxy", "health", "--collector", "http://health-collector:8080"]
    )
    assert done.exit_code == 0, done.stdout + done.stderr
    print(
        f"\ndocker pause cluster1-agent: unavailable after {took_down:.1f}s; unpause: available after {took_up:.1f}s"
    )
