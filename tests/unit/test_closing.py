"""Clean ends and aborts on real sockets: close_notify reaches a peer that requires it, a peer that
never answers costs at most the grace, a socket armed to reset resets, and a tunnel (Mux) ends its
TLS with close_notify after the GOAWAY exchange."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import pytest
import trio

from clusterproxy_protocol.closing import abort, close_cleanly, reset_if_process_dies
from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import open_mux
from tests.support.pki import PkiFiles
from tests.support.tls_streams import tls_pair


async def _tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    """Two ends of one loopback TCP connection (SO_LINGER only means something for TCP)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    dialed = await trio.open_tcp_stream("127.0.0.1", port)
    accepted = await listeners[0].accept()
    await listeners[0].aclose()
    return accepted, dialed  # type: ignore[return-value]


async def _hub_and_strict_client(pki: PkiFiles) -> tuple[trio.SSLStream, trio.SSLStream]:
    """The hub's end as the proxy-server makes it (https_compatible: tolerant), and a client that
    treats an EOF without close_notify as an error (trio's default, like the SDK)."""
    return await tls_pair(pki, await _tcp_pair(), https_compatible=True)


async def _end_seen_by(client: trio.SSLStream) -> str:
    try:
        while await client.receive_some(65536):
            pass
    except trio.BrokenResourceError as exc:
        return f"error: {exc.__cause__!r}"
    return "clean"


async def test_close_cleanly_sends_close_notify_where_aclose_does_not(pki: PkiFiles) -> None:
    hub, client = await _hub_and_strict_client(pki)
    await hub.send_all(b"last bytes")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(close_cleanly, hub)
        assert await client.receive_some(100) == b"last bytes"
        assert await _end_seen_by(client) == "clean"
        await client.aclose()  # our close_notify answers theirs: their close returns at once

    # The control: what the proxy-server did before (aclose of an https_compatible stream).
    hub, client = await _hub_and_strict_client(pki)
    await hub.aclose()
    assert "EOF occurred in violation of protocol" in await _end_seen_by(client)


async def test_close_cleanly_waits_at_most_the_grace_for_a_silent_peer(pki: PkiFiles) -> None:
    hub, client = await _hub_and_strict_client(pki)
    started = trio.current_time()
    await close_cleanly(hub, grace=0.3)
    elapsed = trio.current_time() - started
    assert 0.25 < elapsed < 1.5, elapsed
    assert await _end_seen_by(client) == "clean"  # the close_notify went out before the wait


async def test_a_socket_armed_to_reset_resets_unless_closed_cleanly() -> None:
    accepted, dialed = await _tcp_pair()
    reset_if_process_dies(accepted)
    await trio.aclose_forcefully(accepted)  # as the kernel closes the sockets of a killed process
    with pytest.raises(trio.BrokenResourceError) as raised:
        await dialed.receive_some(10)
    assert isinstance(raised.value.__cause__, ConnectionResetError)

    accepted, dialed = await _tcp_pair()
    reset_if_process_dies(accepted)
    await accepted.send_all(b"done")
    await close_cleanly(accepted)
    assert await dialed.receive_some(10) == b"done"
    assert await dialed.receive_some(10) == b""  # FIN: the data are complete


async def test_abort_resets_a_tcp_connection() -> None:
    accepted, dialed = await _tcp_pair()
    await abort(accepted)
    with pytest.raises(trio.BrokenResourceError) as raised:
        await dialed.receive_some(10)
    assert isinstance(raised.value.__cause__, ConnectionResetError)


@pytest.mark.parametrize("role", [Role.ACCEPTOR, Role.OPENER])
async def test_a_tunnel_closed_here_ends_its_tls_with_close_notify(pki: PkiFiles, role: Role) -> None:
    """Both ends of an agent tunnel and the client port's HTTP/2 side close a Mux this way."""
    hub, client = await _hub_and_strict_client(pki)
    peer = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=role is Role.ACCEPTOR, header_encoding="utf-8")
    )
    peer.initiate_connection()
    await client.send_all(peer.data_to_send())
    outcome: list[str] = []

    async def strict_peer() -> None:
        """Speaks HTTP/2 until our GOAWAY, answers it with its own, then reads to the end."""
        try:
            while data := await client.receive_some(65536):
                events = peer.receive_data(data)
                if any(isinstance(event, h2.events.ConnectionTerminated) for event in events):
                    peer.close_connection()
                await client.send_all(peer.data_to_send())
        except trio.BrokenResourceError as exc:
            outcome.append(f"error: {exc.__cause__!r}")
            return
        outcome.append("clean")
        await client.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(strict_peer)
        with trio.fail_after(5):
            async with open_mux(hub, role):
                pass  # closes at once: GOAWAY, the peer's GOAWAY, close_notify
    assert outcome == ["clean"]
