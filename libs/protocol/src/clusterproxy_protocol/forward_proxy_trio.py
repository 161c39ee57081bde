"""The trio side of :mod:`clusterproxy_protocol.forward_proxy`: open a byte stream to ``HOST:PORT``
through an HTTP(S) forward proxy with ``CONNECT``.

The stream returned carries the destination's bytes untouched: the caller does its own TLS on top (the
agent's mTLS to the hub, the signer's HTTPS), so the proxy sees a TLS handshake and ciphertext, never
the tunnel's plaintext. With an ``https://`` proxy that is TLS inside the TLS to the proxy.

Every failure of the proxy leg is a :class:`~clusterproxy_protocol.forward_proxy.ForwardProxyError`
(an ``OSError``) whose message names the proxy: unreachable, a failed TLS handshake with it, an answer
that is not HTTP, a refusal (``ProxyRefused``: 403, 407, 502, ...).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import trio

from clusterproxy_protocol import tls
from clusterproxy_protocol.config import ConfigError
from clusterproxy_protocol.errors import describe_exception
from clusterproxy_protocol.forward_proxy import ConnectExchange, ForwardProxyError, ProxyURL
from clusterproxy_protocol.wire import format_authority

__all__ = ["ForwardProxy", "Prefixed", "open_tcp_or_proxy"]

READ_SIZE = 4096


@dataclass(frozen=True)
class ForwardProxy:
    """A proxy to dial through; ``ca_file`` verifies an ``https://`` proxy (read at each dial; without
    it, the system's trust store)."""

    url: ProxyURL
    ca_file: Path | None = None
    user_agent: str = "cluster-proxy"

    def __str__(self) -> str:
        return self.url.redacted

    def ssl_context(self) -> ssl.SSLContext:
        return tls.web_client_context(self.ca_file)

    async def open(self, host: str, port: int) -> trio.abc.Stream:
        """A stream to ``host:port`` through the proxy (the ``CONNECT`` answered 2xx)."""
        proxy = self.url
        try:
            tcp = await trio.open_tcp_stream(proxy.host, proxy.port)
        except OSError as exc:
            raise ForwardProxyError(
                proxy, f"cannot connect to forward proxy {proxy.redacted}: {describe_exception(exc)}"
            ) from exc
        stream: trio.abc.Stream = tcp
        try:
            if proxy.scheme == "https":
                stream = await self._tls(tcp)
            early = await self._connect(stream, host, port)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        return Prefixed(early, stream) if early else stream

    async def _tls(self, tcp: trio.SocketStream) -> trio.SSLStream[trio.SocketStream]:
        proxy = self.url
        try:
            context = self.ssl_context()
        except ConfigError as exc:
            raise ForwardProxyError(proxy, f"forward proxy {proxy.redacted}: {exc}") from None
        stream = trio.SSLStream(tcp, context, server_hostname=proxy.host)
        try:
            await stream.do_handshake()
        except (ssl.SSLError, trio.BrokenResourceError) as exc:
            hint = ""
            if isinstance(exc.__cause__ or exc, ssl.SSLCertVerificationError) or "verify" in str(exc):
                hint = (
                    f" (is {self.ca_file} the CA of the proxy's certificate?)"
                    if self.ca_file
                    else " (give the proxy's CA with --proxy-ca-file)"
                )
            raise ForwardProxyError(
                proxy,
                f"TLS with forward proxy {proxy.redacted} failed: {describe_exception(exc)}{hint}",
            ) from exc
        return stream

    async def _connect(self, stream: trio.abc.Stream, host: str, port: int) -> bytes:
        """The CONNECT exchange; returns the destination's bytes that came with the proxy's answer."""
        exchange = ConnectExchange(self.url, host, port, user_agent=self.user_agent)
        try:
            await stream.send_all(exchange.request())
            while True:
                answer = exchange.receive_data(await stream.receive_some(READ_SIZE))
                if answer is not None:
                    return answer.leftover
        except (OSError, trio.BrokenResourceError) as exc:
            if isinstance(exc, ForwardProxyError):
                raise
            raise ForwardProxyError(
                self.url,
                f"forward proxy {self.url.redacted} dropped the connection during CONNECT "
                f"{format_authority(host, port)}: {describe_exception(exc)}",
            ) from exc


class Prefixed(trio.abc.Stream):
    """``stream`` with ``prefix`` read first: bytes already read from it (here the destination's first
    bytes, when they came in the same read as the proxy's answer: only for a destination that speaks
    first; TLS servers do not)."""

    def __init__(self, prefix: bytes, stream: trio.abc.Stream) -> None:
        self._prefix = prefix
        self._stream = stream

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._prefix:
            size = len(self._prefix) if max_bytes is None else max_bytes
            data, self._prefix = self._prefix[:size], self._prefix[size:]
            return data
        return await self._stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()


async def open_tcp_or_proxy(host: str, port: int, proxy: ForwardProxy | None) -> trio.abc.Stream:
    """TCP to ``host:port``, through ``proxy`` when one is given."""
    if proxy is None:
        return await trio.open_tcp_stream(host, port)
    return await proxy.open(host, port)
