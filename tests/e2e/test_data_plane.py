"""Bytes through real processes: integrity, half-close, concurrency, a stalled reader."""

from __future__ import annotations

import contextlib
import hashlib
import math

import pytest
import trio

from clusterproxy_sdk import open_tunnel
from tests.support.pki import PkiFiles
from tests.support.procs import Hub
from tests.support.targets import (
    digest_transfer as transfer,
    pattern,
    pattern_digest,
    serve_digest,
    serve_source,
)

pytestmark = pytest.mark.slow
MiB = 1 << 20


async def test_100_mib_each_way_through_one_stream(hub: Hub, pki: PkiFiles, nursery: trio.Nursery) -> None:
    target = await serve_digest(nursery)
    async with open_tunnel(
        f"127.0.0.1:{hub.client_port}", pki.sdk_files(), server_hostname="localhost"
    ) as tunnel:
        with trio.fail_after(240):
            await transfer(tunnel, target, "one-stream", 100 * MiB, 100 * MiB)


async def test_100_mib_each_way_over_16_parallel_streams(
    hub: Hub, pki: PkiFiles, nursery: trio.Nursery
) -> None:
    target = await serve_digest(nursery)
    share = 100 * MiB // 16
    async with open_tunnel(
        f"127.0.0.1:{hub.client_port}", pki.sdk_files(), server_hostname="localhost"
    ) as tunnel:
        with trio.fail_after(240):
            async with trio.open_nursery() as streams:
                for i in range(16):
                    streams.start_soon(transfer, tunnel, target, f"parallel-{i}", share, share)
    assert len([t for t in target.received if t.startswith("parallel-")]) == 16


async def test_half_close_client_sends_eof_then_reads_whole_reply(
    hub: Hub, pki: PkiFiles, nursery: trio.Nursery
) -> None:
    """The target only answers after our EOF: the reply must still arrive in full."""
    got_eof = trio.Event()

    async def answer_after_eof(stream: trio.SocketStream) -> None:
        digest = hashlib.sha256()
        while data := await stream.receive_some():
            digest.update(data)
        got_eof.set()
        await stream.send_all(digest.hexdigest().encode() + b"\n" + b"z" * (3 * MiB))
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(trio.serve_listeners, answer_after_eof, listeners)
    port = listeners[0].socket.getsockname()[1]
    request = b"q" * (2 * MiB + 17)
    async with open_tunnel(
        f"127.0.0.1:{hub.client_port}", pki.sdk_files(), server_hostname="localhost"
    ) as tunnel:
        stream = await tunnel.connect("cluster1", "127.0.0.1", port)
        await stream.send_all(request)
        await stream.send_eof()
        reply = b""
        with trio.fail_after(30):
            while data := await stream.receive_some():
                reply += data
    assert got_eof.is_set()
    line, _, rest = reply.partition(b"\n")
    assert line.decode() == hashlib.sha256(request).hexdigest()
    assert rest == b"z" * (3 * MiB)


async def test_1000_concurrent_streams_over_one_tunnel(
    hub: Hub, pki: PkiFiles, nursery: trio.Nursery
) -> None:
    target = await serve_digest(nursery)
    started = 0
    all_open = trio.Event()
    release = trio.Event()

    # A client keeps under the server's --max-pending-dials-per-connection (128): opening is paced,
    # being open is not.
    dialing = [trio.CapacityLimiter(100) for _ in range(4)]

    async def one(tunnel, i: int) -> None:
        nonlocal started
        async with dialing[i % 4]:
            stream = await tunnel.connect("cluster1", target.host, target.port)
        started += 1
        if started == 1000:
            all_open.set()
        await release.wait()  # every stream is open at the same time before any finishes
        async with stream:
            token = f"many-{i}"
            await stream.send_all(f"{token} 4096\n".encode() + b"".join(pattern(token + "-up", 4096)))
            await stream.send_eof()
            data = b""
            while chunk := await stream.receive_some():
                data += chunk
        assert hashlib.sha256(data).hexdigest() == pattern_digest(token, 4096)
        assert target.received[token] == pattern_digest(token + "-up", 4096)

    # The client port allows 256 streams per connection (--client-max-streams): four SDK connections
    # of 250 streams each, all 1,000 on the one agent tunnel of cluster1 at the same time.
    async with contextlib.AsyncExitStack() as connections:
        tunnels = [
            await connections.enter_async_context(
                open_tunnel(f"127.0.0.1:{hub.client_port}", pki.sdk_files(), server_hostname="localhost")
            )
            for _ in range(4)
        ]
        with trio.fail_after(180):
            async with trio.open_nursery() as streams:
                for i in range(1000):
                    streams.start_soon(one, tunnels[i % 4], i)
                await all_open.wait()
                assert [tunnel.open_streams for tunnel in tunnels] == [250] * 4
                cluster1 = [
                    a
                    for a in await trio.to_thread.run_sync(hub.agents_connected)
                    if a["cluster"] == "cluster1"
                ]
                assert len(cluster1) == 1 and cluster1[0]["open_streams"] == 1000, cluster1
                release.set()
    assert sum(1 for t in target.received if t.startswith("many-")) == 1000


async def test_stalled_reader_stops_only_itself_and_memory_stays_bounded(
    hub: Hub, pki: PkiFiles, nursery: trio.Nursery
) -> None:
    assert hub.server is not None
    target = await serve_digest(nursery)
    source = await serve_source(nursery)
    size = 16 * MiB

    async def four_transfers(tunnel, tag: str) -> float:
        start = trio.current_time()
        async with trio.open_nursery() as streams:
            for i in range(4):
                streams.start_soon(transfer, tunnel, target, f"{tag}-{i}", size, size)
        return 4 * 2 * size / (trio.current_time() - start)

    async with open_tunnel(
        f"127.0.0.1:{hub.client_port}", pki.sdk_files(), server_hostname="localhost"
    ) as tunnel:
        with trio.fail_after(240):
            baseline = await four_transfers(tunnel, "baseline")
            rss_before = hub.server.rss_kib()
            stalled = await tunnel.connect("cluster1", source.host, source.port)
            assert await stalled.receive_some(1024)  # the source is flowing, then we stop reading
            stalled_rate = await four_transfers(tunnel, "stalled")
            sent_while_stalled = sum(source.sent.values())
            rss_after = hub.server.rss_kib()
            # The stalled stream is still alive and its data intact after the others finished.
            assert await stalled.receive_some(1024)
            await stalled.aclose()
    ratio = stalled_rate / baseline
    print(
        f"\nthroughput of 4 streams: baseline {baseline / MiB:.1f} MiB/s, next to a stalled reader "
        f"{stalled_rate / MiB:.1f} MiB/s (ratio {ratio:.2f}); source pushed {sent_while_stalled / MiB:.1f} MiB "
        f"into the stalled stream; server RSS {rss_before} -> {rss_after} KiB"
    )
    assert math.isfinite(ratio) and ratio > 0
    # Windows bound what the stalled stream can hold: 1 MiB per hop plus kernel socket buffers.
    assert sent_while_stalled < 24 * MiB, f"the stalled stream absorbed {sent_while_stalled} bytes"
    assert rss_after - rss_before < 48 * 1024, (
        f"server RSS grew by {rss_after - rss_before} KiB while stalled"
    )
