"""Sans-IO core of the reverse HTTP/2 tunnel.

:class:`TunnelCore` wraps an ``h2`` connection and adds what the tunnel needs on top of it:
per-stream receive buffers bounded by the stream window, CONNECT helpers, error replies, and
socket-like close semantics. It never touches a socket: feed it bytes with :meth:`receive_bytes`,
send what :meth:`data_to_send` returns, and react to the events.

Flow control, the reason for most of this module:

* The *stream* window is only reopened when the application reads from the stream's buffer, so a
  stream whose reader stops holds at most one stream window of memory and stops only itself.
* The *connection* window is reopened as soon as bytes land in a stream buffer. The stream windows
  already bound the memory, and releasing the connection window at once means a stalled stream can
  never starve the others (the upstream head-of-line problem).

Abuse limits (``TunnelSettings``): a peer may keep at most ``max_concurrent_streams`` streams open
(the excess is refused with ``REFUSED_STREAM``, not by ending the connection); it may reset at most
``reset_budget`` of the streams it opened per ``RESET_BUDGET_WINDOW`` (rapid reset), may leave at
most ``max_reply_backlog`` bytes of our replies unread, and may not announce a frame larger than
``max_frame_size``. Each trip is reported as a :class:`~clusterproxy_protocol.events.LimitExceeded`;
the connection-level ones end the connection with ``GOAWAY ENHANCE_YOUR_CALM`` (or
``FRAME_SIZE_ERROR``). The limits on time (a frame that started arriving, a stalled stream, an idle
connection) need a clock and a timer, so the driver keeps them; the core only tells when the frame
now arriving started (:attr:`TunnelCore.partial_frame_since`).

Draining: ``h2`` treats a received GOAWAY as the end of the connection, so a graceful drain is
announced with ``SETTINGS_MAX_CONCURRENT_STREAMS = 0`` (no new streams, existing ones go on) and the
GOAWAY is sent only when the tunnel is done.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from clusterproxy_protocol import events as ev
from clusterproxy_protocol.errors import clean_reason
from clusterproxy_protocol.windows import Budget, next_window
from clusterproxy_protocol.wire import REASON_HEADER
from clusterproxy_protocol.workarounds import TunnelH2Connection

CANCEL = h2.errors.ErrorCodes.CANCEL
NO_ERROR = h2.errors.ErrorCodes.NO_ERROR
REFUSED_STREAM = h2.errors.ErrorCodes.REFUSED_STREAM
ENHANCE_YOUR_CALM = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
FRAME_SIZE_ERROR = h2.errors.ErrorCodes.FRAME_SIZE_ERROR
H2_DEFAULT_WINDOW = 65535
RESET_BUDGET_WINDOW = 10.0  # seconds: reset_budget resets per this long, refilled evenly
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER = 9
DATA = 0x0
SMALL_PIECE = 1024  # received pieces shorter than this join the previous one while it is below
MERGED_PIECE = 16384
HEADERS_TYPES = (0x1, 0x5)  # HEADERS, PUSH_PROMISE: may start a header block
CONTINUATION = 0x9
END_HEADERS = 0x4


class Role(enum.Enum):
    OPENER = "opener"  # HTTP/2 client: opens CONNECT streams (proxy-server toward agents, SDK toward server)
    ACCEPTOR = "acceptor"  # HTTP/2 server: answers them (agent, proxy-server's client frontend)


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


class TunnelCore:
    def __init__(
        self,
        role: Role,
        settings: TunnelSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        budget: Budget | None = None,
        reserve: int = 0,
    ) -> None:
        self.role = role
        self.settings = settings or TunnelSettings()
        self.budget = budget  # what the peer's streams' windows are charged to
        # Charged with each stream the peer opens, beside its window: the window of the stream the
        # application will open on its behalf (a proxy's stream toward the agent), which takes it
        # over (take_reserve). Admitting a burst of streams then cannot spend the whole budget on
        # their own windows and leave none for the streams that serve them.
        self.reserve = reserve
        self._clock = clock
        config = h2.config.H2Configuration(client_side=role is Role.OPENER, header_encoding="utf-8")
        self._conn = TunnelH2Connection(config=config)
        self._inbound_parity = 1 if role is Role.ACCEPTOR else 0  # stream ids the peer opens
        self._reset_tokens = float(self.settings.reset_budget)
        self._reset_checked_at = clock()
        # Frame boundaries, followed as bytes arrive (before h2 buffers them): an oversized frame is
        # refused at its header, and the driver learns when the frame now arriving started.
        self._preface_left = len(PREFACE) if role is Role.ACCEPTOR else 0
        self._frame_head = b""
        self._frame_left = 0
        self._data_stream = 0  # the stream whose DATA frame is arriving past h2, 0 when none
        self._to_h2: list[bytes] = []
        self._header_block_since: float | None = None
        self._frame_since: float | None = None
        self.partial_frame_since: float | None = None
        self._streams: dict[int, StreamState] = {}
        self._conn_unacked = 0
        self._pending_out = 0
        self.peer_settings_received = False  # its limits are known: opening streams before is a guess
        self._settings_acked = False  # the peer has our limits: a stream beyond them is its fault
        self.closed = False
        self.closed_by_us = False
        self.draining = False
        self.peer_max_streams = 100  # RFC default until the peer's SETTINGS arrive
        self.bytes_in = 0
        self.bytes_out = 0

    # -- connection -------------------------------------------------------------------------------

    def initiate(self) -> None:
        s = self.settings
        self._conn.local_settings = h2.settings.Settings(
            client=self.role is Role.OPENER,
            initial_values={
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: s.first_window,
                h2.settings.SettingCodes.MAX_FRAME_SIZE: s.max_frame_size,
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: s.max_concurrent_streams,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: s.max_header_list_size,
            },
        )
        # h2 reads these two from the settings only when a change is acknowledged, and values given
        # up front are never "changed", so apply them by hand.
        self._conn.max_inbound_frame_size = s.max_frame_size
        self._conn.decoder.max_header_list_size = s.max_header_list_size
        self._conn.initiate_connection()
        self._conn.increment_flow_control_window(s.connection_window - H2_DEFAULT_WINDOW)

    def data_to_send(self) -> bytes:
        self._pending_out = 0
        return self._conn.data_to_send()

    @property
    def outbound_pending(self) -> int:
        """Payload bytes queued since the last :meth:`data_to_send` (frame headers not counted)."""
        return self._pending_out

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def ping(self, payload: bytes) -> None:
        self._conn.ping(payload)

    def drain(self) -> None:
        """Ask the peer to open no new streams; existing streams go on."""
        if self.draining or self.closed:
            return
        self.draining = True
        self._conn.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 0})

    def close(self, error_code: int = NO_ERROR, reason: str = "") -> None:
        """Send GOAWAY; ``reason`` travels as its debug data so the peer can log why."""
        if not self.closed:
            self.closed = True
            self.closed_by_us = True
            self._conn.close_connection(error_code=error_code, additional_data=reason.encode()[:512] or None)

    # -- opener -----------------------------------------------------------------------------------

    def can_open_stream(self) -> bool:
        if self.closed or self.peer_max_streams == 0:
            return False
        return self._conn.open_outbound_streams < self._conn.remote_settings.max_concurrent_streams

    def open_connect(
        self,
        authority: str,
        headers: list[tuple[str, str]] = (),  # type: ignore[assignment]
        budget: Budget | None = None,
        prepaid: int = 0,
    ) -> int:
        """Open a CONNECT stream; its receive window is charged to ``budget`` (else the connection's),
        of which ``prepaid`` bytes were charged already (a reservation, :meth:`take_reserve`)."""
        request = [(":method", "CONNECT"), (":authority", authority), *headers]
        return self._open(request, end_stream=False, budget=budget, prepaid=prepaid)

    def open_request(
        self,
        method: str,
        path: str,
        authority: str,
        headers: list[tuple[str, str]] = (),  # type: ignore[assignment]
        body: bytes = b"",
    ) -> int:
        request = [
            (":method", method),
            (":scheme", "https"),
            (":authority", authority),
            (":path", path),
            *headers,
        ]
        stream_id = self._open(request, end_stream=not body)
        if body:
            self.send_data(stream_id, body)
            self.end_stream(stream_id)
        return stream_id

    def _open(
        self,
        request: list[tuple[str, str]],
        *,
        end_stream: bool,
        budget: Budget | None = None,
        prepaid: int = 0,
    ) -> int:
        stream_id = self._conn.get_next_available_stream_id()
        self._conn.send_headers(stream_id, request, end_stream=end_stream)
        budget = budget or self.budget
        self._add_stream(stream_id, budget, local_ended=end_stream)
        if budget is not None and prepaid:
            budget.give(prepaid)  # the reservation it was paid from is over
        return stream_id

    def _add_stream(
        self,
        stream_id: int,
        budget: Budget | None,
        *,
        local_ended: bool = False,
        remote_ended: bool = False,
        reserve: int = 0,
    ) -> StreamState:
        window = self.settings.first_window
        state = StreamState(stream_id, window, budget, local_ended=local_ended, remote_ended=remote_ended)
        if budget is not None:
            # Promised by our SETTINGS already: charged whatever the budget says.
            budget.take(window + reserve)
            state.charged, state.reserved = window + reserve, reserve
        self._streams[stream_id] = state
        return state

    def take_reserve(self, stream_id: int) -> int:
        """Hand over the stream's reservation (its bytes stay charged) to pay for the stream opened on its
        behalf (``open_connect(prepaid=...)``); 0 when it has none left."""
        state = self._streams.get(stream_id)
        if state is None or not state.reserved:
            return 0
        taken, state.reserved = state.reserved, 0
        state.charged -= taken
        return taken

    def _forget(self, state: StreamState) -> None:
        if self._streams.pop(state.stream_id, None) is state:
            self._release(state)

    def _release(self, state: StreamState, keep: int = 0) -> None:
        """The peer can send the stream nothing more: give back its charge but ``keep`` (what is still
        buffered), so a rapid reset's or an ended stream's window is free at once, not when the
        application gets round to it."""
        if state.budget is not None and state.charged > keep:
            state.budget.give(state.charged - keep)
            state.charged = keep
        state.reserved = 0  # given back with the rest: what is opened on its behalf pays for itself

    # -- acceptor ---------------------------------------------------------------------------------

    def respond(
        self,
        stream_id: int,
        status: int,
        headers: list[tuple[str, str]] = (),  # type: ignore[assignment]
        *,
        end_stream: bool = False,
    ) -> None:
        state = self._streams[stream_id]
        self._conn.send_headers(stream_id, [(":status", str(status)), *headers], end_stream=end_stream)
        if end_stream:
            state.local_ended = True

    def refuse(self, stream_id: int, status: int, reason: str) -> bool:
        """Answer with an error status at once; the reason goes in a header and, for humans, in the body.

        When the windows cannot take the whole body now, the stream is reset (``REFUSED_STREAM``)
        instead and False returned: a short body ended with END_STREAM would be a malformed reply. A
        caller that can wait sends :func:`error_reply` through the stream instead."""
        head, body = error_reply(reason)
        if self.send_window(stream_id) < len(body):
            self.reset(stream_id, REFUSED_STREAM)
            return False
        self.respond(stream_id, status, [*head, ("content-length", str(len(body)))])
        self.send_data(stream_id, body)
        self.end_stream(stream_id)
        return True

    # -- both -------------------------------------------------------------------------------------

    def stream(self, stream_id: int) -> StreamState | None:
        return self._streams.get(stream_id)

    def send_window(self, stream_id: int) -> int:
        if self.closed:
            return 0
        try:
            # Negative after the peer lowers SETTINGS_INITIAL_WINDOW_SIZE under data in flight
            # (RFC 9113 6.9.2): nothing may be sent until WINDOW_UPDATEs bring it above zero.
            return max(0, self._conn.local_flow_control_window(stream_id))
        except h2.exceptions.StreamClosedError:
            return 0

    def send_data(self, stream_id: int, data: bytes | memoryview) -> int:
        """Queue as much of ``data`` as the windows allow; returns how many bytes were taken."""
        state = self._streams[stream_id]
        count = min(len(data), self.send_window(stream_id))
        if count:
            self._conn.send_data_frames(stream_id, memoryview(data)[:count])
        state.bytes_out += count
        self.bytes_out += count
        self._pending_out += count
        return count

    def end_stream(self, stream_id: int, trailers: list[tuple[str, str]] | None = None) -> None:
        """END_STREAM: on an empty DATA frame, or on a HEADERS frame of ``trailers`` (gRPC's status)."""
        state = self._streams[stream_id]
        if state.local_ended or state.reset_code is not None:
            return
        state.local_ended = True
        if trailers:
            self._conn.send_headers(stream_id, trailers, end_stream=True)
        else:
            self._conn.end_stream(stream_id)
        self._forget_if_finished(state)

    def reset(self, stream_id: int, error_code: int = CANCEL) -> None:
        state = self._streams.get(stream_id)
        if state is None or state.reset_code is not None:
            return
        self._reset(state, error_code)
        self._forget_if_finished(state)

    def _wire_open(self) -> bool:
        # h2 closes its side as soon as it parses a GOAWAY, which can be in the same read as DATA we
        # are still translating: sending anything then would raise.
        return not self.closed and self._conn.state_machine.state is not h2.connection.ConnectionState.CLOSED

    def _reset(self, state: StreamState, error_code: int) -> None:
        state.reset_code = error_code
        self._drop_buffer(state)
        if self._wire_open():
            try:
                self._conn.reset_stream(state.stream_id, error_code)
            except h2.exceptions.StreamClosedError:
                pass  # already closed on the wire (both sides ended); nothing to abort

    def read(self, stream_id: int, max_bytes: int) -> bytes:
        """Take up to ``max_bytes`` from the stream's buffer and reopen its window by that much."""
        state = self._streams[stream_id]
        chunks = state.chunks
        taken: list[bytes] = []
        room = max_bytes
        while chunks and room:  # several frames per read: fewer trips through the relay and syscalls
            chunk = chunks.popleft()
            if len(chunk) > room:
                chunks.appendleft(chunk[room:])
                chunk = chunk[:room]
            taken.append(chunk)
            room -= len(chunk)
        data = taken[0] if len(taken) == 1 else b"".join(taken)
        state.buffered -= len(data)
        self._ack_stream(state, len(data))
        return data

    def close_stream(self, stream_id: int) -> None:
        """The application is done with the stream, like ``close()`` on a socket.

        Unread data, or data still coming, aborts the stream (RST_STREAM, as TCP sends RST);
        otherwise our direction is ended gracefully and later data from the peer resets it.
        """
        state = self._streams.get(stream_id)
        if state is None or state.app_closed:
            return
        state.app_closed = True
        if state.reset_code is None:
            if state.buffered:
                self._reset(state, CANCEL)
            elif not state.local_ended:
                state.local_ended = True
                if not self.closed:
                    self._conn.end_stream(stream_id)
        self._forget_if_finished(state)

    def _forget_if_finished(self, state: StreamState) -> None:
        if state.finished or self.closed:
            self._forget(state)

    def _drop_buffer(self, state: StreamState) -> None:
        """The stream was reset: its bytes will never be read, and no more can come."""
        if state.buffered:
            state.chunks.clear()
            state.buffered = 0
        self._release(state)

    def _ack_stream(self, state: StreamState, count: int) -> None:
        state.unacked += count
        if state.remote_ended or not self._wire_open():
            return
        growth = 0
        if state.starved and not state.buffered:
            # The peer sent as fast as the window let it and the reader took it all: a bigger window
            # would have kept the peer sending. A reader that stops never empties its buffer, so a
            # stalled stream keeps the window it had.
            state.starved = False
            bigger = next_window(state.window, self.settings.stream_window)
            if state.budget is None or state.budget.try_take(bigger - state.window):
                growth = bigger - state.window
                state.window = bigger
                state.charged += growth
        if growth or state.unacked >= state.window // 4:
            try:
                self._conn.increment_flow_control_window(state.unacked + growth, stream_id=state.stream_id)
            except h2.exceptions.StreamClosedError:
                pass
            state.unacked = 0

    def _ack_connection(self, count: int) -> None:
        self._conn_unacked += count
        if self._conn_unacked >= self.settings.connection_window // 4 and self._wire_open():
            self._conn.increment_flow_control_window(self._conn_unacked)
            self._conn_unacked = 0

    # -- input ------------------------------------------------------------------------------------

    def receive_bytes(self, data: bytes) -> list[ev.Event]:
        """Feed bytes from the peer; returns what happened. b"" means the transport hit EOF."""
        if self.closed:
            return []
        if not data:
            self.closed = True
            self._close_all_streams()
            return [ev.ConnectionEnded(NO_ERROR, "peer closed the connection")]
        if not isinstance(data, bytes):
            data = bytes(data)  # its pieces are kept in stream buffers: nobody may change them
        out: list[ev.Event] = []
        try:
            oversized = self._take_frames(data, out)
        except h2.exceptions.ProtocolError as exc:
            # h2 has already queued a GOAWAY naming the violation.
            self.closed = True
            self._close_all_streams()
            return [ev.ConnectionEnded(h2.errors.ErrorCodes.PROTOCOL_ERROR, f"protocol error: {exc}")]
        if oversized:
            limit = self.settings.max_frame_size
            return self._give_up(
                "frame_size",
                f"peer announced a frame of {oversized} bytes (limit {limit})",
                FRAME_SIZE_ERROR,
            )
        if self.closed:
            return out  # a limit ended the connection: the rest of this read was not acted on
        cap = self.settings.max_reply_backlog
        if cap:
            # What h2 holds beyond the DATA we queued is replies (SETTINGS and PING ACKs, RST_STREAMs,
            # WINDOW_UPDATEs) and frame headers: it grows only while the peer sends and does not read.
            backlog = self._conn.queued_output - self._pending_out
            if backlog > cap:
                out += self._give_up(
                    "reply_backlog", f"peer left {backlog} bytes of replies unread (limit {cap})"
                )
        return out

    def _give_up(self, limit: str, reason: str, error_code: int = ENHANCE_YOUR_CALM) -> list[ev.Event]:
        """A connection-level limit tripped: GOAWAY with ``reason``, every stream broken."""
        self.close(error_code, reason)
        self._close_all_streams()
        return [ev.LimitExceeded(limit, reason), ev.ConnectionEnded(error_code, reason)]

    def _take_frames(self, data: bytes, out: list[ev.Event]) -> int:
        """Split ``data`` at frame boundaries: a plain DATA frame on an open stream goes straight into
        the stream's buffer, piece by piece as it arrives (h2 would copy it three times and wait for
        the whole frame); every other frame goes through h2. Returns the length of an oversized
        frame, else 0; stops early when a limit closes the connection.

        Also keeps :attr:`partial_frame_since`: when the frame (or header block) that has started but
        not finished arriving began, None when the input ends on a boundary."""
        pos, end = 0, len(data)
        to_h2 = self._to_h2
        if self._preface_left > 0:
            done = len(PREFACE) - self._preface_left
            take = min(self._preface_left, end)
            if data[:take] != PREFACE[done : done + take]:
                self._preface_left = -1  # not HTTP/2: h2 says so with a protocol error
            else:
                self._preface_left -= take
                to_h2.append(data[:take])
                pos = take
        if self._preface_left < 0:
            to_h2.append(data[pos:] if pos else data)
            self._feed_h2(out)
            return 0
        started_here = False
        while pos < end:
            if self._frame_left:
                step = min(self._frame_left, end - pos)
                piece = data[pos : pos + step] if step < end or pos else data
                if self._data_stream:
                    self._on_data(self._data_stream, piece, step, out)
                else:
                    to_h2.append(piece)
                pos += step
                self._frame_left -= step
                continue
            need = FRAME_HEADER - len(self._frame_head)
            started_here = started_here or not self._frame_head  # a frame starts at its header's first byte
            if end - pos < need:
                self._frame_head += data[pos:]
                break
            head = self._frame_head + data[pos : pos + need] if self._frame_head else data[pos : pos + need]
            self._frame_head = b""
            pos += need
            length = int.from_bytes(head[:3], "big")
            if length > self.settings.max_frame_size:
                return length
            frame_type, flags = head[3], head[4]
            self._data_stream = 0
            if frame_type == DATA and not flags and length and self._header_block_since is None:
                self._feed_h2(out)  # what came before may open, end or reset the stream
                if self.closed:
                    return 0
                stream_id = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                if self._conn.take_data_frame(stream_id, length):
                    self._data_stream = stream_id
            if not self._data_stream:
                if frame_type in HEADERS_TYPES and not flags & END_HEADERS:
                    self._header_block_since = self._clock()
                elif frame_type == CONTINUATION and flags & END_HEADERS:
                    self._header_block_since = None
                to_h2.append(head)
            self._frame_left = length
        self._feed_h2(out)
        if self._frame_left or self._frame_head:
            if started_here or self._frame_since is None:
                self._frame_since = self._clock()
        else:
            self._frame_since = None
        since = self._frame_since
        if self._header_block_since is not None and (since is None or self._header_block_since < since):
            since = self._header_block_since
        self.partial_frame_since = since
        return 0

    def _feed_h2(self, out: list[ev.Event]) -> None:
        """Hand h2 the bytes gathered for it and translate what it makes of them."""
        to_h2 = self._to_h2
        if not to_h2:
            return
        chunk = to_h2[0] if len(to_h2) == 1 else b"".join(to_h2)
        to_h2.clear()
        for event in self._conn.receive_data(chunk):
            self._translate(event, out)
            if self.closed:
                return

    def goodbye_received(self, data: bytes) -> bool:
        """After our own close: does ``data`` hold the peer's GOAWAY (so it is closing too)?"""
        if self._data_stream and self._frame_left:  # the rest of a DATA frame h2 never saw the start of
            skip = min(self._frame_left, len(data))
            self._frame_left -= skip
            data = data[skip:]
        try:
            h2_events = self._conn.receive_data(data)
        except h2.exceptions.ProtocolError:
            return True  # it is not talking HTTP/2 to us any more either
        return any(isinstance(e, h2.events.ConnectionTerminated) for e in h2_events)

    def _translate(self, event: h2.events.Event, out: list[ev.Event]) -> None:
        match event:
            case h2.events.DataReceived(stream_id=sid, data=data, flow_controlled_length=length):
                self._on_data(sid, data, length or 0, out)
            case h2.events.RequestReceived(stream_id=sid, headers=headers, stream_ended=ended):
                if sid in self._conn.streams_over_limit:
                    self._conn.streams_over_limit.discard(sid)
                    limit = self._conn.local_settings.max_concurrent_streams
                    self._refuse_stream(
                        sid, "concurrent_streams", f"more than {limit} concurrent streams", out
                    )
                    return
                need = self.settings.first_window + self.reserve
                full = self.budget.exhausted(need) if self.budget is not None else None
                if full is not None:
                    # Its first window cannot be granted: open streams hold the budget with data
                    # nobody has read yet. Refused before it can send any.
                    self._refuse_over_budget(sid, full, out)
                    return
                fields = dict(headers or [])
                self._add_stream(sid, self.budget, remote_ended=ended is not None, reserve=self.reserve)
                out.append(
                    ev.RequestReceived(
                        sid,
                        fields.pop(":method", ""),
                        fields.pop(":authority", ""),
                        fields.pop(":path", ""),
                        {k: v for k, v in fields.items() if not k.startswith(":")},
                        ended is not None,
                    )
                )
            case h2.events.ResponseReceived(stream_id=sid, headers=headers):
                fields = dict(headers or [])
                status = int(fields.pop(":status", "0"))
                out.append(ev.ResponseReceived(sid, status, fields))
            case h2.events.StreamEnded(stream_id=sid):
                state = self._streams.get(sid)
                if state is not None:
                    state.remote_ended = True
                    self._release(state, keep=state.buffered)
                    self._forget_if_finished(state)
                    out.append(ev.RemoteEnded(sid))
            case h2.events.StreamReset(stream_id=sid, error_code=code):
                state = self._streams.get(sid)
                if state is not None and state.reset_code is None:
                    state.reset_code = int(code or 0)
                    self._drop_buffer(state)
                    self._forget_if_finished(state)
                    out.append(ev.StreamReset(sid, state.reset_code))
                if sid % 2 == self._inbound_parity:
                    self._charge_reset(out)
            case h2.events.WindowUpdated(stream_id=sid):
                out.append(ev.WindowOpened(sid or 0))
            case h2.events.SettingsAcknowledged():
                self._settings_acked = True
            case h2.events.RemoteSettingsChanged(changed_settings=changed):
                self.peer_settings_received = True
                max_streams = changed.get(h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS)
                if max_streams is not None:
                    self.peer_max_streams = max_streams.new_value
                    out.append(ev.PeerSettingsChanged(max_streams.new_value))
                if h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in changed:
                    out.append(ev.WindowOpened(0))
            case h2.events.PingAckReceived(ping_data=payload):
                out.append(ev.PingAcked(payload or b""))
            case h2.events.ConnectionTerminated(error_code=code, additional_data=extra):
                self.closed = True
                self._close_all_streams()
                text = (extra or b"").decode("utf-8", "replace")
                out.append(
                    ev.ConnectionEnded(
                        int(code or 0), f"peer sent GOAWAY {code}" + (f": {text}" if text else "")
                    )
                )
            case h2.events.TrailersReceived(stream_id=sid):
                pass  # a tunnel stream carries no trailers worth keeping; END_STREAM follows in its own event

    def _refuse_stream(self, sid: int, limit: str, detail: str, out: list[ev.Event]) -> None:
        """A stream beyond a limit (concurrent streams, the buffer budget): REFUSED_STREAM (the peer
        may retry it later)."""
        try:
            self._conn.reset_stream(sid, REFUSED_STREAM)
        except h2.exceptions.StreamClosedError:
            pass  # already closed on the wire: nothing to refuse
        out.append(ev.LimitExceeded(limit, detail, sid))
        if self._settings_acked:  # before that, a peer opening streams at once only raced our SETTINGS
            self._charge_reset(out)

    def _refuse_over_budget(self, sid: int, full: Budget, out: list[ev.Event]) -> None:
        """A whole answer at once (HEADERS are not flow-controlled, so even a peer with no window reads
        the reason): 429, or 503 when the process's own budget is full, then RST_STREAM NO_ERROR so the
        peer sends nothing more (RFC 9113 8.1)."""
        reason = clean_reason(f"stream refused: {full.full_reason()}")
        status = "503" if full.parent is None else "429"
        try:
            head = [(":status", status), (REASON_HEADER, reason), ("content-length", "0")]
            self._conn.send_headers(sid, head, end_stream=True)
            self._conn.reset_stream(sid, NO_ERROR)
        except h2.exceptions.StreamClosedError:
            pass  # already closed on the wire: nothing to refuse
        out.append(ev.LimitExceeded("buffer_budget", reason, sid))
        if self._settings_acked:  # a peer that keeps opening streams it is refused meets the reset budget
            self._charge_reset(out)

    def _charge_reset(self, out: list[ev.Event]) -> None:
        """One more stream the peer opened and that ended in a reset (its own, or our refusal)."""
        budget = self.settings.reset_budget
        if not budget or self.closed:
            return
        now = self._clock()
        refill = (now - self._reset_checked_at) * budget / RESET_BUDGET_WINDOW
        self._reset_checked_at = now
        self._reset_tokens = min(float(budget), self._reset_tokens + refill) - 1
        if self._reset_tokens < 0:
            out += self._give_up(
                "reset_budget",
                f"peer reset or had refused more than {budget} streams in {RESET_BUDGET_WINDOW:g}s",
            )

    def _on_data(self, sid: int, data: bytes, length: int, out: list[ev.Event]) -> None:
        self._ack_connection(length)
        state = self._streams.get(sid)
        if state is None or state.reset_code is not None:
            return  # late data for a stream we already forgot or aborted
        if state.app_closed:
            self._reset(state, CANCEL)  # nobody will read it: tell the sender, like TCP's RST
            self._forget_if_finished(state)
            return
        if length > len(data):
            self._ack_stream(state, length - len(data))  # padding is never read by anyone
        if data:
            chunks = state.chunks
            if len(data) < SMALL_PIECE and chunks and len(chunks[-1]) < MERGED_PIECE:
                chunks[-1] += data  # a peer trickling bytes costs us its bytes, not an object per piece
            else:
                chunks.append(data)
            state.buffered += len(data)
            state.bytes_in += len(data)
            self.bytes_in += len(data)
            if state.window < self.settings.stream_window and (
                state.window - state.buffered - state.unacked <= state.window // 8
            ):
                state.starved = True  # (almost) no window left: the peer waits for us
            out.append(ev.DataArrived(sid))

    def _close_all_streams(self) -> None:
        """The connection is gone: every stream is broken, except that a stream whose peer had already
        ended it keeps its buffered bytes, because they are the complete data."""
        for state in list(self._streams.values()):
            if state.remote_ended and state.reset_code is None and not state.app_closed:
                continue
            if state.reset_code is None:
                state.reset_code = CANCEL
                self._drop_buffer(state)
            self._forget(state)


def error_reply(reason: str) -> tuple[list[tuple[str, str]], bytes]:
    """The headers (without content-length) and body of an error reply: the reason in a header and,
    for humans, in the body."""
    reason = clean_reason(reason)
    return [(REASON_HEADER, reason), ("content-type", "text/plain")], (reason + "\n").encode()
