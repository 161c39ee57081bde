"""``cluster-proxy proxy`` as a process in front of a real proxy-server and real agents, with real curl.

SOCKS5 (``socks5h://cluster1@...``) and HTTP (``CONNECT`` with ``--proxytunnel``, plain-HTTP forward
requests) on one port reach an HTTP echo service beside the agents; every body goes both ways and is
checked by its sha256. One proxy process serves the whole module, so its tunnel count at the end of
the concurrency test covers every test before it too: exactly one TLS connection to the hub's client
port, counted from the kernel's socket table of the proxy process (the sockets its file descriptors
hold, ESTABLISHED to that port), and one ``tunnel_connected`` in its log.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from clusterproxy_cli.echo import serve as serve_echo
from tests.support import require
from tests.support.pki import PkiFiles
from tests.support.procs import BIN, Hub, Process, json_records
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

CONCURRENT = 100


class LocalProxy:
    def __init__(self, process: Process, port: int) -> None:
        self.process = process
        self.port = port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def proxy_argv(hub: Hub, pki: PkiFiles, *flags: str) -> list[str]:
    return [
        str(BIN / "cluster-proxy"),
        "proxy",
        f"--proxy=127.0.0.1:{hub.client_port}",
        f"--ca={pki.ca}",
        f"--cert={pki.client.cert}",
        f"--key={pki.client.key}",
        *flags,
    ]


@pytest.fixture(scope="module")
def local_proxy(hub: Hub, pki: PkiFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalProxy]:
    require(shutil.which("curl") is not None, "the curl binary")
    directory = tmp_path_factory.mktemp("local-proxy")
    process = Process("cluster-proxy-proxy", proxy_argv(hub, pki, "--listen=127.0.0.1:0"), directory)
    try:

        async def started() -> int:
            found: list[re.Match[str]] = []

            def line() -> bool:
                assert process.popen.poll() is None, process.tail()
                match = re.search(r"Proxying on 127\.0\.0\.1:(\d+)", process.log_path.read_text())
                found.extend([match] if match else [])
                return match is not None

            await wait_until(line, timeout=20, what="the proxy's Proxying line")
            return int(found[0].group(1))

        yield LocalProxy(process, trio.run(started))
    finally:
        process.stop()


@pytest.fixture
async def echo(nursery: trio.Nursery) -> tuple[str, int]:
    """An HTTP echo service (POST: the body back) where cluster1's agent can dial it."""
    return await nursery.start(serve_echo, "127.0.0.1", 0, "cluster1-echo", "cluster1")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def _curl(*args: str) -> trio.CompletedProcess[bytes]:
    argv = ["curl", "--silent", "--show-error", "--max-time", "60", *args]
    return await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)


