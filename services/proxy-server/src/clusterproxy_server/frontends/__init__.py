"""Client frontends of the proxy-server: each adapts one client protocol to the shared
dial-and-relay path (:class:`clusterproxy_server.relaying.ClientRequest`).

``FRONTENDS`` maps the protocol a client speaks on the client port, told by its first bytes
(:mod:`.sniff`), to the module that serves the connection. Kinds of HTTP/2 stream (CONNECT today) are
chosen per stream in :mod:`.http2`. docs/architecture.md shows how to add one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from clusterproxy_server.frontends import http1, http2
from clusterproxy_server.frontends.connection import ClientConnection
from clusterproxy_server.frontends.sniff import ClientProtocol

FRONTENDS: dict[ClientProtocol, Callable[[ClientConnection], Awaitable[None]]] = {
    "http1": http1.serve,
    "h2": http2.serve,
}
# How each refuses a connection as a whole (a client identity over its connection bound), with a reason.
REFUSALS: dict[ClientProtocol, Callable[[ClientConnection, str], Awaitable[None]]] = {
    "http1": http1.refuse_connection,
    "h2": http2.refuse_connection,
}

__all__ = ["FRONTENDS", "REFUSALS", "ClientConnection"]
