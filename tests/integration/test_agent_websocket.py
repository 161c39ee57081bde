"""The WebSocket transport between a real agent service and a real proxy-server, in one process: the
tunnel inside a WebSocket on the server's agent WebSocket port (``ws://``, no ingress), the mTLS inside
it checked as on the raw agent port, and the port's answers to peers that are not agents.

The same through a real nginx ingress (``wss://``), a forward proxy and separate processes is
tests/e2e/test_agent_websocket.py.
"""

from __future__ import annotations

import hashlib
import random

import pytest
import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, open_websocket, wrap_client_stream

from clusterproxy_agent.app import Service
from clusterproxy_agent.config import AgentSettings, WebSocketEndpoint
from clusterproxy_agent.egress import parse_rule
from clusterproxy_agent.main import parse_settings
from clusterproxy_protocol import tls
from clusterproxy_protocol.websocket import WebSocketStream
from clusterproxy_protocol.wire import ALPN_H2, WEBSOCKET_PATH, WEBSOCKET_SUBPROTOCOL
from clusterproxy_sdk import TLSFiles, open_tunnel
from tests.support.inprocess import start_server
from tests.support.pki import PkiFiles
from tests.support.targets import serve_echo
from tests.support.waiting import wait_until

SIZE = 4 << 20


def websocket_agent(pki: PkiFiles, port: int, cluster: str = "cluster1", **overrides: object) -> Service:
    pair = pki.agent("cluster1", "agent-a")
    options: dict[str, object] = {
        "server": ("127.0.0.1", port),
        "websocket": WebSocketEndpoint(secure=False),
        "server_name": "localhost",
        "cluster": cluster,
        "agent_id": "agent-a",
        "ca": pki.ca,
        "cert": pair.cert,
        "key": pair.key,
        "admin_listen": ("127.0.0.1", 0),
        "allow": [parse_rule("127.0.0.0/8")],
        "backoff_initial": 0.05,
        "backoff_max": 0.2,
    }
    options.update(overrides)
    return Service(AgentSettings(**options))  # type: ignore[arg-type]


def rejected(server: object, reason: str) -> float:
    value = server.metrics.registry.get_sample_value(  # type: ignore[attr-defined]
        "cluster_proxy_server_rejected_connections_total", {"port": "agent-websocket", "reason": reason}
    )
    return value or 0.0


async def test_a_tunnel_inside_a_websocket_carries_bytes_intact(pki: PkiFiles, nursery: trio.Nursery) -> None:
    server, bound = await start_server(nursery, pki, agent_websocket_listen=("127.0.0.1", 0))
    echo = await serve_echo(nursery)
    agent = websocket_agent(pki, bound.agent_websocket[1])
    await nursery.start(agent.run)
    await wait_until(lambda: server.registry.find("cluster1", "agent-a"), what="the agent registered")
    tunnel = server.registry.find("cluster1", "agent-a")
    assert tunnel is not None and tunnel.peer.startswith("127.0.0.1:")

    payload = random.Random(7).randbytes(SIZE)
    files = TLSFiles(pki.ca, pki.client.cert, pki.client.key)
    async with open_tunnel(f"127.0.0.1:{bound.client[1]}", files, server_hostname="localhost") as client:
        stream = await client.connect("cluster1", "127.0.0.1", echo.port)
        received = hashlib.sha256()

        async def send() -> None:
            for i in range(0, SIZE, 64 << 10):
                await stream.send_all(payload[i : i + (64 << 10)])
            await stream.send_eof()

        with trio.fail_after(30):
            async with trio.open_nursery() as both:
                both.start_soon(send)
                while data := await stream.receive_some(1 << 16):
                    received.update(data)
    assert received.hexdigest() == hashlib.sha256(payload).hexdigest()
    assert tunnel.mux.bytes_in >= SIZE and tunnel.mux.bytes_out >= SIZE
    tunnels = agent.agent.describe_servers()["tunnels"]
    assert [t["address"] for t in tunnels] == [f"ws://127.0.0.1:{bound.agent_websocket[1]}{WEBSOCKET_PATH}"]


async def test_an_agent_certificate_for_another_cluster_is_refused_inside_the_websocket(
    pki: PkiFiles, nursery: trio.Nursery
) -> None:
    server, bound = await start_server(nursery, pki, agent_websocket_listen=("127.0.0.1", 0))
    impostor = websocket_agent(pki, bound.agent_websocket[1], cluster="cluster2")
    await nursery.start(impostor.run)
    await wait_until(
        lambda: server.metrics.registry.get_sample_value(
            "cluster_proxy_server_rejected_connections_total", {"port": "agent", "reason": "registration"}
        ),
        what="the impostor's registration refused",
    )
    assert server.registry.find("cluster2", "agent-a") is None
    await wait_until(
        lambda: "certificate is for cluster 'cluster1'" in (impostor.agent.last_error or ""),
        what="the server's reason in the agent's last error",
    )


