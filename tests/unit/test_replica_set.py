"""The agent's replica set (``clusterproxy_agent.replicas``): the slot plan as a pure function, and the
replica set itself against fake proxy-server replicas behind a fake load balancer (in-memory streams,
the mock clock), each replica a real tunnel peer (``open_mux`` as the opener, ``GET /v1/info`` with its
id and count, the agent's ``409`` honoured by closing)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from clusterproxy_agent.agent import Agent, AgentConfig, ServerIdentity, TunnelRecord
from clusterproxy_agent.egress import EgressPolicy
from clusterproxy_agent.main import parse_settings
from clusterproxy_agent.replicas import (
    MAX_REPLICAS,
    Plan,
    ReplicaSet,
    SlotState,
    plan,
    slot_state,
    wanted_replicas,
)
from clusterproxy_agent.tunnel import TunnelOptions, TunnelRunner
from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import Mux, open_mux
from clusterproxy_protocol.pki import DevCA
from clusterproxy_protocol.wire import SERVER_COUNT_HEADER, SERVER_ID_HEADER
from tests.support.waiting import wait_until

D, H, R = SlotState.DIALING, SlotState.HOLDING, SlotState.DRAINING


# --- the plan -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("states", "wanted", "expected"),
    [
        ([], 1, Plan(1, ())),  # the first slot
        ([H], 3, Plan(2, ())),  # told 3: two more
        ([H, H, H], 3, Plan(0, ())),  # all held: nothing dials
        ([H, R, H], 3, Plan(1, ())),  # a replica drains: one slot for its successor
        ([H, R, H, D], 3, Plan(0, ())),  # ... already looking
        ([H, H, H, D], 3, Plan(0, (3,))),  # the drained tunnel ended: its slot, now dialing, goes
        ([H, D, H, D], 2, Plan(0, (3, 1))),  # count down: dialing slots stop, last started first
        ([H, H, H], 2, Plan(0, ())),  # count down, all held: a live tunnel is never closed for it
        ([D, D, D], 3, Plan(0, ())),  # all lost: each slot dials again by itself
    ],
)
def test_plan(states: list[SlotState], wanted: int, expected: Plan) -> None:
    assert plan(states, wanted) == expected


@dataclass
class _FakeMux:
    dead: bool = False
    peer_draining: bool = False


def _record(count: int | None, *, draining: bool = False, duplicate: bool = False) -> TunnelRecord:
    record = TunnelRecord(_FakeMux(peer_draining=draining), "hub:8091", 0.0)  # type: ignore[arg-type]
    record.identity = ServerIdentity("s", count)
    record.duplicate = duplicate
    return record


def test_wanted_is_the_largest_count_a_held_replica_tells() -> None:
    assert wanted_replicas([], 1) == 1
    assert wanted_replicas([_record(3), _record(2)], 1) == 3  # a rollout changing the count: the larger
    assert (
        wanted_replicas([_record(3, draining=True), _record(2)], 1) == 2
    )  # a leaving replica's count does not
    assert wanted_replicas([_record(5, duplicate=True), _record(2)], 1) == 2
    assert wanted_replicas([_record(None)], 4) == 4  # an older server tells no count: the last one told
    assert wanted_replicas([], 3) == 3  # nothing held: the last count told
    assert wanted_replicas([_record(10_000)], 1) == MAX_REPLICAS  # a server cannot make us dial forever


# --- the replica set against fake replicas ---------------------------------------------------------------


@dataclass
class FakeReplica:
    server_id: str
    count: int
    tunnels: set[Mux] = field(default_factory=set)
    refused: int = 0  # tunnels the agent answered 409 (it held this replica already)
    draining: bool = False

    async def serve(self, stream: trio.abc.Stream) -> None:
        async with open_mux(stream, Role.OPENER) as mux:
            response = await mux.request(
                "GET",
                "/v1/info",
                [(SERVER_ID_HEADER, self.server_id), (SERVER_COUNT_HEADER, str(self.count))],
            )
            if response.status == 409:
                self.refused += 1
                mux.close("the agent holds this replica already")
                return
            assert response.status == 200
            self.tunnels.add(mux)
            if self.draining:
                mux.drain()
            try:
                await mux.closed.wait()
            finally:
                self.tunnels.discard(mux)

    def drain(self) -> None:
        self.draining = True
        for mux in self.tunnels:
            mux.drain()

    def stop(self) -> None:
        for mux in list(self.tunnels):
            mux.close("replica stopped")


@dataclass
class FakeBalancer:
    """Spreads dials over the live, non-draining replicas (round robin, as haproxy or a Service might)."""

    nursery: trio.Nursery
    replicas: dict[str, FakeReplica] = field(default_factory=dict)
    dials: int = 0
    _turn: itertools.count = field(default_factory=itertools.count)

    def add(self, server_id: str, count: int) -> FakeReplica:
        replica = self.replicas[server_id] = FakeReplica(server_id, count)
        return replica

    def pick(self, ready: list[FakeReplica]) -> FakeReplica:
        return ready[next(self._turn) % len(ready)]

    def remove(self, server_id: str) -> None:
        self.replicas.pop(server_id).stop()

    async def open(self, _transport_tasks: trio.Nursery) -> trio.abc.Stream:
        self.dials += 1
        ready = [r for r in self.replicas.values() if not r.draining]
        if not ready:
            raise ConnectionRefusedError(111, "Connection refused")
        replica = self.pick(ready)
        agent_side, replica_side = trio.testing.memory_stream_pair()
        self.nursery.start_soon(replica.serve, replica_side)
        return agent_side


def make_agent() -> Agent:
    return Agent(AgentConfig("cluster1", "agent-a", policy=EgressPolicy.build()))


def options(name: str = "hub", **overrides: float) -> TunnelOptions:
    settings = {"backoff_initial": 0.1, "backoff_max": 1.0} | overrides
    return TunnelOptions(server=(name, 8091), keepalive=None, **settings)  # type: ignore[arg-type]


def holds(agent: Agent, balancer: FakeBalancer) -> bool:
    """The agent holds exactly one tunnel to every live replica, and each replica counts exactly one."""
    live = {sid for sid, r in balancer.replicas.items() if not r.draining}
    tunnels = [r for r in agent.replica_tunnels() if r.holds_replica]
    return (
        sorted(str(r.server_id) for r in tunnels) == sorted(live)
        and agent.held_replicas() == live
        and all(len(balancer.replicas[sid].tunnels) == 1 for sid in live)
    )


async def run_replica_set(
    nursery: trio.Nursery, agent: Agent, targets: list[tuple[TunnelOptions, Callable]], **kwargs: object
) -> ReplicaSet:
    replicas = ReplicaSet(agent, targets, rng=lambda: 1.0, **kwargs)  # type: ignore[arg-type]
    await nursery.start(replicas.run)
    return replicas


async def stop(agent: Agent, replicas: ReplicaSet) -> None:
    replicas.stop()
    agent.close_all("test over")
    with trio.fail_after(30):
        await replicas.stopped.wait()


async def test_holds_each_replica_once_and_follows_drain_and_scale(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    balancer = FakeBalancer(nursery)
    for i in range(3):
        balancer.add(f"r{i}", 3)
    agent = make_agent()
    replicas = await run_replica_set(nursery, agent, [(options(), balancer.open)])
    await wait_until(lambda: holds(agent, balancer), timeout=60, what="the first mesh")
    assert agent.expected_replicas == 3
    duplicates = agent.metrics.registry.get_sample_value("cluster_proxy_agent_duplicate_dials_total")
    assert duplicates == sum(r.refused for r in balancer.replicas.values())

    # A rolling step: r1 drains (the balancer sends it nothing new), its successor r3 starts. The agent
    # keeps r1's tunnel for its open streams and finds r3 meanwhile.
    balancer.replicas["r1"].drain()
    balancer.add("r3", 3)
    await wait_until(lambda: agent.held_replicas() == {"r0", "r2", "r3"}, timeout=60, what="the successor")
    draining = [r for r in agent.replica_tunnels() if r.server_id == "r1"]
    assert len(draining) == 1 and not draining[0].mux.dead and draining[0].mux.peer_draining
    balancer.remove("r1")
    await wait_until(lambda: holds(agent, balancer) and len(replicas.slots) == 3, timeout=60, what="3 slots")

    # Scale down to 2: r0 goes, r2 and r3 are replaced by replicas telling 2.
    balancer.remove("r0")
    for old, new in (("r2", "r4"), ("r3", "r5")):
        balancer.replicas[old].drain()
        balancer.add(new, 2)
        await wait_until(lambda: new in agent.held_replicas(), timeout=60, what=new)  # noqa: B023
        balancer.remove(old)
    await wait_until(lambda: holds(agent, balancer) and len(replicas.slots) == 2, timeout=60, what="2 slots")
    assert agent.expected_replicas == 2
    dials = balancer.dials
    await trio.sleep(120)  # (mock clock) with every replica held, nothing dials
    assert balancer.dials == dials and holds(agent, balancer)
    await stop(agent, replicas)


@dataclass
class RoutedBalancer(FakeBalancer):
    """Sends the dials to the replicas named in ``route``, in order (then round robin)."""

    route: list[str] = field(default_factory=list)

    def pick(self, ready: list[FakeReplica]) -> FakeReplica:
        return self.replicas[self.route.pop(0)] if self.route else super().pick(ready)


async def test_a_dial_that_reaches_a_held_replica_is_made_again_soon(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The hub answered (it is up; its balancer chose a replica already held): the next dial comes 50,
    100, 200 ms later as that repeats, not after the failure backoff (here 0.5, 1, 2 s)."""
    balancer = RoutedBalancer(nursery, route=["r0", "r0", "r0", "r0", "r1"])
    balancer.add("r0", 2)
    balancer.add("r1", 2)
    agent = make_agent()
    started = trio.current_time()
    replicas = await run_replica_set(
        nursery, agent, [(TunnelOptions(server=("hub", 8091), keepalive=None), balancer.open)]
    )
    await wait_until(lambda: holds(agent, balancer), timeout=60, what="both replicas")
    assert balancer.replicas["r0"].refused == 3
    assert trio.current_time() - started <= 0.05 + 0.1 + 0.2 + 0.01
    await stop(agent, replicas)


