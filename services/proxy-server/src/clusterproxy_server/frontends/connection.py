"""What a frontend is handed: one authenticated client connection and the shared relay path."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import trio

from clusterproxy_protocol import CANCEL, LimitHandler, Mux, TunnelSettings, abort, close_cleanly
from clusterproxy_server.authz import ClientIdentity
from clusterproxy_server.quotas import ConnectionQuota
from clusterproxy_server.relaying import ClientRequest


@dataclass(eq=False)
class Drain:
    """The server's drain as client connections see it: when it began, and the HTTP/2 connections to
    close with a reason when it is over (their streams still open are cut)."""

    started: trio.Event = field(default_factory=trio.Event)
    http2: set[Mux] = field(default_factory=set)
    _http2_gone: trio.Event = field(default_factory=trio.Event)

    def __post_init__(self) -> None:
        self._http2_gone.set()

    @contextmanager
    def serving(self, mux: Mux) -> Iterator[None]:
        """``mux`` is an HTTP/2 client connection for the duration of the block."""
        if not self.http2:
            self._http2_gone = trio.Event()
        self.http2.add(mux)
        try:
            yield
        finally:
            self.http2.discard(mux)
            if not self.http2:
                self._http2_gone.set()

    def cut(self, reason: str) -> None:
        """GOAWAY ``CANCEL`` with ``reason`` on every HTTP/2 client connection: their open streams fail."""
        for mux in list(self.http2):
            mux.close(reason, error_code=CANCEL)

    async def wait_http2_closed(self) -> None:
        """Until every HTTP/2 client connection has ended (after :meth:`cut`: sent its GOAWAY)."""
        await self._http2_gone.wait()


@dataclass(frozen=True)
class ClientConnection:
    stream: trio.SSLStream[trio.abc.Stream]
    client: ClientIdentity
    received: bytes  # what was read to tell the protocol; the frontend processes it first
    proxy: Callable[[ClientRequest], Awaitable[None]]  # the shared dial-and-relay path
    request_timeout: float  # for the request head to arrive
    tunnel_settings: TunnelSettings
    on_limit: LimitHandler | None = None  # an HTTP/2 abuse limit tripped (metrics, one log line)
    drain: Drain = field(default_factory=Drain)
    quota: ConnectionQuota | None = None  # the client identity's share this connection draws on
    # Charged with each HTTP/2 stream beside its own window: the window of its stream toward an agent.
    stream_reserve: int = 0


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
