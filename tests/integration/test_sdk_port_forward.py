"""``cluster-proxy port-forward`` (built on the SDK's shared tunnel) against the fake TLS + HTTP/2 proxy.

Real sockets everywhere: local TCP client -> port-forward listener -> TLS/HTTP/2 -> fake acceptor.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from clusterproxy_cli.portforward import PortForward, run_port_forward
from clusterproxy_cli.state import ProxySettings, build_local_json, write_local_json
from clusterproxy_protocol.logs import configure_logging
from clusterproxy_sdk import ProxyConnectionError
from clusterproxy_sdk.testing import FakeProxy, echo_handler, open_fake_proxy, refuse_handler
from tests.support.waiting import wait_until

BIN = Path(sys.executable).parent


def _forward(
    fake: FakeProxy, cluster: str = "cluster1", target: tuple[str, int] = ("10.0.0.7", 8080)
) -> PortForward:
    return PortForward(
        cluster=cluster,
        target_host=target[0],
        target_port=target[1],
        listen_host="127.0.0.1",
        listen_port=0,
        proxy=fake.address,
        tls=fake.client_tls,
    )


async def _exchange(port: int, payload: bytes) -> bytes:
    """Connect to the forwarded port, send ``payload`` and EOF, read until the far end closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    received = bytearray()
    async with stream:

        async def sender() -> None:
            await stream.send_all(payload)
            await stream.send_eof()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            while data := await stream.receive_some(1 << 16):
                received += data
    return bytes(received)


