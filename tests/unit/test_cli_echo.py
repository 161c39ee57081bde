"""The echo service of local mode: real HTTP/1.1 over real loopback sockets."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys

import httpx
import trio

from clusterproxy_cli.echo import serve
from clusterproxy_protocol import http1client


async def _start(
    nursery: trio.Nursery, name: str = "cluster1-echo", cluster: str = "cluster1"
) -> tuple[str, int]:
    return await nursery.start(serve, "127.0.0.1", 0, name, cluster)


async def _raw_exchange(port: int, data: bytes) -> bytes:
    """Send raw bytes, half-close, read until the server closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        await stream.send_eof()
        out = bytearray()
        with trio.fail_after(5):
            while chunk := await stream.receive_some():
                out += chunk
    return bytes(out)


async def test_get_names_service_cluster_and_path(nursery: trio.Nursery) -> None:
    host, port = await _start(nursery)
    response = await http1client.get(host, port, "/some/path?q=1")
    assert response.status == 200
    assert response.headers["content-type"] == "application/json"
    info = json.loads(response.body)
    assert info["service"] == "cluster1-echo"
    assert info["cluster"] == "cluster1"
    assert info["path"] == "/some/path?q=1"
    assert info["method"] == "GET"
    assert "cluster1-echo" in info["message"] and "cluster1" in info["message"]


async def test_post_bodies_are_echoed_small_and_streamed(nursery: trio.Nursery) -> None:
    host, port = await _start(nursery)
    small = b"hello echo"
    big = os.urandom(5 << 20)  # beyond what is kept in memory: spooled to a file
    async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
        r1 = await client.post("/a", content=small, headers={"content-type": "text/plain"})
        r2 = await client.post("/b", content=big)

        async def chunks():  # no Content-Length: a chunked request
            for i in range(0, len(big), 300_000):
                yield big[i : i + 300_000]

        r3 = await client.put("/c", content=chunks())
    assert (r1.status_code, r1.content, r1.headers["content-type"]) == (200, small, "text/plain")
    assert r1.headers["x-echo-cluster"] == "cluster1"
    assert r2.status_code == 200
    assert hashlib.sha256(r2.content).digest() == hashlib.sha256(big).digest()
    assert r2.headers["content-length"] == str(len(big))
    assert r3.status_code == 200
    assert hashlib.sha256(r3.content).digest() == hashlib.sha256(big).digest()


async def test_keep_alive_serves_several_requests_on_one_connection(nursery: trio.Nursery) -> None:
    _, port = await _start(nursery)
    requests = (
        b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n"
        b"POST /two HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nabcde"
        b"GET /three HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    answer = await _raw_exchange(port, requests)
    assert answer.count(b"HTTP/1.1 200 ") == 3
    assert b'"path": "/one"' in answer
    assert b"\r\n\r\nabcde" in answer
    assert b'"path": "/three"' in answer


async def test_expect_100_continue_is_honoured(nursery: trio.Nursery) -> None:
    _, port = await _start(nursery)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(
            b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n"
        )
        with trio.fail_after(5):
            first = await stream.receive_some()
        assert first.startswith(b"HTTP/1.1 100 ")
        await stream.send_all(b"xyz")
        rest = b""
        with trio.fail_after(5):
            while not rest.endswith(b"xyz"):
                rest += await stream.receive_some()
    assert b"HTTP/1.1 200 " in rest


async def test_other_methods_get_405_and_garbage_gets_400(nursery: trio.Nursery) -> None:
    _, port = await _start(nursery)
    answer = await _raw_exchange(port, b"DELETE /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 405 ")
    assert b"allow: get" in answer.lower()
    garbage = await _raw_exchange(port, b"\x16\x03\x01 this is not HTTP\r\n\r\n")
    assert garbage.startswith(b"HTTP/1.1 400 ")
    # The service is still fine afterwards.
    response = await http1client.get("127.0.0.1", port, "/after")
    assert response.status == 200


async def test_head_has_no_body(nursery: trio.Nursery) -> None:
    _, port = await _start(nursery)
    answer = await _raw_exchange(port, b"HEAD /h HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert int(re.search(rb"content-length: (\d+)", head.lower()).group(1)) > 0  # type: ignore[union-attr]
    assert body == b""


async def test_module_runs_as_a_process_and_stops_on_sigterm() -> None:
    process = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "clusterproxy_cli.echo",
            "--listen",
            "127.0.0.1:0",
            "--name",
            "c9-echo",
            "--cluster",
            "c9",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(15):
            while b"\n" not in line:
                chunk = await process.stdout.receive_some()
                assert chunk, f"echo exited early: {line!r}"
                line += chunk
        match = re.search(rb"listening on 127\.0\.0\.1:(\d+)", line)
        assert match, line
        response = await http1client.get("127.0.0.1", int(match.group(1)), "/p")
        assert json.loads(response.body)["cluster"] == "c9"
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
