"""Hub clients for tests: an HTTP/1.1 CONNECT client over mTLS (the SDK covers HTTP/2), and an SDK
echo round trip."""

from __future__ import annotations

import hashlib
import ssl
from dataclasses import dataclass

import trio

from clusterproxy_protocol import tls
from clusterproxy_sdk import TLSFiles, open_tunnel
from tests.support.pki import PkiFiles


async def sdk_echo_intact(client_port: int, pki: PkiFiles, echo_port: int, size: int) -> bool:
    """``size`` bytes through a new SDK connection to cluster1's echo target and back, both ways at
    once: whether what came back has the sha256 of what was sent."""
    payload = bytes(range(256)) * (size // 256)
    got = hashlib.sha256()
    async with open_tunnel(
        f"127.0.0.1:{client_port}",
        TLSFiles(pki.ca, pki.client.cert, pki.client.key),
        server_hostname="localhost",
    ) as tunnel:
        stream = await tunnel.connect("cluster1", "127.0.0.1", echo_port)

        async def send() -> None:
            await stream.send_all(payload)
            await stream.send_eof()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            while data := await stream.receive_some():
                got.update(data)
    return got.digest() == hashlib.sha256(payload).digest()


def client_context(pki: PkiFiles, *, alpn: list[str]) -> ssl.SSLContext:
    return tls.client_context(pki.client.cert, pki.client.key, pki.ca, alpn=alpn)


@dataclass
class ConnectReply:
    status: int
    head: str
    body: bytes
    stream: trio.SSLStream | None  # set when the tunnel is established (status 200)


async def h1_connect(
    port: int, context: ssl.SSLContext, authority: str, headers: dict[str, str] | None = None
) -> ConnectReply:
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(tcp, context, server_hostname="localhost", https_compatible=True)
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode())
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(4096)
        if not data:
            raise AssertionError(f"proxy closed before answering; got {buffer!r}")
        buffer += data
    head, _, rest = buffer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if status == 200:
        assert not rest, "bytes after 200 before we sent anything"
        return ConnectReply(status, head.decode(), b"", stream)
    body = rest
    try:
        while data := await stream.receive_some(4096):
            body += data
    except trio.BrokenResourceError:
        pass
    await trio.aclose_forcefully(stream)
    return ConnectReply(status, head.decode(), body, None)
