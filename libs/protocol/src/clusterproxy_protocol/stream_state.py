"""What the core knows of one stream: its receive window and what it is charged, its buffer, how
each side ended it, and its byte counts. Sans-IO: a plain record, changed only by
:class:`~clusterproxy_protocol.core.TunnelCore` (and its receive windows,
:class:`~clusterproxy_protocol.flow_control.ReceiveWindows`); the driver reads it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from clusterproxy_protocol.windows import Budget

__all__ = ["StreamState"]


@dataclass(slots=True)
class StreamState:
    stream_id: int
    window: int = 0  # the receive window granted: at most this much is ever buffered
    budget: Budget | None = None  # charged ``window`` while the peer may still send, then what is buffered
    charged: int = 0
    reserved: int = 0  # of ``charged``: held for the stream the application opens on its behalf
    starved: bool = False  # the peer used up the window since it last grew
    chunks: deque[bytes] = field(default_factory=deque)
    buffered: int = 0
    remote_ended: bool = False
    local_ended: bool = False
    reset_code: int | None = None
    app_closed: bool = False
    unacked: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    @property
    def finished(self) -> bool:
        both_ended = self.remote_ended and self.local_ended
        return self.app_closed and (self.reset_code is not None or both_ended)
