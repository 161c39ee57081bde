"""Hub clients for tests: an HTTP/1.1 CONNECT client over mTLS (the SDK covers HTTP/2), an SDK
echo round trip, and a digest-checked transfer both ways to a cluster's target."""

from __future__ import annotations

import hashlib
import random
import ssl
from dataclasses import dataclass

import trio

from clusterproxy_protocol import tls
from clusterproxy_sdk import TLSFiles, open_tunnel
from tests.support.pki import PkiFiles
from tests.support.procs import Hub
from tests.support.targets import CHUNK, Target, pattern_digest


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


async def transfer(
    hub: Hub, cluster: str, target: Target, size: int = 16 << 20, *, tls: ssl.SSLContext | None = None
) -> float:
    """``size`` bytes each way between the test and ``target`` inside ``cluster``, through the hub's
    client port (SDK, the hub client certificate or ``tls``) and that cluster's agent; both
    sha256-checked. Returns the seconds it took."""
    token = f"{cluster}-{random.getrandbits(32):08x}"
    upload = random.Random(token).randbytes(size)
    received = hashlib.sha256()
    started = trio.current_time()
    client = tls or TLSFiles(hub.pki.ca, hub.pki.client.cert, hub.pki.client.key)
    async with open_tunnel(f"127.0.0.1:{hub.client_port}", client, server_hostname="localhost") as tunnel:
        stream = await tunnel.connect(cluster, target.host, target.port)

        async def send() -> None:
            await stream.send_all(f"{token} {size}\n".encode())
            for i in range(0, size, CHUNK):
                await stream.send_all(upload[i : i + CHUNK])
            await stream.send_eof()

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                while data := await stream.receive_some(CHUNK):
                    received.update(data)
    elapsed = trio.current_time() - started
    assert received.hexdigest() == pattern_digest(token, size), "the download's sha256 does not match"
    assert target.received[token] == hashlib.sha256(upload).hexdigest(), "the upload's sha256 does not match"
    return elapsed
