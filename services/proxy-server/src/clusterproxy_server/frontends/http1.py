"""HTTP/1.1 frontend: ``CONNECT host:port`` (curl, kubectl, Go, Java) and plain-HTTP forward requests
(``GET http://host/path``, curl ``-x`` without ``-p``), one request per connection."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import trio

from clusterproxy_protocol import close_cleanly, reset_if_process_dies
from clusterproxy_server.authz import ClientIdentity
from clusterproxy_server.frontends import http1_messages as messages
from clusterproxy_server.frontends.connection import ClientConnection, send_and_close


@dataclass
class Http1Request:
    stream: trio.SSLStream[trio.abc.Stream]
    client: ClientIdentity
    authority: str
    headers: Mapping[str, str]
    early_data: bytes
    is_connect: bool
    frontend: str = "http1"

    async def accept(self) -> trio.abc.Stream:
        if self.is_connect:
            await self.stream.send_all(messages.established())
        return self.stream

    async def refuse(self, status: int, reason: str) -> None:
        await send_and_close(self.stream, messages.error_response(status, reason))

    def take_reserve(self) -> int:
        return 0  # the client's side is a socket: its kernel buffers it, not our windows


async def serve(connection: ClientConnection) -> None:
    stream = connection.stream
    # HTTP/1.1 clients (curl, Go) take a FIN without close_notify for a clean end: if this process
    # dies mid-transfer, its kernel must reset the connection instead; clean ends send close_notify.
    reset_if_process_dies(stream)
    try:
        with trio.fail_after(connection.request_timeout):
            request = await messages.read_request(stream, connection.received)
    except trio.TooSlowError:
        await send_and_close(stream, messages.error_response(408, "request head not received in time"))
        return
    except messages.BadRequest as exc:
        await send_and_close(stream, messages.error_response(exc.status, exc.reason))
        return
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        await trio.aclose_forcefully(stream)
        return
    if request is None:  # the client closed without asking anything
        await close_cleanly(stream)
        return
    authority, early_data = request.target, request.early_data
    is_connect = request.method == "CONNECT"
    if not is_connect:
        try:
            authority, head = messages.forward_form(request)
        except messages.BadRequest as exc:
            await send_and_close(stream, messages.error_response(exc.status, exc.reason))
            return
        early_data = head + early_data
    await connection.proxy(
        Http1Request(stream, connection.client, authority, request.headers, early_data, is_connect)
    )


async def refuse_connection(connection: ClientConnection, reason: str) -> None:
    """Refuse the whole connection before reading its request: ``429`` with ``reason``."""
    await send_and_close(connection.stream, messages.error_response(429, reason))
