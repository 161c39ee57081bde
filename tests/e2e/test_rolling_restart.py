"""A rolling restart of three proxy-server replicas behind a real haproxy, one at a time, under
continuous traffic to two clusters with two agents each (real processes on loopback).

Each step is what a Deployment's rolling update does with ``maxUnavailable: 1``: SIGTERM to a replica
and its successor started at once in another place (a new pod, a new address). Throughout, through
haproxy:

- new streams every few milliseconds: each on a new TLS connection, alternating HTTP/1.1 ``CONNECT``
  and the SDK over HTTP/2 (``tests.support.traffic.Traffic``), and on one shared SDK connection
  (``open_shared_tunnel``), every transfer sha256-checked both ways;
- long-lived streams: one-second sessions (a message echoed every 100 ms, then a clean close), which
  must all complete; and endless ones, which the drain of their replica cuts at ``--drain-timeout``.

Asserted: 0 failed new streams and sessions; every endless stream that ended did so loudly (a
reset, never a clean end) and at its replica's drain timeout, never earlier; after each step every agent
holds exactly one tunnel to each live replica.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from clusterproxy_protocol import tls
from clusterproxy_sdk import TLSFiles, open_shared_tunnel
from tests.support import require
from tests.support.haproxy import HAPROXY_MISSING, EchoStreams, Fleet, Replica, allocate_places, make_ha_pki
from tests.support.pki import PkiFiles
from tests.support.proxies import binary
from tests.support.traffic import BYE, Traffic, serve_bye_echo, serve_sized
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow
DRAIN_TIMEOUT = 3.0
SERVER_ARGS = ("--drain-timeout", f"{DRAIN_TIMEOUT:g}s", "--dial-timeout", "20s")
AGENTS = [("cluster1", "agent-a"), ("cluster1", "agent-b"), ("cluster2", "agent-a"), ("cluster2", "agent-b")]
CLUSTERS = ("cluster1", "cluster2")
SESSION = 1.0  # seconds a session lasts: well within the drain timeout
CUT_LATE_BY = 2.0  # an endless stream's cut may come this long after its replica's drain timeout


@pytest.fixture
async def fleet(ha_pki: PkiFiles, tmp_path: Path):
    require(binary("haproxy") is not None, HAPROXY_MISSING)
    fleet = Fleet(ha_pki, tmp_path, allocate_places(6))
    try:
        await fleet.start()
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def ha_pki(tmp_path_factory: pytest.TempPathFactory) -> PkiFiles:
    return make_ha_pki(tmp_path_factory.mktemp("ha-pki"))


@dataclass
class SharedStreams:
    """New streams every few ms on one shared SDK connection through haproxy (it moves to another
    replica when its replica drains)."""

    port: int
    pki: PkiFiles
    echo_address: str
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    connections: int = 0

    async def run(self, stop: trio.Event) -> None:
        host, port = self.echo_address.rsplit(":", 1)
        files = TLSFiles(self.pki.ca, self.pki.client.cert, self.pki.client.key)
        async with open_shared_tunnel(f"127.0.0.1:{self.port}", files, server_hostname="localhost") as shared:

            async def worker(i: int) -> None:
                cluster = CLUSTERS[i % 2]
                rng = random.Random(f"shared-{i}")
                while not stop.is_set():
                    payload = rng.randbytes(rng.randrange(1, 32 << 10))
                    try:
                        with trio.fail_after(20):
                            stream = await shared.connect(cluster, host, int(port))
                            async with stream:
                                await stream.send_all(payload + BYE)
                                echoed = b""
                                while chunk := await stream.receive_some():
                                    echoed += chunk
                        if echoed != payload + BYE:
                            raise AssertionError(f"echoed {len(echoed)} bytes of {len(payload) + len(BYE)}")
                        self.ok += 1
                    except Exception as exc:
                        self.failures.append(f"shared {cluster}: {type(exc).__name__}: {exc}")
                    await trio.sleep(0.005)

            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(worker, i)
            self.connections = shared.connections_made


async def restart_step(fleet: Fleet, server_id: str, successor: str) -> dict[str, float]:
    """SIGTERM ``server_id`` and start ``successor`` at once in a free place; returns the step's times
    (seconds after the SIGTERM)."""
    old = fleet.sigterm(server_id)
    assert old.sigterm_at is not None
    await fleet.start_replica(successor, 3, *SERVER_ARGS)
    times = {"successor_up": trio.current_time() - old.sigterm_at}
    await fleet.wait_converged(timeout=20)
    times["mesh"] = trio.current_time() - old.sigterm_at
    code = await old.process.wait_exit(DRAIN_TIMEOUT + 10)
    times["old_exited"] = trio.current_time() - old.sigterm_at
    assert code == 0, old.process.tail()
    return times


def cut_by_a_drain(when: float, drained: list[Replica]) -> float | None:
    """How long after a drained replica's drain timeout ``when`` is (the closest such replica), or None
    when no replica's drain explains it."""
    delays = [when - (r.sigterm_at + DRAIN_TIMEOUT) for r in drained if r.sigterm_at is not None]
    fitting = [d for d in delays if -0.05 <= d <= CUT_LATE_BY]
    return min(fitting) if fitting else None


