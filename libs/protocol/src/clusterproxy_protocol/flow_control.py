"""Flow control: the receive windows the core grants and reopens, and h2's windows charged for the
DATA frames that go past h2.

:class:`ReceiveWindows`, the core's base class, reopens the windows:

* The *stream* window is only reopened when the application reads from the stream's buffer, so a
  stream whose reader stops holds at most one stream window of memory and stops only itself. A
  stream whose peer used up its window and whose reader emptied the buffer gets a bigger one
  (:func:`~clusterproxy_protocol.windows.next_window`), as far as its
  :class:`~clusterproxy_protocol.windows.Budget` allows.
* The *connection* window is reopened as soon as bytes land in a stream buffer. The stream windows
  already bound the memory, and releasing the connection window at once means a stalled stream can
  never starve the others (the upstream head-of-line problem).

The tunnel moves plain DATA past h2's copies both ways: :class:`~clusterproxy_protocol.framing.FrameScanner`
hands a received DATA frame's payload straight to its stream's buffer, and
:meth:`~clusterproxy_protocol.h2_connection.TunnelH2Connection.send_data_frames` queues outgoing ones
as a header and a view of the caller's bytes. h2 must still see its windows move exactly as if it had
framed or parsed those bytes itself, or its WINDOW_UPDATE arithmetic and flow-control errors would be
wrong: the two functions here charge them as h2's ``send_data`` and ``receive_data`` do, and only
where h2 would take the frame as plain data (an open stream, an open connection, room in both
windows). Everything else goes through h2, which then raises or answers what applies. The
WINDOW_UPDATEs that reopen the receive windows are queued the same way, past h2's frame objects
(:func:`grant_received`).

The windows are h2's private counters (``H2Stream._inbound_window_manager``,
``H2Connection._inbound_flow_control_window_manager``); that they move here as h2 moves them is
checked by :func:`clusterproxy_protocol.h2_connection.check_h2_internals`, when the first
connection is made.

The budget the windows are charged to is :mod:`clusterproxy_protocol.windows`. Sans-IO: no clock,
no I/O, no trio.
"""

from __future__ import annotations

import struct

import h2.connection
import h2.exceptions
import h2.stream

from clusterproxy_protocol.settings import TunnelSettings
from clusterproxy_protocol.stream_state import StreamState
from clusterproxy_protocol.windows import next_window

__all__ = ["ReceiveWindows", "charge_received", "charge_sent", "grant_received"]

MAX_WINDOW_INCREMENT = 2**31 - 1
# A whole WINDOW_UPDATE frame: its length (4) and type (8) in one word, flags, stream id, increment.
WINDOW_UPDATE = struct.Struct(">IBII")
WINDOW_UPDATE_HEAD = 4 << 8 | 0x8
_SENDING_STREAM_STATES = (h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_REMOTE)
_RECEIVING_STREAM_STATES = (h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_LOCAL)
_OPEN_CONNECTION_STATES = (
    h2.connection.ConnectionState.CLIENT_OPEN,
    h2.connection.ConnectionState.SERVER_OPEN,
)


def charge_sent(connection: h2.connection.H2Connection, stream: h2.stream.H2Stream, length: int) -> bool:
    """``length`` bytes of DATA about to be queued on ``stream`` past h2: when h2's ``send_data``
    would send them as they are (stream and connection open, both windows large enough), charge its
    outbound windows as it does and return True; otherwise False, charging nothing, and the bytes
    must go through h2."""
    if (
        stream.state_machine.state not in _SENDING_STREAM_STATES
        or connection.state_machine.state not in _OPEN_CONNECTION_STATES
        or length > stream.outbound_flow_control_window
        or length > connection.outbound_flow_control_window
    ):
        return False
    stream.outbound_flow_control_window -= length
    connection.outbound_flow_control_window -= length
    return True


