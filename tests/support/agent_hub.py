"""A stand-in for the proxy-server's agent port, for tests of the agent (in-process or its process):
:class:`Hub` accepts agent tunnels over mutual TLS with ALPN h2 and hands each one's Mux to the test
(``open_mux(..., Role.OPENER)``); :func:`echo_once` sends one stream through such a tunnel, and
:func:`admin_get` asks the agent's admin port."""

from __future__ import annotations

from functools import partial

import trio

from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import Mux, open_mux
from clusterproxy_protocol.errors import describe_exception
from clusterproxy_protocol.pki import PemPair
from clusterproxy_protocol.tls import server_context


class Hub:
    """Accepts agent tunnels over mTLS; each live tunnel's Mux arrives on ``tunnels``."""

    def __init__(self, pki: dict[str, object], *, alpn: list[str] | None = None) -> None:
        server: PemPair = pki["server"]  # type: ignore[assignment]
        self.ctx = server_context(server.cert, server.key, pki["ca"], alpn=alpn or ["h2"])  # type: ignore[arg-type]
        self._send, self.tunnels = trio.open_memory_channel[Mux](10)
        self.handshake_errors: list[str] = []
        self.port = 0

    async def start(self, nursery: trio.Nursery) -> Hub:
        listeners = await nursery.start(
            partial(trio.serve_ssl_over_tcp, self._handle, 0, self.ctx, host="127.0.0.1")
        )
        self.port = listeners[0].transport_listener.socket.getsockname()[1]
        return self

    async def _handle(self, stream: trio.SSLStream) -> None:
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError as exc:
            self.handshake_errors.append(describe_exception(exc))
            return
        async with open_mux(stream, Role.OPENER) as mux:
            await self._send.send(mux)
            await mux.closed.wait()

    async def next_tunnel(self, timeout: float = 10) -> Mux:
        with trio.fail_after(timeout):
            return await self.tunnels.receive()


async def admin_get(address: str, path: str) -> tuple[int, str]:
    host, port = address.rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nhost: agent\r\nconnection: close\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some():
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


async def echo_once(mux: Mux, port: int, payload: bytes) -> bytes:
    stream = await mux.open_connect(f"127.0.0.1:{port}")
    async with stream:
        await stream.send_all(payload)
        await stream.send_eof()
        data = b""
        while chunk := await stream.receive_some():
            data += chunk
    return data