async def test_forwarded_connections_round_trip_over_one_tunnel(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    fake = await nursery.start(_run_fake, tmp_path)
    out = io.StringIO()
    [(host, port)] = await nursery.start(
        lambda task_status: run_port_forward(_forward(fake), out=out, task_status=task_status)
    )
    assert host == "127.0.0.1" and port != 0
    assert out.getvalue() == f"Forwarding from 127.0.0.1:{port} -> cluster1/10.0.0.7:8080\n"

    payloads = [os.urandom(n) for n in (1, 70_000, 2 << 20)]
    with trio.fail_after(20):
        results = []
        for payload in payloads:
            results.append(await _exchange(port, payload))
    for payload, result in zip(payloads, results, strict=True):
        assert hashlib.sha256(result).digest() == hashlib.sha256(payload).digest()
    assert len(fake.connections) == 1  # dialed once at start, shared by every local connection
    assert [r.authority for r in fake.requests] == ["10.0.0.7:8080"] * 3
    assert {r.cluster for r in fake.requests} == {"cluster1"}


async def test_refused_connect_is_logged_and_local_connection_closed(
    tmp_path: Path, nursery: trio.Nursery, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("info", json=True)  # to the captured stderr
    try:
        fake = await nursery.start(_run_fake, tmp_path)
        fake.handler = refuse_handler(503, "no agent of cluster cluster1 is connected")
        [(_, port)] = await nursery.start(
            lambda task_status: run_port_forward(_forward(fake), out=io.StringIO(), task_status=task_status)
        )
        with trio.fail_after(10):
            try:
                answer = await _exchange(port, b"GET / HTTP/1.0\r\n\r\n")
            except* trio.BrokenResourceError:  # closed with our request unread: the kernel sends RST
                answer = b""
        assert answer == b""
        events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
        refused = [e for e in events if e.get("event") == "connect_refused"]
        assert refused, events
        assert refused[0]["status"] == 503
        assert refused[0]["reason"] == "no agent of cluster cluster1 is connected"
        assert refused[0]["cluster"] == "cluster1"
        # The tunnel survives a refusal: the next local connection goes through.
        fake.handler = echo_handler
        with trio.fail_after(10):
            assert await _exchange(port, b"again") == b"again"
        assert len(fake.connections) == 1
    finally:
        with contextlib.redirect_stderr(sys.__stderr__):  # not the capture, which closes after the test
            configure_logging("info")


async def test_tunnel_is_redialed_after_it_died(tmp_path: Path, nursery: trio.Nursery) -> None:
    fake = await nursery.start(_run_fake, tmp_path)
    [(_, port)] = await nursery.start(
        lambda task_status: run_port_forward(_forward(fake), out=io.StringIO(), task_status=task_status)
    )
    with trio.fail_after(10):
        assert await _exchange(port, b"one") == b"one"
    fake.drop_connections()
    with trio.fail_after(10):  # both steps together, as before
        await wait_until(lambda: not fake.live_connections, timeout=10, what="the dropped connection to go")
        assert await _exchange(port, b"two") == b"two"
    assert len(fake.connections) == 2


async def test_unreachable_proxy_fails_at_start(tmp_path: Path) -> None:
    async with open_fake_proxy(tmp_path) as fake:
        pf = _forward(fake)
    with trio.fail_after(10), pytest.raises(ProxyConnectionError, match="cannot connect"):
        await run_port_forward(pf, out=io.StringIO())


async def _run_fake(
    directory: Path, *, task_status: trio.TaskStatus[FakeProxy] = trio.TASK_STATUS_IGNORED
) -> None:
    async with open_fake_proxy(directory) as fake:
        task_status.started(fake)
        await trio.sleep_forever()


async def _read_line(process: trio.Process) -> str:
    assert process.stdout is not None
    line = b""
    while b"\n" not in line:
        chunk = await process.stdout.receive_some(1)
        if not chunk:
            raise AssertionError(f"port-forward exited before printing its line: {line!r}")
        line += chunk
    return line.decode()


async def _run_cli(args: list[str], *, cwd: Path | None = None) -> trio.Process:
    return await trio.lowlevel.open_process(
        [str(BIN / "cluster-proxy"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=cwd,
    )


async def _stop(process: trio.Process, signum: int = signal.SIGINT) -> int:
    if process.returncode is None:
        process.send_signal(signum)
    with trio.fail_after(10):
        return await process.wait()


@pytest.mark.parametrize("mode", ["flags", "state-dir"])
async def test_cli_process_forwards(tmp_path: Path, nursery: trio.Nursery, mode: str) -> None:
    fake = await nursery.start(_run_fake, tmp_path / "pki")
    if mode == "flags":
        how = [
            "--proxy",
            fake.url,
            "--ca",
            str(fake.ca),
            "--cert",
            str(fake.client_cert),
            "--key",
            str(fake.client_key),
        ]
    else:
        proxy = ProxySettings(*fake.address, fake.ca, fake.client_cert, fake.client_key)
        write_local_json(tmp_path / "state", build_local_json(proxy, {}, {}, tmp_path / "state"))
        how = ["--state-dir", str(tmp_path / "state")]
    process = await _run_cli(["port-forward", "cluster2", "[fd00::9]:443", "--listen", "127.0.0.1:0", *how])
    try:
        with trio.fail_after(20):
            line = await _read_line(process)
        match = re.fullmatch(r"Forwarding from 127\.0\.0\.1:(\d+) -> cluster2/\[fd00::9\]:443\n", line)
        assert match, line
        payload = os.urandom(300_000)
        with trio.fail_after(20):
            assert await _exchange(int(match.group(1)), payload) == payload
        assert fake.requests[-1].authority == "[fd00::9]:443"
        assert fake.requests[-1].cluster == "cluster2"
    finally:
        code = await _stop(process, signal.SIGTERM if mode == "flags" else signal.SIGINT)
    assert code == 0


async def test_cli_process_exits_1_when_proxy_is_down(tmp_path: Path) -> None:
    async with open_fake_proxy(tmp_path) as fake:
        args = [
            "--proxy",
            fake.url,
            "--ca",
            str(fake.ca),
            "--cert",
            str(fake.client_cert),
            "--key",
            str(fake.client_key),
        ]
    process = await _run_cli(["port-forward", "cluster1", "svc:80", *args])
    with trio.fail_after(20):
        code = await process.wait()
        assert process.stderr is not None
        err = (await process.stderr.receive_some(1 << 16)).decode()
    assert code == 1
    assert f"cannot connect to the proxy-server at {fake.url}" in err
