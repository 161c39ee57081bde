"""A process of ours that dies resets the connections where a FIN would read as a clean end
(issue 32, point 2; docs/protocol.md, "Resets that reach the target").

Real processes, SIGKILLed: ``cluster-proxy port-forward`` (its local connections) and the
cluster-gateway's upgrade relay (the caller's connection after the 101). Each test also ends a
connection cleanly through the same code, which must still be a FIN (a clean EOF after every byte).
The WebSocket carrier is not armed: a peer's death already reads as a failure there (tested too).
The agent's connections to targets: tests/e2e/test_agent_death_resets_targets.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from clusterproxy_protocol.websocket import host_header, open_websocket
from clusterproxy_protocol.wire import WEBSOCKET_PATH
from clusterproxy_sdk.testing import FakeProxy, open_fake_proxy

BIN = Path(sys.executable).parent
CHUNK = 64 << 10


async def read_to_end(stream: trio.abc.ReceiveStream, buffer: bytes = b"") -> tuple[bytes, str]:
    """Everything until the end, and how it ended: "eof" or "reset" (or the error)."""
    data = bytearray(buffer)
    try:
        while chunk := await stream.receive_some(CHUNK):
            data += chunk
    except trio.BrokenResourceError as exc:
        cause = exc.__cause__
        return bytes(data), "reset" if isinstance(cause, ConnectionResetError) else f"error: {cause!r}"
    return bytes(data), "eof"


async def read_exactly(stream: trio.abc.ReceiveStream, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some(size - len(data))
        assert chunk, f"ended after {len(data)} of {size} bytes"
        data += chunk
    return bytes(data)


async def _killed(process: trio.Process) -> None:
    process.kill()
    with trio.fail_after(10):
        assert await process.wait() == -signal.SIGKILL


# --- cluster-proxy port-forward ----------------------------------------------------------------------


@pytest.fixture
async def port_forward(tmp_path: Path) -> AsyncIterator[tuple[trio.Process, int]]:
    """The ``cluster-proxy port-forward`` command, to the fake proxy's echo: (the process, its port)."""
    async with open_fake_proxy(tmp_path) as fake:
        process = await trio.lowlevel.open_process(
            [str(BIN / "cluster-proxy"), "port-forward", "cluster1", "10.0.0.7:8080", *_flags(fake)],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            assert process.stdout is not None
            line = b""
            with trio.fail_after(20):
                while b"\n" not in line:
                    chunk = await process.stdout.receive_some(1)
                    assert chunk, "port-forward exited before its Forwarding line"
                    line += chunk
            match = re.match(rb"Forwarding from 127\.0\.0\.1:(\d+) ", line)
            assert match, line
            yield process, int(match.group(1))
        finally:
            if process.returncode is None:
                process.kill()
            with trio.fail_after(10):
                await process.wait()


def _flags(fake: FakeProxy) -> list[str]:
    return [
        *("--listen", "127.0.0.1:0", "--proxy", fake.url),
        *("--ca", str(fake.ca), "--cert", str(fake.client_cert), "--key", str(fake.client_key)),
    ]


async def test_port_forward_killed_resets_its_local_connections_and_a_clean_end_is_a_fin(
    port_forward: tuple[trio.Process, int],
) -> None:
    process, port = port_forward
    payload = os.urandom(300_000)
    with trio.fail_after(20):
        # A clean end: our EOF goes through, the echo answers it with its own, read as a clean EOF.
        clean = await trio.open_tcp_stream("127.0.0.1", port)
        await clean.send_all(payload)
        await clean.send_eof()
        assert await read_to_end(clean) == (payload, "eof")
        await clean.aclose()

        # In flight: everything sent has come back (nothing unread in port-forward, which would make
        # its kernel reset the connection armed or not); then the process dies.
        flowing = await trio.open_tcp_stream("127.0.0.1", port)
        await flowing.send_all(payload)
        assert await read_exactly(flowing, len(payload)) == payload
        await _killed(process)
        assert await read_to_end(flowing) == (b"", "reset")
        await flowing.aclose()


# --- the cluster-gateway's upgrade relay -------------------------------------------------------------

# ClusterProxy._exchange, as the gateway runs it for one request, between two connections the test
# accepts: the caller's (the aggregator's, here without TLS: the arming is the TCP socket's) and the
# cluster kube-apiserver's (a tunnel stream in the gateway; a plain socket here, left as it is).
GATEWAY = """
import sys, h11, trio
from clusterproxy_gateway.http import HTTPConnection
from clusterproxy_gateway.inventory import ClusterToken
from clusterproxy_gateway.proxy import ClusterProxy
from clusterproxy_gateway.server import GatewayServer

async def main(port: int) -> None:
    caller = await trio.open_tcp_stream("127.0.0.1", port)
    cluster = await trio.open_tcp_stream("127.0.0.1", port)
    http = HTTPConnection(caller, h11.SERVER)
    request = GatewayServer._request(await http.next_event())
    request.body = await http.read_body(1 << 20)

    async def fail(code: int, message: str) -> int:
        raise SystemExit(f"failed: {code} {message}")

    proxy = ClusterProxy(None, None, proxy_server="unused")
    token = ClusterToken("token", b"", "kube.cluster1")
    print(await proxy._exchange(http, request, "cluster1", request.path, token, cluster, fail, []), flush=True)

trio.run(main, int(sys.argv[1]))
"""
UPGRADE_REQUEST = (
    b"GET /api/v1/namespaces/ns/pods/p/exec?command=x HTTP/1.1\r\nHost: hub\r\nConnection: Upgrade\r\n"
    b"Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)
SWITCHED = (
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"
)


async def _head(stream: trio.abc.ReceiveStream) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(CHUNK)
        assert chunk, f"ended before a head: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


async def _upgraded() -> tuple[trio.Process, trio.SocketStream, trio.SocketStream]:
    """The gateway process with an upgraded exchange carrying bytes both ways: (it, the caller, the
    cluster), every byte sent so far read by the other side."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", GATEWAY, str(port)], stdout=subprocess.PIPE, env={**os.environ}
    )
    try:
        with trio.fail_after(20):
            caller = await listener.accept()  # the script connects in this order
            cluster = await listener.accept()
            await listener.aclose()
            await caller.send_all(UPGRADE_REQUEST)
            head, _ = await _head(cluster)
            assert head.startswith(b"GET /api/v1/namespaces/ns/pods/p/exec"), head
            await cluster.send_all(SWITCHED)
            head, rest = await _head(caller)
            assert head.startswith(b"HTTP/1.1 101 "), head
            assert rest == b""
            await caller.send_all(b"stdin bytes")
            assert await read_exactly(cluster, 11) == b"stdin bytes"
            await cluster.send_all(b"stdout bytes")
            assert await read_exactly(caller, 12) == b"stdout bytes"
    except BaseException:
        process.kill()
        raise
    return process, caller, cluster


async def test_gateway_killed_after_an_upgrade_resets_the_callers_connection() -> None:
    process, caller, cluster = await _upgraded()
    with trio.fail_after(20):
        await _killed(process)
        assert await read_to_end(caller) == (b"", "reset")
    await caller.aclose()
    await cluster.aclose()


async def test_gateway_upgrade_ended_cleanly_is_a_fin_to_the_caller() -> None:
    process, caller, cluster = await _upgraded()
    with trio.fail_after(20):
        await cluster.send_all(b"last words")
        await cluster.send_eof()
        assert await read_to_end(caller) == (b"last words", "eof")
        await caller.send_eof()  # the other direction ends too: the relay is done, cleanly
        assert await read_to_end(cluster) == (b"", "eof")
        assert process.stdout is not None
        out, end = await read_to_end(process.stdout)  # its log lines, then what _exchange returned
        assert (out.splitlines()[-1], end) == (b"101", "eof"), out
        assert await process.wait() == 0
    await caller.aclose()
    await cluster.aclose()


# --- the WebSocket carrier: not armed, and no need -----------------------------------------------------

# A WebSocket peer in a process of its own (what the proxy-server's agent WebSocket port or an ingress is
# to the agent): accepts the tunnel's upgrade, sends one message, then closes with 1000 ("clean") or
# waits to be killed.
WEBSOCKET_PEER = """
import sys, trio
from trio_websocket import serve_websocket
from clusterproxy_protocol.wire import WEBSOCKET_SUBPROTOCOL

async def handler(request) -> None:
    connection = await request.accept(subprotocol=WEBSOCKET_SUBPROTOCOL)
    await connection.send_message(b"hello")
    if sys.argv[1] == "clean":
        await connection.aclose()
    await trio.sleep_forever()

async def main() -> None:
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve_websocket, handler, "127.0.0.1", 0, None)
        print(server.port, flush=True)

trio.run(main)
"""


@pytest.mark.parametrize("how", ["clean", "killed"])
async def test_a_websocket_carrier_reads_its_peers_death_as_a_failure(
    how: str, nursery: trio.Nursery
) -> None:
    """The kernel's FIN for a dead WebSocket peer comes without a close frame: WebSocketStream reads that
    (code 1006) as a failure, so the carrier needs no arming (the tunnel's TLS inside would tell too)."""
    peer = await trio.lowlevel.open_process(
        [sys.executable, "-c", WEBSOCKET_PEER, how], stdout=subprocess.PIPE, env={**os.environ}
    )
    try:
        assert peer.stdout is not None
        with trio.fail_after(20):
            line = b""
            while not line.endswith(b"\n"):
                chunk = await peer.stdout.receive_some(100)
                assert chunk, "the WebSocket peer exited before listening"
                line += chunk
            tcp = await trio.open_tcp_stream("127.0.0.1", int(line))
            stream = await open_websocket(
                nursery, tcp, host_header("127.0.0.1", int(line), False), WEBSOCKET_PATH
            )
            assert await stream.receive_some() == b"hello"
            if how == "clean":
                assert await stream.receive_some() == b""
            else:
                await _killed(peer)
                with pytest.raises(trio.BrokenResourceError, match="code 1006"):
                    await stream.receive_some()
            await stream.aclose()
    finally:
        if peer.returncode is None:
            peer.kill()
        await peer.wait()
