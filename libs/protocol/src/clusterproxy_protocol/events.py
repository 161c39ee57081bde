"""Events produced by the sans-IO tunnel core (:mod:`clusterproxy_protocol.core`).

They are deliberately few: the core keeps received bytes in per-stream buffers, so an event only
says *that* something changed; the driver then asks the core for the data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestReceived:
    """The peer opened a stream (acceptor role): a CONNECT or a control request."""

    stream_id: int
    method: str
    authority: str
    path: str
    headers: dict[str, str]
    ended: bool


@dataclass(frozen=True, slots=True)
class ResponseReceived:
    """The peer answered a stream we opened (opener role)."""

    stream_id: int
    status: int
    headers: dict[str, str]


@dataclass(frozen=True, slots=True)
class DataArrived:
    """Bytes were appended to the stream's receive buffer."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class RemoteEnded:
    """The peer half-closed the stream (END_STREAM): no more bytes will arrive."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class StreamReset:
    """The stream was aborted (RST_STREAM, sent by the peer or by the core itself)."""

    stream_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class WindowOpened:
    """Send window grew. ``stream_id`` 0 means the connection window or every stream."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class PeerSettingsChanged:
    """The peer changed its settings; ``max_concurrent_streams`` 0 means it is draining."""

    max_concurrent_streams: int


@dataclass(frozen=True, slots=True)
class PingAcked:
    payload: bytes


@dataclass(frozen=True, slots=True)
class ConnectionEnded:
    """The connection is over: GOAWAY from the peer, or a protocol violation we answered with GOAWAY."""

    error_code: int
    reason: str


@dataclass(frozen=True, slots=True)
class LimitExceeded:
    """The peer went past an abuse limit. ``stream_id`` 0: the connection ends (a ``ConnectionEnded``
    follows); otherwise only that stream was refused or reset."""

    limit: str  # concurrent_streams, reset_budget, reply_backlog, frame_size (the core's);
    # frame_timeout, stream_stall, idle_timeout (the driver's)
    detail: str
    stream_id: int = 0


Event = (
    RequestReceived
    | ResponseReceived
    | DataArrived
    | RemoteEnded
    | StreamReset
    | WindowOpened
    | PeerSettingsChanged
    | PingAcked
    | LimitExceeded
    | ConnectionEnded
)
