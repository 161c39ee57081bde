"""One HTTP/2 connection to a proxy-server's client port, carrying many CONNECT streams."""

from __future__ import annotations

import errno
import ipaddress
import re
import ssl
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from cryptography import x509

from clusterproxy_protocol import (
    ALPN_H2,
    CLUSTER_HEADER,
    CLUSTER_NAME,
    ConfigError,
    Mux,
    Role,
    TunnelClosed,
    TunnelError,
    TunnelSettings,
    TunnelStream,
    client_context,
    format_authority as wire_format_authority,
    open_mux,
    parse_hostport,
)

from ._reload import LoadedTLS, ReloadingTLSFiles

DEFAULT_KEEPALIVE = (30.0, 10.0)
KUBE_APISERVER_PORT = 443

_HOST = re.compile(r"^[A-Za-z0-9._-]{1,253}$")


class ProxyConnectionError(TunnelError):
    """The connection to the proxy-server could not be set up (TCP connect, TLS handshake, timeout)."""


class ALPNError(ProxyConnectionError):
    """The TLS handshake succeeded but the server did not agree to speak HTTP/2 (ALPN ``h2``)."""


@dataclass(frozen=True)
class TLSFiles:
    """PEM files for mutual TLS with the proxy-server: the CA bundle that signed the server's
    certificate, and the client certificate and key that identify you to it."""

    ca: Path | str
    cert: Path | str | None = None
    key: Path | str | None = None

    def context(self) -> ssl.SSLContext:
        """A TLS 1.3 client context offering ALPN ``h2`` (raises ``ConfigError`` naming a bad file)."""
        return client_context(
            Path(self.cert) if self.cert is not None else None,
            Path(self.key) if self.key is not None else None,
            Path(self.ca),
            alpn=[ALPN_H2],
        )

    def reloading(self, *, log: Any = None) -> ReloadingTLSFiles:
        """A context that is rebuilt whenever these files change (for long-lived users: each new
        handshake presents the current certificate). Raises ``ConfigError`` naming a bad file."""
        return ReloadingTLSFiles(self.ca, self.cert, self.key, alpn=[ALPN_H2], log=log)


TLSSource = ssl.SSLContext | TLSFiles | ReloadingTLSFiles | Callable[[], ssl.SSLContext]
"""What ``open_tunnel`` and ``open_shared_tunnel`` accept as ``tls``: a fixed ``ssl.SSLContext``; PEM
files (read at each dial); or a callable returning the context for the next handshake (e.g. a
``clusterproxy_protocol.reloader.ReloadingContext`` kept fresh by a ``CertRenewer``)."""


def _resolve_tls(tls: TLSSource) -> tuple[ssl.SSLContext, x509.Certificate | None]:
    """The context for one handshake, and the client certificate it presents when the SDK loaded it
    from files (None for a context or callable of the caller's)."""
    if isinstance(tls, ssl.SSLContext):
        return tls, None
    if isinstance(tls, TLSFiles | ReloadingTLSFiles):
        loaded: LoadedTLS = tls.reloading().loaded if isinstance(tls, TLSFiles) else tls.current()
        return loaded.context, loaded.certificate
    if callable(tls):
        context = tls()
        if isinstance(context, ssl.SSLContext):
            return context, None
        raise TypeError(f"the tls callable returned {type(context).__name__}, not an ssl.SSLContext")
    raise TypeError(
        f"tls must be an ssl.SSLContext, TLSFiles or a callable returning one, not {type(tls).__name__}"
    )


def check_cluster(cluster: str) -> str:
    """Return ``cluster`` if it is a valid cluster name (a Kubernetes object name), else raise ValueError."""
    if not isinstance(cluster, str) or not CLUSTER_NAME.match(cluster):
        raise ValueError(
            f"invalid cluster name {cluster!r}: expected a DNS name (lower-case letters, digits, "
            "'.' and '-', starting and ending with a letter or digit, at most 253 characters)"
        )
    return cluster


