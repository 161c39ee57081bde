"""The proxy-server's agent WebSocket port (``--agent-websocket-listen 127.0.0.1:0``), as the server
reports it at start: what an ingress in front of it, or an agent dialing it directly, connects to."""

from __future__ import annotations

from tests.support.procs import Hub


def websocket_port(hub: Hub) -> int:
    """The port the hub's running proxy-server bound for agent WebSockets (its ``server_started`` event)."""
    assert hub.server is not None
    started = next(e for e in hub.server.events() if e.get("event") == "server_started")
    return int(started["agent_websocket_port"].rsplit(":", 1)[1])
