"""The agent's stream handler behind a real HTTP/2 tunnel (in memory), dialling real loopback targets.

The hub side is a plain ``open_mux(..., Role.OPENER)``: what the proxy-server does, without TLS.

The 504 case needs a target that neither accepts nor refuses. On Linux a listener whose accept queue
is full drops incoming SYNs (the SYN-cookie path does not apply to a full *accept* queue), so a
``listen(0)`` socket with one connection queued and never accepted is a reliable loopback blackhole:
see :class:`tests.support.targets.Blackhole`, which waits (with a deadline, via ``TCP_INFO``) until
the queue is full.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from clusterproxy_agent.agent import Agent, AgentConfig
from clusterproxy_agent.egress import EgressPolicy
from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import Mux, open_mux
from clusterproxy_protocol.errors import (
    ConnectRefused,
    DialTimeout,
    Forbidden,
    MalformedTarget,
    TargetUnreachable,
)
from clusterproxy_protocol.wire import REASON_HEADER
from tests.support.targets import Blackhole, closed_port, serve_echo
from tests.support.waiting import wait_until


def dials(agent: Agent, result: str) -> float | None:
    return agent.metrics.registry.get_sample_value("cluster_proxy_agent_dials_total", {"result": result})


LOOPBACK_ONLY = EgressPolicy.build(["127.0.0.0/8"])


def make_agent(policy: EgressPolicy = LOOPBACK_ONLY, **kwargs) -> Agent:
    options = {"cluster": "cluster1", "agent_id": "agent-a", "policy": policy, "dial_timeout": 5.0}
    resolver = kwargs.pop("resolver", None)
    connector = kwargs.pop("connector", None)
    options.update(kwargs)
    extra = {}
    if resolver is not None:
        extra["resolver"] = resolver
    if connector is not None:
        extra["connector"] = connector
    return Agent(AgentConfig(**options), **extra)


@asynccontextmanager
async def hub_side(agent: Agent) -> AsyncIterator[Mux]:
    """An opener mux (the proxy-server's role) whose peer is ``agent``'s handler."""
    left, right = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:

        async def run_agent_side(task_status: trio.TaskStatus[None]) -> None:
            async with open_mux(right, Role.ACCEPTOR, handler=agent.handle) as mux:
                with agent.tunnel(mux, "memory"):
                    task_status.started()
                    await mux.closed.wait()

        await nursery.start(run_agent_side)
        async with open_mux(left, Role.OPENER) as opener:
            yield opener
        nursery.cancel_scope.cancel()


async def round_trip(stream: trio.abc.HalfCloseableStream, size: int) -> None:
    payload = os.urandom(size)
    received = bytearray()

    async def send() -> None:
        for i in range(0, size, 100_000):
            await stream.send_all(payload[i : i + 100_000])
        await stream.send_eof()

    async def receive() -> None:
        while data := await stream.receive_some():
            received.extend(data)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        nursery.start_soon(receive)
    await stream.aclose()
    assert len(received) == size
    assert hashlib.sha256(received).hexdigest() == hashlib.sha256(payload).hexdigest()


# --- (a) data round trip --------------------------------------------------------------------------------


async def test_connect_round_trips_data_with_half_close(nursery: trio.Nursery) -> None:
    port = (await serve_echo(nursery)).port
    agent = make_agent()
    async with hub_side(agent) as hub:
        stream = await hub.open_connect(f"127.0.0.1:{port}")
        assert agent.metrics.registry.get_sample_value("cluster_proxy_agent_open_streams") == 1
        await round_trip(stream, 3 * 1024 * 1024 + 17)
        with trio.fail_after(5):
            await hub.wait_idle()
    assert dials(agent, "ok") == 1
    assert agent.metrics.registry.get_sample_value("cluster_proxy_agent_bytes_in_total") >= 3 * 1024 * 1024
    assert agent.metrics.registry.get_sample_value("cluster_proxy_agent_bytes_out_total") >= 3 * 1024 * 1024


async def test_many_concurrent_streams(nursery: trio.Nursery) -> None:
    port = (await serve_echo(nursery)).port
    agent = make_agent()
    async with hub_side(agent) as hub, trio.open_nursery() as streams:
        for _ in range(20):
            streams.start_soon(_one, hub, port)
    assert dials(agent, "ok") == 20


async def _one(hub: Mux, port: int) -> None:
    await round_trip(await hub.open_connect(f"127.0.0.1:{port}"), 50_000)


# --- (b) egress policy ----------------------------------------------------------------------------------


async def test_metadata_address_is_forbidden_with_the_rule_named() -> None:
    agent = make_agent(EgressPolicy.build(["0.0.0.0/0"]))
    async with hub_side(agent) as hub:
        with pytest.raises(Forbidden) as info:
            await hub.open_connect("169.254.169.254:80")
    assert info.value.status == 403
    assert "169.254.169.254:80" in info.value.reason
    assert "built-in rule link-local 169.254.0.0/16" in info.value.reason
    assert dials(agent, "forbidden") == 1


async def test_name_resolving_to_metadata_is_forbidden() -> None:
    """DNS rebinding: an allowed name that resolves to a metadata address is still refused."""
    asked: list[str] = []

    async def resolver(host: str, port: int) -> list:
        asked.append(host)
        return [ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("169.254.169.254")]

    agent = make_agent(EgressPolicy.build(["*.svc"]), resolver=resolver)
    async with hub_side(agent) as hub:
        with pytest.raises(Forbidden) as info:
            await hub.open_connect("innocent.default.svc:80")
    assert asked == ["innocent.default.svc"]
    assert "resolves to 169.254.169.254" in info.value.reason


async def test_target_outside_allow_rules_is_forbidden_without_dialling(nursery: trio.Nursery) -> None:
    port = (await serve_echo(nursery)).port
    agent = make_agent(EgressPolicy.build([f"127.0.0.1:{port + 1}"]))
    async with hub_side(agent) as hub:
        with pytest.raises(Forbidden) as info:
            await hub.open_connect(f"127.0.0.1:{port}")
    assert "not allowed by any allow rule" in info.value.reason


# --- (c) refused ----------------------------------------------------------------------------------------


async def test_closed_port_is_502_with_the_os_error() -> None:
    port = closed_port()
    agent = make_agent()
    async with hub_side(agent) as hub:
        with pytest.raises(TargetUnreachable) as info:
            await hub.open_connect(f"127.0.0.1:{port}")
    assert info.value.status == 502
    assert f"127.0.0.1:{port}" in info.value.reason
    assert "Connection refused" in info.value.reason
    assert dials(agent, "refused") == 1


async def test_unresolvable_name_is_502() -> None:
    agent = make_agent(EgressPolicy.build(["*.invalid"]))
    async with hub_side(agent) as hub:
        with pytest.raises(TargetUnreachable) as info:
            await hub.open_connect("no-such-host.invalid:80")
    assert "cannot resolve 'no-such-host.invalid'" in info.value.reason


# --- (d) timeout ----------------------------------------------------------------------------------------


async def test_blackholed_target_is_504_after_the_dial_timeout() -> None:
    agent = make_agent(dial_timeout=0.5)
    with Blackhole() as hole:
        async with hub_side(agent) as hub:
            started = trio.current_time()
            with trio.fail_after(5), pytest.raises(DialTimeout) as info:
                await hub.open_connect(f"127.0.0.1:{hole.port}")
            elapsed = trio.current_time() - started
            assert hole.queued() == 1  # the agent's SYN was dropped, never queued
    assert info.value.status == 504
    assert info.value.reason == f"dial to 127.0.0.1:{hole.port} timed out after 0.5s (connecting)"
    assert 0.5 <= elapsed < 3
    assert dials(agent, "timeout") == 1


async def test_slow_resolver_counts_against_the_dial_timeout() -> None:
    async def never_answers(host: str, port: int) -> list:
        await trio.sleep_forever()
        raise AssertionError

    agent = make_agent(EgressPolicy.build(["*.svc"]), dial_timeout=0.2, resolver=never_answers)
    async with hub_side(agent) as hub:
        with trio.fail_after(5), pytest.raises(DialTimeout) as info:
            await hub.open_connect("slow.default.svc:443")
    assert "timed out after 0.2s (resolving the name)" in info.value.reason


# --- (e) bare cluster name ------------------------------------------------------------------------------


async def test_bare_cluster_name_reaches_the_kube_apiserver(nursery: trio.Nursery) -> None:
    port = (await serve_echo(nursery)).port
    # No --allow: the default allow rules, which include the configured kube-apiserver.
    policy = EgressPolicy.build(kube_apiserver=("127.0.0.1", port))
    agent = make_agent(policy, kube_apiserver=("127.0.0.1", port))
    async with hub_side(agent) as hub:
        await round_trip(await hub.open_connect("cluster1:443"), 100_000)
        # Another host on the same address is not the apiserver and not allowed by default.
        with pytest.raises(Forbidden):
            await hub.open_connect(f"127.0.0.1:{port + 1}")


# --- (f) control requests -------------------------------------------------------------------------------


async def test_info_answers_identity_and_records_the_server() -> None:
    agent = make_agent()
    async with hub_side(agent) as hub:
        response = await hub.request(
            "GET",
            "/v1/info",
            [("cluster-proxy-server-id", "server-b"), ("cluster-proxy-server-count", "3")],
        )
        assert response.status == 200
        assert response.headers["content-type"] == "application/json"
        info = json.loads(response.body)
        assert info["agent_id"] == "agent-a"
        assert info["cluster"] == "cluster1"
        assert info["capabilities"] == ["connect", "half-close"]
        assert isinstance(info["version"], str) and info["version"]
        assert set(agent.servers) == {"server-b"}
        assert agent.servers["server-b"].server_count == 3
    assert agent.servers == {}  # forgotten with its tunnel


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("POST", "/v1/info", 405), ("GET", "/v1/nothing", 404), ("DELETE", "/", 404)],
)
async def test_other_requests_are_refused_with_a_reason(method: str, path: str, status: int) -> None:
    agent = make_agent()
    async with hub_side(agent) as hub:
        response = await hub.request(method, path)
    assert response.status == status
    assert response.headers[REASON_HEADER]
    assert path in response.headers[REASON_HEADER] or method in response.headers[REASON_HEADER]


@pytest.mark.parametrize(
    "authority", ["no-port", "host:0", "host:99999", "[::1:443", "a b:80", "::1:443", "host:¹", "[::1]:٤٤٣"]
)
async def test_malformed_target_is_400(authority: str) -> None:
    agent = make_agent()
    async with hub_side(agent) as hub:
        with pytest.raises(MalformedTarget) as info:
            await hub.open_connect(authority)
    assert info.value.status == 400
    assert dials(agent, "bad_target") == 1


async def test_a_failing_stream_does_not_take_the_tunnel_down(nursery: trio.Nursery) -> None:
    port = (await serve_echo(nursery)).port

    async def broken_connector(addresses, port):
        raise RuntimeError("bug in a dialer")

    agent = make_agent(connector=broken_connector)
    async with hub_side(agent) as hub:
        with pytest.raises(ConnectRefused) as info:
            await hub.open_connect(f"127.0.0.1:{port}")
        assert info.value.status == 500
        assert "RuntimeError" in info.value.reason
        response = await hub.request("GET", "/v1/info")
        assert response.status == 200
        assert not hub.dead


async def test_drain_lets_open_streams_finish(nursery: trio.Nursery) -> None:
    port = (await serve_echo(nursery)).port
    agent = make_agent()
    async with hub_side(agent) as hub:
        stream = await hub.open_connect(f"127.0.0.1:{port}")
        agent.drain()
        await wait_until(
            lambda: hub.peer_draining, timeout=5, what="the hub to see the drain", interval=0.005
        )
        assert not hub.accepts_streams
        await round_trip(stream, 200_000)  # the open stream still works
        with trio.fail_after(5):
            await agent.wait_idle()


async def test_hub_giving_up_during_the_dial_cancels_the_dial(nursery: trio.Nursery) -> None:
    """The hub drops its pending CONNECT while the agent dials: the reset cancels the dial, so no
    target connection is made for a stream that is gone, and the tunnel lives on."""
    port = (await serve_echo(nursery)).port
    dialling = trio.Event()
    release = trio.Event()
    connected: list[trio.SocketStream] = []
    cancelled: list[bool] = []

    async def slow_connector(addresses, target_port):
        dialling.set()
        try:
            await release.wait()
        except trio.Cancelled:
            cancelled.append(True)
            raise
        stream = await trio.open_tcp_stream(str(addresses[0]), target_port)
        connected.append(stream)
        return stream

    agent = make_agent(connector=slow_connector)
    async with hub_side(agent) as hub:
        with trio.move_on_after(5) as scope:
            async with trio.open_nursery() as inner:
                inner.start_soon(hub.open_connect, f"127.0.0.1:{port}")
                await dialling.wait()
                inner.cancel_scope.cancel()  # the hub client gave up on the pending CONNECT
        assert not scope.cancelled_caught
        with trio.fail_after(5):  # both waits together, as before
            await agent.wait_idle()
            await wait_until(
                lambda: not agent.metrics.registry.get_sample_value("cluster_proxy_agent_open_streams"),
                timeout=5,
                what="no open stream",
            )
        release.set()
        assert cancelled == [True]
        assert connected == []
        response = await hub.request("GET", "/v1/info")
        assert response.status == 200
