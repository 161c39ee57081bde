"""Continuous, checked traffic through a proxy-server, for runs that last across certificate renewals
and CA rotations.

- :func:`serve_sized`: a target that needs no client EOF (so HTTP/1.1 CONNECT over TLS, which cannot
  half-close, works too): the client sends ``<token> <up> <down>\\n`` and ``up`` bytes; the target
  records their sha256, sends ``down`` pattern bytes and closes.
- :func:`serve_bye_echo`: echoes everything; closes after echoing a chunk that ends in ``BYE\\n``.
- :class:`Traffic`: a loop of transfers, each on a **new** TLS connection (so each is a fresh
  handshake with the contexts of the moment), alternating the HTTP/2 (SDK) and HTTP/1.1 frontends,
  digest-checked both ways; and long-lived streams (one per frontend) that exchange a message every
  ``interval`` for the whole run. Every failure is recorded, never raised, so a run reports its counts.
"""

from __future__ import annotations

import hashlib
import random
import ssl
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from cryptography import x509

from clusterproxy_sdk import open_tunnel
from tests.support.clients import h1_connect
from tests.support.targets import CHUNK, Target, _read_line, pattern, pattern_digest, serve

BYE = b"BYE\n"


async def _sized(stream: trio.SocketStream, target: Target) -> None:
    line, rest = await _read_line(stream)
    token, up, down = line.split()
    digest, left = hashlib.sha256(rest), int(up) - len(rest)
    while left > 0:
        data = await stream.receive_some(min(CHUNK, left))
        if not data:
            raise ValueError("upload cut short")
        digest.update(data)
        left -= len(data)
    target.received[token] = digest.hexdigest()
    for chunk in pattern(token, int(down)):
        await stream.send_all(chunk)


async def serve_sized(nursery: trio.Nursery) -> Target:
    return await serve(nursery, _sized)


async def _bye_echo(stream: trio.SocketStream, target: Target) -> None:
    while data := await stream.receive_some(CHUNK):
        await stream.send_all(data)
        if data.endswith(BYE):
            break


async def serve_bye_echo(nursery: trio.Nursery) -> Target:
    return await serve(nursery, _bye_echo)


