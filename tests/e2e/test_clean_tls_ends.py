"""Clean TLS ends against the real proxy-server (issue 10, finding 9).

A finished HTTP/1.1 CONNECT transfer and a refusal end with close_notify, which a client that
requires it (Python ssl without https_compatible) sees as a clean end and real curl as success. A
proxy-server SIGKILLed mid-transfer is an error for every client: curl exits non-zero, the SDK's
stream breaks, port-forward resets its local connection and logs why. The targets answer with a
close-delimited body (HTTP/1.0, no content-length), so that only the connection's end tells a
complete download from a truncated one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from clusterproxy_protocol import tls
from clusterproxy_sdk import TLSFiles, open_tunnel
from tests.support import require
from tests.support.gopeers import go_peer
from tests.support.pki import PkiFiles
from tests.support.procs import Hub
from tests.support.targets import Target, pattern, pattern_digest, serve
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow
MiB = 1 << 20
HEAD = b"HTTP/1.0 200 OK\r\ncontent-type: application/octet-stream\r\n\r\n"
BIN = Path(sys.executable).parent


async def _start_hub(hub: Hub) -> None:
    await hub.start_server()
    hub.start_agent("cluster1", "agent-a", "--allow", "127.0.0.0/8")
    await hub.wait_agent("cluster1", "agent-a")


@pytest.fixture(scope="module")
def hub(pki: PkiFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """A proxy-server and one agent of cluster1, processes of this module's own."""
    hub = Hub(pki, Path(tmp_path_factory.mktemp("logs")))
    try:
        trio.run(_start_hub, hub)
        yield hub
    finally:
        hub.stop()


@pytest.fixture
async def own_hub(pki: PkiFiles, tmp_path: Path) -> AsyncIterator[Hub]:
    """A hub of its own, because the test kills its proxy-server."""
    hub = Hub(pki, tmp_path)
    try:
        await _start_hub(hub)
        yield hub
    finally:
        hub.stop()


async def _read_request_head(stream: trio.SocketStream) -> None:
    head = b""
    while b"\r\n\r\n" not in head:
        data = await stream.receive_some(4096)
        if not data:
            raise ValueError("no request")
        head += data


async def serve_download(nursery: trio.Nursery, token: str, size: int) -> Target:
    """An HTTP/1.0 server: ``size`` pattern bytes of ``token``, the end marked by closing only."""

    async def answer(stream: trio.SocketStream, target: Target) -> None:
        await _read_request_head(stream)
        await stream.send_all(HEAD)
        for chunk in pattern(token, size):
            await stream.send_all(chunk)

    return await serve(nursery, answer)


async def serve_endless_download(
    nursery: trio.Nursery, size: int, stop: trio.Event, all_sent: list[None] | None = None
) -> Target:
    """Like :func:`serve_download`, but after ``size`` bytes it neither sends nor closes until
    ``stop``: a download in flight, with no end of its own to reach. ``all_sent`` gets an entry for
    each download whose ``size`` bytes went out."""

    async def answer(stream: trio.SocketStream, target: Target) -> None:
        await _read_request_head(stream)
        await stream.send_all(HEAD)
        for chunk in pattern("endless", size):
            await stream.send_all(chunk)
        if all_sent is not None:
            all_sent.append(None)
        await stop.wait()

    return await serve(nursery, answer)


def curl_argv(hub: Hub, pki: PkiFiles, url: str, output: Path) -> list[str]:
    return [
        "curl",
        "--silent",
        "--show-error",
        "--max-time",
        "60",
        "--proxytunnel",
        "--proxy",
        f"https://cluster1@127.0.0.1:{hub.client_port}",
        "--proxy-cacert",
        str(pki.ca),
        "--proxy-cert",
        str(pki.client.cert),
        "--proxy-key",
        str(pki.client.key),
        "--output",
        str(output),
        url,
    ]


