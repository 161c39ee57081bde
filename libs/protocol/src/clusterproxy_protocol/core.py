"""Sans-IO core of the reverse HTTP/2 tunnel.

:class:`TunnelCore` wraps an ``h2`` connection and adds what the tunnel needs on top of it:
per-stream receive buffers bounded by the stream window, CONNECT helpers, error replies, and
socket-like close semantics. It never touches a socket: feed it bytes with :meth:`receive_bytes`,
send what :meth:`data_to_send` returns, and react to the events.

Flow control, the reason for most of this module, is its base class
:class:`~clusterproxy_protocol.flow_control.ReceiveWindows`: a stream's window reopens as the
application reads it, the connection's as soon as bytes land in a stream buffer. Frames are followed
as they arrive by :class:`~clusterproxy_protocol.framing.FrameScanner`, which hands plain DATA to the
stream buffers past h2.

Abuse limits: those without a clock are kept here (:mod:`clusterproxy_protocol.settings` lists
them all); each trip is reported as a :class:`~clusterproxy_protocol.events.LimitExceeded`, and the
core tells the driver when the frame now arriving started (:attr:`TunnelCore.partial_frame_since`).

Draining: ``h2`` treats a received GOAWAY as the end of the connection, so a graceful drain is
announced with ``SETTINGS_MAX_CONCURRENT_STREAMS = 0`` (no new streams, existing ones go on) and the
GOAWAY is sent only when the tunnel is done.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from clusterproxy_protocol import events as ev
from clusterproxy_protocol.errors import clean_reason, error_reply
from clusterproxy_protocol.flow_control import ReceiveWindows
from clusterproxy_protocol.framing import FrameScanner
from clusterproxy_protocol.h2_connection import TunnelH2Connection
from clusterproxy_protocol.settings import H2_DEFAULT_WINDOW, RESET_BUDGET_WINDOW, TunnelSettings
from clusterproxy_protocol.stream_state import StreamState
from clusterproxy_protocol.windows import Budget
from clusterproxy_protocol.wire import REASON_HEADER

if TYPE_CHECKING:
    from hpack.struct import Header

CANCEL = h2.errors.ErrorCodes.CANCEL
NO_ERROR = h2.errors.ErrorCodes.NO_ERROR
REFUSED_STREAM = h2.errors.ErrorCodes.REFUSED_STREAM
ENHANCE_YOUR_CALM = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
FRAME_SIZE_ERROR = h2.errors.ErrorCodes.FRAME_SIZE_ERROR
SMALL_PIECE = 1024  # received pieces shorter than this join the previous one while it is below
MERGED_PIECE = 16384


class Role(enum.Enum):
    OPENER = "opener"  # HTTP/2 client: opens CONNECT streams (proxy-server toward agents, SDK toward server)
    ACCEPTOR = "acceptor"  # HTTP/2 server: answers them (agent, proxy-server's client frontend)


class TunnelCore(ReceiveWindows):
    # The base knows only h2's class (h2_connection imports flow_control, so it cannot name ours).
    _conn: TunnelH2Connection

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
        self._scanner = FrameScanner(
            self._conn,
            preface=role is Role.ACCEPTOR,
            max_frame_size=self.settings.max_frame_size,
            clock=clock,
        )
        self.partial_frame_since: float | None = None  # the scanner's, after each read
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
    def has_output(self) -> bool:
        """Bytes are queued for the peer (the driver's writer has something to send)."""
        return self._conn.queued_output > 0

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
        headers: Sequence[tuple[str, str]] = (),
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
        headers: Sequence[tuple[str, str]] = (),
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

    def _forget(self, state: StreamState) -> None:
        if self._streams.pop(state.stream_id, None) is state:
            self._release(state)

    # -- acceptor ---------------------------------------------------------------------------------

    def respond(
        self,
        stream_id: int,
        status: int,
        headers: Sequence[tuple[str, str]] = (),
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

    # -- input ------------------------------------------------------------------------------------

    def receive_bytes(self, data: bytes | bytearray) -> list[ev.Event]:
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
            oversized = self._scanner.scan(data, out, self._on_data, self._feed_h2)
            self.partial_frame_since = self._scanner.partial_frame_since
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

    def _feed_h2(self, to_h2: list[bytes], out: list[ev.Event]) -> bool:
        """Hand h2 the bytes the frame scanner gathered for it (emptying ``to_h2``) and translate what
        it makes of them; True once the connection is closed (the rest is not acted on)."""
        if not to_h2:
            return self.closed
        chunk = to_h2[0] if len(to_h2) == 1 else b"".join(to_h2)
        to_h2.clear()
        for event in self._conn.receive_data(chunk):
            self._translate(event, out)
            if self.closed:
                return True
        return False

    def goodbye_received(self, data: bytes | bytearray) -> bool:
        """After our own close: does ``data`` hold the peer's GOAWAY (so it is closing too)?"""
        data = self._scanner.skip_unseen_data(data)
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
                fields = _fields(headers)
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
                fields = _fields(headers)
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


def _fields(headers: list[Header] | None) -> dict[str, str]:
    """A header block as a dict. h2 declares names and values bytes, but the core's connection decodes
    them (``header_encoding="utf-8"``, :class:`TunnelCore`): they are str."""
    return dict(cast("list[tuple[str, str]]", headers or []))
