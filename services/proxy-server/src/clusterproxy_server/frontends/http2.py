"""HTTP/2 frontend: many ``CONNECT`` streams on one TLS connection (the SDK, ``port-forward``).

Each incoming stream goes to the first entry of ``STREAM_KINDS`` whose ``matches`` accepts it; a
new kind of HTTP/2 stream (gRPC's ``POST /...``, say) is one module and one line there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import trio

from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import IncomingRequest, open_mux
from clusterproxy_server.authz import ClientIdentity
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


def _is_connect(request: IncomingRequest) -> bool:
    return request.method == "CONNECT"


async def _serve_connect(request: IncomingRequest, connection: ClientConnection) -> None:
    await connection.proxy(Http2ConnectRequest(request, connection.client))


@dataclass(frozen=True)
class StreamKind:
    matches: Callable[[IncomingRequest], bool]
    serve: Callable[[IncomingRequest, ClientConnection], Awaitable[None]]


STREAM_KINDS: list[StreamKind] = [StreamKind(_is_connect, _serve_connect)]


async def serve(connection: ClientConnection) -> None:
    async def handle(request: IncomingRequest) -> None:
        for kind in STREAM_KINDS:
            if kind.matches(request):
                await kind.serve(request, connection)
                return
        await request.refuse(405, f"method {request.method} not served: open CONNECT streams here")

    async with open_mux(
        connection.stream,
        Role.ACCEPTOR,
        settings=connection.tunnel_settings,
        handler=handle,
        received=connection.received,
        on_limit=connection.on_limit,
    ) as mux:
        await mux.closed.wait()