async def _echo_through(proxy_flags: list[str], url: str, body: Path) -> bytes:
    """POST ``body`` to the echo service through the proxy; the answer's body."""
    done = await _curl(
        *proxy_flags, "--data-binary", f"@{body}", "-H", "content-type: application/octet-stream", url
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout


def _random_file(directory: Path, name: str, size: int) -> tuple[Path, str]:
    data = os.urandom(size)
    path = directory / name
    path.write_bytes(data)
    return path, _sha256(data)


FORMS = {
    "socks5h": lambda proxy: ["--proxy", f"socks5h://cluster1@{proxy.address}"],
    "http-connect": lambda proxy: ["--proxytunnel", "--proxy", f"http://cluster1@{proxy.address}"],
    "http-forward": lambda proxy: ["--proxy", f"http://cluster1@{proxy.address}"],
}


PROTOCOLS = {"socks5h": "socks5", "http-connect": "http-connect", "http-forward": "http-forward"}


@pytest.mark.parametrize("form", FORMS)
async def test_curl_reaches_echo_in_cluster1(
    local_proxy: LocalProxy, echo: tuple[str, int], tmp_path: Path, form: str
) -> None:
    body, digest = _random_file(tmp_path, "body", 1 << 20)
    answer = await _echo_through(FORMS[form](local_proxy), f"http://{echo[0]}:{echo[1]}/{form}", body)
    assert len(answer) == 1 << 20 and _sha256(answer) == digest

    def closed() -> list[dict[str, object]]:
        return [
            r
            for r in json_records(local_proxy.process.log_path, "connection_closed")
            if r.get("target") == f"{echo[0]}:{echo[1]}" and r.get("protocol") == PROTOCOLS[form]
        ]

    # logged once the relay saw both ends, which may be just after curl exited
    await wait_until(closed, timeout=10, what=f"the proxy's connection_closed for {form}")
    record = closed()[-1]
    assert record["cluster"] == "cluster1" and record["named_by"] == "proxy-user", record
    assert record["error"] is None and record["bytes_to_client"] > 1 << 20, record


def _tunnel_sockets(pid: int, port: int) -> int:
    """ESTABLISHED TCP sockets of process ``pid`` whose remote port is ``port`` (the kernel's tables,
    matched to the socket inodes of the process's file descriptors)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    count = 0
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[3] == "01" and fields[9] in inodes:
                count += 1
    return count


async def test_100_concurrent_curls_share_one_tunnel(
    local_proxy: LocalProxy, hub: Hub, echo: tuple[str, int], tmp_path: Path
) -> None:
    bodies = [_random_file(tmp_path, f"body-{i}", 64 << 10) for i in range(CONCURRENT)]
    forms = list(FORMS)
    answers: dict[int, bytes] = {}
    most_sockets = [0]

    async def one(i: int) -> None:
        form = forms[i % len(forms)]
        url = f"http://{echo[0]}:{echo[1]}/concurrent/{i}"
        answers[i] = await _echo_through(FORMS[form](local_proxy), url, bodies[i][0])

    async def watch_sockets() -> None:
        while True:
            most_sockets[0] = max(most_sockets[0], _tunnel_sockets(local_proxy.process.pid, hub.client_port))
            await trio.sleep(0.05)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_sockets)
        async with trio.open_nursery() as curls:
            for i in range(CONCURRENT):
                curls.start_soon(one, i)
        nursery.cancel_scope.cancel()
    assert {i: _sha256(a) for i, a in answers.items()} == {i: d for i, (_, d) in enumerate(bodies)}
    # One TLS connection from the proxy process to the hub's client port, during and after the
    # burst, and it is the one dialed at start: the module's only tunnel_connected.
    assert _tunnel_sockets(local_proxy.process.pid, hub.client_port) == 1
    assert most_sockets[0] == 1
    connected = json_records(local_proxy.process.log_path, "tunnel_connected")
    assert len(connected) == 1 and connected[0]["connections_made"] == 1, connected
    print(f"\n{CONCURRENT} concurrent curls: all digests match, 1 TLS connection to the hub")


async def _socks(proxy: LocalProxy, greeting: bytes, *messages: bytes) -> tuple[bytes, bytes]:
    """Send a SOCKS5 greeting (answer: 2 bytes), then ``messages``; the replies and whatever follows
    until the proxy closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
    async with stream:
        await stream.send_all(greeting)
        chosen = b""
        while len(chosen) < 2:
            chosen += await stream.receive_some(2 - len(chosen))
        for message in messages:
            await stream.send_all(message)
        rest = b""
        with trio.fail_after(20):
            while data := await stream.receive_some():
                rest += data
        return chosen, rest


def _connect_request(host: str, port: int, command: int = 1) -> bytes:
    name = host.encode()
    return bytes([5, command, 0, 3, len(name)]) + name + struct.pack("!H", port)


def _user(name: str) -> bytes:
    return bytes([1, len(name)]) + name.encode() + bytes([0])


async def test_socks_bind_is_refused_with_command_not_supported(local_proxy: LocalProxy) -> None:
    bind = bytes([5, 2, 0, 1, 127, 0, 0, 1]) + struct.pack("!H", 80)
    chosen, rest = await _socks(local_proxy, b"\x05\x01\x00", bind)
    assert chosen == b"\x05\x00"
    assert rest == bytes([5, 0x07, 0, 1, 0, 0, 0, 0, 0, 0])  # then the proxy closed


@pytest.mark.parametrize(
    ("cluster", "status", "reply", "reason"),
    [
        ("no-such-cluster", 404, 0x03, "unknown cluster 'no-such-cluster'"),
        ("cluster3", 503, 0x03, "no agent of cluster 'cluster3' is connected"),
    ],
)
async def test_socks_refusal_gets_a_reply_code_and_the_hubs_reason_is_logged(
    local_proxy: LocalProxy, cluster: str, status: int, reply: int, reason: str
) -> None:
    chosen, rest = await _socks(
        local_proxy, b"\x05\x02\x00\x02", _user(cluster), _connect_request("svc.example", 80)
    )
    assert chosen == b"\x05\x02"
    assert rest[:2] == b"\x01\x00"  # the user name accepted
    assert rest[2:] == bytes([5, reply, 0, 1, 0, 0, 0, 0, 0, 0])

    def logged() -> list[dict[str, object]]:
        return [
            r
            for r in json_records(local_proxy.process.log_path, "connect_refused")
            if r.get("cluster") == cluster and r.get("status") == status
        ]

    await wait_until(logged, timeout=10, what=f"the proxy's connect_refused for {cluster}")
    assert reason in str(logged()[-1]["reason"]), logged()


async def test_curl_through_socks_to_a_closed_port_fails_with_connection_refused(
    local_proxy: LocalProxy,
) -> None:
    with trio.socket.socket() as unused:  # a port nothing listens on
        await unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    done = await _curl("--proxy", f"socks5h://cluster1@{local_proxy.address}", f"http://127.0.0.1:{port}/")
    assert done.returncode == 97, done.stderr  # CURLE_PROXY
    assert b"Can't complete SOCKS5 connection to 127.0.0.1. (5)" in done.stderr, done.stderr  # reply 0x05


async def test_http_without_a_cluster_is_answered_407_with_the_realm(local_proxy: LocalProxy) -> None:
    done = await _curl(
        "--verbose", "--proxytunnel", "--proxy", f"http://{local_proxy.address}", "http://10.0.0.5/"
    )
    assert done.returncode != 0
    assert b"HTTP/1.1 407 Proxy Authentication Required" in done.stderr, done.stderr
    assert b'Proxy-Authenticate: Basic realm="cluster-proxy: user name = cluster"' in done.stderr


async def test_a_non_loopback_listen_address_is_refused(hub: Hub, pki: PkiFiles) -> None:
    done = await trio.run_process(
        proxy_argv(hub, pki, "--listen=0.0.0.0:0"), capture_stdout=True, capture_stderr=True, check=False
    )
    assert done.returncode == 2
    err = done.stderr.decode()
    assert "--listen 0.0.0.0:0 is not a loopback address" in err and "--allow-remote" in err, err
    assert "hub client certificate" in err
    print(f"\n{err.strip().splitlines()[-1]}", file=sys.stderr)