def charge_received(connection: h2.connection.H2Connection, stream_id: int, length: int) -> bool:
    """A DATA frame without flags announced on ``stream_id``: when h2 would take it as plain data
    on an open stream, charge h2's inbound windows as its receive path does and return True (the
    caller delivers the payload itself); otherwise False, and the frame must go through h2."""
    stream = connection.streams.get(stream_id)
    if (
        stream is None
        or stream.state_machine.state not in _RECEIVING_STREAM_STATES
        or not stream.state_machine.headers_received
        or stream._expected_content_length is not None
        or connection.state_machine.state not in _OPEN_CONNECTION_STATES
        or length > connection._inbound_flow_control_window_manager.current_window_size
        or length > stream._inbound_window_manager.current_window_size
    ):
        return False
    connection._inbound_flow_control_window_manager.window_consumed(length)
    stream._inbound_window_manager.window_consumed(length)
    return True


def grant_received(connection: h2.connection.H2Connection, stream_id: int, increment: int) -> None:
    """``increment`` more bytes of receive window for ``stream_id`` (0: the connection), as h2's
    ``increment_flow_control_window`` gives them, without its state machines' inputs and frame
    objects where they change nothing (a connection open, a stream open or half-closed by us: a
    WINDOW_UPDATE leaves their states as they were): its window grown, the frame packed behind what
    h2 queued (a visible share of a receiving relay's CPU, one per quarter window). Anything else
    goes through h2, which raises what applies."""
    if (
        not 1 <= increment <= MAX_WINDOW_INCREMENT
        or connection.state_machine.state not in _OPEN_CONNECTION_STATES
    ):
        connection.increment_flow_control_window(increment, stream_id=stream_id or None)
        return
    if stream_id:
        stream = connection.streams.get(stream_id)
        if stream is None or stream.state_machine.state not in _RECEIVING_STREAM_STATES:
            connection.increment_flow_control_window(increment, stream_id=stream_id)
            return
        stream._inbound_window_manager.window_opened(increment)
    else:
        connection._inbound_flow_control_window_manager.window_opened(increment)
    connection._data_to_send += WINDOW_UPDATE.pack(WINDOW_UPDATE_HEAD, 0, stream_id, increment)


class ReceiveWindows:
    """The receive windows of :class:`~clusterproxy_protocol.core.TunnelCore`, its base class: what
    a stream and the connection are charged and given back, and when their windows reopen. A base
    class rather than an object of its own so the core's data path calls these as it would its own
    methods, with nothing in between."""

    # The core's, set by its __init__.
    _conn: h2.connection.H2Connection
    _streams: dict[int, StreamState]
    _conn_unacked: int
    settings: TunnelSettings
    closed: bool

    def take_reserve(self, stream_id: int) -> int:
        """Hand over the stream's reservation (its bytes stay charged) to pay for the stream opened on its
        behalf (``open_connect(prepaid=...)``); 0 when it has none left."""
        state = self._streams.get(stream_id)
        if state is None or not state.reserved:
            return 0
        taken, state.reserved = state.reserved, 0
        state.charged -= taken
        return taken

    def _release(self, state: StreamState, keep: int = 0) -> None:
        """The peer can send the stream nothing more: give back its charge but ``keep`` (what is still
        buffered), so a rapid reset's or an ended stream's window is free at once, not when the
        application gets round to it."""
        if state.budget is not None and state.charged > keep:
            state.budget.give(state.charged - keep)
            state.charged = keep
        state.reserved = 0  # given back with the rest: what is opened on its behalf pays for itself

    def _wire_open(self) -> bool:
        # h2 closes its side as soon as it parses a GOAWAY, which can be in the same read as DATA we
        # are still translating: sending anything then would raise.
        return not self.closed and self._conn.state_machine.state is not h2.connection.ConnectionState.CLOSED

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
                grant_received(self._conn, state.stream_id, state.unacked + growth)
            except h2.exceptions.StreamClosedError:
                pass
            state.unacked = 0

    def _ack_connection(self, count: int) -> None:
        self._conn_unacked += count
        if self._conn_unacked >= self.settings.connection_window // 4 and self._wire_open():
            grant_received(self._conn, 0, self._conn_unacked)
            self._conn_unacked = 0
