"""A tunnel connection shared by many users that is re-established when it dies."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import trio

from clusterproxy_protocol import TunnelClosed, TunnelSettings, TunnelStream

from ._tunnel import (
    DEFAULT_KEEPALIVE,
    TLSFiles,
    TLSSource,
    Tunnel,
    open_tunnel,
    parse_address,
    single_exceptions,
)


class SharedTunnel:
    """Like :class:`Tunnel`, but a dead or draining connection is replaced by a new one on demand.

    All streams share the current connection. When it dies, the next :meth:`connect` dials again
    (one dial at a time, however many callers wait); a draining connection is closed once its last
    stream ends. A CONNECT that fails because the connection died under it is retried once on a
    fresh connection.

    Every dial takes the TLS context anew from ``tls``: ``TLSFiles`` are followed (a
    :class:`ReloadingTLSFiles`), so a replaced certificate is presented at the next dial while the
    live connection keeps its session; a callable is called at each dial; a plain ``ssl.SSLContext``
    is used as it is.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        address: str | tuple[str, int],
        tls: TLSSource,
        *,
        server_hostname: str | None,
        connect_timeout: float,
        keepalive: tuple[float, float] | None,
        settings: TunnelSettings | None,
        on_connected: Callable[[Tunnel], None] | None = None,
    ) -> None:
        self._nursery = nursery
        self.address = parse_address(address)
        self.tls = tls.reloading() if isinstance(tls, TLSFiles) else tls
        self._server_hostname = server_hostname
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._settings = settings
        self._on_connected = on_connected
        self._current: Tunnel | None = None
        self._lock = trio.Lock()
        self.connections_made = 0

    @property
    def current(self) -> Tunnel | None:
        """The connection in use, if any (it may have died since)."""
        return self._current

    async def tunnel(self) -> Tunnel:
        """The live connection, dialing a new one if there is none (raises ProxyConnectionError)."""
        current = self._current
        if current is not None and current.accepts_streams:
            return current
        async with self._lock:
            current = self._current
            if current is not None and current.accepts_streams:
                return current
            tunnel: Tunnel = await self._nursery.start(self._hold)
            self._current = tunnel
            self.connections_made += 1
            if self._on_connected is not None:
                self._on_connected(tunnel)
            if current is not None and current.is_alive:
                self._nursery.start_soon(self._retire, current)
            return tunnel

    async def _hold(self, *, task_status: trio.TaskStatus[Tunnel]) -> None:
        async with open_tunnel(
            self.address,
            self.tls,
            server_hostname=self._server_hostname,
            connect_timeout=self._connect_timeout,
            keepalive=self._keepalive,
            settings=self._settings,
        ) as tunnel:
            task_status.started(tunnel)
            await tunnel.wait_closed()

    @staticmethod
    async def _retire(tunnel: Tunnel) -> None:
        await tunnel.mux.wait_idle()
        tunnel.close()

    async def _with_retry(self, open_stream: Callable[[Tunnel], Awaitable[TunnelStream]]) -> TunnelStream:
        tunnel = await self.tunnel()
        try:
            return await open_stream(tunnel)
        except TunnelClosed:
            if tunnel.accepts_streams:
                raise
        return await open_stream(await self.tunnel())

    async def connect(self, cluster: str, host: str, port: int) -> TunnelStream:
        """See :meth:`Tunnel.connect`; also raises ProxyConnectionError when no connection can be made."""
        return await self._with_retry(lambda t: t.connect(cluster, host, port))

    async def connect_kube_apiserver(self, cluster: str) -> TunnelStream:
        """See :meth:`Tunnel.connect_kube_apiserver`."""
        return await self._with_retry(lambda t: t.connect_kube_apiserver(cluster))

    def close(self) -> None:
        """Close the current connection (the next connect dials again)."""
        if self._current is not None:
            self._current.close()


@asynccontextmanager
async def open_shared_tunnel(
    address: str | tuple[str, int],
    tls: TLSSource,
    *,
    server_hostname: str | None = None,
    connect_timeout: float = 10.0,
    keepalive: tuple[float, float] | None = DEFAULT_KEEPALIVE,
    settings: TunnelSettings | None = None,
    on_connected: Callable[[Tunnel], None] | None = None,
) -> AsyncIterator[SharedTunnel]:
    """A :class:`SharedTunnel` for the duration of the block; it dials lazily, on the first connect.

    Arguments as for :func:`open_tunnel`; ``TLSFiles`` are followed (see :class:`SharedTunnel`).
    ``on_connected(tunnel)`` is called after each successful dial. Bad TLS files fail here, at once.
    """
    with single_exceptions():
        async with trio.open_nursery() as nursery:
            shared = SharedTunnel(
                nursery,
                address,
                tls,
                server_hostname=server_hostname,
                connect_timeout=connect_timeout,
                keepalive=keepalive,
                settings=settings,
                on_connected=on_connected,
            )
            try:
                yield shared
            finally:
                nursery.cancel_scope.cancel()
