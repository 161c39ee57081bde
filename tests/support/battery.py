"""The bad-input battery's harness: one hostile input (a :class:`BadInput`) run against a real
proxy-server while normal traffic goes on beside it, with the three checks every case gets:

1. the hostile connection is answered or closed, the way its class must be (the attack returns how),
   within ``bound`` + ``HANG_GUARD`` seconds: the time taken is printed beside the case's ``bound``
   (what an idle machine shows), never asserted, since a loaded machine only delays the reaction;
2. the server's RSS comes back within the case's ``rss_margin_kib`` of its warm baseline;
3. traffic beside it is intact: one SDK stream that is mid-transfer for the whole attack (sha256 of
   both directions), and fresh transfers on new connections, HTTP/2 and HTTP/1.1 alternating, that
   go on during and after it (each sha256-checked both ways, see :class:`tests.support.traffic.Traffic`);
   and no agent tunnel is lost or replaced.

A case is data: a name, the port it hits and an async function that performs the attack (raw frames:
:class:`tests.support.h2_attacker.Attacker`; bytes and handshakes:
:mod:`tests.support.hostile_connections`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import trio

from clusterproxy_sdk import open_tunnel
from tests.support.clients import client_context
from tests.support.pki import PkiFiles
from tests.support.procs import Hub
from tests.support.rss import RssWatch
from tests.support.targets import Target, pattern_digest, serve_digest, serve_echo
from tests.support.traffic import Traffic, serve_sized
from tests.support.waiting import wait_until

CLUSTER = "cluster1"  # the hub must have an agent of it
BESIDE_DOWN = 8 << 20  # the long stream beside the attack: bytes from the target
BESIDE_UP = 1 << 20  # and toward it
FRESH_AFTER = 2  # fresh transfers that must complete after the attack started
# how long a wait for the server's reaction may last: load only delays it, so only none fails
HANG_GUARD = 30.0
LONG_STREAM_DEADLINE = 60.0  # seconds for the whole long stream, attack included
TRICKLE = 1 << 10  # the long stream's upload during the attack: this many bytes ...
TRICKLE_INTERVAL = 0.1  # ... every this many seconds
WARM_UP = 4  # fresh transfers before the baseline: TLS, the SDK and allocator pools warmed


@dataclass(frozen=True)
class AttackContext:
    hub: Hub
    pki: PkiFiles
    port: int  # the port the case hits
    target: Target  # an echo service reachable in CLUSTER: the CONNECTs an attack opens go here

    def server_events(self, event: str, **match: object) -> list[dict[str, object]]:
        """The server's log records of ``event`` whose fields include ``match``."""
        assert self.hub.server is not None
        records = self.hub.server.events()
        return [
            r for r in records if r.get("event") == event and all(r.get(k) == v for k, v in match.items())
        ]

    async def server_event(self, event: str, **match: object) -> dict[str, object]:
        """The server's log record of ``event`` with ``match`` (say the attacker's ``peer``), waited for
        briefly: the server writes it before it answers, so it is there by the time the answer is."""
        assert self.hub.server is not None
        return await self.hub.server.wait_event(event, timeout=5, **match)


Attack = Callable[[AttackContext], Awaitable[str]]


@dataclass(frozen=True)
class BadInput:
    """One entry of the battery."""

    name: str
    port: Literal["client", "agent"]
    # Returns how the server ended the hostile connection ("closed", "refused: ...", "GOAWAY ...") once
    # it did, never before (one that holds a connection open waits for the server to cut it); raises
    # when the server's answer is wrong.
    attack: Attack
    bound: float = 5.0  # seconds the server should take to answer or close it (printed, not asserted)
    rss_margin_kib: int = 16 << 10  # the server's RSS after the case: at most this above the baseline
    rss_timeout: float = 10.0  # seconds for the RSS to come back


@dataclass
class CaseResult:
    name: str
    outcome: str
    seconds: float  # the attack, until answered or closed
    bound: float  # the case's
    baseline_kib: int
    peak_kib: int
    after_kib: int
    fresh_transfers: int  # completed beside and after the attack
    beside_bytes: int  # moved by the long stream

    def line(self) -> str:
        return (
            f"{self.name}: {self.outcome} in {self.seconds:.3f}s (bound {self.bound:g}s); server RSS KiB baseline {self.baseline_kib}, "
            f"peak {self.peak_kib}, after {self.after_kib}; {self.fresh_transfers} fresh transfers and "
            f"{self.beside_bytes} bytes on the long stream beside, all sha256-checked"
        )


async def _tunnels(hub: Hub) -> set[tuple[str, str, str]]:
    """The live agent tunnels as (cluster, agent id, peer address): a reconnection changes the peer."""
    agents = await trio.to_thread.run_sync(hub.agents_connected)
    return {(a["cluster"], a["agent_id"], a["peer"]) for a in agents}


