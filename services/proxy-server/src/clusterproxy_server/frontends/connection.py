"""What a frontend is handed: one authenticated client connection and the shared relay path."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from clusterproxy_protocol.core import TunnelSettings
from clusterproxy_server.authz import ClientIdentity
from clusterproxy_server.relaying import ClientRequest


@dataclass(frozen=True)
class ClientConnection:
    stream: trio.SSLStream
    client: ClientIdentity
    received: bytes  # what was read to tell the protocol; the frontend processes it first
    proxy: Callable[[ClientRequest], Awaitable[None]]  # the shared dial-and-relay path
    request_timeout: float  # for the request head to arrive
    tunnel_settings: TunnelSettings


async def send_and_close(stream: trio.abc.Stream, data: bytes) -> None:
    """Best effort: send ``data`` (a refusal), close cleanly, and never wait long for a slow reader."""
    try:
        with trio.move_on_after(5):
            await stream.send_all(data)
            await stream.aclose()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    await trio.aclose_forcefully(stream)
