"""Several proxy-server replicas behind a real haproxy, two clusters with two agents each (real
processes on loopback; ``tests/support/haproxy.py``).

- Every agent holds exactly one tunnel to each replica within 5 s, seen from both ends (the agents'
  ``/api/v1/servers``, the servers' ``/api/v1/agents``), and a 16 MiB stream each way to each cluster
  through each replica is sha256-checked.
- SIGKILL of one replica: the streams through it fail loudly (never a clean end), new streams through
  haproxy keep succeeding through the others; the time from the kill to the first new stream that
  succeeded is measured; the agents take the replica's successor back.
- Scale 1 -> 3 -> 2, as a Deployment whose count is in the pod template does it (the count changes
  by replacing replicas): the agents converge to one tunnel per live replica each time, and once the
  count says 2 they stop dialing.
- An explicit list of replica addresses instead of a load balancer.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import re
from pathlib import Path

import pytest
import trio

from clusterproxy_sdk import TLSFiles, open_shared_tunnel, open_tunnel
from tests.support import require
from tests.support.haproxy import (
    HAPROXY_MISSING,
    EchoStreams,
    Fleet,
    allocate_places,
    make_ha_pki,
    strict_h1_connect,
)
from tests.support.pki import PkiFiles
from tests.support.procs import Process, http_get
from tests.support.proxies import binary
from tests.support.targets import Target, pattern_digest, serve_digest, serve_source
from tests.support.traffic import serve_bye_echo
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow
MiB = 1 << 20
AGENTS = [("cluster1", "agent-a"), ("cluster1", "agent-b"), ("cluster2", "agent-a"), ("cluster2", "agent-b")]
AGENT_ARGS = ("--allow", "127.0.0.0/8")
SERVER_ARGS = ("--drain-timeout", "3s", "--dial-timeout", "10s")


@pytest.fixture(scope="module")
def ha_pki(tmp_path_factory: pytest.TempPathFactory) -> PkiFiles:
    return make_ha_pki(tmp_path_factory.mktemp("ha-pki"))


@pytest.fixture
async def fleet(ha_pki: PkiFiles, tmp_path: Path, request: pytest.FixtureRequest):
    """Six places behind haproxy; ``@pytest.mark.parametrize("agent_balance", ...)`` picks how haproxy
    balances the agents' connections (least connections unless said)."""
    require(binary("haproxy") is not None, HAPROXY_MISSING)
    balance = getattr(request, "param", None) or "leastconn"
    fleet = Fleet(ha_pki, tmp_path, allocate_places(6), agent_balance=balance)
    try:
        await fleet.start()
        yield fleet
    finally:
        fleet.stop()


def client_files(pki: PkiFiles) -> TLSFiles:
    return TLSFiles(pki.ca, pki.client.cert, pki.client.key)


async def start_agents(fleet: Fleet) -> float:
    """Start the four agents; seconds from starting their processes until every one holds every
    replica, seen from both ends (Python's start-up and the polling included)."""
    started = trio.current_time()
    for cluster, agent_id in AGENTS:
        fleet.start_agent(cluster, agent_id, *AGENT_ARGS)
    await fleet.wait_converged(timeout=30)
    return trio.current_time() - started


def seconds_to_hold(agent: Process, replicas: int) -> float:
    """From the agent's first log line (``agent_starting``, its configuration read) to the moment it
    had been told ``replicas`` distinct server ids, from its own log's timestamps."""
    start, seen = None, set()
    for record in agent.events():
        stamp = dt.datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()
        if record["event"] == "agent_starting":
            start = stamp
        elif record["event"] == "server_identified":
            seen.add(record["server_id"])
            if len(seen) == replicas:
                assert start is not None
                return stamp - start
    raise AssertionError(f"{agent.name} was told {sorted(seen)} only")


