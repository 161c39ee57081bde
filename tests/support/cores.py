"""Two sans-IO tunnel cores wired back to back: no sockets, no trio."""

from __future__ import annotations

from clusterproxy_protocol import events as ev
from clusterproxy_protocol.core import Role, TunnelCore
from clusterproxy_protocol.settings import TunnelSettings


def pump(a: TunnelCore, b: TunnelCore) -> tuple[list[ev.Event], list[ev.Event]]:
    """Move bytes both ways until both cores are quiet; returns the events each side saw."""
    seen_a: list[ev.Event] = []
    seen_b: list[ev.Event] = []
    while True:
        out_a, out_b = a.data_to_send(), b.data_to_send()
        if not out_a and not out_b:
            return seen_a, seen_b
        if out_a:
            seen_b += b.receive_bytes(out_a)
        if out_b:
            seen_a += a.receive_bytes(out_b)


def connected(settings: TunnelSettings | None = None) -> tuple[TunnelCore, TunnelCore]:
    """(opener, acceptor), each past the other's preface and SETTINGS."""
    opener, acceptor = TunnelCore(Role.OPENER, settings), TunnelCore(Role.ACCEPTOR, settings)
    opener.initiate()
    acceptor.initiate()
    pump(opener, acceptor)
    return opener, acceptor