def format_authority(host: str, port: int) -> str:
    """``host:port`` for a CONNECT request; an IPv6 address is put in brackets (``[::1]:443``)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"invalid port {port!r}: expected an integer 1-65535")
    if not isinstance(host, str) or not host:
        raise ValueError(f"invalid host {host!r}: expected a host name or IP address")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" in bare:
        try:
            ipaddress.IPv6Address(bare.split("%", 1)[0])
        except ValueError:
            raise ValueError(f"invalid host {host!r}: not a host name or IP address") from None
    elif not _HOST.match(bare):
        raise ValueError(f"invalid host {host!r}: not a host name or IP address")
    return wire_format_authority(bare, port)


def parse_address(address: str | tuple[str, int]) -> tuple[str, int]:
    """``"host:port"``, ``"[::1]:port"``, ``"https://host:port"`` or ``(host, port)`` -> ``(host, port)``."""
    if isinstance(address, tuple):
        host, port = address
        format_authority(host, port)  # validates
        return (host[1:-1] if host.startswith("[") else host), port
    text = address.strip()
    if text.startswith("https://"):
        text = text[len("https://") :].rstrip("/")
        text = text.rpartition("@")[2]
    try:
        host, port = parse_hostport(text)
    except ConfigError as exc:
        raise ValueError(f"invalid proxy-server address: {exc}") from None
    if port == 0:
        raise ValueError(f"invalid proxy-server address {address!r}: port 0")
    return host, port


def _unwrap(group: BaseExceptionGroup) -> BaseException | None:
    """The single leaf exception of a (nested) exception group, or None if there are several."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) != 1:
            return None
        exc = exc.exceptions[0]
    return exc


@contextmanager
def single_exceptions() -> Iterator[None]:
    """Re-raise a lone exception that a nursery wrapped in an exception group as itself."""
    try:
        yield
    except BaseExceptionGroup as group:
        single = _unwrap(group)
        if single is None:
            raise
        raise single from single.__cause__


class Tunnel:
    """A live connection to a proxy-server; open proxied TCP streams with :meth:`connect`.

    ``client_certificate`` is the certificate its handshake presented when the SDK loaded it from
    files (``TLSFiles``, ``ReloadingTLSFiles``); None for an ``ssl.SSLContext`` or a callable of yours.
    """

    def __init__(
        self, mux: Mux, address: tuple[str, int], client_certificate: x509.Certificate | None = None
    ) -> None:
        self._mux = mux
        self.address = address
        self.client_certificate = client_certificate

    @property
    def mux(self) -> Mux:
        """The underlying HTTP/2 connection (for stats: ``open_streams``, ``bytes_in``, ``last_rtt``)."""
        return self._mux

    @property
    def is_alive(self) -> bool:
        """True while the connection is up."""
        return not self._mux.dead

    @property
    def accepts_streams(self) -> bool:
        """True while new streams can be opened (the connection is up and the server is not draining)."""
        return self._mux.accepts_streams and not self._mux.peer_draining

    @property
    def open_streams(self) -> int:
        return self._mux.open_streams

    async def wait_closed(self) -> None:
        """Wait until the connection is gone."""
        await self._mux.closed.wait()

    async def connect(self, cluster: str, host: str, port: int) -> TunnelStream:
        """A TCP stream to ``host:port`` inside ``cluster``.

        Raises a :class:`~clusterproxy_protocol.errors.ConnectRefused` subclass when the server or the
        agent refuses (status and reason in the exception), :class:`TunnelClosed` when this connection
        is gone, ``ValueError`` for a malformed cluster, host or port.
        """
        authority = format_authority(host, port)
        check_cluster(cluster)
        return await self._mux.open_connect(authority, [(CLUSTER_HEADER, cluster)])

    async def connect_kube_apiserver(self, cluster: str) -> TunnelStream:
        """A TCP stream to the kube-apiserver of ``cluster``.

        Uses the upstream convention: ``CONNECT <cluster>:443`` with no cluster header; the agent
        routes it to its cluster's kube-apiserver.
        """
        check_cluster(cluster)
        return await self._mux.open_connect(f"{cluster}:{KUBE_APISERVER_PORT}")

    def close(self) -> None:
        """Close the connection now; open streams fail."""
        self._mux.close("closed by the client")