async def digest_transfer(
    port: int, pki: PkiFiles, cluster: str, target: Target, token: str, size: int
) -> float:
    """``size`` bytes each way through the client port ``port`` to ``cluster``'s digest target, both
    checked by sha256; returns when the stream opened (trio clock)."""
    upload = hashlib.sha256()
    async with open_tunnel(f"127.0.0.1:{port}", client_files(pki), server_hostname="localhost") as tunnel:
        stream = await tunnel.connect(cluster, target.host, target.port)
        opened = trio.current_time()
        got = hashlib.sha256()

        async def send() -> None:
            await stream.send_all(f"{token} {size}\n".encode())
            block = bytes(range(256)) * 1024
            for _ in range(size // len(block)):
                upload.update(block)
                await stream.send_all(block)
            await stream.send_eof()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            while data := await stream.receive_some(1 << 18):
                got.update(data)
    assert got.hexdigest() == pattern_digest(token, size), f"{token}: download corrupted"
    assert target.received[token] == upload.hexdigest(), f"{token}: upload corrupted"
    return opened


async def test_every_agent_holds_every_replica_and_each_carries_16_mib(
    fleet: Fleet, ha_pki: PkiFiles, nursery: trio.Nursery
) -> None:
    for i in range(3):
        await fleet.start_replica(f"replica-{i}", 3, *SERVER_ARGS)
    took = await start_agents(fleet)
    per_agent = {key: seconds_to_hold(agent, 3) for key, agent in fleet.agents.items()}
    print(
        f"\nfour agents each hold a tunnel to each of 3 replicas {took:.2f}s after their processes "
        f"started (both ends checked); by the agents' logs, from start to the third replica: "
        + ", ".join(f"{key} {value:.2f}s" for key, value in per_agent.items())
    )
    assert max(per_agent.values()) < 5, per_agent

    mesh = await fleet.mesh()
    for key, view in mesh["agents"].items():
        assert view["expected_replicas"] == 3, (key, view)
        assert len(view["tunnels"]) == 3, (key, view)  # no duplicate left open
    for server_id, agents in mesh["servers"].items():
        assert sorted((a["cluster"], a["agent_id"]) for a in agents) == sorted(AGENTS)
        assert {a["server_id"] for a in agents} == {server_id}

    # The agents' /metrics say the same.
    key = "cluster1/agent-a"
    status, body = await trio.to_thread.run_sync(http_get, f"http://{fleet.agent_admin[key]}/metrics")
    assert status == 200
    text = body.decode()
    assert "cluster_proxy_agent_replicas_held 3.0" in text
    assert "cluster_proxy_agent_replicas_expected 3.0" in text
    for server_id in fleet.replicas:
        assert re.search(rf'cluster_proxy_agent_server_tunnel\{{[^}}]*server_id="{server_id}"', text), text

    targets = {cluster: await serve_digest(nursery) for cluster in ("cluster1", "cluster2")}
    started = trio.current_time()
    for server_id, replica in fleet.replicas.items():
        for cluster, target in targets.items():
            await digest_transfer(
                replica.place.client, ha_pki, cluster, target, f"{server_id}-{cluster}", 16 * MiB
            )
    took = trio.current_time() - started
    print(f"6 x 16 MiB each way (2 clusters x 3 replicas), sha256 checked: {took:.2f}s")
    # Each replica's streams went through its own tunnels (its metrics count them).
    for server_id, replica in fleet.replicas.items():
        status, body = await trio.to_thread.run_sync(
            http_get, f"http://127.0.0.1:{replica.place.admin}/metrics"
        )
        found = re.search(rb'cluster_proxy_server_streams_total\{frontend="h2",status="200"\} (\S+)', body)
        assert found and float(found[1]) >= 2, (server_id, body[:2000])


async def read_until_end(stream: trio.abc.ReceiveStream) -> str:
    """How a stream ends: 'clean end' or 'broken: ...'."""
    try:
        while await stream.receive_some(1 << 18):
            pass
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        return f"broken: {type(exc).__name__}: {str(exc) or repr(exc.__cause__)}"
    return "clean end"


async def test_sigkill_of_a_replica_fails_its_streams_loudly_and_new_ones_go_to_the_others(
    fleet: Fleet, ha_pki: PkiFiles, nursery: trio.Nursery
) -> None:
    for i in range(3):
        await fleet.start_replica(f"replica-{i}", 3, *SERVER_ARGS)
    await start_agents(fleet)
    source = await serve_source(nursery)
    digest = await serve_digest(nursery)
    echo = await serve_bye_echo(nursery)
    # Six echo streams through haproxy, each on its own connection: round robin puts some on the victim.
    through = EchoStreams(fleet.haproxy.client_port, ha_pki, echo.address)
    victim = fleet.replicas["replica-1"]
    outcomes: dict[str, str] = {}
    attempts: list[tuple[float, float, str]] = []  # (started, opened or ended, outcome) of new streams
    stop = trio.Event()

    async def new_streams_through_haproxy() -> None:
        """One new SDK connection and stream after another through haproxy, 64 KiB each way."""
        n = 0
        while not stop.is_set():
            n += 1
            begun = trio.current_time()
            try:
                with trio.fail_after(10):
                    opened = await digest_transfer(
                        fleet.haproxy.client_port, ha_pki, "cluster1", digest, f"probe-{n}", 64 << 10
                    )
                attempts.append((begun, opened, "ok"))
            except Exception as exc:
                attempts.append((begun, trio.current_time(), f"{type(exc).__name__}: {exc}"))
            await trio.sleep(0.005)

    async with open_shared_tunnel(
        f"127.0.0.1:{victim.place.client}", client_files(ha_pki), server_hostname="localhost"
    ) as shared:
        victims = {
            f"h2 {cluster}": await shared.connect(cluster, source.host, source.port)
            for cluster in ("cluster1", "cluster2")
        }
        for cluster in ("cluster1", "cluster2"):
            victims[f"http1 {cluster}"] = await strict_h1_connect(
                victim.place.client, ha_pki, cluster, source.address
            )
        for stream in victims.values():
            assert await stream.receive_some(1024)  # flowing

        async def watch(name: str, stream: trio.abc.ReceiveStream) -> None:
            outcomes[name] = await read_until_end(stream)

        async with trio.open_nursery() as inner:
            for name, stream in victims.items():
                inner.start_soon(watch, name, stream)
            inner.start_soon(new_streams_through_haproxy)
            for n, frontend in itertools.product(range(3), ("http1", "h2")):
                inner.start_soon(through.endless, frontend, "cluster1", stop, f"#{n}")
            await wait_until(lambda: sum(a[2] == "ok" for a in attempts) >= 5, timeout=20, what="probes")
            await wait_until(lambda: through.endless_exchanges >= 12, timeout=20, what="echo streams")
            killed_at = trio.current_time()
            fleet.sigkill("replica-1")
            await wait_until(
                lambda: len(outcomes) == len(victims), timeout=5, what="the victims' streams to end"
            )
            failed_at = trio.current_time() - killed_at
            await wait_until(
                lambda: sum(a[0] > killed_at and a[2] == "ok" for a in attempts) >= 20,
                timeout=30,
                what="new streams after the kill",
            )
            stop.set()
    assert all(o.startswith("broken") for o in outcomes.values()), outcomes
    for name, outcome in outcomes.items():
        print(f"  direct to the victim: {name}: {outcome}")
    after = [a for a in attempts if a[0] > killed_at]
    first_ok = min(a[1] for a in after if a[2] == "ok") - killed_at
    failed_after = [a for a in after if a[2] != "ok"]
    in_flight = [a for a in attempts if a[0] <= killed_at < a[1] and a[2] != "ok"]
    print(
        f"\nSIGKILL of a replica: its {len(victims)} streams failed loudly within {failed_at:.3f}s; "
        f"the first new stream through haproxy opened {first_ok:.3f}s after the kill (and carried "
        "64 KiB each way, sha256 checked); "
        f"{len(after)} new streams after it, {len(failed_after)} failed; "
        f"{len(in_flight)} in flight at the kill failed"
    )
    assert not failed_after, failed_after[:5]
    assert first_ok < 2
    # Through haproxy: the streams that were on the victim broke (then reopened elsewhere), loudly and
    # at the kill; none ended cleanly; the others went on to a clean BYE at the end.
    for when, which, how in through.cuts:
        print(f"  through haproxy, cut {when - killed_at:.3f}s after the kill: {which}: {how}")
    assert through.cuts and all(0 <= when - killed_at < 2 for when, _, _ in through.cuts), through.cuts
    assert not through.clean_ends and not through.failures, (through.clean_ends, through.failures)

    # The agents take a successor back into the mesh.
    await fleet.haproxy.wait_state(victim.place.name, "DOWN")
    await fleet.start_replica("replica-1b", 3, *SERVER_ARGS)
    took = await fleet.wait_converged(timeout=20)
    print(f"successor held by every agent {took:.2f}s after it started")


async def replace(fleet: Fleet, server_id: str, successor: str, count: int) -> None:
    """A rolling step: SIGTERM ``server_id`` and start ``successor`` telling ``count``."""
    gone = fleet.sigterm(server_id)
    await fleet.start_replica(successor, count, *SERVER_ARGS)
    assert await gone.process.wait_exit(15) == 0, gone.process.tail()


def duplicate_dials(metrics_text: str) -> float:
    found = re.search(r"^cluster_proxy_agent_duplicate_dials_total (\S+)$", metrics_text, re.M)
    assert found, metrics_text
    return float(found[1])


@pytest.mark.parametrize("fleet", ["roundrobin"], indirect=True)
async def test_scale_1_to_3_to_2_converges_to_one_tunnel_per_live_replica(fleet: Fleet) -> None:
    """With haproxy balancing the agents round robin (as a Service without session affinity spreads
    them): the agents find each new replica by dialing again, at a bounded cost."""
    await fleet.start_replica("r1", 1, *SERVER_ARGS)
    await start_agents(fleet)
    assert all(v["expected_replicas"] == 1 for v in (await fleet.mesh())["agents"].values())

    # 1 -> 3: two new replicas counting 3, and the first replaced by one counting 3.
    began = trio.current_time()
    await fleet.start_replica("r2", 3, *SERVER_ARGS)
    await fleet.start_replica("r3", 3, *SERVER_ARGS)
    await replace(fleet, "r1", "r1b", 3)
    took = await fleet.wait_converged(timeout=30)
    print(f"\nscale 1 -> 3: converged {trio.current_time() - began:.2f}s after the first new replica")
    assert all(v["expected_replicas"] == 3 for v in (await fleet.mesh())["agents"].values())
    del took

    # 3 -> 2: one replica leaves; the others are replaced by replicas counting 2.
    began = trio.current_time()
    gone = fleet.sigterm("r3")
    assert await gone.process.wait_exit(15) == 0
    await fleet.wait_converged(timeout=30)  # one tunnel per live replica even while some still count 3
    await replace(fleet, "r2", "r2b", 2)
    await replace(fleet, "r1b", "r1c", 2)
    await fleet.wait_converged(timeout=30)
    print(f"scale 3 -> 2: converged {trio.current_time() - began:.2f}s after the replica left")
    mesh = await fleet.mesh()
    assert all(v["expected_replicas"] == 2 for v in mesh["agents"].values()), mesh

    # With the count met, the agents dial no more: their duplicate-dial counters stay still.
    async def counters() -> dict[str, float]:
        out = {}
        for key in fleet.agents:
            status, body = await trio.to_thread.run_sync(http_get, f"http://{fleet.agent_admin[key]}/metrics")
            assert status == 200
            out[key] = duplicate_dials(body.decode())
        return out

    before = await counters()
    quiet_since = trio.current_time()
    await wait_until(lambda: trio.current_time() - quiet_since > 3, timeout=10, interval=0.5, what="3 s")
    assert await counters() == before
    assert fleet.converged(await fleet.mesh())


async def test_an_explicit_list_of_replica_addresses(
    fleet: Fleet, ha_pki: PkiFiles, nursery: trio.Nursery
) -> None:
    replicas = [await fleet.start_replica(f"direct-{i}", 3, *SERVER_ARGS) for i in range(3)]
    addresses = ",".join(f"127.0.0.1:{r.place.agent}" for r in replicas)
    started = trio.current_time()
    for cluster, agent_id in AGENTS[:2]:
        fleet.start_agent(cluster, agent_id, *AGENT_ARGS, server=addresses)
    await fleet.wait_converged(timeout=20)
    print(
        f"\nexplicit list: both agents hold all 3 replicas {trio.current_time() - started:.2f}s after start"
    )
    target = await serve_digest(nursery)
    for replica in replicas:
        await digest_transfer(replica.place.client, ha_pki, "cluster1", target, replica.server_id, MiB)

    # A restarted replica comes back at its address and is taken again.
    await replace_in_place(fleet, "direct-1")
    await fleet.wait_converged(timeout=20)


async def replace_in_place(fleet: Fleet, server_id: str) -> None:
    """Stop a replica and start its successor on the same ports (what an explicit list needs)."""
    replica = fleet.sigterm(server_id)
    assert await replica.process.wait_exit(15) == 0
    await fleet.start_replica(f"{server_id}b", 3, *SERVER_ARGS, place=replica.place)