async def strict_connect(
    hub: Hub, pki: PkiFiles, authority: str, cluster: str
) -> tuple[bytes, bytes, trio.SSLStream]:
    """An HTTP/1.1 CONNECT over a TLS stream that requires close_notify (https_compatible=False):
    an EOF without it raises BrokenResourceError. Returns the answer's head, the bytes read after it
    and the stream."""
    context = tls.client_context(pki.client.cert, pki.client.key, pki.ca, alpn=["http/1.1"])
    tcp = await trio.open_tcp_stream("127.0.0.1", hub.client_port)
    stream = trio.SSLStream(tcp, context, server_hostname="localhost", https_compatible=False)
    await stream.send_all(
        f"CONNECT {authority} HTTP/1.1\r\nhost: {authority}\r\ncluster-proxy-cluster: {cluster}\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        data = await stream.receive_some(4096)
        assert data, f"proxy closed before answering: {head!r}"
        head += data
    answer, _, rest = head.partition(b"\r\n\r\n")
    return answer, rest, stream


async def read_to_end(stream: trio.abc.ReceiveStream) -> tuple[bytes, str]:
    """Everything until the end, and how it ended: "clean" or the error."""
    data = bytearray()
    try:
        while chunk := await stream.receive_some(256 << 10):
            data += chunk
    except trio.BrokenResourceError as exc:
        return bytes(data), f"error: {exc.__cause__!r}"
    return bytes(data), "clean"


async def test_http1_connect_download_ends_with_close_notify(
    hub: Hub, pki: PkiFiles, nursery: trio.Nursery, tmp_path: Path
) -> None:
    require(shutil.which("curl") is not None, "the curl binary")
    size = 8 * MiB
    target = await serve_download(nursery, "clean-end", size)

    # Real curl: the download is whole and curl says so.
    output = tmp_path / "download"
    argv = curl_argv(hub, pki, f"http://{target.address}/file", output)
    result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 0, result.stderr.decode()
    body = output.read_bytes()
    assert body.startswith(HEAD) is False  # curl wrote the body only
    assert hashlib.sha256(body).hexdigest() == pattern_digest("clean-end", size)

    # A client that requires close_notify: the same download ends cleanly, not with an EOF error.
    answer, rest, stream = await strict_connect(hub, pki, target.address, "cluster1")
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert not rest
    await stream.send_all(b"GET /file HTTP/1.0\r\n\r\n")
    with trio.fail_after(30):
        data, end = await read_to_end(stream)
    await stream.aclose()
    assert end == "clean"
    assert data.startswith(HEAD)
    assert hashlib.sha256(data[len(HEAD) :]).hexdigest() == pattern_digest("clean-end", size)


async def test_go_forward_request_through_the_https_proxy_downloads_whole(
    hub: Hub, pki: PkiFiles, nursery: trio.Nursery
) -> None:
    """Go's net/http fetching an http:// URL through the https:// proxy sends the request itself to the
    proxy (no CONNECT), after offering ALPN h2 and http/1.1; with h2 chosen it refused to go on
    ("http2: unencrypted HTTP/2 not enabled"). The end of the close-delimited body is the proxy's
    clean close."""
    proxyget = await trio.to_thread.run_sync(go_peer, "proxyget")
    size = 8 * MiB
    target = await serve_download(nursery, "go-forward", size)
    argv = [
        str(proxyget),
        *("-proxy", f"https://cluster1@127.0.0.1:{hub.client_port}"),
        *("-url", f"http://{target.address}/file"),
        *("-ca", str(pki.ca), "-cert", str(pki.client.cert), "-key", str(pki.client.key)),
    ]
    result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 0, result.stderr.decode()
    answer = json.loads(result.stdout)
    assert (answer["status"], answer["bytes"]) == (200, size)
    assert answer["sha256"] == pattern_digest("go-forward", size)


async def test_http1_refusal_ends_with_close_notify(hub: Hub, pki: PkiFiles) -> None:
    answer, rest, stream = await strict_connect(hub, pki, "127.0.0.1:80", "no-such-cluster")
    assert answer.startswith(b"HTTP/1.1 404"), answer
    with trio.fail_after(10):
        body, end = await read_to_end(stream)
    body = rest + body
    await stream.aclose()
    assert end == "clean"
    assert b"unknown cluster 'no-such-cluster'" in body


async def _start_port_forward(hub: Hub, pki: PkiFiles, target: Target, log: Path) -> tuple[trio.Process, int]:
    process = await trio.lowlevel.open_process(
        [
            str(BIN / "cluster-proxy"),
            "port-forward",
            "cluster1",
            target.address,
            "--listen",
            "127.0.0.1:0",
            "--proxy",
            f"127.0.0.1:{hub.client_port}",
            "--ca",
            str(pki.ca),
            "--cert",
            str(pki.client.cert),
            "--key",
            str(pki.client.key),
        ],
        stdout=subprocess.PIPE,
        stderr=log.open("wb"),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    line = b""
    with trio.fail_after(20):
        while b"\n" not in line:
            chunk = await process.stdout.receive_some(1)
            assert chunk, f"port-forward exited: {log.read_text()}"
            line += chunk
    match = re.search(rb"Forwarding from 127\.0\.0\.1:(\d+) ", line)
    assert match, line
    return process, int(match.group(1))


async def test_proxy_server_killed_mid_transfer_is_an_error_for_every_client(
    own_hub: Hub, pki: PkiFiles, nursery: trio.Nursery, tmp_path: Path
) -> None:
    require(shutil.which("curl") is not None, "the curl binary")
    proxyget = await trio.to_thread.run_sync(go_peer, "proxyget")
    hub = own_hub
    stop = trio.Event()
    sent = 2 * MiB  # then the target goes quiet: every download is in flight when the hub dies
    all_sent: list[None] = []
    target = await serve_endless_download(nursery, sent, stop, all_sent)
    outcomes: dict[str, str] = {}
    received: dict[str, int] = {}

    output = tmp_path / "curl-download"
    curl = await trio.lowlevel.open_process(
        curl_argv(hub, pki, f"http://{target.address}/file", output), stderr=subprocess.PIPE
    )
    # Go's net/http, as kubectl and client-go use it: a forward request over the HTTPS proxy.
    go_client = await trio.lowlevel.open_process(
        [
            str(proxyget),
            *("-proxy", f"https://cluster1@127.0.0.1:{hub.client_port}"),
            *("-url", f"http://{target.address}/file"),
            *("-ca", str(pki.ca), "-cert", str(pki.client.cert), "-key", str(pki.client.key)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )

    async def sdk_download() -> None:
        files = TLSFiles(pki.ca, pki.client.cert, pki.client.key)
        async with open_tunnel(f"127.0.0.1:{hub.client_port}", files, server_hostname="localhost") as tunnel:
            stream = await tunnel.connect("cluster1", target.host, target.port)
            await stream.send_all(b"GET /file HTTP/1.0\r\n\r\n")
            received["sdk"] = 0
            try:
                while chunk := await stream.receive_some():
                    received["sdk"] += len(chunk)
                outcomes["sdk"] = "clean EOF"
            except trio.BrokenResourceError as exc:
                outcomes["sdk"] = f"error: {exc}"

    pf_log = tmp_path / "port-forward.log"
    port_forward, local_port = await _start_port_forward(hub, pki, target, pf_log)

    async def port_forward_download() -> None:
        local = await trio.open_tcp_stream("127.0.0.1", local_port)
        await local.send_all(b"GET /file HTTP/1.0\r\n\r\n")
        received["port-forward"] = 0
        try:
            while chunk := await local.receive_some(256 << 10):
                received["port-forward"] += len(chunk)
            outcomes["port-forward"] = "clean EOF"
        except trio.BrokenResourceError as exc:
            outcomes["port-forward"] = f"error: {exc.__cause__!r}"
        await local.aclose()

    try:
        nursery.start_soon(sdk_download)
        nursery.start_soon(port_forward_download)
        whole = len(HEAD) + sent
        await wait_until(
            lambda: (
                received.get("sdk", 0) >= whole
                and received.get("port-forward", 0) >= whole
                and output.exists()
                and output.stat().st_size >= sent - (64 << 10)
                and len(all_sent) == 4  # curl, the SDK, port-forward and the Go client
            ),  # curl's stdio buffer may hold the rest
            timeout=30,
            what="every download in flight",
        )
        assert hub.server is not None
        hub.server.kill(signal.SIGKILL)
        with trio.fail_after(15):
            curl_code = await curl.wait()
            go_code = await go_client.wait()
        await wait_until(lambda: len(outcomes) == 2, timeout=15, what="the SDK and port-forward outcomes")
    finally:
        stop.set()
        for process in (curl, go_client):
            if process.returncode is None:
                process.kill()
        port_forward.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            await port_forward.wait()
    assert curl.stderr is not None
    curl_error = (await curl.stderr.receive_some(65536)).decode()
    print(f"\ncurl exit {curl_code}: {curl_error.strip()}\noutcomes: {outcomes}")
    assert curl_code != 0, "curl took the dead hub's end for a complete download"
    assert go_client.stderr is not None and go_client.stdout is not None
    go_error = (await go_client.stderr.receive_some(65536)).decode()
    print(f"Go net/http exit {go_code}: {go_error.strip()}")
    assert go_code != 0, "Go's net/http took the dead hub's end for a complete download"
    assert "connection reset by peer" in go_error, go_error
    assert outcomes["sdk"].startswith("error: tunnel connection lost"), outcomes
    assert outcomes["port-forward"] == f"error: {ConnectionResetError(104, 'Connection reset by peer')!r}"
    closed = [
        json.loads(line)
        for line in pf_log.read_text().splitlines()
        if line.startswith("{") and '"connection_closed"' in line
    ]
    assert len(closed) == 1, pf_log.read_text()
    assert closed[0]["local_end"] == "reset"
    assert "tunnel connection lost" in closed[0]["error"]
    assert (
        "without close_notify" in closed[0]["error"]
        or "EOF occurred in violation of protocol" in closed[0]["error"]
    ), closed[0]
