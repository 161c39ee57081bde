"""The user-facing commands as processes: `cluster-proxy port-forward` and `cluster-proxy local up`."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
from pathlib import Path

import pytest
import trio

from tests.support import require
from tests.support.localup import LocalUp
from tests.support.pki import PkiFiles
from tests.support.procs import BIN, Hub, Process, alive
from tests.support.targets import serve_http
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


async def wait_for_line(process: Process, pattern: str, timeout: float = 20.0) -> re.Match[str]:
    def logged() -> re.Match[str] | None:
        found = re.search(pattern, process.log_path.read_text(errors="replace"))
        if not found and process.popen.poll() is not None:
            raise AssertionError(f"{process.name} exited ({process.popen.returncode}):\n{process.tail()}")
        return found

    return await wait_until(
        logged,
        timeout=timeout,
        interval=0.02,
        message=lambda: f"{process.name}: no line matching {pattern!r} in {timeout}s:\n{process.tail()}",
    )


async def test_port_forward_reaches_target_and_keeps_half_close(
    hub: Hub, pki: PkiFiles, nursery: trio.Nursery, tmp_path: Path
) -> None:
    target = await serve_http(nursery, b"forwarded body")

    async def answer_after_eof(stream: trio.SocketStream) -> None:
        data = b""
        while chunk := await stream.receive_some():
            data += chunk
        await stream.send_all(hashlib.sha256(data).hexdigest().encode())
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(trio.serve_listeners, answer_after_eof, listeners)
    eof_port = listeners[0].socket.getsockname()[1]

    forwards = []
    for name, port in (("pf-http", target.port), ("pf-eof", eof_port)):
        process = Process(
            name,
            [
                str(BIN / "cluster-proxy"),
                "port-forward",
                "cluster2",
                f"127.0.0.1:{port}",
                "--listen",
                "127.0.0.1:0",
                "--proxy",
                f"127.0.0.1:{hub.client_port}",
                "--server-name",
                "localhost",
                "--ca",
                str(pki.ca),
                "--cert",
                str(pki.client.cert),
                "--key",
                str(pki.client.key),
            ],
            tmp_path,
        )
        forwards.append(process)
    try:
        http_line = await wait_for_line(forwards[0], r"Forwarding from 127\.0\.0\.1:(\d+) -> cluster2/")
        eof_line = await wait_for_line(forwards[1], r"Forwarding from 127\.0\.0\.1:(\d+) -> cluster2/")

        stream = await trio.open_tcp_stream("127.0.0.1", int(http_line.group(1)))
        await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        reply = b""
        with trio.fail_after(10):
            while data := await stream.receive_some():
                reply += data
        assert reply.endswith(b"\r\n\r\nforwarded body")

        # A plain TCP half-close through port-forward: the request ends with EOF, the reply follows.
        stream = await trio.open_tcp_stream("127.0.0.1", int(eof_line.group(1)))
        request = os.urandom(300_000)
        await stream.send_all(request)
        await stream.send_eof()
        reply = b""
        with trio.fail_after(10):
            while data := await stream.receive_some():
                reply += data
        assert reply.decode() == hashlib.sha256(request).hexdigest()
    finally:
        for process in forwards:
            process.stop()


async def test_local_up_runs_the_simulation_and_stops_cleanly(tmp_path: Path) -> None:
    """The README's main job: a hub and two clusters on loopback, curl through it, Ctrl-C stops all."""
    require(shutil.which("curl") is not None, "the curl binary")
    local = await LocalUp.start(tmp_path / "state", tmp_path / "local-up.out")
    try:
        description = local.description()
        assert set(description["clusters"]) == {"cluster1", "cluster2"}
        for key in ("ca", "cert", "key"):
            assert Path(description["proxy"][key]).is_absolute() and Path(description["proxy"][key]).exists()
        pids = [pid for name, pid in description["pids"].items() if name != "cluster-proxy"]
        children = set(description["pids"]) - {"cluster-proxy"}
        expected = {
            "cert-signer",
            "proxy-server",
            "cluster1-agent",
            "cluster2-agent",
            "cluster1-echo",
            "cluster2-echo",
        }
        if shutil.which("cluster-proxy-health-collector", path=str(BIN)):
            expected.add("health-collector")  # local up runs it when its package is installed
        assert children == expected  # by default: one server, no haproxy, no tinyproxy

        commands = [
            line.strip()
            for line in local.text().splitlines()
            if line.strip().startswith("curl ") and "https://cluster" in line
        ]
        assert len(commands) == 2
        for cluster, command in zip(("cluster1", "cluster2"), commands, strict=True):
            result = await trio.run_process(
                [*shlex.split(command), "--silent", "--show-error", "--max-time", "10"],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            assert result.returncode == 0, result.stderr.decode()
            assert json.loads(result.stdout)["cluster"] == cluster

        assert await local.stop(signal.SIGINT, timeout=20) == 0
        for pid in pids:
            assert not alive(pid), f"child {pid} still running after local up stopped"
        assert not (local.state / "local.json").exists()
    finally:
        await local.stop()
