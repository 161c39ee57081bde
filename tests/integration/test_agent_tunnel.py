"""The agent service dialling a TLS hub in the same process: connect, identify, relay, reconnect, drain.

The hub (:mod:`tests.support.agent_hub`) is a minimal stand-in for the proxy-server's agent port: mTLS
with ALPN h2, then an ``open_mux(..., Role.OPENER)`` on the accepted connection, handed to the test
through a channel.
"""

from __future__ import annotations

import itertools
import json

import pytest
import trio
import trio.testing

from clusterproxy_agent.agent import Agent, AgentConfig
from clusterproxy_agent.app import Service
from clusterproxy_agent.config import AgentSettings
from clusterproxy_agent.egress import EgressPolicy, parse_rule
from clusterproxy_agent.tunnel import TunnelOptions, TunnelRunner
from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import open_mux
from clusterproxy_protocol.pki import DevCA, PemPair
from tests.support.agent_hub import Hub, admin_get, echo_once
from tests.support.targets import serve_echo
from tests.support.waiting import wait_until


@pytest.fixture(scope="module")
def tunnel_pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    directory = tmp_path_factory.mktemp("tunnel-pki")
    ca = DevCA.create_or_load(directory / "ca")
    other = DevCA.create_or_load(directory / "other", name="not-the-hub-ca")
    return {
        "ca": ca.ca_path,
        "other_ca": other.ca_path,
        "server": ca.issue_server("hub", ["localhost", "127.0.0.1"], directory),
        "agent": ca.issue_agent("cluster1", "agent-a", directory),
    }


def agent_settings(pki: dict[str, object], port: int, **overrides: object) -> AgentSettings:
    agent: PemPair = pki["agent"]  # type: ignore[assignment]
    options: dict[str, object] = {
        "server": ("127.0.0.1", port),
        "server_name": "localhost",
        "cluster": "cluster1",
        "agent_id": "agent-a",
        "ca": pki["ca"],
        "cert": agent.cert,
        "key": agent.key,
        "admin_listen": ("127.0.0.1", 0),
        "allow": [parse_rule("127.0.0.0/8")],
        "backoff_initial": 0.05,
        "backoff_max": 0.2,
        "drain_timeout": 10.0,
    }
    options.update(overrides)
    return AgentSettings(**options)  # type: ignore[arg-type]


def metric(service: Service, name: str, **labels: str) -> float | None:
    return service.agent.metrics.registry.get_sample_value(name, labels)


async def test_connects_identifies_relays_reconnects_and_drains(tunnel_pki, nursery: trio.Nursery) -> None:
    hub = await Hub(tunnel_pki).start(nursery)
    echo_port = (await serve_echo(nursery)).port
    service = Service(agent_settings(tunnel_pki, hub.port))
    done = trio.Event()

    async def run_service(task_status: trio.TaskStatus[None]) -> None:
        await service.run(task_status=task_status)
        done.set()

    await nursery.start(run_service)
    assert (await admin_get(service.admin_address, "/healthz")) == (200, "ok\n")

    # Connect and identify.
    mux = await hub.next_tunnel()
    response = await mux.request(
        "GET", "/v1/info", [("cluster-proxy-server-id", "hub-0"), ("cluster-proxy-server-count", "1")]
    )
    info = json.loads(response.body)
    assert (info["cluster"], info["agent_id"]) == ("cluster1", "agent-a")
    assert service.agent.servers["hub-0"].server_count == 1  # one replica: no second dial
    status, body = await admin_get(service.admin_address, "/readyz")
    assert (status, body) == (200, f"ok: 1 tunnel(s) connected to 127.0.0.1:{hub.port}\n")
    assert metric(service, "cluster_proxy_agent_tunnels_connected") == 1

    # Relay.
    assert await echo_once(mux, echo_port, b"hello through TLS") == b"hello through TLS"
    assert metric(service, "cluster_proxy_agent_dials_total", result="ok") == 1

    # The hub drops the tunnel: the agent comes back by itself.
    mux.close("hub restarting")
    mux = await hub.next_tunnel()
    assert metric(service, "cluster_proxy_agent_tunnel_reconnects_total") == 1
    assert await echo_once(mux, echo_port, b"again") == b"again"
    status, metrics_text = await admin_get(service.admin_address, "/metrics")
    assert status == 200
    assert 'cluster_proxy_agent_dials_total{result="ok"} 2.0' in metrics_text
    assert "cluster_proxy_agent_bytes_out_total" in metrics_text

    # Drain: no new streams, the open one finishes, then the tunnel closes and the service ends.
    open_stream = await mux.open_connect(f"127.0.0.1:{echo_port}")
    service.stop_requested.set()
    await wait_until(lambda: mux.peer_draining)
    assert (await admin_get(service.admin_address, "/readyz"))[0] == 503
    assert not done.is_set()
    await open_stream.send_all(b"last words")
    await open_stream.send_eof()
    assert await open_stream.receive_some() == b"last words"
    assert await open_stream.receive_some() == b""
    await open_stream.aclose()
    with trio.fail_after(5):
        await done.wait()
    assert mux.dead
    with trio.move_on_after(0.3):  # no reconnect after the shutdown
        await hub.tunnels.receive()
        raise AssertionError("the agent reconnected after its shutdown")


