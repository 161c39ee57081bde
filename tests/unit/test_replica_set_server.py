"""The proxy-server's side of replicas, in process (real TLS on loopback, real agents): a young
replica's startup grace, the agent's 409 for a replica it already holds, and the drain on SIGTERM
(readiness, listeners, HTTP/2 clients told and served, the drain timeout's loud end, a second signal)."""

from __future__ import annotations

import dataclasses
import json
import socket

import pytest
import trio

from clusterproxy_agent.app import Service
from clusterproxy_protocol.config import parse_args_or_exit
from clusterproxy_protocol.errors import ConnectRefused
from clusterproxy_sdk import TLSFiles, open_tunnel
from clusterproxy_server.app import ProxyServer
from clusterproxy_server.main import build_parser, config_from_args
from tests.support.inprocess import agent_settings, start_server
from tests.support.pki import PkiFiles
from tests.support.procs import client_tls, http_get
from tests.support.targets import serve_echo
from tests.support.waiting import wait_until


def client_files(pki: PkiFiles) -> TLSFiles:
    return TLSFiles(pki.ca, pki.client.cert, pki.client.key)


async def echo_through(port: int, pki: PkiFiles, authority: tuple[str, int], cluster: str | None) -> bytes:
    async with open_tunnel(f"127.0.0.1:{port}", client_files(pki), server_hostname="localhost") as tunnel:
        if cluster is None:
            stream = await tunnel.connect_kube_apiserver("cluster1")
        else:
            stream = await tunnel.connect(cluster, *authority)
        async with stream:
            await stream.send_all(b"hello")
            await stream.send_eof()
            return await stream.receive_some()


async def test_a_young_replica_waits_for_agents_within_its_startup_grace(
    pki: PkiFiles, nursery: trio.Nursery
) -> None:
    echo = await serve_echo(nursery)
    server, bound = await start_server(nursery, pki, startup_grace=10.0)
    answers: list[bytes] = []

    async def ask() -> None:
        answers.append(await echo_through(bound.client[1], pki, ("127.0.0.1", echo.port), "cluster1"))

    nursery.start_soon(ask)
    await wait_until(lambda: server.metrics.pending_dials._value.get() == 1, what="the request waiting")
    assert not answers  # cluster1 is unknown to this replica: held, not refused with 404
    settings = agent_settings(pki, [bound.agent])
    settings.kube_apiserver = ("127.0.0.1", echo.port)
    await nursery.start(Service(settings).run)
    await wait_until(lambda: answers, what="the answer once the agent registered")
    assert answers == [b"hello"]


@pytest.mark.parametrize("cluster", ["cluster9", None], ids=["named", "bare-name"])
async def test_without_a_grace_an_unknown_cluster_is_refused_at_once(
    pki: PkiFiles, nursery: trio.Nursery, cluster: str | None
) -> None:
    _server, bound = await start_server(nursery, pki)  # startup_grace 0: one replica's default
    with trio.fail_after(2), pytest.raises(ConnectRefused) as refused:
        await echo_through(bound.client[1], pki, ("127.0.0.1", 1), cluster)
    assert refused.value.status in (400, 404)


async def test_after_the_grace_an_unknown_cluster_is_refused(pki: PkiFiles, nursery: trio.Nursery) -> None:
    _server, bound = await start_server(nursery, pki, startup_grace=0.3)
    began = trio.current_time()
    with pytest.raises(ConnectRefused) as refused:
        await echo_through(bound.client[1], pki, ("127.0.0.1", 1), "cluster9")
    assert refused.value.status == 404
    assert 0.2 < trio.current_time() - began < 2


async def test_an_agent_holding_this_replica_declines_a_second_tunnel(
    pki: PkiFiles, nursery: trio.Nursery
) -> None:
    """Two addresses of the same replica: the agent answers the second tunnel's /v1/info 409, and the
    server closes it without registering it (no duplicate-identity refusal, no second tunnel)."""
    server, bound = await start_server(nursery, pki, server_id="hub-0", server_count=1)
    service = Service(agent_settings(pki, [bound.agent, ("localhost", bound.agent[1])]))
    await nursery.start(service.run)
    duplicates = server.metrics.agent_duplicate_dials.labels("cluster1")
    await wait_until(lambda: duplicates._value.get() >= 2, timeout=10, what="declined tunnels")
    assert len(server.registry.tunnels("cluster1")) == 1
    assert service.agent.held_replicas() == {"hub-0"}
    assert server.metrics.rejected.labels("agent", "duplicate_identity")._value.get() == 0
    url = f"https://127.0.0.1:{bound.admin[1]}/api/v1/agents"
    rows = json.loads((await trio.to_thread.run_sync(http_get, url, 5.0, client_tls(pki.client, pki.ca)))[1])
    assert [(r["cluster"], r["server_id"]) for r in rows] == [("cluster1", "hub-0")]
    servers = service.agent.describe_servers()
    assert servers["held_replicas"] == ["hub-0"] and servers["expected_replicas"] == 2


