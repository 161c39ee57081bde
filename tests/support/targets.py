"""Target services that run inside the test process (trio TCP servers on 127.0.0.1).

The ``digest`` target is the data-integrity workhorse: the client sends one line
``<token> <bytes-wanted>\\n`` then anything it likes; the target sends back ``bytes-wanted``
deterministic pseudo-random bytes (see :func:`pattern`), reads the client's bytes until EOF and
records their sha256 under the token. Both directions run at once, and the reply starts before the
client's EOF, so a transfer checks both directions and half-close in one go.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import trio

from tests.support.waiting import poll_until

CHUNK = 256 << 10


def pattern(token: str, size: int) -> Iterator[bytes]:
    """Deterministic pseudo-random bytes for ``token``, in chunks."""
    rng = random.Random(token)
    left = size
    while left:
        n = min(CHUNK, left)
        yield rng.randbytes(n)
        left -= n


def pattern_digest(token: str, size: int) -> str:
    digest = hashlib.sha256()
    for chunk in pattern(token, size):
        digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Target:
    host: str
    port: int
    received: dict[str, str] = field(default_factory=dict)  # token -> sha256 of what the client sent
    sent: dict[str, int] = field(default_factory=dict)  # token -> bytes the target managed to send
    connections: int = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


async def _read_line(stream: trio.SocketStream, limit: int = 256) -> tuple[str, bytes]:
    buffer = b""
    while b"\n" not in buffer:
        data = await stream.receive_some(limit)
        if not data or len(buffer) > limit:
            raise ValueError("no request line")
        buffer += data
    line, _, rest = buffer.partition(b"\n")
    return line.decode(), rest


Handler = Callable[[trio.SocketStream, Target], Awaitable[None]]


async def serve(nursery: trio.Nursery, handle: Handler) -> Target:
    """A loopback TCP target running ``handle`` per connection; a peer going away ends it quietly."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    target = Target("127.0.0.1", listeners[0].socket.getsockname()[1])

    async def connection(stream: trio.SocketStream) -> None:
        target.connections += 1
        try:
            await handle(stream, target)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ValueError):
            pass
        finally:
            await stream.aclose()

    await nursery.start(trio.serve_listeners, connection, listeners)
    return target


async def _digest(stream: trio.SocketStream, target: Target) -> None:
    line, rest = await _read_line(stream)
    token, wanted = line.split()
    digest = hashlib.sha256(rest)
    upload_done = trio.Event()

    async def send() -> None:
        for chunk in pattern(token, int(wanted)):
            await stream.send_all(chunk)
        await upload_done.wait()  # our EOF tells the client its upload digest is recorded
        await stream.send_eof()

    async def receive() -> None:
        while data := await stream.receive_some(CHUNK):
            digest.update(data)
        target.received[token] = digest.hexdigest()
        upload_done.set()

    async with trio.open_nursery() as inner:
        inner.start_soon(send)
        inner.start_soon(receive)


async def _echo(stream: trio.SocketStream, target: Target) -> None:
    while data := await stream.receive_some(CHUNK):
        await stream.send_all(data)
    await stream.send_eof()


async def serve_echo(nursery: trio.Nursery) -> Target:
    """Echoes every byte until EOF, then half-closes."""
    return await serve(nursery, _echo)


async def serve_digest(nursery: trio.Nursery) -> Target:
    return await serve(nursery, _digest)


SOURCE_BLOCK = 16 << 10  # small enough that ``sent`` moves while a peer's windows are nearly full


async def _source(stream: trio.SocketStream, target: Target) -> None:
    token = f"source-{target.connections}"
    target.sent[token] = 0
    block = random.Random(token).randbytes(SOURCE_BLOCK)
    while True:
        await stream.send_all(block)
        target.sent[token] += len(block)


async def serve_source(nursery: trio.Nursery) -> Target:
    """Sends pattern bytes forever (until the peer goes away); counts what it sent per connection."""
    return await serve(nursery, _source)


async def serve_http(nursery: trio.Nursery, body: bytes) -> Target:
    """A one-shot HTTP/1.1 server answering every request with ``body`` and closing."""

    async def answer(stream: trio.SocketStream, target: Target) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = await stream.receive_some(4096)
            if not data:
                return
            head += data
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % len(body)
            + body
        )

    return await serve(nursery, answer)


def closed_port() -> int:
    """A loopback port with nothing listening (bound then released; nobody else binds it here)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Blackhole:
    """A loopback address where a TCP connect hangs: a listener whose accept queue is full.

    Linux drops SYNs to a listener with a full accept queue (SYN cookies do not apply there), so a
    connect neither succeeds nor is refused until the caller's timeout: the "blackholed target".
    """

    def __init__(self) -> None:
        import socket

        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(0)
        self.port = self._listener.getsockname()[1]
        self._fillers = []
        for _ in range(2):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", self.port))
            self._fillers.append(filler)
        poll_until(  # the fillers' handshakes complete asynchronously
            lambda: self.queued() >= 1,
            timeout=5.0,
            interval=0.005,
            message="the blackhole's accept queue did not fill",
        )

    def queued(self) -> int:
        """Connections in the accept queue (``tcpi_unacked`` of a listener's ``TCP_INFO``: after 8
        one-byte fields, u32 rto, ato, snd_mss, rcv_mss, then unacked)."""
        import socket
        import struct

        info = self._listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 32)
        return struct.unpack_from("I", info, 24)[0]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        for sock in [*self._fillers, self._listener]:
            sock.close()

    def __enter__(self) -> Blackhole:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def digest_transfer(
    tunnel: Any, target: Target, token: str, up: int, down: int, cluster: str = "cluster1"
) -> None:
    """Through ``tunnel`` (an SDK tunnel) to a :func:`serve_digest` target: send ``up`` bytes, then EOF,
    while reading ``down`` bytes; both digests must match."""
    stream = await tunnel.connect(cluster, target.host, target.port)
    received = hashlib.sha256()
    count = 0

    async def send() -> None:
        await stream.send_all(f"{token} {down}\n".encode())
        for chunk in pattern(token + "-up", up):
            await stream.send_all(chunk)
        await stream.send_eof()

    async def receive() -> None:
        nonlocal count
        while data := await stream.receive_some(CHUNK):
            received.update(data)
            count += len(data)

    async with stream, trio.open_nursery() as nursery:
        nursery.start_soon(send)
        nursery.start_soon(receive)
    assert count == down, f"{token}: got {count} of {down} bytes"
    assert received.hexdigest() == pattern_digest(token, down), f"{token}: corrupted download"
    assert target.received[token] == pattern_digest(token + "-up", up), f"{token}: corrupted upload"