async def test_drain_timeout_cuts_streams_that_do_not_finish(tunnel_pki, nursery: trio.Nursery) -> None:
    hub = await Hub(tunnel_pki).start(nursery)
    echo_port = (await serve_echo(nursery)).port
    service = Service(agent_settings(tunnel_pki, hub.port, drain_timeout=0.3))
    done = trio.Event()

    async def run_service(task_status: trio.TaskStatus[None]) -> None:
        await service.run(task_status=task_status)
        done.set()

    await nursery.start(run_service)
    mux = await hub.next_tunnel()
    stream = await mux.open_connect(f"127.0.0.1:{echo_port}")
    service.stop_requested.set()
    with trio.fail_after(5):
        await done.wait()
    with pytest.raises(trio.BrokenResourceError):
        await stream.send_all(b"too late")
        await stream.receive_some()


async def test_wrong_ca_is_reported_and_not_ready(tunnel_pki, nursery: trio.Nursery) -> None:
    hub = await Hub(tunnel_pki).start(nursery)
    service = Service(agent_settings(tunnel_pki, hub.port, ca=tunnel_pki["other_ca"]))
    await nursery.start(service.run)
    await wait_until(lambda: service.agent.last_error is not None)
    assert "certificate verify failed" in service.agent.last_error
    status, body = await admin_get(service.admin_address, "/readyz")
    assert status == 503
    assert "certificate verify failed" in body
    assert service.agent.connected == 0
    service.stop_requested.set()


async def test_server_without_alpn_h2_is_refused(tunnel_pki, nursery: trio.Nursery) -> None:
    hub = await Hub(tunnel_pki, alpn=["http/1.1"]).start(nursery)
    service = Service(agent_settings(tunnel_pki, hub.port))
    await nursery.start(service.run)
    await wait_until(lambda: service.agent.last_error is not None)
    assert "ALPN" in service.agent.last_error
    service.stop_requested.set()


# --- reconnect timing (mock clock, in-memory transport) --------------------------------------------------


async def test_backoff_grows_and_resets_after_a_stable_tunnel(autojump_clock: trio.testing.MockClock) -> None:
    agent = Agent(AgentConfig("cluster1", "agent-a", policy=EgressPolicy.build()))
    attempts: list[float] = []
    peers: list[trio.abc.Stream] = []
    fail = True

    async def opener(_transport_tasks: trio.Nursery) -> trio.abc.Stream:
        attempts.append(trio.current_time())
        if fail:  # a listener that resets (a refusal, nothing listening, backs off less: test_replica_set)
            raise ConnectionResetError(104, "Connection reset by peer")
        left, right = trio.testing.memory_stream_pair()
        peers.append(left)
        return right

    options = TunnelOptions(server=("hub", 8091), keepalive=None, backoff_initial=1.0, backoff_max=8.0)
    runner = TunnelRunner(agent, options, opener, rng=lambda: 1.0)  # no jitter: the ceilings themselves
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner.run)
        await wait_until(lambda: len(attempts) == 6, timeout=100)
        gaps = [round(b - a, 3) for a, b in itertools.pairwise(attempts)]
        assert gaps == [1.0, 2.0, 4.0, 8.0, 8.0]
        assert agent.last_error == "Connection reset by peer"
        assert agent.metrics.registry.get_sample_value("cluster_proxy_agent_tunnel_reconnects_total") == 5

        fail = False
        await wait_until(lambda: agent.connected == 1, timeout=100)
        async with open_mux(peers[-1], Role.OPENER):
            await trio.sleep(11)  # a tunnel that lived longer than 10 s ...
        await wait_until(lambda: agent.connected == 0, timeout=100)
        before = len(attempts)
        await wait_until(lambda: len(attempts) == before + 1, timeout=100)
        assert round(attempts[-1] - attempts[-2], 3) == pytest.approx(11 + 1.0, abs=0.01)  # ... resets to 1 s
        runner.stop()
        agent.close_all("test over")
    assert runner.stopped.is_set()
