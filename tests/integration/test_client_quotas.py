"""Per client identity bounds on a real server in-process (quotas.py): a noisy identity is refused with
429 and the reason, counted under its name, while another identity's streams go through."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import trio

from clusterproxy_protocol import tls
from clusterproxy_protocol.pki import DevCA, PemPair
from clusterproxy_sdk import TooManyRequests, Tunnel, open_tunnel
from clusterproxy_server.app import ProxyServer
from clusterproxy_server.quotas import QuotaSettings
from tests.support.clients import client_context, h1_connect
from tests.support.inprocess import run_wire_agent, start_server
from tests.support.pki import PkiFiles
from tests.support.targets import Target, serve_echo
from tests.support.waiting import wait_until


async def server_with(
    nursery: trio.Nursery, pki: PkiFiles, **quotas: float
) -> tuple[ProxyServer, int, Target]:
    server, bound = await start_server(nursery, pki, quotas=QuotaSettings(**quotas))  # type: ignore[arg-type]
    echo = await serve_echo(nursery)
    nursery.start_soon(run_wire_agent, bound.agent[1], pki, "cluster1", "agent-a")
    await wait_until(lambda: server.registry.tunnels("cluster1"), what="the agent's tunnel")
    return server, bound.client[1], echo


def neighbour(pki: PkiFiles, directory: Path) -> PemPair:
    return DevCA.create_or_load(pki.ca.parent).issue_client("neighbour", directory)


async def echo_once(tunnel: Tunnel, echo: Target) -> None:
    stream = await tunnel.connect("cluster1", echo.host, echo.port)
    async with stream:
        await stream.send_all(b"ping")
        await stream.send_eof()
        assert await stream.receive_some() == b"ping"


def refusals(server: ProxyServer, client: str, bound: str) -> float:
    value = server.metrics.registry.get_sample_value(
        "cluster_proxy_server_client_refusals_total", {"client": client, "bound": bound}
    )
    return value or 0.0


async def test_a_client_over_its_stream_rate_is_refused_and_another_is_not(
    nursery: trio.Nursery, pki: PkiFiles, tmp_path: Path
) -> None:
    # One stream a second after a burst of 10: a client that opens streams back to back is over that
    # rate however slow the machine is (at 20 a second, a loaded machine's round trips were slower
    # than the rate and nothing was refused).
    server, port, echo = await server_with(nursery, pki, stream_rate=1, stream_burst=10)
    refused: list[str] = []
    async with open_tunnel(f"127.0.0.1:{port}", pki.sdk_files(), server_hostname="localhost") as noisy:
        for _ in range(100):  # stops at the tenth refusal
            try:
                await echo_once(noisy, echo)
            except TooManyRequests as exc:
                refused.append(exc.reason)
                if len(refused) == 10:
                    break
    other = neighbour(pki, tmp_path)
    async with open_tunnel(f"127.0.0.1:{port}", pki.sdk_files(other), server_hostname="localhost") as calm:
        for _ in range(10):
            await echo_once(calm, echo)  # a fresh bucket of its own: none refused
    assert len(refused) >= 10, refused
    assert all(
        "faster than 1 per second" in reason and "--client-stream-rate" in reason for reason in refused
    )
    assert refusals(server, "test-admin", "rate") == len(refused)
    assert refusals(server, "neighbour", "rate") == 0


async def test_concurrent_streams_and_connections_are_bounded_per_identity(
    nursery: trio.Nursery, pki: PkiFiles, tmp_path: Path
) -> None:
    server, port, echo = await server_with(nursery, pki, max_streams=3, max_connections=2)
    async with contextlib.AsyncExitStack() as held:
        first = await held.enter_async_context(
            open_tunnel(f"127.0.0.1:{port}", pki.sdk_files(), server_hostname="localhost")
        )
        second = await held.enter_async_context(
            open_tunnel(f"127.0.0.1:{port}", pki.sdk_files(), server_hostname="localhost")
        )
        for tunnel in (first, first, second):  # three streams open, over both connections
            await held.enter_async_context(await tunnel.connect("cluster1", echo.host, echo.port))
        with pytest.raises(
            TooManyRequests, match=r"already has 3 streams open \(--client-max-concurrent-streams 3\)"
        ):
            await second.connect("cluster1", echo.host, echo.port)
        # A third connection of the same certificate: refused as a whole, here over HTTP/1.1.
        reply = await h1_connect(port, client_context(pki, alpn=["http/1.1"]), echo.address)
        assert reply.status == 429
        assert b"already has 2 connections open (--client-max-connections 2)" in reply.body
        # Another identity has bounds of its own.
        other = neighbour(pki, tmp_path)
        context = tls.client_context(other.cert, other.key, pki.ca, alpn=["http/1.1"])
        answer = await h1_connect(port, context, echo.address, {"cluster-proxy-cluster": "cluster1"})
        assert answer.status == 200 and answer.stream is not None
        await answer.stream.aclose()
    assert refusals(server, "test-admin", "streams") == 1
    assert refusals(server, "test-admin", "connections") == 1
    # Everything closed: the identity is forgotten, and a new stream is admitted again.
    await wait_until(lambda: server.quotas.ledger_count() == 0, what="the identities to be forgotten")
    async with open_tunnel(f"127.0.0.1:{port}", pki.sdk_files(), server_hostname="localhost") as again:
        await echo_once(again, echo)
