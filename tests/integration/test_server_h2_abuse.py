"""HTTP/2 abuse against the in-process proxy-server's client port, by a raw attacker over mTLS (frames
built with hyperframe and hpack, so every rule an h2 client keeps can be broken), with the real agent
behind it (issue 10, findings 2 to 6)."""

from __future__ import annotations

import dataclasses

import trio
from hyperframe.frame import DataFrame, GoAwayFrame, PingFrame, RstStreamFrame, SettingsFrame

from clusterproxy_protocol.core import ENHANCE_YOUR_CALM, FRAME_SIZE_ERROR, NO_ERROR, REFUSED_STREAM
from clusterproxy_server.app import ProxyServer, ServerConfig
from clusterproxy_server.config import CLIENT_TUNNEL
from tests.support.battery import HANG_GUARD
from tests.support.clients import sdk_echo_intact
from tests.support.h2_attacker import Attacker
from tests.support.h2_attacks import (
    flood_until_goaway,
    oversized_frame_start,
    ping_until_closed,
    rapid_reset_burst,
    refusal_through_tiny_window,
    resets_of,
    send_half_frame,
    stall_streams,
)
from tests.support.pki import PkiFiles
from tests.support.rogue_agent import start_real_agent
from tests.support.targets import serve_echo
from tests.support.waiting import wait_until


async def start(nursery: trio.Nursery, pki: PkiFiles, **limits: float) -> tuple[ProxyServer, int, int]:
    """The server (client-port limits overridden by ``limits``), the real agent of cluster1, and an
    echo target; returns the server, its client port and the echo port."""
    config = ServerConfig(
        ca=pki.ca,
        cert=pki.server.cert,
        key=pki.server.key,
        agent_listen=("127.0.0.1", 0),
        client_listen=("127.0.0.1", 0),
        admin_listen=("127.0.0.1", 0),
        client_tunnel=dataclasses.replace(CLIENT_TUNNEL, **limits),
    )
    server = ProxyServer(config)
    bound = await nursery.start(server.run)
    await start_real_agent(nursery, bound.agent[1], pki, "cluster1", "agent-a")
    await wait_until(lambda: server.registry.tunnels("cluster1"), what="the agent's tunnel")
    return server, bound.client[1], (await serve_echo(nursery)).port


def trips(server: ProxyServer, limit: str) -> float:
    value = server.metrics.registry.get_sample_value(
        "cluster_proxy_server_http2_limit_trips_total", {"port": "client", "limit": limit}
    )
    return value or 0.0


async def test_rapid_reset_gets_goaway_and_dials_nothing_while_others_transfer(
    nursery: trio.Nursery, pki: PkiFiles
) -> None:
    """Finding 2: 50,000 HEADERS+RST_STREAM pairs on one connection. GOAWAY ENHANCE_YOUR_CALM (in 0.1-0.5 s
    on an idle machine: printed, not asserted); the agent dials at most the budget (500) for streams already gone; a 4 MiB transfer on another
    connection completes with the right sha256 meanwhile; the agent's tunnel stays."""
    server, port, echo_port = await start(nursery, pki)
    tunnel_before = server.registry.tunnels("cluster1")[0].mux
    counted = await serve_echo(nursery)  # the attack's own target: every dial shows here
    attacker = await Attacker.connect(port, pki)
    burst = rapid_reset_burst(attacker, counted.address)
    transfer_done = trio.Event()

    async def transfer() -> None:
        assert await sdk_echo_intact(port, pki, echo_port, 4 << 20)
        transfer_done.set()

    nursery.start_soon(transfer)
    started = trio.current_time()
    with trio.fail_after(HANG_GUARD):
        goaway = await flood_until_goaway(attacker, burst)
    elapsed = trio.current_time() - started
    assert goaway.error_code == ENHANCE_YOUR_CALM
    assert b"reset" in goaway.additional_data
    with trio.fail_after(20):
        await transfer_done.wait()
    dials = counted.connections
    print(f"rapid reset: GOAWAY after {elapsed:.3f}s, target dials {dials}")
    assert dials <= CLIENT_TUNNEL.reset_budget
    assert trips(server, "reset_budget") == 1
    assert server.registry.tunnels("cluster1")[0].mux is tunnel_before and not tunnel_before.dead
    assert (
        server.metrics.registry.get_sample_value(
            "cluster_proxy_server_agent_connects_total", {"cluster": "cluster1"}
        )
        == 1
    )