def agent_b(pki: PkiFiles, servers: list[tuple[str, int]]) -> Service:
    pair = pki.agent("cluster1", "agent-b")
    settings = dataclasses.replace(
        agent_settings(pki, servers), agent_id="agent-b", cert=pair.cert, key=pair.key
    )
    return Service(settings)


async def test_a_request_waits_for_the_successor_of_a_drained_agent(
    pki: PkiFiles, nursery: trio.Nursery
) -> None:
    """A drained node: the cluster's only agent drains and leaves while its successor starts
    elsewhere. A request meanwhile waits for the successor (the replacement grace) rather than 503."""
    echo = await serve_echo(nursery)
    server, bound = await start_server(nursery, pki)  # one replica: no startup grace
    old = Service(agent_settings(pki, [bound.agent]))
    await nursery.start(old.run)
    await wait_until(lambda: server.registry.tunnels("cluster1"), what="the agent")
    await old.shutdown()
    await wait_until(lambda: not server.registry.tunnels("cluster1"), what="the drained agent gone")
    answers: list[bytes] = []

    async def ask() -> None:
        answers.append(await echo_through(bound.client[1], pki, ("127.0.0.1", echo.port), "cluster1"))

    nursery.start_soon(ask)
    await wait_until(lambda: server.metrics.pending_dials._value.get() == 1, what="the request waiting")
    await nursery.start(agent_b(pki, [bound.agent]).run)
    await wait_until(lambda: answers, what="the answer through the successor")
    assert answers == [b"hello"]


async def test_a_replacement_that_never_comes_is_answered_after_the_grace(
    pki: PkiFiles, nursery: trio.Nursery
) -> None:
    server, bound = await start_server(nursery, pki)
    server.relayer.replacement_grace = 0.5
    old = Service(agent_settings(pki, [bound.agent]))
    await nursery.start(old.run)
    await wait_until(lambda: server.registry.tunnels("cluster1"), what="the agent")
    await old.shutdown()
    await wait_until(lambda: not server.registry.tunnels("cluster1"), what="the drained agent gone")
    with trio.fail_after(5), pytest.raises(ConnectRefused) as refused:
        await echo_through(bound.client[1], pki, ("127.0.0.1", 1), "cluster1")
    assert refused.value.status == 503


async def test_an_agent_lost_without_a_drain_is_answered_at_once(
    pki: PkiFiles, nursery: trio.Nursery
) -> None:
    """No drain, no successor announced (the agent's process killed): the request is not held."""
    server, bound = await start_server(nursery, pki)
    async with trio.open_nursery() as agent_side:
        await agent_side.start(Service(agent_settings(pki, [bound.agent])).run)
        await wait_until(lambda: server.registry.tunnels("cluster1"), what="the agent")
        agent_side.cancel_scope.cancel()  # gone at once: no SETTINGS that say it drains
    await wait_until(lambda: not server.registry.tunnels("cluster1"), what="the agent gone")
    assert server.registry.replacement_since("cluster1") is None
    began = trio.current_time()
    with pytest.raises(ConnectRefused) as refused:
        await echo_through(bound.client[1], pki, ("127.0.0.1", 1), "cluster1")
    assert refused.value.status == 503
    assert trio.current_time() - began < 2


async def get(url: str) -> tuple[int, bytes]:
    """The admin port of a server in this very process: never block its event loop."""
    return await trio.to_thread.run_sync(http_get, url)


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


async def refused(*ports: int) -> bool:
    return all([await trio.to_thread.run_sync(_refused, port) for port in ports])


async def start_hub(
    pki: PkiFiles, nursery: trio.Nursery, **config: object
) -> tuple[ProxyServer, object, Service]:
    server, bound = await start_server(nursery, pki, **config)
    service = Service(agent_settings(pki, [bound.agent]))
    await nursery.start(service.run)
    await wait_until(lambda: server.registry.tunnels("cluster1"), what="the agent")
    return server, bound, service


