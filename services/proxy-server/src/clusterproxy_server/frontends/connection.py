"""What a frontend is handed: one authenticated client connection and the shared relay path."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from clusterproxy_protocol.closing import abort, close_cleanly
from clusterproxy_protocol.core import TunnelSettings
from clusterproxy_protocol.driver import LimitHandler
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
    on_limit: LimitHandler | None = None  # an HTTP/2 abuse limit tripped (metrics, one log line)


SEND_TIMEOUT = 5.0  # seconds a refusal may take to reach a slow reader


async def send_and_close(stream: trio.abc.Stream, data: bytes) -> None:
    """Best effort: send ``data`` (a refusal) and close cleanly (TLS ``close_notify``); a refusal
    that could not be sent whole in time ends with a reset instead, never with a clean end."""
    sent = False
    with trio.move_on_after(SEND_TIMEOUT):
        try:
            await stream.send_all(data)
            sent = True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    if sent:
        await close_cleanly(stream)
    else:
        await abort(stream)