async def test_a_client_certificate_inside_the_websocket_is_refused(
    pki: PkiFiles, nursery: trio.Nursery
) -> None:
    server, bound = await start_server(nursery, pki, agent_websocket_listen=("127.0.0.1", 0))
    context = tls.client_context(pki.client.cert, pki.client.key, pki.ca, alpn=[ALPN_H2])
    tcp = await trio.open_tcp_stream("127.0.0.1", bound.agent_websocket[1])
    async with trio.open_nursery() as reader:
        connection = await wrap_client_stream(
            reader, tcp, "localhost", WEBSOCKET_PATH, subprotocols=[WEBSOCKET_SUBPROTOCOL]
        )
        inner = trio.SSLStream(WebSocketStream(connection), context, server_hostname="localhost")
        with trio.fail_after(10):
            with pytest.raises(trio.BrokenResourceError):  # TLS 1.3: the refusal shows at the first read
                await inner.do_handshake()
                await inner.receive_some(1)
        reader.cancel_scope.cancel()
    assert rejected(server, "certificate_role") == 1


async def test_the_websocket_port_answers_what_is_not_an_agent_upgrade(
    pki: PkiFiles, nursery: trio.Nursery
) -> None:
    server, bound = await start_server(
        nursery, pki, agent_websocket_listen=("127.0.0.1", 0), handshake_timeout=1.0
    )
    port = bound.agent_websocket[1]

    with pytest.raises(ConnectionRejected) as wrong_path:
        async with open_websocket(
            "127.0.0.1", port, "/other", use_ssl=False, subprotocols=[WEBSOCKET_SUBPROTOCOL]
        ):
            pass
    assert wrong_path.value.status_code == 404
    assert b"agents connect to /v1/tunnel" in (wrong_path.value.body or b"")

    with pytest.raises(ConnectionRejected) as no_subprotocol:
        async with open_websocket("127.0.0.1", port, WEBSOCKET_PATH, use_ssl=False):
            pass
    assert no_subprotocol.value.status_code == 400
    assert WEBSOCKET_SUBPROTOCOL.encode() in (no_subprotocol.value.body or b"")
    assert rejected(server, "websocket path") == 1 and rejected(server, "websocket subprotocol") == 1

    # a plain HTTP request (no upgrade) is answered 400 at once
    plain = await trio.open_tcp_stream("127.0.0.1", port)
    async with plain:
        await plain.send_all(b"GET / HTTP/1.1\r\nhost: hub\r\n\r\n")
        with trio.fail_after(5):
            answer = await plain.receive_some(4096)
    assert answer.startswith(b"HTTP/1.1 400"), answer

    # a peer that sends nothing is dropped after the handshake timeout
    silent = await trio.open_tcp_stream("127.0.0.1", port)
    async with silent:
        with trio.fail_after(5):
            assert await silent.receive_some(4096) in (b"",)
    await wait_until(lambda: rejected(server, "handshake timeout") >= 1, what="the timeout counted")

    # after the upgrade, a message larger than the limit closes the WebSocket (1009) before the TLS
    async with open_websocket(
        "127.0.0.1", port, WEBSOCKET_PATH, use_ssl=False, subprotocols=[WEBSOCKET_SUBPROTOCOL]
    ) as ws:
        await ws.send_message(b"\x16" * ((1 << 20) + 1))
        with trio.fail_after(5), pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
    assert closed.value.reason.code == 1009


@pytest.mark.parametrize(
    ("server", "error"),
    [
        ("https://hub:443", "https:// is not a transport"),
        ("wss://user:pw@hub/v1/tunnel", "takes no user info"),
        ("wss://hub:99999/", "port must be 1-65535"),
        ("wss:///v1/tunnel", "no host"),
        ("wss://a:443,b:8091", "mixes transports"),
    ],
)
def test_bad_websocket_server_addresses_are_refused_at_start(
    server: str, error: str, pki: PkiFiles, capsys: pytest.CaptureFixture[str]
) -> None:
    pair = pki.agent("cluster1", "agent-a")
    argv = [
        "--server",
        server,
        "--cluster",
        "c1",
        "--ca",
        str(pki.ca),
        "--cert",
        str(pair.cert),
        "--key",
        str(pair.key),
    ]
    with pytest.raises(SystemExit) as exited:
        parse_settings(argv, environ={})
    assert exited.value.code == 2
    assert error in capsys.readouterr().err


def test_a_websocket_server_address_is_parsed(pki: PkiFiles) -> None:
    pair = pki.agent("cluster1", "agent-a")
    base = ["--cluster", "c1", "--ca", str(pki.ca), "--cert", str(pair.cert), "--key", str(pair.key)]
    settings = parse_settings(["--server", "wss://hub.example.com", *base], environ={})
    assert settings.servers == [("hub.example.com", 443)]
    assert settings.websocket == WebSocketEndpoint(secure=True, path=WEBSOCKET_PATH)
    assert settings.server_list == "wss://hub.example.com/v1/tunnel"
    settings = parse_settings(["--server", "ws://[fd00::1]:8080/hub/tunnel", *base], environ={})
    assert settings.servers == [("fd00::1", 8080)]
    assert settings.server_list == "ws://[fd00::1]:8080/hub/tunnel"
    with pytest.raises(SystemExit):
        parse_settings(["--server", "hub:8091", "--websocket-ca-file", str(pki.ca), *base], environ={})
