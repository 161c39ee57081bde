"""Hostile connections below HTTP/2, for the resilience test and the bad-input battery: garbage bytes,
plain HTTP on a TLS port, TLS without a client certificate or with one from a foreign CA
(:func:`attack`); the server must refuse or close each, never answer with data or hang."""

from __future__ import annotations

import os

import trio

from clusterproxy_protocol import tls
from tests.support.pki import PkiFiles


async def attack(port: int, kind: str, pki: PkiFiles) -> str:
    """One hostile connection of ``kind`` ("garbage", "plain-http", "tls-no-cert", else a foreign client
    certificate) to ``port``; returns how the server ended it."""
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    if kind == "garbage":
        await tcp.send_all(os.urandom(64 << 10))
        return await outcome(tcp)
    if kind == "plain-http":
        await tcp.send_all(b"CONNECT 127.0.0.1:80 HTTP/1.1\r\nhost: x\r\n\r\n")
        return await outcome(tcp)
    if kind == "tls-no-cert":
        context = tls.client_context(None, None, pki.ca, alpn=["h2", "http/1.1"])
    else:
        context = tls.client_context(pki.foreign_client.cert, pki.foreign_client.key, pki.ca, alpn=["h2"])
    stream = trio.SSLStream(tcp, context, server_hostname="localhost")
    try:
        await stream.do_handshake()
        await stream.send_all(b"CONNECT 127.0.0.1:80 HTTP/1.1\r\n\r\n")
        return await outcome(stream)
    except trio.BrokenResourceError as exc:
        return f"refused: {exc.__cause__!r}"


async def outcome(stream: trio.abc.Stream) -> str:
    """What the server does: it must close the connection, never answer with data or hang."""
    data = b""
    try:
        with trio.fail_after(15):
            while chunk := await stream.receive_some(65536):
                data += chunk
    except trio.BrokenResourceError as exc:
        return f"refused: {exc.__cause__!r}"
    finally:
        await trio.aclose_forcefully(stream)
    assert not data, f"the server answered a hostile client with {data[:100]!r}"
    return "closed"
