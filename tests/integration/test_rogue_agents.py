"""The proxy-server against broken and hostile agents (issue 10, finding 8), in-process on loopback.

Each rogue (:mod:`tests.support.rogue_agent`) registers like the real agent and then misbehaves,
beside a real agent of the same cluster: requests must not notice (a dial the rogue failed is retried
once on the healthy tunnel, and the rogue leaves routing), a target's own refusal is not retried,
garbage closes the rogue's tunnel at once, a second tunnel with a live agent's identity is refused,
and one client's pending dials are bounded.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import pytest
import trio
import trio.testing

from clusterproxy_agent.agent import Agent, AgentConfig
from clusterproxy_agent.egress import EgressPolicy
from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import open_mux
from clusterproxy_protocol.errors import (
    ConnectRefused,
    DialTimeout,
    Forbidden,
    TargetUnreachable,
    TooManyRequests,
    refusal,
)
from clusterproxy_protocol.pki import DevCA
from clusterproxy_protocol.wire import CLUSTER_HEADER, FAULT_HEADER, FAULT_TARGET
from clusterproxy_sdk import TLSFiles, open_tunnel
from clusterproxy_server.app import ProxyServer
from clusterproxy_server.ejection import EjectionPolicy
from clusterproxy_server.relaying import agent_fault
from tests.support.clients import client_context, h1_connect
from tests.support.inprocess import start_server
from tests.support.pki import PkiFiles
from tests.support.rogue_agent import (
    Behaviour,
    RogueAgent,
    assert_echo,
    client_files,
    echo_through,
    rogue_then_healthy,
    start_real_agent,
)
from tests.support.targets import Blackhole, closed_port, serve_echo
from tests.support.waiting import wait_until


def sample(server: ProxyServer, name: str, **labels: str) -> float:
    return server.metrics.registry.get_sample_value(name, labels) or 0.0


def dials(agent: Agent, result: str) -> float:
    value = agent.metrics.registry.get_sample_value("cluster_proxy_agent_dials_total", {"result": result})
    return value or 0.0


async def concurrent_echoes(server_port: int, pki: PkiFiles, port: int, count: int) -> tuple[int, list[str]]:
    """``count`` echo transfers at once on one SDK connection: (how many echoed intact, the errors)."""
    intact = 0
    errors: list[str] = []
    async with open_tunnel(
        f"127.0.0.1:{server_port}", client_files(pki), server_hostname="localhost"
    ) as tunnel:

        async def one() -> None:
            nonlocal intact
            payload = os.urandom(64 << 10)
            try:
                digest = await echo_through(tunnel, "cluster1", port, payload)
            except ConnectRefused as exc:
                errors.append(str(exc))
                return
            if digest == hashlib.sha256(payload).hexdigest():
                intact += 1
            else:
                errors.append("echo differs")

        async with trio.open_nursery() as requests:
            for _ in range(count):
                requests.start_soon(one)
    return intact, errors


async def test_agent_answering_502_is_retried_on_another_tunnel_and_ejected(
    nursery: trio.Nursery, pki: PkiFiles
) -> None:
    server, bound = await start_server(nursery, pki, ejection=EjectionPolicy(cooldown=300, min_dials=5))
    echo = await serve_echo(nursery)
    rogue, _ = await rogue_then_healthy(nursery, server, bound.agent[1], pki, Behaviour.ANSWER_502)

    intact, errors = await concurrent_echoes(bound.client[1], pki, echo.port, 20)
    assert (intact, errors) == (20, [])
    assert rogue.connects >= 5, "the rogue must have been dialed for this to test anything"
    assert sample(server, "cluster_proxy_server_dial_retries_total", cluster="cluster1") == rogue.connects
    assert (
        sample(server, "cluster_proxy_server_agent_ejections_total", cluster="cluster1", agent_id="agent-a")
        == 1
    )
    ejected = {entry["agent_id"]: entry["ejected"] for entry in server.registry.describe()}
    assert ejected == {"agent-a": True, "agent-b": False}

    dialed_before = rogue.connects
    intact, errors = await concurrent_echoes(bound.client[1], pki, echo.port, 20)
    assert (intact, errors) == (20, [])
    assert rogue.connects == dialed_before, "an ejected tunnel is out of routing for its cool-down"


async def test_http1_connects_meet_a_502_answering_agent_without_failing(
    nursery: trio.Nursery, pki: PkiFiles
) -> None:
    """The curl path (HTTP/1.1 CONNECT), with ejection kept out of the way: the retry alone saves them."""
    server, bound = await start_server(nursery, pki, ejection=EjectionPolicy(min_dials=1000))
    echo = await serve_echo(nursery)
    rogue, _ = await rogue_then_healthy(nursery, server, bound.agent[1], pki, Behaviour.ANSWER_502)
    context = client_context(pki, alpn=["http/1.1"])
    results: list[bool] = []

    async def one() -> None:
        reply = await h1_connect(
            bound.client[1], context, f"127.0.0.1:{echo.port}", {CLUSTER_HEADER: "cluster1"}
        )
        if reply.stream is None:
            results.append(False)
            return
        payload = os.urandom(16 << 10)
        await reply.stream.send_all(payload)
        echoed = b""
        while len(echoed) < len(payload):
            echoed += await reply.stream.receive_some(65536)
        await reply.stream.aclose()
        results.append(hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest())

    async with trio.open_nursery() as requests:
        for _ in range(20):
            requests.start_soon(one)
    assert results.count(True) == 20
    assert rogue.connects >= 5
    assert [entry["ejections"] for entry in server.registry.describe()] == [0, 0]


async def test_blackholing_agent_costs_one_answer_timeout_not_the_dial_timeout(
    nursery: trio.Nursery, pki: PkiFiles
) -> None:
    answer_timeout = 1.0
    server, bound = await start_server(nursery, pki, dial_timeout=30.0, agent_answer_timeout=answer_timeout)
    echo = await serve_echo(nursery)
    rogue, _ = await rogue_then_healthy(nursery, server, bound.agent[1], pki, Behaviour.BLACKHOLE)

    started = trio.current_time()
    intact, errors = await concurrent_echoes(bound.client[1], pki, echo.port, 20)
    elapsed = trio.current_time() - started
    assert (intact, errors) == (20, [])
    assert rogue.connects >= 1
    assert elapsed < answer_timeout + 2.0, f"20 requests took {elapsed:.2f}s"
    timeouts = sample(
        server,
        "cluster_proxy_server_agent_dial_failures_total",
        cluster="cluster1",
        agent_id="agent-a",
        kind="timeout",
    )
    assert timeouts == rogue.connects


async def test_a_targets_own_refusal_is_answered_once_and_not_held_against_the_agent(
    nursery: trio.Nursery, pki: PkiFiles
) -> None:
    server, bound = await start_server(nursery, pki)
    agents = [
        await start_real_agent(nursery, bound.agent[1], pki, "cluster1", agent_id, dial_timeout=0.3)
        for agent_id in ("agent-a", "agent-b")
    ]
    await wait_until(lambda: len(server.registry.tunnels("cluster1")) == 2)
    blackhole = Blackhole()
    try:
        async with open_tunnel(
            f"127.0.0.1:{bound.client[1]}", client_files(pki), server_hostname="localhost"
        ) as tunnel:
            with pytest.raises(TargetUnreachable) as refused:
                await tunnel.connect("cluster1", "127.0.0.1", closed_port())
            assert "Connection refused" in refused.value.reason
            started = trio.current_time()
            with pytest.raises(DialTimeout) as timed_out:
                await tunnel.connect("cluster1", "127.0.0.1", blackhole.port)
            elapsed = trio.current_time() - started
            assert "timed out after 0.3s" in timed_out.value.reason
            assert elapsed < 0.3 * 2, f"a target timeout was waited for twice ({elapsed:.2f}s)"
    finally:
        blackhole.close()
    # Exactly one dial each reached the network, and neither counts against an agent.
    assert sum(dials(agent, "refused") for agent in agents) == 1
    assert sum(dials(agent, "timeout") for agent in agents) == 1
    outcomes = [
        failed for tunnel in server.registry.tunnels("cluster1") for _, failed in tunnel.health.outcomes
    ]
    assert outcomes == [False, False]
    assert sample(server, "cluster_proxy_server_dial_retries_total", cluster="cluster1") == 0


async def test_second_tunnel_with_a_live_agents_identity_is_refused(
    nursery: trio.Nursery, pki: PkiFiles
) -> None:
    server, bound = await start_server(nursery, pki)
    echo = await serve_echo(nursery)
    await start_real_agent(nursery, bound.agent[1], pki, "cluster1", "agent-a")
    await wait_until(lambda: server.registry.find("cluster1", "agent-a"))
    first = server.registry.find("cluster1", "agent-a")

    copy = await nursery.start(
        RogueAgent(pki, "cluster1", "agent-a", Behaviour.ANSWER_502).run, bound.agent[1]
    )
    with trio.fail_after(5):
        await copy.mux.closed.wait()
    assert "already connected" in copy.mux.dead_reason
    assert server.registry.tunnels("cluster1") == [first]
    assert (
        sample(
            server,
            "cluster_proxy_server_rejected_connections_total",
            port="agent",
            reason="duplicate_identity",
        )
        == 1
    )
    async with open_tunnel(
        f"127.0.0.1:{bound.client[1]}", client_files(pki), server_hostname="localhost"
    ) as tunnel:
        await assert_echo(tunnel, echo.port)


async def test_second_tunnel_replaces_one_that_no_longer_answers(
    nursery: trio.Nursery, pki: PkiFiles
) -> None:
    ping_timeout = 0.5
    server, bound = await start_server(nursery, pki, keepalive_interval=60.0, keepalive_timeout=ping_timeout)
    stale = await nursery.start(RogueAgent(pki, "cluster1", "agent-a", Behaviour.RELAY).run, bound.agent[1])
    await wait_until(lambda: server.registry.find("cluster1", "agent-a"))
    stale_tunnel = server.registry.find("cluster1", "agent-a")
    stale.freeze()

    started = trio.current_time()
    await nursery.start(RogueAgent(pki, "cluster1", "agent-a", Behaviour.RELAY).run, bound.agent[1])
    await wait_until(
        lambda: server.registry.tunnels("cluster1") not in ([], [stale_tunnel]),
        timeout=ping_timeout + 2.0,
        what="the new tunnel to replace the silent one",
    )
    elapsed = trio.current_time() - started
    assert len(server.registry.tunnels("cluster1")) == 1
    assert stale_tunnel.mux.dead and "replaced" in stale_tunnel.mux.dead_reason
    assert sample(server, "cluster_proxy_server_agent_replacements_total", cluster="cluster1") == 1
    assert elapsed >= ping_timeout


async def test_pending_dials_are_bounded_per_connection_and_per_client(
    nursery: trio.Nursery, pki: PkiFiles, tmp_path: Path
) -> None:
    server, bound = await start_server(
        nursery,
        pki,
        max_pending_dials_per_connection=4,
        max_pending_dials_per_client=6,
        agent_answer_timeout=30.0,
    )
    echo = await serve_echo(nursery)
    await nursery.start(RogueAgent(pki, "cluster2", "agent-a", Behaviour.BLACKHOLE).run, bound.agent[1])
    await start_real_agent(nursery, bound.agent[1], pki, "cluster1", "agent-b")
    await wait_until(lambda: server.registry.tunnels("cluster1") and server.registry.tunnels("cluster2"))
    other = DevCA.create_or_load(pki.ca.parent).issue_client("test-other-client", tmp_path)
    address = f"127.0.0.1:{bound.client[1]}"

    async def hold(tunnel, task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
        task_status.started()
        await tunnel.connect("cluster2", "127.0.0.1", 80)  # never answered

    with trio.CancelScope() as held:
        async with (
            open_tunnel(address, client_files(pki), server_hostname="localhost") as first,
            open_tunnel(address, client_files(pki), server_hostname="localhost") as second,
            trio.open_nursery() as pending,
        ):
            for _ in range(4):
                await pending.start(hold, first)
            await wait_until(lambda: server.relayer.pending.total == 4)
            with pytest.raises(TooManyRequests) as per_connection:
                await first.connect("cluster2", "127.0.0.1", 80)
            assert "--max-pending-dials-per-connection 4" in per_connection.value.reason

            for _ in range(2):
                await pending.start(hold, second)
            await wait_until(lambda: server.relayer.pending.total == 6)
            with pytest.raises(TooManyRequests) as per_client:
                await second.connect("cluster1", "127.0.0.1", echo.port)
            assert "--max-pending-dials-per-client 6" in per_client.value.reason

            async with open_tunnel(
                address, TLSFiles(pki.ca, other.cert, other.key), server_hostname="localhost"
            ) as someone_else:
                payload = os.urandom(4096)
                digest = await echo_through(someone_else, "cluster1", echo.port, payload)
                assert digest == hashlib.sha256(payload).hexdigest()
            held.cancel()
    assert sample(server, "cluster_proxy_server_pending_dial_refusals_total", scope="connection") == 1
    assert sample(server, "cluster_proxy_server_pending_dial_refusals_total", scope="client") == 1
    await wait_until(lambda: server.relayer.pending.total == 0, what="pending dials released")
    assert math.isclose(sample(server, "cluster_proxy_server_pending_dials"), 0)


async def test_the_agent_marks_a_targets_own_failure_on_the_wire() -> None:
    """How the proxy-server tells a target's refusal from the agent's own failure: the real agent's
    5xx for a target carries ``cluster-proxy-fault: target``; its refusals of the request (4xx) and any
    5xx a broken agent sends do not (:func:`clusterproxy_server.relaying.agent_fault`)."""
    agent = Agent(
        AgentConfig(cluster="cluster1", agent_id="agent-a", policy=EgressPolicy.build(["127.0.0.0/8"]))
    )
    hub_end, agent_end = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_serve_agent, agent, agent_end)
        async with open_mux(hub_end, Role.OPENER) as hub:
            with pytest.raises(TargetUnreachable) as refused:
                await hub.open_connect(f"127.0.0.1:{closed_port()}")
            with pytest.raises(Forbidden) as forbidden:
                await hub.open_connect("10.255.255.1:80")
        nursery.cancel_scope.cancel()
    assert refused.value.headers.get(FAULT_HEADER) == FAULT_TARGET
    assert not agent_fault(refused.value)
    assert FAULT_HEADER not in forbidden.value.headers and not agent_fault(forbidden.value)
    assert agent_fault(TargetUnreachable("upstream connect error"))  # a 502 without the mark
    assert agent_fault(refusal(500, "agent error: KeyError"))


async def _serve_agent(agent: Agent, stream: trio.abc.Stream) -> None:
    async with open_mux(stream, Role.ACCEPTOR, handler=agent.handle) as mux:
        await mux.closed.wait()
