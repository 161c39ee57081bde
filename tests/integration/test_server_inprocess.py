"""The proxy-server in-process, with a minimal agent written against the wire protocol only.

The fast layer for the server: real TLS on loopback, real HTTP/2 and HTTP/1.1, no subprocesses.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import socket
import struct

import pytest
import trio

from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import open_mux
from clusterproxy_protocol.errors import NoAgentConnected, UnknownCluster
from clusterproxy_sdk import TLSFiles, open_tunnel
from tests.support.clients import client_context, h1_connect
from tests.support.inprocess import run_wire_agent, start_server
from tests.support.pki import PkiFiles
from tests.support.targets import serve_echo
from tests.support.waiting import wait_until


async def test_both_frontends_reach_a_target_through_an_agent(nursery: trio.Nursery, pki: PkiFiles) -> None:
    server, bound = await start_server(nursery, pki)
    echo_port = (await serve_echo(nursery)).port
    nursery.start_soon(run_wire_agent, bound.agent[1], pki, "cluster1", "agent-a")
    await wait_until(lambda: server.registry.tunnels("cluster1"))

    payload = bytes(range(256)) * 1000
    async with open_tunnel(
        f"127.0.0.1:{bound.client[1]}",
        TLSFiles(pki.ca, pki.client.cert, pki.client.key),
        server_hostname="localhost",
    ) as tunnel:
        stream = await tunnel.connect("cluster1", "127.0.0.1", echo_port)
        await stream.send_all(payload)
        await stream.send_eof()
        echoed = b""
        while data := await stream.receive_some():
            echoed += data
    assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()

    reply = await h1_connect(
        bound.client[1],
        client_context(pki, alpn=["http/1.1"]),
        f"127.0.0.1:{echo_port}",
        {"cluster-proxy-cluster": "cluster1"},
    )
    assert reply.status == 200 and reply.stream is not None
    await reply.stream.send_all(b"over http/1.1")
    assert await reply.stream.receive_some(100) == b"over http/1.1"
    await reply.stream.aclose()


async def test_agent_whose_certificate_names_another_cluster_is_refused(
    nursery: trio.Nursery, pki: PkiFiles
) -> None:
    server, bound = await start_server(nursery, pki, known_clusters={"cluster2"})
    wire_agent = functools.partial(run_wire_agent, claim="cluster2")
    mux = await nursery.start(wire_agent, bound.agent[1], pki, "cluster1", "agent-a")
    with trio.fail_after(10):
        await mux.closed.wait()
    assert "certificate is for cluster 'cluster1'" in mux.dead_reason
    assert server.registry.tunnels() == []
    async with open_tunnel(
        f"127.0.0.1:{bound.client[1]}",
        TLSFiles(pki.ca, pki.client.cert, pki.client.key),
        server_hostname="localhost",
    ) as tunnel:
        for cluster, error in (("cluster2", NoAgentConnected), ("cluster1", UnknownCluster)):
            try:
                await tunnel.connect(cluster, "127.0.0.1", 80)
            except error as exc:
                assert cluster in exc.reason
            else:
                raise AssertionError(f"{cluster}: expected {error.__name__}")


async def test_streams_go_to_the_least_loaded_tunnel(nursery: trio.Nursery, pki: PkiFiles) -> None:
    server, bound = await start_server(nursery, pki)
    echo_port = (await serve_echo(nursery)).port
    nursery.start_soon(run_wire_agent, bound.agent[1], pki, "cluster1", "agent-a")
    nursery.start_soon(run_wire_agent, bound.agent[1], pki, "cluster1", "agent-b")
    await wait_until(lambda: len(server.registry.tunnels("cluster1")) == 2)
    async with open_tunnel(
        f"127.0.0.1:{bound.client[1]}",
        TLSFiles(pki.ca, pki.client.cert, pki.client.key),
        server_hostname="localhost",
    ) as tunnel:
        streams = [await tunnel.connect("cluster1", "127.0.0.1", echo_port) for _ in range(6)]
        loads = sorted(t.mux.open_streams for t in server.registry.tunnels("cluster1"))
        assert loads == [3, 3]
        for stream in streams:
            await stream.aclose()


async def test_client_connection_closing_ends_its_open_streams(nursery: trio.Nursery, pki: PkiFiles) -> None:
    server, bound = await start_server(nursery, pki)
    echo_port = (await serve_echo(nursery)).port
    nursery.start_soon(run_wire_agent, bound.agent[1], pki, "cluster1", "agent-a")
    await wait_until(lambda: server.registry.tunnels("cluster1"))
    for _ in range(3):
        async with open_tunnel(
            f"127.0.0.1:{bound.client[1]}",
            TLSFiles(pki.ca, pki.client.cert, pki.client.key),
            server_hostname="localhost",
        ) as tunnel:
            stream = await tunnel.connect("cluster1", "127.0.0.1", echo_port)
            await stream.send_all(b"ping")
            assert await stream.receive_some() == b"ping"
        # leaving the block with the stream still open
    await wait_until(lambda: server.open_relays == 0)
    tunnel = server.registry.tunnels("cluster1")[0]
    await wait_until(lambda: tunnel.mux.open_streams == 0)


@pytest.mark.parametrize(("offered", "selected"), [(["h2", "http/1.1"], "http/1.1"), (["h2"], "h2")])
async def test_http1_connect_is_served_whatever_alpn_chose(
    nursery: trio.Nursery, pki: PkiFiles, offered: list[str], selected: str
) -> None:
    """Go's transport (kubectl's ``proxy-url``) offers ALPN h2 and http/1.1 to the proxy, then speaks
    HTTP/1.1: the server prefers http/1.1 when both are offered, and serves HTTP/1.1 even after
    choosing h2."""
    server, bound = await start_server(nursery, pki)
    echo_port = (await serve_echo(nursery)).port
    nursery.start_soon(run_wire_agent, bound.agent[1], pki, "cluster1", "agent-a")
    await wait_until(lambda: server.registry.tunnels("cluster1"))

    reply = await h1_connect(
        bound.client[1],
        client_context(pki, alpn=offered),
        f"127.0.0.1:{echo_port}",
        {"proxy-authorization": "Basic " + base64.b64encode(b"cluster1:").decode()},
    )
    assert reply.status == 200 and reply.stream is not None, reply.head
    assert reply.stream.selected_alpn_protocol() == selected
    payload = bytes(range(256)) * 64
    await reply.stream.send_all(payload)
    echoed = b""
    while len(echoed) < len(payload):
        echoed += await reply.stream.receive_some(65536)
    assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()
    await reply.stream.aclose()


async def test_http2_prior_knowledge_is_served_when_alpn_chose_http1(
    nursery: trio.Nursery, pki: PkiFiles
) -> None:
    server, bound = await start_server(nursery, pki)
    echo_port = (await serve_echo(nursery)).port
    nursery.start_soon(run_wire_agent, bound.agent[1], pki, "cluster1", "agent-a")
    await wait_until(lambda: server.registry.tunnels("cluster1"))

    context = client_context(pki, alpn=["http/1.1"])
    tcp = await trio.open_tcp_stream("127.0.0.1", bound.client[1])
    transport = trio.SSLStream(tcp, context, server_hostname="localhost")
    await transport.do_handshake()
    assert transport.selected_alpn_protocol() == "http/1.1"
    async with open_mux(transport, Role.OPENER) as mux:
        stream = await mux.open_connect(f"127.0.0.1:{echo_port}", [("cluster-proxy-cluster", "cluster1")])
        await stream.send_all(b"prior knowledge")
        await stream.send_eof()
        echoed = b""
        while data := await stream.receive_some():
            echoed += data
    assert echoed == b"prior knowledge"


async def test_client_silent_after_handshake_gets_408(nursery: trio.Nursery, pki: PkiFiles) -> None:
    _, bound = await start_server(nursery, pki, handshake_timeout=0.5)
    tcp = await trio.open_tcp_stream("127.0.0.1", bound.client[1])
    stream = trio.SSLStream(tcp, client_context(pki, alpn=["h2"]), server_hostname="localhost")
    await stream.do_handshake()
    answer = b""
    with trio.fail_after(10):
        try:
            while data := await stream.receive_some():
                answer += data
        except trio.BrokenResourceError:
            pass
    assert answer.startswith(b"HTTP/1.1 408 "), answer


async def test_a_client_connection_reset_before_it_is_served_is_counted_not_a_failure(
    nursery: trio.Nursery, pki: PkiFiles
) -> None:
    server, _bound = await start_server(nursery, pki)
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    async with listener:
        client = socket.create_connection(listener.socket.getsockname())
        accepted = await listener.accept()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # RST: getpeername() of the accepted socket fails with ENOTCONN
        await trio.sleep(0.05)
        async with accepted:
            with trio.fail_after(5):
                await server.handle_client(accepted)
    assert server.metrics.rejected.labels("client", "gone before the handshake")._value.get() == 1
