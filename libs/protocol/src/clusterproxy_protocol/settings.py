"""What one tunnel connection allows: its windows, its frame and header sizes, and the abuse limits
a peer meets (docs/protocol.md).

Abuse limits: a peer may keep at most ``max_concurrent_streams`` streams open (the excess is refused
with ``REFUSED_STREAM``, not by ending the connection); it may reset at most ``reset_budget`` of the
streams it opened per :data:`RESET_BUDGET_WINDOW` (rapid reset), may leave at most
``max_reply_backlog`` bytes of our replies unread, and may not announce a frame larger than
``max_frame_size``. The core (:class:`~clusterproxy_protocol.core.TunnelCore`) keeps these and
reports each trip as a :class:`~clusterproxy_protocol.events.LimitExceeded`; the connection-level
ones end the connection with ``GOAWAY ENHANCE_YOUR_CALM`` (or ``FRAME_SIZE_ERROR``). The limits on
time (a frame that started arriving, a stalled stream, an idle connection) need a clock and a timer,
so the driver (:class:`~clusterproxy_protocol.driver.Mux`) keeps them.

Each service reads its flags into one :class:`TunnelSettings`. Sans-IO: plain values, checked when
made.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["H2_DEFAULT_WINDOW", "RESET_BUDGET_WINDOW", "TunnelSettings"]

H2_DEFAULT_WINDOW = 65535
RESET_BUDGET_WINDOW = 10.0  # seconds: reset_budget resets per this long, refilled evenly


@dataclass(frozen=True, slots=True)
class TunnelSettings:
    stream_window: int = 1 << 20  # the largest receive window a stream is granted
    # The window a stream starts with (SETTINGS_INITIAL_WINDOW_SIZE); it doubles each time the peer
    # used it up and the reader emptied the buffer (the stream keeps up), up to ``stream_window``,
    # as far as the stream's Budget allows. 0: every stream gets ``stream_window`` at once.
    initial_stream_window: int = 0
    connection_window: int = 32 << 20
    max_frame_size: int = 64 << 10
    max_concurrent_streams: int = 20_000
    max_header_list_size: int = 16 << 10
    outbound_high_water: int = 1 << 20
    # Abuse limits; 0 turns a limit off. The defaults suit a tunnel between our own processes; the
    # proxy-server's client port is stricter (its flags).
    reset_budget: int = 0  # streams the peer opened and reset, per RESET_BUDGET_WINDOW
    max_reply_backlog: int = 256 << 10  # bytes of our control replies a peer may leave unread
    frame_timeout: float = 30.0  # seconds for a frame (or header block) to arrive once started
    stall_timeout: float = 0.0  # seconds a stream may make no progress either way while blocked
    idle_timeout: float = 0.0  # seconds a connection may have no stream open

    def __post_init__(self) -> None:
        if not H2_DEFAULT_WINDOW <= self.stream_window <= 2**31 - 1:
            raise ValueError(f"stream window {self.stream_window} outside 65535..2^31-1")
        if (
            self.initial_stream_window
            and not H2_DEFAULT_WINDOW <= self.initial_stream_window <= self.stream_window
        ):
            # Below 65535 a peer may send more than we allow on a stream it opens before it read
            # our SETTINGS (RFC 9113 6.9.2): a flow-control error we would cause ourselves.
            raise ValueError(
                f"initial stream window {self.initial_stream_window} outside 65535..{self.stream_window} "
                "(the stream window)"
            )
        if not H2_DEFAULT_WINDOW <= self.connection_window <= 2**31 - 1:
            raise ValueError(f"connection window {self.connection_window} outside 65535..2^31-1")
        if not 16384 <= self.max_frame_size <= 16777215:
            raise ValueError(f"max frame size {self.max_frame_size} outside 16384..16777215")
        if not 1 <= self.max_concurrent_streams <= 2**31 - 1:
            raise ValueError(f"max concurrent streams {self.max_concurrent_streams} outside 1..2^31-1")
        for name in ("reset_budget", "max_reply_backlog"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', ' ')} {getattr(self, name)} is negative")
        if 0 < self.max_reply_backlog < 4096:
            raise ValueError(f"max reply backlog {self.max_reply_backlog} below 4096 bytes (0 turns it off)")
        for name in ("frame_timeout", "stall_timeout", "idle_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', ' ')} {getattr(self, name)} is negative")

    @property
    def first_window(self) -> int:
        return self.initial_stream_window or self.stream_window
