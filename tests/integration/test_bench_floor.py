"""The bench's floor (bench/floor): its server and agent as processes with the bench's certificates,
CONNECT through them with a plain h11 client over mutual TLS: bytes checked by sha256 both ways on
concurrent streams, half-close both ways, a reset stream leaves the others and the tunnel intact."""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import h11
import pytest
import trio

from bench.pki import BenchPKI

pytestmark = pytest.mark.slow  # real processes

REPO = Path(__file__).resolve().parents[2]
SIZE = 4 << 20
PAYLOAD = os.urandom(SIZE)  # what the target sends on every exchange


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def floor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    folder = tmp_path_factory.mktemp("floor")
    pki = BenchPKI(folder / "pki")
    server, client, agent = pki.server(), pki.client(), pki.agent("cluster1", "agent1")
    client_port, agent_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    tls = ["--ca", str(pki.ca)]
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "bench.floor.server", "--agent-listen", f"127.0.0.1:{agent_port}"),
                *("--client-listen", f"127.0.0.1:{client_port}", *tls, "--cert", str(server.cert)),
                *("--key", str(server.key)),
            ],
            env=env,
        )
    ]
    procs.append(
        subprocess.Popen(
            [
                *(sys.executable, "-m", "bench.floor.agent", "--server", f"127.0.0.1:{agent_port}", *tls),
                *("--cert", str(agent.cert), "--key", str(agent.key), "--cluster", "cluster1"),
            ],
            env=env,
        )
    )
    try:
        yield {"port": client_port, "ca": pki.ca, "cert": client.cert, "key": client.key, "procs": procs}
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


class Client:
    """HTTP/1.1 CONNECT over mutual TLS with TLS 1.3 half-close (close_notify), as Go's CloseWrite."""

    def __init__(self, stream: trio.SocketStream, obj: ssl.SSLObject, bios: tuple[ssl.MemoryBIO, ...]):
        self.stream, self.obj = stream, obj
        self.incoming, self.outgoing = bios
        self.buffered = b""

    @classmethod
    async def connect(cls, floor: dict, target: str, first: bytes) -> Client:
        ctx = ssl.create_default_context(cafile=str(floor["ca"]))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(str(floor["cert"]), str(floor["key"]))
        ctx.set_alpn_protocols(["http/1.1"])
        bios = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = ctx.wrap_bio(*bios, server_hostname="127.0.0.1")  # the server certificate's IP SAN
        client = cls(await trio.open_tcp_stream("127.0.0.1", floor["port"]), obj, bios)
        while True:
            try:
                client.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await client._flush()
                client.incoming.write(await client.stream.receive_some(65536))
        conn = h11.Connection(h11.CLIENT)
        head = [("host", target), ("cluster-proxy-cluster", "cluster1")]
        await client.send(conn.send(h11.Request(method="CONNECT", target=target, headers=head)))
        while (event := conn.next_event()) is h11.NEED_DATA:
            conn.receive_data(await client.recv())
        if event.status_code != 200:
            raise ConnectionError(f"CONNECT answered {event.status_code}")
        client.buffered = conn.trailing_data[0]
        await client.send(first)
        return client

    async def _flush(self) -> None:
        if self.outgoing.pending:
            await self.stream.send_all(self.outgoing.read())

    async def send(self, data: bytes) -> None:
        for offset in range(0, len(data), 64 << 10):
            self.obj.write(data[offset : offset + (64 << 10)])
            await self._flush()

    async def send_eof(self) -> None:
        try:
            self.obj.unwrap()
        except ssl.SSLWantReadError:
            pass
        await self._flush()

    async def recv(self) -> bytes:
        """Some plaintext; b"" at close_notify (EOF without it raises)."""
        if self.buffered:
            data, self.buffered = self.buffered, b""
            return data
        while True:
            try:
                return self.obj.read(65536)
            except ssl.SSLZeroReturnError:
                return b""
            except ssl.SSLWantReadError:
                data = await self.stream.receive_some(256 << 10)
                if not data:
                    raise ConnectionError("EOF without close_notify") from None
                self.incoming.write(data)

    async def recv_all(self) -> bytes:
        parts = []
        while data := await self.recv():
            parts.append(data)
        return b"".join(parts)

    def abort(self) -> None:
        self.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.stream.socket.close()


