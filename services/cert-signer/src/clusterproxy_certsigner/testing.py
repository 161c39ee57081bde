"""Helpers for tests (and for ``cluster-proxy local up``): a signer running in-process on loopback.

::

    async with trio.open_nursery() as nursery:
        signer = await start_signer(nursery, tmp_path / "signer")
        token = signer.agent_token("cluster1")
        await certclient.bootstrap_files(signer.endpoint(), token, files, make_csr)
"""

from __future__ import annotations

import datetime as dt
import ssl
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import trio
from cryptography import x509

from clusterproxy_castore.filestore import FileStore
from clusterproxy_castore.models import Binding
from clusterproxy_castore.tokens import create_token
from clusterproxy_protocol import certclient

from .service import SignerConfig, SignerService

__all__ = ["EchoClient", "RunningSigner", "serve_tls_echo", "start_signer"]


@dataclass
class RunningSigner:
    service: SignerService
    store: FileStore
    address: tuple[str, int]
    bundle: Path  # the trust bundle as of start (what a new party is given to verify the signer)

    def endpoint(self, ca: Path | None = None, *, timeout: float = 10.0) -> certclient.SignerEndpoint:
        host, port = self.address
        return certclient.SignerEndpoint(host, port, ca or self.bundle, "localhost", timeout)

    def token(
        self,
        binding: Binding,
        *,
        ttl: dt.timedelta = dt.timedelta(minutes=10),
        now: dt.datetime | None = None,
    ) -> str:
        return create_token(self.store, binding, ttl, now=now).token

    def agent_token(self, cluster: str, agent_id: str | None = None, **kw: Any) -> str:
        return self.token(Binding(kind="agent", cluster=cluster, agent_id=agent_id), **kw)

    def server_token(self, name: str, hosts: tuple[str, ...], **kw: Any) -> str:
        return self.token(Binding(kind="server", name=name, hosts=hosts), **kw)

    def client_token(self, name: str, organization: str | None = None, **kw: Any) -> str:
        return self.token(Binding(kind="client", name=name, organization=organization), **kw)

    def write_bundle(self, path: Path) -> Path:
        """The store's current trust bundle, written to ``path``."""
        certclient.write_bundle(path, self.store.read_authorities().bundle_pem())
        return path


async def start_signer(nursery: trio.Nursery, directory: Path, **config: Any) -> RunningSigner:
    """A signer on ``127.0.0.1`` (a free port) with a files store in ``directory/store``; ``config``
    overrides :class:`SignerConfig` fields (e.g. ``cert_ttl``, ``ip_burst``)."""
    store = FileStore(directory / "store")
    base = SignerConfig(store=store, tls_dir=directory / "tls", listen=("127.0.0.1", 0))
    service = SignerService(replace(base, **config))
    address = await nursery.start(service.run)
    signer = RunningSigner(service, store, address, directory / "bundle.crt")
    signer.write_bundle(signer.bundle)
    return signer


# --- a TLS echo server and client, to watch handshakes and live connections across reloads --------------


async def serve_tls_echo(nursery: trio.Nursery, context: Callable[[], ssl.SSLContext]) -> int:
    """An echo server on 127.0.0.1 (a free port, returned); ``context()`` is read at each handshake."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def handle(tcp: trio.SocketStream) -> None:
        stream = trio.SSLStream(tcp, context(), server_side=True, https_compatible=True)
        try:
            await stream.do_handshake()
            while data := await stream.receive_some(65536):
                await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    await nursery.start(trio.serve_listeners, handle, listeners)
    return int(listeners[0].socket.getsockname()[1])


class EchoClient:
    """One TLS connection to :func:`serve_tls_echo`."""

    def __init__(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        self.stream = stream

    @classmethod
    async def connect(cls, port: int, ctx: ssl.SSLContext, server_hostname: str = "localhost") -> EchoClient:
        """Connect, handshake and echo once (with TLS 1.3 the server's verdict on a client certificate
        arrives after the handshake): :class:`trio.BrokenResourceError` when refused."""
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        client = cls(trio.SSLStream(tcp, ctx, server_hostname=server_hostname))
        try:
            with trio.fail_after(10):
                await client.stream.do_handshake()
                if await client.echo(b"hello") != b"hello":
                    raise trio.BrokenResourceError("the server closed the connection")
        except BaseException:
            await trio.aclose_forcefully(client.stream)
            raise
        return client

    async def echo(self, data: bytes) -> bytes:
        await self.stream.send_all(data)
        got = b""
        while len(got) < len(data):
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                break
            got += chunk
        return got

    @property
    def peer(self) -> x509.Certificate:
        return x509.load_der_x509_certificate(self.stream.getpeercert(binary_form=True))

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)