async def test_rolling_restart_under_traffic_fails_no_new_stream(
    fleet: Fleet, ha_pki: PkiFiles, nursery: trio.Nursery
) -> None:
    for i in range(3):
        await fleet.start_replica(f"gen0-{i}", 3, *SERVER_ARGS)
    for cluster, agent_id in AGENTS:
        fleet.start_agent(cluster, agent_id, "--allow", "127.0.0.0/8")
    await fleet.wait_converged(timeout=30)
    assert fleet.haproxy is not None
    port = fleet.haproxy.client_port

    sized, echo = await serve_sized(nursery), await serve_bye_echo(nursery)

    def context(alpn: list[str]):
        return lambda: tls.client_context(ha_pki.client.cert, ha_pki.client.key, ha_pki.ca, alpn=alpn)

    fresh = [
        Traffic(
            port, cluster, sized, echo, context(["h2"]), context(["http/1.1"]), up=16 << 10, down=16 << 10
        )
        for cluster in CLUSTERS
    ]
    shared = SharedStreams(port, ha_pki, echo.address)
    long_lived = EchoStreams(port, ha_pki, echo.address, session_seconds=SESSION)
    stop = trio.Event()
    steps: list[dict[str, float]] = []
    async with trio.open_nursery() as traffic:
        for flow in fresh:
            traffic.start_soon(flow.loop, stop)
        traffic.start_soon(shared.run, stop)
        for frontend, cluster in itertools.product(("http1", "h2"), CLUSTERS):
            traffic.start_soon(long_lived.sessions, frontend, cluster, stop)
            traffic.start_soon(long_lived.endless, frontend, cluster, stop)

        def moved() -> int:
            return sum(sum(f.ok.values()) for f in fresh) + shared.ok

        await wait_until(lambda: moved() >= 50, timeout=30, what="traffic before the first step")
        began = trio.current_time()
        for i in range(3):
            steps.append(await restart_step(fleet, f"gen0-{i}", f"gen1-{i}"))
            wanted = moved() + 30
            await wait_until(lambda: moved() >= wanted, timeout=30, what="traffic after the step")  # noqa: B023
        took = trio.current_time() - began
        stop.set()

    drained = [r for r in fleet.gone if r.sigterm_at is not None]
    fresh_ok = {frontend: sum(f.ok[frontend] for f in fresh) for frontend in ("h2", "http1")}
    fresh_failures = [failure for f in fresh for failure in f.failures]
    print(
        f"\nrolling restart of 3 replicas in {took:.1f}s under traffic: new streams on new connections "
        f"{fresh_ok} ({sum(f.bytes_moved for f in fresh) >> 20} MiB), on one shared SDK connection "
        f"{shared.ok} (it dialed {shared.connections} connections), one-second sessions "
        f"{long_lived.sessions_ok}, endless streams' exchanges {long_lived.endless_exchanges}; failed: "
        f"{len(fresh_failures)} + {len(shared.failures)} + {len(long_lived.failures)}; endless streams cut "
        f"by a drain timeout: {len(long_lived.cuts)}"
    )
    for n, step in enumerate(steps):
        print(
            f"  step {n}, seconds after the SIGTERM: successor up (haproxy: UP) {step['successor_up']:.2f}, "
            f"every agent holds the new set {step['mesh']:.2f}, old replica exited {step['old_exited']:.2f}"
        )
    for when, which, how in long_lived.cuts:
        late = cut_by_a_drain(when, drained)
        said = f"{late:.2f}s after a drain timeout" if late is not None else "UNEXPLAINED"
        print(f"  cut: {which} {said}: {how}")
    assert not fresh_failures, fresh_failures[:10]
    assert not shared.failures, shared.failures[:10]
    assert not long_lived.failures, long_lived.failures[:10]
    assert not long_lived.clean_ends, long_lived.clean_ends
    assert all(cut_by_a_drain(when, drained) is not None for when, _, _ in long_lived.cuts), long_lived.cuts
    assert long_lived.cuts, "no endless stream was on a drained replica: the cut path was not exercised"
    assert min(fresh_ok.values()) >= 20 and shared.ok >= 20 and long_lived.sessions_ok >= 8
    # Each replica that had streams at its drain timeout said so.
    timeouts = [
        r
        for r in drained
        if r.process.events() and any(e["event"] == "drain_timeout" for e in r.process.events())
    ]
    assert timeouts, "no replica logged drain_timeout"