async def _read_exactly(stream: trio.abc.ReceiveStream, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await stream.receive_some(n - len(data))
        if not chunk:
            raise AssertionError(f"stream ended after {len(data)} of {n} bytes")
        data += chunk
    return data


@dataclass
class Traffic:
    """Checked traffic to ``cluster`` through the client port; counts in the attributes."""

    client_port: int
    cluster: str
    sized: Target
    echo: Target
    h2: Callable[[], ssl.SSLContext]  # the client's contexts, read at each new connection
    h1: Callable[[], ssl.SSLContext]
    up: int = 128 << 10
    down: int = 128 << 10
    interval: float = 0.25
    ok: Counter[str] = field(default_factory=Counter)  # transfers by frontend
    failures: list[str] = field(default_factory=list)
    bytes_moved: int = 0
    long_exchanges: Counter[str] = field(default_factory=Counter)
    long_streams_closed_cleanly: int = 0
    failure_seen: trio.Event = field(default_factory=trio.Event)  # set at the first failure
    _n: int = 0

    @property
    def failed(self) -> int:
        return len(self.failures)

    def _fail(self, what: str) -> None:
        self.failures.append(what)
        self.failure_seen.set()

    # -- short transfers, one connection each ----------------------------------------------------------

    async def transfer(self, frontend: str) -> None:
        self._n += 1
        token = f"t{self._n}-{frontend}"
        upload = random.Random(token).randbytes(self.up)
        head = f"{token} {self.up} {self.down}\n".encode()
        if frontend == "h2":
            async with open_tunnel(
                f"127.0.0.1:{self.client_port}", self.h2(), server_hostname="localhost"
            ) as tunnel:
                stream = await tunnel.connect(self.cluster, self.sized.host, self.sized.port)
                async with stream:
                    received = await self._sized_exchange(stream, head + upload)
        else:
            reply = await h1_connect(
                self.client_port,
                self.h1(),
                self.sized.address,
                {"cluster-proxy-cluster": self.cluster},
            )
            if reply.status != 200 or reply.stream is None:
                raise AssertionError(f"CONNECT refused: {reply.head!r} {reply.body!r}")
            async with reply.stream:
                received = await self._sized_exchange(reply.stream, head + upload)
        if received != pattern_digest(token, self.down):
            raise AssertionError(f"{token}: the download's digest does not match")
        if self.sized.received.get(token) != hashlib.sha256(upload).hexdigest():
            raise AssertionError(f"{token}: the target recorded a different upload digest")
        self.bytes_moved += self.up + self.down
        self.ok[frontend] += 1

    @staticmethod
    async def _sized_exchange(stream: trio.abc.Stream, data: bytes) -> str:
        digest = hashlib.sha256()

        async def send() -> None:
            for i in range(0, len(data), CHUNK):
                await stream.send_all(data[i : i + CHUNK])

        async def receive() -> None:
            while chunk := await stream.receive_some(CHUNK):
                digest.update(chunk)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            nursery.start_soon(receive)
        return digest.hexdigest()

    async def loop(self, stop: trio.Event, *, parallel: int = 2) -> None:
        """Transfers back to back (``parallel`` at a time, alternating frontends) until ``stop``."""

        async def worker(i: int) -> None:
            frontend = "h2" if i % 2 == 0 else "http1"
            while not stop.is_set():
                try:
                    with trio.fail_after(30):
                        await self.transfer(frontend)
                except Exception as exc:  # recorded: the run reports every failure
                    self._fail(f"{frontend} transfer: {type(exc).__name__}: {exc}")
                frontend = "http1" if frontend == "h2" else "h2"
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            for i in range(parallel):
                nursery.start_soon(worker, i)

    # -- long-lived streams ----------------------------------------------------------------------------

    async def long_stream(
        self,
        frontend: str,
        stop: trio.Event,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """One stream open for the whole run: a 4 KiB message echoed every ``interval``; at ``stop``
        a BYE and a clean close. Opened on the contexts of the start (it outlives their certificates)."""
        rng = random.Random(frontend)
        started = False
        try:
            if frontend == "h2":
                async with open_tunnel(
                    f"127.0.0.1:{self.client_port}", self.h2(), server_hostname="localhost"
                ) as tunnel:
                    stream = await tunnel.connect(self.cluster, self.echo.host, self.echo.port)
                    async with stream:
                        task_status.started()
                        started = True
                        await self._echo_until(stream, frontend, stop, rng)
            else:
                reply = await h1_connect(
                    self.client_port, self.h1(), self.echo.address, {"cluster-proxy-cluster": self.cluster}
                )
                if reply.status != 200 or reply.stream is None:
                    raise AssertionError(f"CONNECT refused: {reply.head!r}")
                async with reply.stream:
                    task_status.started()
                    started = True
                    await self._echo_until(reply.stream, frontend, stop, rng)
        except Exception as exc:
            self._fail(f"long-lived {frontend} stream: {type(exc).__name__}: {exc}")
            if not started:
                task_status.started()

    async def _echo_until(
        self, stream: trio.abc.Stream, frontend: str, stop: trio.Event, rng: random.Random
    ) -> None:
        while not stop.is_set():
            message = rng.randbytes(4096)
            with trio.fail_after(20):
                await stream.send_all(message)
                echoed = await _read_exactly(stream, len(message))
            if echoed != message:
                raise AssertionError("echo mismatch")
            self.long_exchanges[frontend] += 1
            with trio.move_on_after(self.interval):
                await stop.wait()
        with trio.fail_after(20):
            await stream.send_all(BYE)
            if await _read_exactly(stream, len(BYE)) != BYE:
                raise AssertionError("echo mismatch on BYE")
            if await stream.receive_some(1) != b"":
                raise AssertionError("no clean end after BYE")
        self.long_streams_closed_cleanly += 1


async def server_serial(port: int, ctx: ssl.SSLContext) -> str:
    """A fresh TLS handshake with the client port: the serial (hex) of the certificate it presents."""
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(tcp, ctx, server_hostname="localhost")
    try:
        with trio.fail_after(10):
            await stream.do_handshake()
        cert = x509.load_der_x509_certificate(stream.getpeercert(binary_form=True))
        return format(cert.serial_number, "x")
    finally:
        await trio.aclose_forcefully(stream)


@dataclass
class SerialWatch:
    """Which server certificates fresh handshakes see over a run (one handshake every ``interval``)."""

    port: int
    context: Callable[[], ssl.SSLContext]
    interval: float = 1.0
    seen: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    async def probe_once(self) -> None:
        try:
            serial = await server_serial(self.port, self.context())
            if not self.seen or self.seen[-1] != serial:
                self.seen.append(serial)
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    async def run(self, stop: trio.Event) -> None:
        while not stop.is_set():
            await self.probe_once()
            with trio.move_on_after(self.interval):
                await stop.wait()
