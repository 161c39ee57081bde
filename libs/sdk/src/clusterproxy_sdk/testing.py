"""An in-process stand-in for the proxy-server's HTTP/2 client frontend, for testing SDK users.

It is real where it matters: a TCP listener on loopback, TLS 1.3 with client certificates from a
development CA, ALPN, and the tunnel's HTTP/2 acceptor from ``clusterproxy_protocol``. What it does
with each CONNECT is up to a handler (default: echo the bytes back, keeping half-close)::

    async with open_fake_proxy(tmp_path) as fake:
        async with open_tunnel(fake.address, fake.client_tls) as tunnel:
            stream = await tunnel.connect("cluster1", "svc", 80)
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio
from cryptography import x509

from clusterproxy_protocol import (
    CLUSTER_HEADER,
    DevCA,
    IncomingRequest,
    Mux,
    Role,
    TunnelSettings,
    open_mux,
    server_context,
)

from ._tunnel import TLSFiles, single_exceptions

Handler = Callable[[IncomingRequest], Awaitable[None]]

__all__ = ["FakeProxy", "ReceivedConnect", "echo_handler", "open_fake_proxy", "refuse_handler"]


async def echo_handler(request: IncomingRequest) -> None:
    """Accept the CONNECT and send every byte back; EOF from the client is answered with EOF."""
    stream = await request.accept()
    try:
        while data := await stream.receive_some():
            await stream.send_all(data)
        await stream.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def refuse_handler(status: int, reason: str) -> Handler:
    """A handler that refuses every CONNECT with ``status`` and ``reason``."""

    async def refuse(request: IncomingRequest) -> None:
        await request.refuse(status, reason)

    return refuse


@dataclass(frozen=True)
class ReceivedConnect:
    """What the fake server saw of one request."""

    method: str
    authority: str
    headers: dict[str, str]

    @property
    def cluster(self) -> str | None:
        return self.headers.get(CLUSTER_HEADER)


@dataclass
class FakeProxy:
    address: tuple[str, int]
    ca: Path
    client_cert: Path
    client_key: Path
    requests: list[ReceivedConnect] = field(default_factory=list)
    connections: list[Mux] = field(default_factory=list)
    handler: Handler = echo_handler
    client_certificates: list[x509.Certificate] = field(default_factory=list)  # per handshake, in order

    @property
    def client_tls(self) -> TLSFiles:
        return TLSFiles(self.ca, self.client_cert, self.client_key)

    @property
    def url(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def drop_connections(self) -> None:
        """Cut every client connection at once (as a server crash would)."""
        for mux in self.connections:
            mux.close("dropped by the test")

    def drain_connections(self) -> None:
        """Ask every client to open no new streams here (as a server shutting down does)."""
        for mux in self.connections:
            mux.drain()

    @property
    def live_connections(self) -> int:
        return sum(1 for mux in self.connections if not mux.dead)


@asynccontextmanager
async def open_fake_proxy(
    directory: Path,
    handler: Handler = echo_handler,
    *,
    alpn: Sequence[str] = ("h2",),
    settings: TunnelSettings | None = None,
) -> AsyncIterator[FakeProxy]:
    """Serve on ``127.0.0.1:<ephemeral>``; certificates go to ``directory`` (server SANs localhost and
    127.0.0.1, client ``CN=test-client``). ``alpn`` lets a test offer something else than ``h2``.
    ``fake.handler`` may be swapped while running."""
    directory = Path(directory)
    ca = DevCA.create_or_load(directory)
    server = ca.issue_server("fake-proxy", ["localhost", "127.0.0.1"], directory)
    client = ca.issue_client("test-client", directory)
    context = server_context(server.cert, server.key, ca.ca_path, alpn=list(alpn))
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    host, port = listeners[0].socket.getsockname()[:2]
    fake = FakeProxy((host, port), ca.ca_path, client.cert, client.key, handler=handler)

    async def dispatch(request: IncomingRequest) -> None:
        fake.requests.append(ReceivedConnect(request.method, request.authority, dict(request.headers)))
        await fake.handler(request)

    async def serve(tcp: trio.SocketStream) -> None:
        stream = trio.SSLStream(tcp, context, server_side=True)
        try:
            with trio.fail_after(10):
                await stream.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError):
            await trio.aclose_forcefully(stream)
            return
        fake.client_certificates.append(x509.load_der_x509_certificate(stream.getpeercert(binary_form=True)))
        if stream.selected_alpn_protocol() != "h2":
            # Like an HTTP/1.1 server that does not understand what follows: just hang up.
            await trio.aclose_forcefully(stream)
            return
        async with open_mux(stream, Role.ACCEPTOR, settings=settings, handler=dispatch) as mux:
            fake.connections.append(mux)
            await mux.closed.wait()

    with single_exceptions():
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, serve, listeners)
            try:
                yield fake
            finally:
                nursery.cancel_scope.cancel()
