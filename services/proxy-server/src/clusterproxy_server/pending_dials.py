"""Bounds on the work one client can cause toward agents: dials sent to an agent and not answered yet,
counted per client connection and per client identity (its certificate's subject).

A dial costs an agent a resolve, a socket and a slot until the target answers; a client that opens
streams faster than targets answer (or resets them as soon as they are sent) would otherwise queue
unbounded work on the cluster's tunnels, which every other client shares. Beyond either bound the
request is refused with 429 and the reason, before anything reaches an agent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from clusterproxy_protocol import TooManyRequests


@dataclass
class ConnectionDials:
    """The pending dials of one client connection."""

    pending: int = 0


class PendingDials:
    def __init__(self, per_connection: int, per_client: int) -> None:
        if per_connection < 1 or per_client < 1:
            raise ValueError("pending-dial limits must be at least 1")
        self.per_connection = per_connection
        self.per_client = per_client
        self.total = 0
        self._by_client: dict[str, int] = {}

    def pending_for(self, client: str) -> int:
        return self._by_client.get(client, 0)

    @contextmanager
    def hold(self, connection: ConnectionDials, client: str) -> Iterator[None]:
        """One dial of ``client`` on ``connection`` for the duration of the block; raises
        :class:`TooManyRequests` (429), naming the bound and its flag, when either is reached."""
        if connection.pending >= self.per_connection:
            raise ScopedTooManyRequests(
                "connection",
                f"this connection already has {connection.pending} dials waiting for an agent's answer "
                f"(--max-pending-dials-per-connection {self.per_connection}); retry when some are answered",
            )
        held = self._by_client.get(client, 0)
        if held >= self.per_client:
            raise ScopedTooManyRequests(
                "client",
                f"client {client!r} already has {held} dials waiting for an agent's answer "
                f"(--max-pending-dials-per-client {self.per_client}); retry when some are answered",
            )
        connection.pending += 1
        self._by_client[client] = held + 1
        self.total += 1
        try:
            yield
        finally:
            connection.pending -= 1
            self.total -= 1
            left = self._by_client[client] - 1
            if left:
                self._by_client[client] = left
            else:
                del self._by_client[client]


class ScopedTooManyRequests(TooManyRequests):
    """A 429 that says which bound refused it (``connection`` or ``client``), for the metrics."""

    def __init__(self, scope: str, reason: str) -> None:
        super().__init__(reason)
        self.scope = scope
