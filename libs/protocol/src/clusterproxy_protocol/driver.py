"""Trio driver for :class:`~clusterproxy_protocol.core.TunnelCore`.

One :class:`Mux` per HTTP/2 connection. It owns the transport: one reader task feeds the core, one
writer task is the only one that ever writes (it sends whatever the core has queued, so many small
operations coalesce into one ``send_all``). Every proxied connection is a
:class:`~clusterproxy_protocol.tunnel_stream.TunnelStream`, a ``trio.abc.HalfCloseableStream``; the
PINGs that keep a connection alive are :mod:`clusterproxy_protocol.keepalive`'s; a stream the peer
opens reaches the handler as an :class:`~clusterproxy_protocol.incoming_request.IncomingRequest`. A
Mux's life is one :class:`MuxState`.

The abuse limits that need a clock live here (the rest are the core's): a frame that started
arriving must finish within ``frame_timeout``; a stream blocked on flow control with no progress
either way for ``stall_timeout`` is reset, and so is a connection whose peer reads nothing for that
long; a connection with no stream for ``idle_timeout`` is closed; a stream the peer resets before we
answered it cancels its handler (no work for a stream that is gone). Every trip goes to the
``on_limit`` callback (metrics), flagged ``first`` once per limit and connection (logs).
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from clusterproxy_protocol import events as ev
from clusterproxy_protocol.closing import close_cleanly
from clusterproxy_protocol.core import ENHANCE_YOUR_CALM, NO_ERROR, Role, TunnelCore
from clusterproxy_protocol.errors import TunnelClosed, refusal
from clusterproxy_protocol.incoming_request import IncomingRequest as IncomingRequest  # re-exported
from clusterproxy_protocol.keepalive import keep_alive
from clusterproxy_protocol.logs import get_logger
from clusterproxy_protocol.relay import BULK_HINT
from clusterproxy_protocol.settings import TunnelSettings
from clusterproxy_protocol.transport import input_waiting, read_in_bulk, receive_batch, send_all
from clusterproxy_protocol.tunnel_stream import RECEIVE_SIZE, TunnelStream
from clusterproxy_protocol.windows import Budget
from clusterproxy_protocol.wire import REASON_HEADER

_log = get_logger("tunnel")

MAX_CONTROL_BODY = 1 << 20
MAX_REASON_BODY = 4096
CLOSE_GRACE = 1.0  # seconds the peer gets to read our GOAWAY and close first
STUCK_FRAME_RECHECK = 0.05  # seconds between looks while a late frame's rest waits unread

RequestHandler = Callable[[IncomingRequest], Awaitable[None]]
LimitHandler = Callable[[ev.LimitExceeded, bool], None]  # (what tripped, first time on this connection)


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


class MuxState(enum.Enum):
    """The life of a :class:`Mux`. It only moves forward, along :data:`NEXT_STATES`, and only in
    ``Mux._enter``; leaving ``OPEN`` fails every stream and waiter at once.

    * ``OPEN``: streams work.
    * ``CLOSING``: dead, ended on this side (``close()``, a failed write); at the end the peer gets a
      moment to read our GOAWAY and close first.
    * ``PEER_CLOSED``: dead, ended from the peer's side (EOF, its GOAWAY, a failed read, a protocol
      error): nothing to wait for. Also reached from ``CLOSING`` when a read already under way brings
      the peer's close.
    * ``STOPPED``: reader, writer and stream handlers have stopped; ``Mux.closed`` is set.
    * ``FINISHED``: the last bytes are flushed and the transport is closed; ``Mux.finished`` is set.
    """

    OPEN = "open"
    CLOSING = "closing"
    PEER_CLOSED = "peer-closed"
    STOPPED = "stopped"
    FINISHED = "finished"


NEXT_STATES: dict[MuxState, frozenset[MuxState]] = {
    MuxState.OPEN: frozenset({MuxState.CLOSING, MuxState.PEER_CLOSED}),
    MuxState.CLOSING: frozenset({MuxState.PEER_CLOSED, MuxState.STOPPED}),
    MuxState.PEER_CLOSED: frozenset({MuxState.STOPPED}),
    MuxState.STOPPED: frozenset({MuxState.FINISHED}),
    MuxState.FINISHED: frozenset(),
}


class Mux:
    """An HTTP/2 connection carrying tunnel streams."""

    def __init__(
        self,
        transport: trio.abc.Stream,
        role: Role,
        settings: TunnelSettings | None,
        handler: RequestHandler | None,
        received: bytes = b"",
        on_limit: LimitHandler | None = None,
        budget: Budget | None = None,
        reserve: int = 0,
    ) -> None:
        self.transport = transport
        self._received = received
        self.core = TunnelCore(role, settings, clock=trio.current_time, budget=budget, reserve=reserve)
        self._handler = handler
        self._on_limit = on_limit
        self.limits_tripped: dict[str, int] = {}  # limit -> how many times on this connection
        self._streams: dict[int, TunnelStream] = {}
        self._write_wanted = trio.Event()
        self._drained_lot = trio.lowlevel.ParkingLot()
        self._idle_lot = trio.lowlevel.ParkingLot()
        self._busy_lot = trio.lowlevel.ParkingLot()
        self._frame_started_lot = trio.lowlevel.ParkingLot()  # a read ended inside a frame
        self._pings: dict[bytes, trio.Event] = {}
        self.state = MuxState.OPEN
        self.dead_reason = ""  # why it left OPEN
        self.closed = trio.Event()  # set on entering STOPPED
        self._can_open = trio.Event()  # the peer's first SETTINGS arrived (its limits), or we are dead
        self.finished = trio.Event()  # set on entering FINISHED
        self.last_rtt: float | None = None
        self.last_heard = 0.0  # trio clock of the last bytes read from the peer
        self.peer_draining = False
        self.peer_drain_started = trio.Event()  # set when the peer first announced its drain
        self._nursery: trio.Nursery | None = None
        self._reader_scope = trio.CancelScope()
        self._writer_scope = trio.CancelScope()

    # -- public -----------------------------------------------------------------------------------

    @property
    def dead(self) -> bool:
        """The connection is gone: every stream fails from now on (``dead_reason`` says why)."""
        return self.state is not MuxState.OPEN

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def bytes_in(self) -> int:
        return self.core.bytes_in

    @property
    def bytes_out(self) -> int:
        return self.core.bytes_out

    @property
    def accepts_streams(self) -> bool:
        return not self.dead and self.core.can_open_stream()

    async def open_connect(
        self,
        authority: str,
        headers: Sequence[tuple[str, str]] = (),
        budget: Budget | None = None,
        prepaid: Callable[[], int] | None = None,
    ) -> TunnelStream:
        """Open a CONNECT stream; returns it once the peer answered 200, else raises ConnectRefused.
        Its receive window is charged to ``budget`` (the client it is opened for), else the connection's;
        ``prepaid()`` says how much of it a reservation pays (the client stream's ``take_reserve``)."""
        await self._peer_settings()
        stream = self._open(
            lambda: self.core.open_connect(authority, list(headers), budget, prepaid() if prepaid else 0)
        )
        try:
            await stream.wait_response()
            if stream.status == 200:
                return stream
            reason = (
                stream.response_headers.get(REASON_HEADER)
                or (await stream.read_body(MAX_REASON_BODY)).decode("utf-8", "replace").strip()
            )
        except BaseException:
            stream.abort()  # cancelled or failed while the peer may still be dialing: tell it to stop
            raise
        stream.close()
        raise refusal(stream.status, reason or f"status {stream.status}", stream.response_headers)

    async def request(
        self,
        method: str,
        path: str,
        headers: Sequence[tuple[str, str]] = (),
        body: bytes = b"",
        *,
        authority: str = "tunnel",
    ) -> Response:
        """A control request on its own stream (for example ``GET /v1/info``)."""
        await self._peer_settings()
        stream = self._open(lambda: self.core.open_request(method, path, authority, list(headers), body))
        try:
            await stream.wait_response()
            data = await stream.read_body(MAX_CONTROL_BODY)
            return Response(stream.status, stream.response_headers, data)
        finally:
            stream.close()

    async def ping(self) -> float:
        """Round-trip time of one HTTP/2 PING, in seconds."""
        self._check_alive()
        payload = os.urandom(8)
        acked = self._pings[payload] = trio.Event()
        start = trio.current_time()
        self.core.ping(payload)
        self.kick()
        try:
            await acked.wait()
        finally:
            self._pings.pop(payload, None)
        self._check_alive()
        self.last_rtt = trio.current_time() - start
        return self.last_rtt

    def drain(self) -> None:
        """No new streams from the peer; the ones open go on."""
        if not self.dead:
            self.core.drain()
            self.kick()

    async def wait_idle(self) -> None:
        """Wait until no stream is open (or the connection is gone)."""
        while self._streams and not self.dead:
            await self._idle_lot.park()

    def close(self, reason: str, *, error_code: int = NO_ERROR) -> None:
        """End the connection now (GOAWAY): every stream still open fails at once."""
        if not self.dead:
            self.core.close(error_code, reason)
            self._die(reason)

    def report_limit(self, event: ev.LimitExceeded) -> None:
        """Count a limit that tripped and tell ``on_limit`` (``first``: not seen on this connection)."""
        seen = self.limits_tripped.get(event.limit, 0)
        self.limits_tripped[event.limit] = seen + 1
        if self._on_limit is not None:
            self._on_limit(event, seen == 0)

    # -- internals used by streams ----------------------------------------------------------------

    async def _peer_settings(self) -> None:
        """Until the peer's SETTINGS (its stream limit) arrived, or the connection died. Our preface
        goes out first: the peer may be waiting for it."""
        if not self._can_open.is_set():
            self.kick()
            await self._can_open.wait()

    def kick(self) -> None:
        """Wake the writer when there is something for it: queued bytes, or the connection's end."""
        if self.state is not MuxState.OPEN or self.core.has_output:
            self._write_wanted.set()

    async def wait_outbound_room(self) -> None:
        while self.core.outbound_pending >= self.core.settings.outbound_high_water and not self.dead:
            await self._drained_lot.park()

    def forget(self, stream: TunnelStream) -> None:
        if self._streams.get(stream.stream_id) is stream:
            del self._streams[stream.stream_id]
            if not self._streams:
                self._idle_lot.unpark_all()
            if not self.dead:
                self.core.close_stream(stream.stream_id)
                self.kick()

    def _check_alive(self) -> None:
        if self.dead:
            raise TunnelClosed(self.dead_reason)

    def _open(self, start: Callable[[], int]) -> TunnelStream:
        self._check_alive()
        if not self.core.can_open_stream():
            raise TunnelClosed(
                "the peer accepts no more streams on this connection (draining or at its limit)"
            )
        stream_id = start()
        state = self.core.stream(stream_id)
        assert state is not None  # start() has just opened it
        stream = TunnelStream(self, state)
        self._add(stream)
        self.kick()
        return stream

    def _add(self, stream: TunnelStream) -> None:
        self._streams[stream.stream_id] = stream
        if len(self._streams) == 1:
            self._busy_lot.unpark_all()

    # -- life -------------------------------------------------------------------------------------

    def _die(self, reason: str, *, peer_closed: bool = False) -> None:
        """The connection is dead from now on; the first reason stays. ``peer_closed``: the peer's side
        is closed too, so there is no point waiting for it to read our GOAWAY."""
        if self.state is MuxState.OPEN:
            self.dead_reason = reason
            self._enter(MuxState.PEER_CLOSED if peer_closed else MuxState.CLOSING)
        elif peer_closed and self.state is MuxState.CLOSING:
            self._enter(MuxState.PEER_CLOSED)

    def _enter(self, state: MuxState) -> None:
        if state not in NEXT_STATES[self.state]:
            raise RuntimeError(f"a mux cannot go from {self.state.name} to {state.name}")
        leaving_open = self.state is MuxState.OPEN
        self.state = state
        self._can_open.set()  # _open raises from now on
        if leaving_open:
            for stream in list(self._streams.values()):
                stream.on_broken()
            for event in self._pings.values():
                event.set()
            self._drained_lot.unpark_all()
            self._idle_lot.unpark_all()
            self._frame_started_lot.unpark_all()
            self._reader_scope.cancel()
            # The writer sends what is queued (a GOAWAY, resets) and stops, given this long to do it.
            self._writer_scope.deadline = trio.current_time() + CLOSE_GRACE
            self.kick()
        if state is MuxState.STOPPED:
            self.closed.set()
        elif state is MuxState.FINISHED:
            self.finished.set()

    # -- tasks ------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.core.initiate()
        self.last_heard = trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._reader)
                if self.core.settings.idle_timeout:
                    nursery.start_soon(self._close_when_idle, self.core.settings.idle_timeout)
                if self.core.settings.frame_timeout:
                    nursery.start_soon(self._close_on_stuck_frame, self.core.settings.frame_timeout)
                task_status.started()
                await self._writer()  # returns once the connection is dead
                nursery.cancel_scope.cancel()  # handlers still running have broken streams by now
        finally:
            self._die("connection closed")
            peer_closed = self.state is MuxState.PEER_CLOSED
            self._enter(MuxState.STOPPED)
            with trio.CancelScope(shield=True):
                with trio.move_on_after(CLOSE_GRACE):
                    await self._flush()
                    if not peer_closed:
                        await self._wait_peer_close()
                await close_cleanly(self.transport, CLOSE_GRACE)  # TLS: close_notify, not a bare FIN
            self._enter(MuxState.FINISHED)

    async def _wait_peer_close(self) -> None:
        # Closing a socket with unread input makes the kernel send RST, which can destroy our GOAWAY
        # (and its reason) before the peer reads it; so let the peer close first, briefly.
        try:
            while data := await self.transport.receive_some(RECEIVE_SIZE):
                if self.core.goodbye_received(data):
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, OSError):
            pass

    async def _flush(self) -> None:
        data = self.core.data_to_send()
        if data:
            try:
                await send_all(self.transport, data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

    async def _writer(self) -> None:
        stall_timeout = self.core.settings.stall_timeout or math.inf
        # One scope for every write, its deadline moved for each (a scope made per write cost a
        # visible share of a small request's CPU): a write that outlasts it ends the loop.
        stalled = trio.CancelScope()
        with self._writer_scope:
            with stalled:
                while True:
                    await self._write_wanted.wait()
                    self._write_wanted = trio.Event()
                    data = self.core.data_to_send()
                    self._drained_lot.unpark_all()
                    if data:
                        if stall_timeout != math.inf:  # no timer on the hot path when there is none
                            stalled.deadline = trio.current_time() + stall_timeout
                        try:
                            await send_all(self.transport, data)
                        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                            self._die(f"write failed: {_describe(exc)}")
                            return
                        stalled.deadline = math.inf
                    if self.dead:
                        return
            if stalled.cancelled_caught and not self.dead:
                detail = f"peer read nothing for {stall_timeout:g}s"
                self.report_limit(ev.LimitExceeded("stream_stall", detail))
                self._die(f"write stalled: {detail}")

    async def _reader(self) -> None:
        with self._reader_scope:
            if self._received:
                self._dispatch(self.core.receive_bytes(self._received))
                self._received = b""
                self._watch_partial_frame()
                self.kick()
            # The opener's peer is one of ours (an agent, a proxy-server): once its frames come in
            # bulk, big socket reads (a quarter of the reads and wake-ups per MiB), as the agent reads
            # its tunnel. Not the acceptor's: a client port's peer may be anyone (transport.read_in_bulk).
            bulk_pending = self.core.role is Role.OPENER
            while not self.dead:
                try:
                    data = await receive_batch(self.transport, RECEIVE_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    self._die(f"read failed: {_describe(exc)}", peer_closed=True)
                    return
                if bulk_pending and len(data) >= BULK_HINT:
                    bulk_pending = False
                    read_in_bulk(self.transport)
                self.last_heard = trio.current_time()
                self._dispatch(self.core.receive_bytes(data))
                self._watch_partial_frame()
                self.kick()

    def _watch_partial_frame(self) -> None:
        if self._frame_started_lot and self.core.partial_frame_since is not None:
            self._frame_started_lot.unpark_all()

    async def _close_on_stuck_frame(self, timeout: float) -> None:
        # A task of its own rather than a deadline on every read: reads are the hot path.
        while not self.dead:
            since = self.core.partial_frame_since
            if since is None:
                # Parked, not polling: an idle tunnel wakes nobody (the reader unparks this when a
                # read ends inside a frame).
                await self._frame_started_lot.park()
                continue
            if trio.current_time() < since + timeout:
                await trio.sleep_until(since + timeout)
                continue
            if input_waiting(self.transport):
                # The rest may be here, unread while this process was busy: let the reader catch up
                # (its frame's start time stays, so a peer that really stopped is cut at the next look).
                await trio.sleep(STUCK_FRAME_RECHECK)
                continue
            detail = f"a frame started arriving and did not finish within {timeout:g}s"
            self.report_limit(ev.LimitExceeded("frame_timeout", detail))
            self.close(detail, error_code=ENHANCE_YOUR_CALM)

    async def _close_when_idle(self, timeout: float) -> None:
        while not self.dead:
            if self._streams:
                await self._idle_lot.park()
                continue
            with trio.move_on_after(timeout):
                await self._busy_lot.park()
                continue
            if not self._streams and not self.dead:
                detail = f"no stream open for {timeout:g}s"
                self.report_limit(ev.LimitExceeded("idle_timeout", detail))
                self.close(f"idle: {detail}")

    def _dispatch(self, events: list[ev.Event]) -> None:
        if self.core.peer_settings_received:
            self._can_open.set()
        for event in events:
            match event:
                case ev.DataArrived(stream_id=sid) | ev.RemoteEnded(stream_id=sid):
                    stream = self._streams.get(sid)
                    if stream is not None:
                        stream.on_readable()
                case ev.WindowOpened(stream_id=0) | ev.PeerSettingsChanged():
                    if isinstance(event, ev.PeerSettingsChanged):
                        self.peer_draining = event.max_concurrent_streams == 0
                        if self.peer_draining:
                            self.peer_drain_started.set()
                    for stream in self._streams.values():
                        stream.on_writable()
                case ev.WindowOpened(stream_id=sid):
                    stream = self._streams.get(sid)
                    if stream is not None:
                        stream.on_writable()
                case ev.ResponseReceived(stream_id=sid, status=status, headers=headers):
                    stream = self._streams.get(sid)
                    if stream is not None:
                        stream.on_response(status, headers)
                case ev.StreamReset(stream_id=sid):
                    stream = self._streams.get(sid)
                    if stream is not None:
                        stream.on_broken()
                case ev.LimitExceeded():
                    self.report_limit(event)
                case ev.RequestReceived():
                    self._start_handler(event)
                case ev.PingAcked(payload=payload):
                    waiter = self._pings.get(payload)
                    if waiter is not None:
                        waiter.set()
                case ev.ConnectionEnded(reason=reason):
                    self._die(reason, peer_closed=not self.core.closed_by_us)

    def _start_handler(self, event: ev.RequestReceived) -> None:
        state = self.core.stream(event.stream_id)
        if state is None:
            return  # a limit later in the same read ended the connection and every stream with it
        stream = TunnelStream(self, state)
        self._add(stream)
        handler = self._handler
        if handler is None or self._nursery is None:
            self.core.refuse(event.stream_id, 405, "this side of the tunnel accepts no streams")
            stream.close()
            return
        request = IncomingRequest(event.method, event.authority, event.path, event.headers, stream, self)
        # Made now, not in the task: a reset later in this same read must reach it (on_broken).
        stream.unanswered_work = trio.CancelScope()
        self._nursery.start_soon(self._run_handler, handler, request, stream.unanswered_work)

    async def _run_handler(
        self, handler: RequestHandler, request: IncomingRequest, unanswered_work: trio.CancelScope
    ) -> None:
        try:
            with unanswered_work:
                if not request.stream.answerable:
                    return  # reset (or the connection lost) before the handler started: no work at all
                await handler(request)
        except Exception:
            # A bug in one stream's handler costs that stream, never the whole tunnel.
            _log.exception("stream_handler_failed", stream_id=request.stream.stream_id)
            request.stream.abort()
        finally:
            request.stream.unanswered_work = None
            request.stream.close()


def limit_reporter(log: Any, count: Callable[[str], None], **identity: object) -> LimitHandler:
    """An ``on_limit`` for :func:`open_mux`: ``count(limit)`` every time (a metric), a warning with the
    peer's ``identity`` the first time each limit trips on the connection."""

    def report(event: ev.LimitExceeded, first: bool) -> None:
        count(event.limit)
        if first:
            log.warning(
                "http2_limit_exceeded",
                limit=event.limit,
                detail=event.detail,
                stream_id=event.stream_id or None,
                **identity,
            )

    return report


def _describe(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    text = str(exc) or (repr(cause) if cause else "") or type(exc).__name__
    return text


@asynccontextmanager
async def open_mux(
    transport: trio.abc.Stream,
    role: Role,
    *,
    settings: TunnelSettings | None = None,
    handler: RequestHandler | None = None,
    keepalive: tuple[float, float] | None = None,
    ping_when_quiet: bool = False,
    received: bytes = b"",
    on_limit: LimitHandler | None = None,
    budget: Budget | None = None,
    reserve: int = 0,
) -> AsyncIterator[Mux]:
    """Run an HTTP/2 tunnel connection over ``transport`` for the duration of the block.

    ``keepalive`` is ``(interval, timeout)``: a PING every interval; a PING not answered within the
    timeout declares the connection dead, which fails all its streams at once. With
    ``ping_when_quiet`` a PING goes out only after ``QUIET_FACTOR`` intervals without a frame from
    the peer (the agent's side: the hub PINGs anyway, and data proves the peer alive as well).
    ``received`` are bytes the caller already read from ``transport`` (to tell the protocol apart);
    they are processed first.
    ``on_limit`` hears of every abuse limit that trips (see the module's docstring).
    ``budget`` is charged the receive windows of the streams the peer opens (core.TunnelSettings), and
    ``reserve`` more for each, held for a stream opened on its behalf (``TunnelStream.take_reserve``).
    """
    mux = Mux(transport, role, settings, handler, received, on_limit, budget, reserve)
    async with trio.open_nursery() as nursery:
        await nursery.start(mux.run)
        if keepalive is not None:
            nursery.start_soon(keep_alive, mux, *keepalive, ping_when_quiet)
        try:
            yield mux
        finally:
            mux.close("closed locally")
            # Let run() send what is queued (our GOAWAY and its reason) before tearing it down.
            with trio.CancelScope(shield=True), trio.move_on_after(3 * CLOSE_GRACE):
                await mux.finished.wait()
            nursery.cancel_scope.cancel()
