"""Garbage from a registered agent closes its tunnel at once (issue 10, finding 8): a frame header
announcing more than the tunnel's max frame size is refused when its 9 bytes arrive, not once the
announced megabytes have (they never do: before, the tunnel hung until the PING timeout)."""

from __future__ import annotations

import pytest
import trio

from clusterproxy_sdk import open_tunnel
from tests.support.inprocess import start_server
from tests.support.pki import PkiFiles
from tests.support.rogue_agent import Behaviour, assert_echo, client_files, rogue_then_healthy
from tests.support.targets import serve_echo


async def test_garbage_after_registration_closes_the_tunnel_and_fails_its_streams_at_once(
    nursery: trio.Nursery, pki: PkiFiles
) -> None:
    server, bound = await start_server(nursery, pki)
    echo = await serve_echo(nursery)
    rogue, _ = await rogue_then_healthy(nursery, server, bound.agent[1], pki, Behaviour.RELAY)
    rogue_tunnel = server.registry.find("cluster1", "agent-a")
    assert rogue_tunnel is not None
    async with open_tunnel(
        f"127.0.0.1:{bound.client[1]}", client_files(pki), server_hostname="localhost"
    ) as tunnel:
        stream = await tunnel.connect("cluster1", "127.0.0.1", echo.port)  # ties go to the rogue
        assert rogue.connects == 1
        await stream.send_all(b"before")
        assert await stream.receive_some() == b"before"

        await rogue.send_raw(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        with trio.fail_after(1.0):  # the bound: no waiting for the PING timeout (20 s) or a frame's end
            with pytest.raises(trio.BrokenResourceError):
                while await stream.receive_some():
                    pass
            await rogue_tunnel.mux.closed.wait()
        assert "protocol error" in rogue_tunnel.mux.dead_reason or "frame" in rogue_tunnel.mux.dead_reason
        assert server.registry.find("cluster1", "agent-a") is None

        await assert_echo(tunnel, echo.port)