async def target_conn(stream: trio.SocketStream, seen: list[str]) -> None:
    """b"X": send PAYLOAD while reading to EOF, then the sha256 of what was read. b"H": send 1 MiB and
    half-close first, then read to EOF and note its sha256 in ``seen``. b"S": read forever (a stream
    to reset). b"R": take 64 KiB, then abort (RST: the agent resets the stream)."""
    mode = await stream.receive_some(1)
    digest = hashlib.sha256()

    async def drain() -> None:
        while data := await stream.receive_some(256 << 10):
            digest.update(data)

    try:
        if mode == b"X":
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream.send_all, PAYLOAD)
                await drain()
            await stream.send_all(digest.digest())
        elif mode == b"H":
            await stream.send_all(PAYLOAD[: 1 << 20])
            await stream.send_eof()
            await drain()
            seen.append(digest.hexdigest())
        elif mode == b"R":
            await stream.receive_some(64 << 10)
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            await drain()
    except trio.BrokenResourceError:
        seen.append("broken")
    finally:
        await stream.aclose()


async def open_through(floor: dict, target: str, first: bytes) -> Client:
    """A CONNECT, retried while the agent's tunnel is not up yet."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return await Client.connect(floor, target, first)
        except (ConnectionError, OSError):
            if time.monotonic() > deadline:
                raise
            await trio.sleep(0.1)


async def exchange(floor: dict, target: str, results: list[bool]) -> None:
    """4 MiB each way at once; after our close_notify the target answers the sha256 of what it got."""
    sent = os.urandom(SIZE)
    client = await open_through(floor, target, b"X")
    received = bytearray()

    async def reader() -> None:
        received.extend(await client.recv_all())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await client.send(sent)
        await client.send_eof()
    results.append(
        hashlib.sha256(received[:-32]).digest() == hashlib.sha256(PAYLOAD).digest()
        and bytes(received[-32:]) == hashlib.sha256(sent).digest()
    )
    await client.stream.aclose()


@pytest.fixture
async def target(nursery: trio.Nursery) -> tuple[str, list[str]]:
    seen: list[str] = []
    listeners = await nursery.start(
        partial(trio.serve_tcp, host="127.0.0.1"), lambda s: target_conn(s, seen), 0
    )
    return f"127.0.0.1:{listeners[0].socket.getsockname()[1]}", seen


async def test_concurrent_transfers_checked_both_ways(floor: dict, target: tuple[str, list[str]]) -> None:
    results: list[bool] = []
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(exchange, floor, target[0], results)
    assert results == [True] * 8


async def test_half_close_from_the_target_then_the_client_goes_on(
    floor: dict, target: tuple[str, list[str]]
) -> None:
    with trio.fail_after(60):
        client = await open_through(floor, target[0], b"H")
        assert await client.recv_all() == PAYLOAD[: 1 << 20]  # the target's half-close reached us
        sent = os.urandom(SIZE)
        await client.send(sent)  # and our direction is still open
        await client.send_eof()
        while not target[1]:
            await trio.sleep(0.02)
        await client.stream.aclose()
    assert target[1] == [hashlib.sha256(sent).hexdigest()]


async def test_reset_stream_leaves_the_others_and_the_tunnel(
    floor: dict, target: tuple[str, list[str]]
) -> None:
    results: list[bool] = []
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            doomed = [await open_through(floor, target[0], b"S") for _ in range(3)]
            for client in doomed:
                await client.send(os.urandom(256 << 10))
            for _ in range(4):
                nursery.start_soon(exchange, floor, target[0], results)
            reset_by_target = await open_through(floor, target[0], b"R")
            await trio.sleep(0.2)
            for client in doomed:
                client.abort()  # RST: the server resets the stream, the agent aborts its target
            with pytest.raises((ConnectionError, trio.BrokenResourceError)):  # aborted, not ended
                await reset_by_target.send(os.urandom(256 << 10))  # may meet the abort already
                await reset_by_target.recv_all()
        while len(target[1]) < 3:  # the target side of each reset stream broke too
            await trio.sleep(0.02)
        await exchange(floor, target[0], results)  # the tunnel still carries new streams
    assert results == [True] * 5
    assert target[1] == ["broken"] * 3
    assert all(p.poll() is None for p in floor["procs"])