class LongStream:
    """An SDK stream to a digest target, mid-transfer for the whole attack: it reads half of the
    download before the attack ends, then waits for the end of the attack to read the rest. Its upload
    goes on slowly meanwhile (TRICKLE bytes every TRICKLE_INTERVAL): a slow client, not a stalled one,
    which the server's stall timeout (shorter than some attacks in the battery) must leave alone."""

    def __init__(self, hub: Hub, pki: PkiFiles, target: Target, token: str) -> None:
        self.hub, self.pki, self.target, self.token = hub, pki, target, token
        self.upload = random.Random(token).randbytes(BESIDE_UP)
        self.received = 0
        self.flowing = trio.Event()
        self.attack_over = trio.Event()

    async def run(self) -> None:
        address = f"127.0.0.1:{self.hub.client_port}"
        context = client_context(self.pki, alpn=["h2"])
        digest = hashlib.sha256()
        with trio.fail_after(LONG_STREAM_DEADLINE):
            async with open_tunnel(address, context, server_hostname="localhost") as tunnel:
                stream = await tunnel.connect(CLUSTER, self.target.host, self.target.port)
                async with stream:
                    await stream.send_all(f"{self.token} {BESIDE_DOWN}\n".encode())

                    async def upload() -> None:
                        sent = BESIDE_UP // 2
                        await stream.send_all(self.upload[:sent])
                        while not self.attack_over.is_set() and sent < BESIDE_UP - TRICKLE:
                            await stream.send_all(self.upload[sent : sent + TRICKLE])
                            sent += TRICKLE
                            with trio.move_on_after(TRICKLE_INTERVAL):
                                await self.attack_over.wait()
                        await stream.send_all(self.upload[sent:])
                        await stream.send_eof()

                    async def download() -> None:
                        while chunk := await stream.receive_some(64 << 10):
                            digest.update(chunk)
                            self.received += len(chunk)
                            self.flowing.set()
                            if self.received >= BESIDE_DOWN // 2:
                                await self.attack_over.wait()

                    async with trio.open_nursery() as both:
                        both.start_soon(upload)
                        both.start_soon(download)
        if digest.hexdigest() != pattern_digest(self.token, BESIDE_DOWN):
            raise AssertionError(f"the long stream's download is corrupt ({self.received} bytes)")
        if self.target.received.get(self.token) != hashlib.sha256(self.upload).hexdigest():
            raise AssertionError("the long stream's upload arrived corrupt at the target")


async def run_case(case: BadInput, hub: Hub, pki: PkiFiles, nursery: trio.Nursery) -> CaseResult:
    """Run one case against ``hub`` (a server with an agent of CLUSTER); AssertionError on any check."""
    assert hub.server is not None
    digest_target = await serve_digest(nursery)
    sized = await serve_sized(nursery)
    echo = await serve_echo(nursery)
    h2, h1 = client_context(pki, alpn=["h2"]), client_context(pki, alpn=["http/1.1"])
    traffic = Traffic(hub.client_port, CLUSTER, sized, sized, h2=lambda: h2, h1=lambda: h1)
    for i in range(WARM_UP):
        await traffic.transfer("h2" if i % 2 == 0 else "http1")
    tunnels_before = await _tunnels(hub)
    watch = RssWatch.from_now(hub.server.pid)
    port = hub.client_port if case.port == "client" else hub.agent_port
    context = AttackContext(hub, pki, port, echo)
    long_stream = LongStream(hub, pki, digest_target, f"beside-{case.name}")
    stop = trio.Event()

    async with trio.open_nursery() as sampling:
        sampling.start_soon(watch.sample)
        async with trio.open_nursery() as beside:
            beside.start_soon(long_stream.run)
            beside.start_soon(traffic.loop, stop)
            with trio.fail_after(30):
                await long_stream.flowing.wait()
            fresh_before = sum(traffic.ok.values())
            started = trio.current_time()
            try:
                with trio.fail_after(case.bound + HANG_GUARD):
                    outcome = await case.attack(context)
            except trio.TooSlowError:
                raise AssertionError(
                    f"{case.name}: not answered or closed within {case.bound + HANG_GUARD:g}s"
                ) from None
            seconds = trio.current_time() - started
            long_stream.attack_over.set()
            await wait_until(
                lambda: sum(traffic.ok.values()) >= fresh_before + FRESH_AFTER or traffic.failures,
                timeout=30,
                what=f"{FRESH_AFTER} fresh transfers after the attack",
            )
            stop.set()  # the loop ends after its transfers in flight, the long stream by itself
        sampling.cancel_scope.cancel()
    assert not traffic.failures, f"{case.name}: traffic beside failed: {traffic.failures[:3]}"
    assert long_stream.received == BESIDE_DOWN
    assert hub.server.popen.poll() is None, f"{case.name}: the server died:\n{hub.server.tail()}"
    assert await _tunnels(hub) == tunnels_before, f"{case.name}: an agent tunnel was lost or replaced"
    after = await watch.wait_within(case.rss_margin_kib, timeout=case.rss_timeout)
    return CaseResult(
        name=case.name,
        outcome=outcome,
        seconds=seconds,
        bound=case.bound,
        baseline_kib=watch.baseline_kib,
        peak_kib=watch.peak_kib,
        after_kib=after,
        fresh_transfers=sum(traffic.ok.values()) - fresh_before,
        beside_bytes=long_stream.received + BESIDE_UP,
    )
