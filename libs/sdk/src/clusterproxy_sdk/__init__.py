"""Python client SDK for cluster-proxy: open TCP streams into managed clusters through the hub.

The SDK speaks the proxy-server's HTTP/2 client frontend: one mutually authenticated TLS connection
(ALPN ``h2``) and one HTTP/2 ``CONNECT`` stream per TCP stream, naming the cluster in the header
``cluster-proxy-cluster``. Every stream is a ``trio.abc.HalfCloseableStream``: ``send_all``,
``receive_some``, ``send_eof`` (half-close: the target sees EOF and can still answer) and ``aclose``.

Quick start (trio)::

    import trio
    from clusterproxy_sdk import TLSFiles, open_tunnel

    async def main():
        tls = TLSFiles(ca="ca.crt", cert="local-admin.crt", key="local-admin.key")
        async with open_tunnel("127.0.0.1:8090", tls) as tunnel:
            stream = await tunnel.connect("cluster1", "10.0.0.5", 80)
            async with stream:
                await stream.send_all(b"GET / HTTP/1.0\\r\\n\\r\\n")
                await stream.send_eof()
                while data := await stream.receive_some():
                    print(data)

    trio.run(main)

API:

- ``open_tunnel(address, tls, *, server_hostname=None, connect_timeout=10.0, keepalive=(30, 10),
  settings=None)`` - async context manager yielding a :class:`Tunnel`. ``address`` is ``"host:port"``,
  ``"[::1]:port"``, ``"https://host:port"`` or ``(host, port)``; ``tls`` a :class:`TLSFiles` or an
  ``ssl.SSLContext`` that offers ALPN ``h2``. Raises :class:`ProxyConnectionError` when TCP or TLS
  fails or takes longer than ``connect_timeout``, :class:`ALPNError` when the server does not select
  ``h2``.
- ``Tunnel.connect(cluster, host, port)`` - a stream to ``host:port`` inside ``cluster``. Many streams
  share the connection; each has its own flow control, so a slow reader stalls only its own stream.
- ``Tunnel.connect_kube_apiserver(cluster)`` - a stream to the cluster's kube-apiserver, using the
  upstream convention ``CONNECT <cluster>:443`` without a cluster header.
- ``open_shared_tunnel(...)`` - same arguments, yields a :class:`SharedTunnel` with the same
  ``connect`` methods, which dials lazily and replaces a dead or draining connection on demand (what
  ``cluster-proxy port-forward`` uses). Each dial presents the certificate in the files *now*.
- ``TLSFiles(ca, cert, key)`` - PEM paths; ``.context()`` builds the TLS 1.3 client context,
  ``.reloading()`` a :class:`ReloadingTLSFiles` that rebuilds it whenever the files change. ``tls``
  may also be any callable returning the context for the next handshake.

Errors (all subclasses of :class:`TunnelError`): a refused CONNECT raises a :class:`ConnectRefused`
subclass carrying ``.status`` and ``.reason``: :class:`MalformedTarget` (400), :class:`Forbidden` (403),
:class:`UnknownCluster` (404), :class:`TooManyRequests` (429: this client has too many dials
waiting for agents), :class:`TargetUnreachable` (502), :class:`NoAgentConnected` (503),
:class:`DialTimeout` (504); another status gives a plain :class:`ConnectRefused`. :class:`TunnelClosed`
means the connection to the server is gone (its streams fail at once); broken streams raise
``trio.BrokenResourceError`` like sockets do. Malformed arguments raise ``ValueError``.

See ``docs/sdk.md`` for more.
"""

from clusterproxy_protocol import (
    CLUSTER_HEADER,
    REASON_HEADER,
    ConnectRefused,
    DialTimeout,
    Forbidden,
    MalformedTarget,
    NoAgentConnected,
    TargetUnreachable,
    TooManyRequests,
    TunnelClosed,
    TunnelError,
    TunnelStream,
    UnknownCluster,
)

from ._reload import LoadedTLS, ReloadingTLSFiles
from ._shared import SharedTunnel, open_shared_tunnel
from ._tunnel import (
    ALPNError,
    ProxyConnectionError,
    TLSFiles,
    TLSSource,
    Tunnel,
    check_cluster,
    format_authority,
    open_tunnel,
    parse_address,
)

__all__ = [
    "ALPNError",
    "CLUSTER_HEADER",
    "ConnectRefused",
    "DialTimeout",
    "Forbidden",
    "LoadedTLS",
    "MalformedTarget",
    "NoAgentConnected",
    "ProxyConnectionError",
    "REASON_HEADER",
    "ReloadingTLSFiles",
    "SharedTunnel",
    "TLSFiles",
    "TLSSource",
    "TargetUnreachable",
    "TooManyRequests",
    "Tunnel",
    "TunnelClosed",
    "TunnelError",
    "TunnelStream",
    "UnknownCluster",
    "check_cluster",
    "format_authority",
    "open_shared_tunnel",
    "open_tunnel",
    "parse_address",
]
