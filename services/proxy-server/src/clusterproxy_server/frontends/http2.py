"""HTTP/2 frontend: many ``CONNECT`` streams on one TLS connection (the SDK, ``port-forward``).

Each incoming stream goes to the first entry of ``STREAM_KINDS`` whose ``matches`` accepts it; a
new kind of HTTP/2 stream (gRPC's ``POST /...``, say) is one module and one line there.

When the server drains, each connection is told with ``SETTINGS_MAX_CONCURRENT_STREAMS = 0`` (no new
streams; the open ones go on: a GOAWAY would stop an h2 peer's open streams too, docs/protocol.md), and
closed with a GOAWAY once its last stream ended. A connection that has not opened its first stream yet
was dialed before the drain began: it gets to open one (within the request timeout) before it is told,
so that a client that dialed just then is served rather than refused.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import trio

from clusterproxy_protocol import ENHANCE_YOUR_CALM, IncomingRequest, Mux, Role, TunnelError, open_mux
from clusterproxy_server.authz import ClientIdentity
from clusterproxy_server.frontends import konnectivity
from clusterproxy_server.frontends.connection import ClientConnection


@dataclass
class Http2ConnectRequest:
    request: IncomingRequest
    client: ClientIdentity
    frontend: str = "h2"
    early_data: bytes = b""

    @property
    def authority(self) -> str:
        return self.request.authority

    @property
    def headers(self) -> Mapping[str, str]:
        return self.request.headers

    async def accept(self) -> trio.abc.Stream:
        return await self.request.accept()

    async def refuse(self, status: int, reason: str) -> None:
        await self.request.refuse(status, reason)

    def take_reserve(self) -> int:
        return self.request.stream.take_reserve()


def _is_connect(request: IncomingRequest) -> bool:
    return request.method == "CONNECT"


async def _serve_connect(request: IncomingRequest, connection: ClientConnection) -> None:
    await connection.proxy(Http2ConnectRequest(request, connection.client))


@dataclass(frozen=True)
class StreamKind:
    matches: Callable[[IncomingRequest], bool]
    serve: Callable[[IncomingRequest, ClientConnection], Awaitable[None]]


STREAM_KINDS: list[StreamKind] = [
    StreamKind(_is_connect, _serve_connect),
    StreamKind(konnectivity.matches, konnectivity.serve),
]


DRAINED = "proxy-server draining: open a new connection for new streams"


async def serve(connection: ClientConnection) -> None:
    first_stream = trio.Event()

    async def handle(request: IncomingRequest) -> None:
        first_stream.set()
        for kind in STREAM_KINDS:
            if kind.matches(request):
                await kind.serve(request, connection)
                return
        await request.refuse(
            405,
            f"{request.method} {request.path} not served: open CONNECT streams, or konnectivity's gRPC "
            f"POST {konnectivity.PATH}",
        )

    async with (
        open_mux(
            connection.stream,
            Role.ACCEPTOR,
            settings=connection.tunnel_settings,
            handler=handle,
            received=connection.received,
            on_limit=connection.on_limit,
            budget=connection.quota.budget if connection.quota is not None else None,
            reserve=connection.stream_reserve,
        ) as mux,
        trio.open_nursery() as watch,
    ):
        with connection.drain.serving(mux):
            watch.start_soon(_drain_when_told, mux, connection, first_stream)
            await mux.closed.wait()
            watch.cancel_scope.cancel()


async def _drain_when_told(mux: Mux, connection: ClientConnection, first_stream: trio.Event) -> None:
    await connection.drain.started.wait()
    with trio.move_on_after(connection.request_timeout):
        await first_stream.wait()
    mux.drain()
    try:
        # The PING's answer comes after the client has read our SETTINGS: any stream it opened before
        # knowing has arrived by then, and is served.
        with trio.move_on_after(connection.request_timeout):
            await mux.ping()
    except TunnelError:
        return
    await mux.wait_idle()
    mux.close(DRAINED)


async def refuse_connection(connection: ClientConnection, reason: str) -> None:
    """Refuse the whole connection: GOAWAY ``ENHANCE_YOUR_CALM`` with ``reason`` (h2 clients show it)."""
    async with open_mux(
        connection.stream, Role.ACCEPTOR, settings=connection.tunnel_settings, received=connection.received
    ) as mux:
        mux.close(reason, error_code=ENHANCE_YOUR_CALM)
