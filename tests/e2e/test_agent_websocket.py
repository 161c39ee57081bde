"""Agents whose hub is reachable only through an L7 ingress: the tunnel inside a WebSocket over HTTPS,
through a real nginx terminating TLS with a certificate of its own CA, to the proxy-server's agent
WebSocket port; every process real.

Every transfer is 16 MiB each way through the hub's client port, checked by sha256. The mTLS between
agent and proxy-server runs inside the WebSocket, so the proxy-server still checks the agent's identity
(a certificate for another cluster is refused) and nginx relays only ciphertext. What nginx saw is
read from its own access log.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trio

from clusterproxy_protocol.certclient import CertFiles
from clusterproxy_protocol.pki import DevCA
from clusterproxy_protocol.wire import WEBSOCKET_PATH
from tests.support import require
from tests.support.agent_websocket import websocket_port
from tests.support.clients import transfer
from tests.support.nginx import Ingress, IngressRequest, missing, start_ingress
from tests.support.pki import PkiFiles
from tests.support.procs import Hub, Process, running_hub
from tests.support.proxies import binary, missing as missing_proxy, start_tinyproxy
from tests.support.targets import serve_digest

pytestmark = pytest.mark.slow

SIZE = 16 << 20
NO_PROXY_ENV = {"HTTPS_PROXY": "", "https_proxy": "", "NO_PROXY": "", "no_proxy": ""}


@pytest.fixture(autouse=True)
def _nginx_installed() -> None:
    require(binary("nginx") is not None, missing())


@pytest.fixture(scope="module")
def hub(pki: PkiFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """One proxy-server with its agent WebSocket port; each test brings its ingress and agents."""
    with running_hub(
        pki,
        tmp_path_factory.mktemp("logs"),
        "--agent-websocket-listen",
        "127.0.0.1:0",
        "--handshake-timeout",
        "2s",
    ) as hub:
        yield hub


def launch_agent(hub: Hub, cluster: str, server: str, *extra: str, cert_for: str | None = None) -> Process:
    """An agent of ``cluster`` (a certificate for ``cert_for`` instead, when given) dialing ``server``
    (a ``wss://`` URL), allowed to reach loopback targets, with no proxy variables but ``extra``'s."""
    ca = DevCA.create_or_load(hub.pki.ca.parent)
    pair = ca.issue_agent(cert_for or cluster, "agent-a", hub.log_dir / "leaves")
    files = CertFiles(pair.cert, pair.key, hub.pki.ca)
    argv = hub.agent_argv(
        files,
        cluster,
        "agent-a",
        server=server,
        log_level="debug",
        allow=["127.0.0.0/8"],
        options=extra,
    )
    name = f"agent-{cluster}" + (f"-with-{cert_for}-cert" if cert_for else "")
    process = Process(name, argv, hub.log_dir, env=NO_PROXY_ENV)
    hub.agents[name] = process
    return process


async def ingress_for(hub: Hub, name: str) -> Ingress:
    return await start_ingress(hub.log_dir, websocket_port(hub), name)


async def test_agent_over_websocket_through_nginx_carries_16_mib_and_its_identity_is_checked_inside(
    hub: Hub, nursery: trio.Nursery
) -> None:
    ingress = await ingress_for(hub, "nginx-main")
    target = await serve_digest(nursery)
    try:
        agent = launch_agent(hub, "behind-ingress", ingress.url(), "--websocket-ca-file", str(ingress.ca))
        await hub.wait_agent("behind-ingress", "agent-a")
        connected = await agent.wait_event("tunnel_connected")
        assert connected["server"] == ingress.url()
        assert (await agent.wait_event("agent_starting"))["transport"] == "websocket"
        assert hub.server is not None
        registered = [e for e in hub.server.named("agent_connected") if e["cluster"] == "behind-ingress"]
        assert registered[-1]["peer"].endswith(" for 127.0.0.1"), registered  # nginx's X-Forwarded-For

        seconds = await transfer(hub, "behind-ingress", target, SIZE)
        print(
            f"\n16 MiB each way through nginx + WebSocket: {seconds:.2f} s ({2 * SIZE * 8 / seconds / 1e6:.0f} Mbit/s)"
        )

        # the mTLS runs end to end inside the WebSocket: a certificate for another cluster is refused by
        # the proxy-server though nginx accepted the upgrade
        before = len(hub.server.named("agent_refused"))
        impostor = launch_agent(
            hub,
            "behind-ingress-2",
            ingress.url(),
            "--websocket-ca-file",
            str(ingress.ca),
            cert_for="behind-ingress",
        )
        refused = (await hub.server.wait_count("agent_refused", before + 1))[before]
        assert "claims cluster 'behind-ingress-2'" in refused["error"], refused
        assert "certificate is for cluster 'behind-ingress'" in refused["error"], refused
        impostor.stop()
        assert all(a["cluster"] != "behind-ingress-2" for a in hub.agents_connected())

        # nginx logs a WebSocket when it closes: stop the agents, then every request it saw was an upgrade
        # at the tunnel path, answered 101 by the proxy-server's WebSocket port
        agent.stop()
        upstream = f"127.0.0.1:{websocket_port(hub)}"
        requests = ingress.requests()
        assert requests and all(
            r == IngressRequest("GET", WEBSOCKET_PATH, 101, upstream) for r in requests
        ), requests
    finally:
        ingress.stop()


async def test_websocket_refusals_are_one_clear_line_then_backoff(hub: Hub) -> None:
    ingress = await ingress_for(hub, "nginx-refusals")
    try:
        # the ingress's certificate is not from a CA the agent trusts (no --websocket-ca-file)
        untrusting = launch_agent(hub, "ws-untrusting", ingress.url())
        failed = (await untrusting.wait_count("tunnel_connect_failed", 2))[0]
        assert failed["error"].startswith(
            f"TLS with the WebSocket endpoint localhost:{ingress.port} failed"
        ), failed
        assert "certificate verify failed" in failed["error"], failed

        # a path the ingress does not route: nginx's own 404 and its body, in the agent's words
        lost = launch_agent(hub, "ws-lost", ingress.url("/elsewhere"), "--websocket-ca-file", str(ingress.ca))
        failed = (await lost.wait_count("tunnel_connect_failed", 2))[0]
        assert failed["error"] == (
            f"WebSocket upgrade to localhost:{ingress.port}/elsewhere refused with HTTP 404: no route here"
        ), failed

        # straight to the proxy-server's port with a wrong path: its 404 says where agents connect
        wrong = launch_agent(hub, "ws-wrong-path", f"ws://127.0.0.1:{websocket_port(hub)}/tunnel")
        failed = (await wrong.wait_count("tunnel_connect_failed", 2))[0]
        assert (
            "refused with HTTP 404: no tunnel at '/tunnel': agents connect to /v1/tunnel" in failed["error"]
        )

        for agent in (untrusting, lost, wrong):
            assert agent.popen.poll() is None, agent.tail()
            assert agent.named("tunnel_reconnect_scheduled"), agent.tail()
            agent.stop()
    finally:
        ingress.stop()


async def test_agent_through_a_forward_proxy_then_the_ingress(hub: Hub, nursery: trio.Nursery) -> None:
    """A private cloud's egress proxy that passes only CONNECT, and an ingress in front of the hub."""
    require(binary("tinyproxy") is not None, missing_proxy("tinyproxy"))
    ingress = await ingress_for(hub, "nginx-behind-proxy")
    proxy = await start_tinyproxy(hub.log_dir, "tinyproxy-to-ingress")
    target = await serve_digest(nursery)
    try:
        agent = launch_agent(
            hub,
            "proxied-websocket",
            ingress.url(),
            "--websocket-ca-file",
            str(ingress.ca),
            "--proxy-url",
            proxy.url(),
        )
        await hub.wait_agent("proxied-websocket", "agent-a")
        await transfer(hub, "proxied-websocket", target, SIZE)
        assert [(r.method, r.target) for r in proxy.requests()] == [("CONNECT", f"localhost:{ingress.port}")]
        agent.stop()
    finally:
        proxy.stop()
        ingress.stop()