async def test_streams_beyond_the_limit_are_refused_and_the_rest_work(
    nursery: trio.Nursery, pki: PkiFiles
) -> None:
    """h2spec 5.1.2: the limit advertised is enforced, the excess gets REFUSED_STREAM, the connection lives."""
    server, port, echo_port = await start(nursery, pki, max_concurrent_streams=4)
    attacker = await Attacker.connect(port, pki)
    settings = await attacker.until(SettingsFrame)
    assert settings.settings[SettingsFrame.MAX_CONCURRENT_STREAMS] == 4
    await attacker.send(
        b"".join(attacker.connect_frame(sid, f"127.0.0.1:{echo_port}") for sid in (1, 3, 5, 7, 9))
    )
    with trio.fail_after(HANG_GUARD):
        refused = await attacker.until(RstStreamFrame)
    assert (refused.stream_id, refused.error_code) == (9, REFUSED_STREAM)
    assert trips(server, "concurrent_streams") == 1
    # The four streams within the limit were opened: each echoes.
    await attacker.send(DataFrame(7, b"still here", flags=["END_STREAM"]).serialize())
    with trio.fail_after(HANG_GUARD):
        echoed = await attacker.until(DataFrame, 7)
    assert echoed.data == b"still here"


async def test_unread_ping_acks_close_the_connection(nursery: trio.Nursery, pki: PkiFiles) -> None:
    """Finding 3: PINGs from a client that never reads its ACKs close the connection at the cap."""
    server, port, _ = await start(nursery, pki, max_reply_backlog=64 << 10)
    attacker = await Attacker.connect(port, pki)
    with trio.fail_after(20):
        sent = await ping_until_closed(attacker)
    print(f"unread PINGs: closed after {sent >> 10} KiB of PINGs")
    assert trips(server, "reply_backlog") == 1


async def test_a_half_sent_frame_closes_the_connection_at_the_deadline(
    nursery: trio.Nursery, pki: PkiFiles
) -> None:
    """Finding 5: a frame announced and sent but for 10 bytes is held no longer than the frame timeout,
    and a 16 MiB frame is refused at its header."""
    server, port, echo_port = await start(nursery, pki, frame_timeout=0.5)
    attacker = await Attacker.connect(port, pki)
    started = trio.current_time()
    await send_half_frame(attacker, f"127.0.0.1:{echo_port}")
    with trio.fail_after(HANG_GUARD):
        goaway = await attacker.until(GoAwayFrame)
    held = trio.current_time() - started
    assert goaway.error_code == ENHANCE_YOUR_CALM
    assert held >= 0.4, held  # the deadline closed it, not something earlier
    assert trips(server, "frame_timeout") == 1

    attacker = await Attacker.connect(port, pki)
    await attacker.send(oversized_frame_start(sent=1000))
    with trio.fail_after(HANG_GUARD):
        goaway = await attacker.until(GoAwayFrame)
    assert goaway.error_code == FRAME_SIZE_ERROR
    assert trips(server, "frame_size") == 1


async def test_stalled_streams_are_reset_after_the_stall_timeout(
    nursery: trio.Nursery, pki: PkiFiles
) -> None:
    """Finding 4: streams with posted data and the receive window held at 0 are reset, not kept."""
    server, port, echo_port = await start(nursery, pki, stall_timeout=0.5)
    attacker = await Attacker.connect(port, pki, _4=0)  # SETTINGS_INITIAL_WINDOW_SIZE 0
    sids = list(range(1, 16, 2))
    await stall_streams(attacker, f"127.0.0.1:{echo_port}", sids)
    started = trio.current_time()
    with trio.fail_after(HANG_GUARD):
        await resets_of(attacker, sids)
    print(f"stalled streams: {len(sids)} reset after {trio.current_time() - started:.2f}s")
    assert trips(server, "stream_stall") == len(sids)
    await wait_until(lambda: server.open_relays == 0, what="the relays to end")
    tunnel = server.registry.tunnels("cluster1")[0]
    await wait_until(lambda: tunnel.mux.open_streams == 0, what="the agent streams to end")
    await attacker.send(PingFrame(0, opaque_data=b"alive???").serialize())  # the connection itself lives
    with trio.fail_after(HANG_GUARD):
        assert (await attacker.until(PingFrame)).opaque_data == b"alive???"


async def test_a_refusal_into_a_tiny_window_waits_for_window(nursery: trio.Nursery, pki: PkiFiles) -> None:
    """Finding 6: with a 3-byte stream window, an error reply sends 3 bytes, waits, and finishes the body
    when the window opens: never a short body with END_STREAM."""
    _, port, _ = await start(nursery, pki)
    attacker = await Attacker.connect(port, pki, _4=3)
    with trio.fail_after(10):
        refusal = await refusal_through_tiny_window(attacker)
    assert refusal.length > 3 and int(refusal.fields[":status"]) >= 400
    assert len(refusal.first_chunk) == 3 and not refusal.first_ended
    assert len(refusal.body) == refusal.length
    assert refusal.body.decode().strip() == refusal.fields["cluster-proxy-reason"]


async def test_an_idle_client_connection_is_closed(nursery: trio.Nursery, pki: PkiFiles) -> None:
    server, port, _ = await start(nursery, pki, idle_timeout=0.3)
    attacker = await Attacker.connect(port, pki)
    started = trio.current_time()
    with trio.fail_after(HANG_GUARD):
        goaway = await attacker.until(GoAwayFrame)
    assert goaway.error_code == NO_ERROR
    assert trio.current_time() - started >= 0.25  # the idle timeout closed it, not something earlier
    assert trips(server, "idle_timeout") == 1
