"""A loopback relay for clients that cannot present a certificate (h2spec): it accepts plain TCP and,
per connection, opens mutual TLS to the hub's client port with a hub client certificate and pipes the
bytes both ways, unchanged. The client port tells HTTP/2 by the connection preface, so what the client
speaks reaches the server as is; only the TLS layer is the relay's.

Ends are passed on: the server's end of the TLS connection becomes a FIN toward the client (after
every byte before it), then the relay keeps reading the client until it closes, so the kernel never
answers a client's late bytes with a reset that could discard the server's last frames (a GOAWAY)
before the client read them. The client's end closes the TLS connection.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

import trio

PIPE_CHUNK = 64 << 10
# After the server ended, how long the client may keep its side open before the relay closes it.
LINGER = 10.0


@dataclass
class MtlsRelay:
    port: int  # plain TCP, loopback
    connections: int = 0  # accepted from clients
    handshakes: int = 0  # mutual TLS connections made to the client port
    failures: list[str] = field(default_factory=list)  # handshakes that failed, with the reason


async def _pipe(source: trio.abc.ReceiveStream, sink: trio.abc.SendStream) -> None:
    """Copy until ``source`` ends; a broken or closed side ends the copy too."""
    try:
        while data := await source.receive_some(PIPE_CHUNK):
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def _pipe_then_discard(source: trio.abc.ReceiveStream, sink: trio.abc.SendStream) -> None:
    """Copy until ``source`` ends; once ``sink`` is gone, keep reading ``source`` and drop the bytes."""
    sink_open = True
    try:
        while data := await source.receive_some(PIPE_CHUNK):
            if sink_open:
                try:
                    await sink.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    sink_open = False
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def start_mtls_relay(
    nursery: trio.Nursery, upstream_port: int, context: ssl.SSLContext, *, server_hostname: str = "localhost"
) -> MtlsRelay:
    """Listen on a free loopback port; each client connection is relayed to ``127.0.0.1:upstream_port``
    over TLS with ``context`` (which carries the client certificate)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    relay = MtlsRelay(port=listeners[0].socket.getsockname()[1])

    async def connection(client: trio.SocketStream) -> None:
        relay.connections += 1
        tcp = await trio.open_tcp_stream("127.0.0.1", upstream_port)
        server = trio.SSLStream(tcp, context, server_hostname=server_hostname, https_compatible=True)
        try:
            await server.do_handshake()
        except trio.BrokenResourceError as exc:
            relay.failures.append(f"{type(exc.__cause__).__name__}: {exc.__cause__}")
            await trio.aclose_forcefully(client)
            await trio.aclose_forcefully(server)
            return
        relay.handshakes += 1

        async def toward_client() -> None:
            await _pipe(server, client)
            try:
                await client.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                both.cancel_scope.cancel()
                return
            await trio.sleep(LINGER)  # the client's own close ends this earlier (toward_server)
            both.cancel_scope.cancel()

        async def toward_server() -> None:
            await _pipe_then_discard(client, server)
            both.cancel_scope.cancel()

        async with trio.open_nursery() as both:
            both.start_soon(toward_client)
            both.start_soon(toward_server)
        await trio.aclose_forcefully(server)
        await trio.aclose_forcefully(client)

    await nursery.start(trio.serve_listeners, connection, listeners)
    return relay
