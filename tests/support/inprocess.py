"""A proxy-server running in the test's own trio nursery, on loopback ports chosen by the OS."""

from __future__ import annotations

from typing import Any

import trio

from clusterproxy_server.app import ProxyServer, ServerConfig
from tests.support.pki import PkiFiles


async def start_server(nursery: trio.Nursery, pki: PkiFiles, **overrides: Any) -> tuple[ProxyServer, Any]:
    """The server with ``pki``'s server certificate and any ``ServerConfig`` field overridden; returns
    it and its bound addresses (``.agent``, ``.client``, ``.admin``) once it listens."""
    config = ServerConfig(
        ca=pki.ca,
        cert=pki.server.cert,
        key=pki.server.key,
        agent_listen=("127.0.0.1", 0),
        client_listen=("127.0.0.1", 0),
        admin_listen=("127.0.0.1", 0),
        **overrides,
    )
    server = ProxyServer(config)
    bound = await nursery.start(server.run)
    return server, bound