async def test_drain_stops_accepting_tells_everyone_and_lets_streams_finish(
    pki: PkiFiles, nursery: trio.Nursery
) -> None:
    server, bound, service = await start_hub(pki, nursery, drain_timeout=30.0)
    echo = await serve_echo(nursery)
    admin = f"http://127.0.0.1:{bound.admin[1]}/readyz"
    assert (await get(admin))[0] == 200
    done = trio.Event()
    async with (
        open_tunnel(f"127.0.0.1:{bound.client[1]}", client_files(pki), server_hostname="localhost") as busy,
        open_tunnel(f"127.0.0.1:{bound.client[1]}", client_files(pki), server_hostname="localhost") as fresh,
    ):
        stream = await busy.connect("cluster1", "127.0.0.1", echo.port)
        began = trio.current_time()

        async def shutdown() -> None:
            await server.shutdown()
            done.set()

        nursery.start_soon(shutdown)
        await wait_until(lambda: server.drain.started.is_set(), what="the drain")
        assert await get(admin) == (503, b"not ready: draining\n")  # at once
        await wait_until(lambda: refused(bound.client[1], bound.agent[1]), what="listeners closed")
        await wait_until(lambda: not busy.accepts_streams, what="the busy connection told")
        await wait_until(
            lambda: all(mux.peer_draining for mux in service.agent.tunnels), what="the agent told"
        )
        # A connection made before the drain that had opened no stream gets its first one.
        first = await fresh.connect("cluster1", "127.0.0.1", echo.port)
        async with first:
            await first.send_all(b"first")
            await first.send_eof()
            assert await first.receive_some() == b"first"
        await wait_until(lambda: not fresh.is_alive, what="the fresh connection closed once idle")
        assert "draining" in fresh.mux.dead_reason
        # The open stream goes on, then the server stops well before its drain timeout.
        await stream.send_all(b"still here")
        await stream.send_eof()
        assert await stream.receive_some() == b"still here"
        await stream.aclose()
        with trio.fail_after(10):
            await done.wait()
    assert trio.current_time() - began < 10


@pytest.mark.parametrize("second_signal", [False, True], ids=["drain-timeout", "second-signal"])
async def test_streams_open_at_the_end_of_the_drain_fail_loudly(
    pki: PkiFiles, nursery: trio.Nursery, second_signal: bool
) -> None:
    server, bound, _service = await start_hub(pki, nursery, drain_timeout=30.0 if second_signal else 0.5)
    echo = await serve_echo(nursery)
    async with open_tunnel(
        f"127.0.0.1:{bound.client[1]}", client_files(pki), server_hostname="localhost"
    ) as t:
        stream = await t.connect("cluster1", "127.0.0.1", echo.port)
        began = trio.current_time()
        nursery.start_soon(server.shutdown)
        if second_signal:
            await wait_until(lambda: server.drain.started.is_set())
            server.cut_drain()
        with trio.fail_after(10), pytest.raises(trio.BrokenResourceError) as broken:
            while True:
                await stream.send_all(b"x")
                await stream.receive_some()
                await trio.sleep(0.02)
    assert "GOAWAY 8: proxy-server shut down: streams still open" in str(broken.value)
    assert trio.current_time() - began < (2 if second_signal else 3)


async def test_a_shutdown_delay_keeps_serving_while_readiness_fails(
    pki: PkiFiles, nursery: trio.Nursery
) -> None:
    """--shutdown-delay: for a balancer that learns only from /readyz (a Service's endpoints), the
    replica still accepts and serves new connections for the delay, then drains as usual."""
    server, bound, _service = await start_hub(pki, nursery, shutdown_delay=1.0)
    echo = await serve_echo(nursery)
    nursery.start_soon(server.shutdown)
    await wait_until(lambda: server.stopping, what="SIGTERM")
    began = trio.current_time()
    admin = f"http://127.0.0.1:{bound.admin[1]}/readyz"
    assert await get(admin) == (503, b"not ready: draining\n")
    assert not server.drain.started.is_set()
    # A new connection and stream during the delay: served.
    assert await echo_through(bound.client[1], pki, ("127.0.0.1", echo.port), "cluster1") == b"hello"
    assert trio.current_time() - began < 1.0
    await wait_until(lambda: refused(bound.client[1]), timeout=5, what="the ports closed after the delay")
    assert trio.current_time() - began >= 0.9


@pytest.mark.parametrize(
    ("flags", "grace", "delay"),
    [
        ([], 0.0, 0.0),  # one replica: nothing to wait for
        (["--server-count", "3"], 10.0, 0.0),  # replicas: a new one waits for its agents
        (["--server-count", "3", "--startup-grace", "0", "--shutdown-delay", "5s"], 0.0, 5.0),
    ],
)
def test_replica_flags(pki: PkiFiles, flags: list[str], grace: float, delay: float) -> None:
    argv = ["--ca", str(pki.ca), "--cert", str(pki.server.cert), "--key", str(pki.server.key), *flags]
    config = config_from_args(parse_args_or_exit(build_parser(), argv, environ={}))
    assert (config.startup_grace, config.shutdown_delay) == (grace, delay)
    assert config.server_id  # the host name plus a random suffix by default