async def test_a_missing_replica_costs_at_most_one_dial_per_backoff_max(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Two of three replicas live: the agent holds both and dials for the third, each dial that lands on
    a held one answered 409 and backed off (no jitter here: the ceilings 0.1, 0.2, ..., then 1 s)."""
    balancer = FakeBalancer(nursery)
    balancer.add("r0", 3)
    balancer.add("r1", 3)
    agent = make_agent()
    replicas = await run_replica_set(nursery, agent, [(options(), balancer.open)])
    await wait_until(lambda: holds(agent, balancer), timeout=60, what="both replicas")
    dials = balancer.dials
    await trio.sleep(60)
    spent = balancer.dials - dials
    assert 40 <= spent <= 60 / 1.0 + 5, spent  # one slot: a dial per backoff_max once the backoff grew
    assert holds(agent, balancer)  # never at the price of a held replica
    assert sum(r.refused for r in balancer.replicas.values()) >= spent - 1
    balancer.add("r2", 3)
    await wait_until(lambda: holds(agent, balancer), timeout=5, what="the third replica within a backoff")
    await stop(agent, replicas)


async def test_a_long_search_still_finds_a_late_successor_within_the_search_ceiling(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """With the 30 s backoff ceiling, a minute of dials landing on held replicas does not make the
    agent wait 30 s for a successor that comes up late: the search backs off 2 s at most."""
    balancer = FakeBalancer(nursery)
    balancer.add("r0", 3)
    balancer.add("r1", 3)
    agent = make_agent()
    search = options(backoff_max=30.0, search_backoff_max=2.0)
    replicas = await run_replica_set(nursery, agent, [(search, balancer.open)])
    await wait_until(lambda: holds(agent, balancer), timeout=60, what="both replicas")
    dials = balancer.dials
    await trio.sleep(60)
    assert 25 <= balancer.dials - dials <= 35  # a dial every 2 s, not every 30 s
    balancer.add("r2", 3)
    added = trio.current_time()
    await wait_until(lambda: holds(agent, balancer), timeout=10, what="the late successor")
    # round robin over three: at most three dials, 2 s apart, reach it (haproxy's leastconn: the first)
    assert trio.current_time() - added <= 3 * 2.0 + 0.5
    await stop(agent, replicas)


@pytest.mark.parametrize(
    ("failure", "dials_in_a_minute"),
    [
        # nothing listens (the hub restarting): costs the hub nothing, so every 2 s (the search ceiling)
        (ConnectionRefusedError(111, "Connection refused"), range(25, 36)),
        # anything else (a TLS failure, a timeout) may be a hub at its limit: 0.1 s doubling up to 30 s
        (trio.BrokenResourceError("TLS handshake failed"), range(7, 11)),
    ],
)
async def test_only_a_refused_connect_keeps_the_backoff_at_the_search_ceiling(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    failure: Exception,
    dials_in_a_minute: range,
) -> None:
    balancer = FakeBalancer(nursery)
    dials = 0

    async def failing_then_balanced(transport_tasks: trio.Nursery) -> trio.abc.Stream:
        nonlocal dials
        dials += 1
        if not balancer.replicas:
            raise failure
        return await balancer.open(transport_tasks)

    agent = make_agent()
    hub = options(backoff_max=30.0, search_backoff_max=2.0)
    replicas = await run_replica_set(nursery, agent, [(hub, failing_then_balanced)])
    await trio.sleep(60)
    assert dials in dials_in_a_minute
    if isinstance(failure, ConnectionRefusedError):
        balancer.add("r0", 3)
        listening = trio.current_time()
        await wait_until(lambda: holds(agent, balancer), timeout=10, what="the hub listening again")
        assert trio.current_time() - listening <= 2.0 + 0.5
    await stop(agent, replicas)


async def test_an_explicit_list_holds_one_tunnel_per_address(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    balancers = [FakeBalancer(nursery) for _ in range(3)]
    for i, balancer in enumerate(balancers):
        balancer.add(f"r{i}", 3)
    agent = make_agent()
    targets = [(options(f"hub-{i}"), b.open) for i, b in enumerate(balancers)]
    replicas = await run_replica_set(nursery, agent, targets)

    def all_held() -> bool:
        live = [r for b in balancers for r in b.replicas.values() if not r.draining]
        return agent.held_replicas() == {r.server_id for r in live} and all(len(r.tunnels) == 1 for r in live)

    await wait_until(all_held, timeout=60, what="every address")
    assert agent.expected_replicas == 3 and len(replicas.slots) == 3
    assert all(b.dials == 1 for b in balancers)  # no search: one dial per address

    # The replica at hub-1 restarts at the same address (a new id): drained, the slot's successor dials it.
    balancers[1].replicas["r1"].drain()
    balancers[1].add("r1b", 3)
    await wait_until(lambda: "r1b" in agent.held_replicas(), timeout=60, what="the restarted replica")
    balancers[1].remove("r1")
    await wait_until(lambda: len(replicas.slots) == 3 and len(agent.tunnels) == 3, timeout=60, what="3 slots")
    await stop(agent, replicas)


async def test_a_server_that_tells_no_count_is_one_replica(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """An older proxy-server (no id, no count): one tunnel, as before replicas."""

    class Anonymous(FakeReplica):
        async def serve(self, stream: trio.abc.Stream) -> None:
            async with open_mux(stream, Role.OPENER) as mux:
                assert (await mux.request("GET", "/v1/info")).status == 200
                self.tunnels.add(mux)
                await mux.closed.wait()

    balancer = FakeBalancer(nursery)
    balancer.replicas["old"] = Anonymous("old", 0)
    agent = make_agent()
    replicas = await run_replica_set(nursery, agent, [(options(), balancer.open)])
    await wait_until(lambda: len(balancer.replicas["old"].tunnels) == 1, timeout=60, what="the tunnel")
    await trio.sleep(60)
    assert balancer.dials == 1 and len(replicas.slots) == 1 and agent.expected_replicas == 1
    await stop(agent, replicas)


class Silenceable(trio.abc.Stream):
    """A replica's end of a tunnel that can go silent (a host that vanished, a NAT that dropped the
    connection): from then on it reads and answers nothing, and the agent's side stays open."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.silent = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.silent:
            await trio.sleep_forever()
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = await self.inner.receive_some(max_bytes)
        if self.silent:
            await trio.sleep_forever()
        return data

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_silent_holder_is_replaced_by_a_new_tunnel_to_its_replica(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The tunnel holding r0 goes silent (no keepalive here to notice); a later dial reaches r0 again:
    the old tunnel does not answer a PING within 5 s, so it is closed and the new one holds r0."""
    balancer = FakeBalancer(nursery)
    replica = balancer.add("r0", 2)  # told 2 while one exists: the agent keeps dialing (backing off)
    ends: list[Silenceable] = []
    serve = replica.serve

    async def serve_silenceable(stream: trio.abc.Stream) -> None:
        ends.append(Silenceable(stream))
        await serve(ends[-1])

    replica.serve = serve_silenceable  # type: ignore[method-assign]
    agent = make_agent()
    replicas = await run_replica_set(nursery, agent, [(options(), balancer.open)])
    await wait_until(lambda: agent.held_replicas() == {"r0"} and replica.refused >= 1, timeout=60, what="r0")
    holder = next(r for r in agent.replica_tunnels() if r.server_id == "r0")
    ends[0].silent = True  # the first tunnel, the one that holds r0
    await wait_until(lambda: holder.mux.dead, timeout=60, what="the silent holder replaced")
    assert "no PING answer within 5s" in holder.mux.dead_reason
    await wait_until(lambda: agent.held_replicas() == {"r0"}, timeout=60, what="r0 held again")
    assert next(r for r in agent.replica_tunnels() if r.server_id == "r0") is not holder
    await stop(agent, replicas)


# --- --server as a list ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agent_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    directory = tmp_path_factory.mktemp("replica-set-pki")
    ca = DevCA.create_or_load(directory / "ca")
    pair = ca.issue_agent("cluster1", "agent-a", directory)
    return [
        "--cluster",
        "cluster1",
        "--ca",
        str(ca.ca_path),
        "--cert",
        str(pair.cert),
        "--key",
        str(pair.key),
    ]


@pytest.mark.parametrize(
    ("argv", "environ"),
    [
        (["--server", "a.hub:8091,b.hub:8091", "--server", "[fd00::3]:8091"], {}),
        ([], {"CLUSTER_PROXY_AGENT_SERVER": "a.hub:8091, b.hub:8091,[fd00::3]:8091"}),
    ],
    ids=["flags", "environment"],
)
def test_server_takes_a_list_of_replica_addresses(
    agent_files: list[str], argv: list[str], environ: dict[str, str]
) -> None:
    settings = parse_settings([*argv, *agent_files], environ=environ)
    assert settings.servers == [("a.hub", 8091), ("b.hub", 8091), ("fd00::3", 8091)]
    assert settings.server == ("a.hub", 8091) and settings.server_name == "a.hub"
    assert settings.summary()["server"] == "a.hub:8091,b.hub:8091,[fd00::3]:8091"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("a.hub:8091,a.hub:8091", "--server lists a.hub:8091 more than once"),
        ("a.hub:8091,,", None),  # empty items are ignored
        (",", "expected HOST:PORT[,HOST:PORT...]"),
        ("a.hub:8091,b.hub", "b.hub"),
    ],
)
def test_bad_server_lists_stop_the_start(
    agent_files: list[str], value: str, message: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    if message is None:
        assert parse_settings(["--server", value, *agent_files], environ={}).servers == [("a.hub", 8091)]
        return
    with pytest.raises(SystemExit) as exited:
        parse_settings(["--server", value, *agent_files], environ={})
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


# --- a slot stopped while its tunnel opens --------------------------------------------------------------


def test_a_slot_whose_transport_is_up_counts_as_holding() -> None:
    # between the connect and the tunnel's record the plan must not take the slot for a dialing one: a
    # stop meant for a dialing slot would leave its tunnel held by a slot the plan no longer counts, and
    # another slot would dial for that replica forever (each dial a 409)
    assert slot_state(None, opening=True) is H
    assert slot_state(None) is D


async def test_a_slot_stopped_as_its_connect_completes_opens_no_tunnel(
    autojump_clock: trio.testing.MockClock,
) -> None:
    agent = Agent(AgentConfig("cluster1", "agent-a", policy=EgressPolicy.build()))
    runner: TunnelRunner
    peer_ends: list[trio.testing.MemoryReceiveStream] = []

    async def open_while_stopped(_transport_tasks: trio.Nursery) -> trio.abc.Stream:
        ours, theirs = trio.testing.memory_stream_pair()
        peer_ends.append(theirs)  # type: ignore[arg-type]
        runner.stop()  # the stop arrives; the connect completes without another checkpoint
        return ours

    options = TunnelOptions(server=("hub", 8091), keepalive=None)
    runner = TunnelRunner(agent, options, open_while_stopped)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner.run)
        with trio.fail_after(5):
            await runner.stopped.wait()
    assert runner.attempts == 1 and not agent.tunnels and runner.record is None and not runner.opening
    with trio.fail_after(1), pytest.raises(trio.BrokenResourceError):  # our end was closed
        await peer_ends[0].send_all(b"x")