def _os_error_detail(exc: OSError) -> str:
    """The most useful text of a connect error (trio wraps per-address errors in a group)."""
    cause = exc.__cause__
    while isinstance(cause, BaseExceptionGroup) and cause.exceptions:
        cause = cause.exceptions[0]
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    return exc.strerror or str(exc) or errno.errorcode.get(exc.errno or 0, "error")


async def _connect_tls(
    host: str, port: int, context: ssl.SSLContext, server_hostname: str, timeout: float
) -> trio.SSLStream[trio.SocketStream]:
    where = format_authority(host, port)
    tcp: trio.SocketStream | None = None
    try:
        with trio.fail_after(timeout):
            try:
                tcp = await trio.open_tcp_stream(host, port)
            except OSError as exc:
                detail = _os_error_detail(exc)
                raise ProxyConnectionError(
                    f"cannot connect to the proxy-server at {where}: {detail}"
                ) from exc
            # Not https_compatible: an EOF without close_notify (the hub killed, the connection cut)
            # must fail the streams still open, never end them as if their data were complete.
            stream = trio.SSLStream(tcp, context, server_hostname=server_hostname, https_compatible=False)
            try:
                await stream.do_handshake()
            except trio.BrokenResourceError as exc:
                cause = exc.__cause__ or exc
                if isinstance(cause, ssl.SSLCertVerificationError):
                    detail = f"server certificate not accepted: {cause.verify_message or cause}"
                else:
                    detail = str(cause) or type(cause).__name__
                raise ProxyConnectionError(f"TLS handshake with {where} failed: {detail}") from exc
    except trio.TooSlowError:
        if tcp is not None:
            await trio.aclose_forcefully(tcp)
        raise ProxyConnectionError(
            f"could not connect to the proxy-server at {where} within {timeout:g}s"
        ) from None
    except BaseException:
        if tcp is not None:
            await trio.aclose_forcefully(tcp)
        raise
    selected = stream.selected_alpn_protocol()
    if selected != ALPN_H2:
        await trio.aclose_forcefully(stream)
        raise ALPNError(
            f"the server at {where} did not agree to HTTP/2: ALPN selected {selected or 'nothing'}, "
            "expected h2 (is this the proxy-server's client port? an SSLContext you pass must offer h2)"
        )
    return stream


@asynccontextmanager
async def open_tunnel(
    address: str | tuple[str, int],
    tls: TLSSource,
    *,
    server_hostname: str | None = None,
    connect_timeout: float = 10.0,
    keepalive: tuple[float, float] | None = DEFAULT_KEEPALIVE,
    settings: TunnelSettings | None = None,
) -> AsyncIterator[Tunnel]:
    """Connect to the proxy-server's client port; one TLS connection, HTTP/2, many streams.

    ``address`` is ``"host:port"``, ``"[v6]:port"``, ``"https://host:port"`` or ``(host, port)``.
    ``tls`` is a :class:`TLSFiles` (read now), a :class:`ReloadingTLSFiles`, an ``ssl.SSLContext``
    that offers ALPN ``h2``, or a callable returning one (called once, for this handshake).
    ``server_hostname`` (default: the host of ``address``) is checked against the server certificate.
    ``keepalive`` is ``(interval, timeout)`` in seconds for HTTP/2 PINGs (``None``: off); a dead
    connection fails its streams at once.
    """
    host, port = parse_address(address)
    context, client_certificate = _resolve_tls(tls)
    stream = await _connect_tls(host, port, context, server_hostname or host, connect_timeout)
    # open_mux runs a nursery around our caller's block: give them back their own exception.
    with single_exceptions():
        async with open_mux(stream, Role.OPENER, settings=settings, keepalive=keepalive) as mux:
            yield Tunnel(mux, (host, port), client_certificate)


__all__ = [
    "ALPNError",
    "ProxyConnectionError",
    "ReloadingTLSFiles",
    "TLSFiles",
    "TLSSource",
    "Tunnel",
    "TunnelClosed",
    "check_cluster",
    "format_authority",
    "open_tunnel",
    "parse_address",
]
