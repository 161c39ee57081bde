"""One proxied connection over the tunnel: :class:`TunnelStream`, bytes both ways over one HTTP/2
stream of a :class:`~clusterproxy_protocol.driver.Mux`, as a ``trio.abc.HalfCloseableStream``.

Its send waits for the peer's flow-control window (and resets the stream when neither window nor
data move for ``stall_timeout``); its receive reads the stream's buffer in the core, which reopens
the window as it is read. The Mux wakes it as the peer's frames arrive (``on_readable``,
``on_writable``, ``on_response``, ``on_broken``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from clusterproxy_protocol import events as ev
from clusterproxy_protocol.errors import TunnelClosed, TunnelError
from clusterproxy_protocol.stream_state import StreamState
from clusterproxy_protocol.transport import take_turn

if TYPE_CHECKING:
    from clusterproxy_protocol.driver import Mux

__all__ = ["RECEIVE_SIZE", "TunnelStream"]

RECEIVE_SIZE = 256 << 10


class _Busy:
    """Raises BusyResourceError when two tasks use the same direction of a stream at once."""

    __slots__ = ("_held", "_what")

    def __init__(self, what: str) -> None:
        self._what = what
        self._held = False

    def __enter__(self) -> None:
        if self._held:
            raise trio.BusyResourceError(f"another task is already {self._what} this stream")
        self._held = True

    def __exit__(self, *exc: object) -> None:
        self._held = False


class TunnelStream(trio.abc.HalfCloseableStream):
    """One proxied TCP connection: bytes both ways over one HTTP/2 stream."""

    def __init__(self, mux: Mux, state: StreamState) -> None:
        self._mux = mux
        self._state = state
        self.stream_id = state.stream_id
        self._closed = False
        self._send_busy = _Busy("sending on")
        self._receive_busy = _Busy("receiving from")
        self._send_lot = trio.lowlevel.ParkingLot()
        self._receive_lot = trio.lowlevel.ParkingLot()
        self._response = trio.Event()
        self.status = 0
        self.response_headers: dict[str, str] = {}
        self.unanswered_work: trio.CancelScope | None = None  # the handler, until it answers the peer
        self._blocked_since: float | None = None
        self._blocked_bytes_in = 0

    @property
    def bytes_in(self) -> int:
        return self._state.bytes_in

    @property
    def bytes_out(self) -> int:
        return self._state.bytes_out

    def _check_send(self) -> None:
        if self._closed or self._state.local_ended:
            raise trio.ClosedResourceError("stream was closed for sending")
        if self._state.reset_code is not None or self._mux.dead:
            raise trio.BrokenResourceError(self._broken_reason())

    def _broken_reason(self) -> str:
        if self._mux.dead:
            return f"tunnel connection lost: {self._mux.dead_reason}"
        return f"stream reset by peer (code {self._state.reset_code})"

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with self._send_busy:
            await trio.lowlevel.checkpoint()
            await self._send_all(data)

    async def send_all_batched(self, data: bytes | bytearray | memoryview) -> None:
        """:meth:`send_all` that yields to the scheduler only every few calls (a cancellation point
        every time: ``transport.take_turn``), the relay's: it goes on reading while the Mux's writer
        sends what it queued, in one write for several reads (up to ``outbound_high_water``), rather
        than one scheduler pass and one write per read."""
        with self._send_busy:
            await take_turn()
            await self._send_all(data)

    async def _send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._check_send()
        view = memoryview(data).cast("B")
        mux = self._mux
        while view:
            await mux.wait_outbound_room()
            self._check_send()
            sent = mux.core.send_data(self.stream_id, view)
            if sent:
                view = view[sent:]
                self._blocked_since = None
                mux.kick()
            else:
                await self._wait_for_window()
                self._check_send()

    def send_room(self) -> int:
        """Bytes :meth:`send_all` would send now without waiting for the peer's window."""
        return self._mux.core.send_window(self.stream_id)

    async def wait_send_all_might_not_block(self) -> None:
        with self._send_busy:
            await trio.lowlevel.checkpoint()
            self._check_send()
            while self._mux.core.send_window(self.stream_id) <= 0:
                await self._wait_for_window()
                self._check_send()
            self._blocked_since = None

    async def _wait_for_window(self) -> None:
        """Park until a window may have opened; a stall (no window and no byte from the peer for
        ``stall_timeout``) resets the stream and raises BrokenResourceError."""
        timeout = self._mux.core.settings.stall_timeout
        if not timeout:
            await self._send_lot.park()
            return
        bytes_in = self._state.bytes_in
        if self._blocked_since is None or bytes_in != self._blocked_bytes_in:
            self._blocked_since = trio.current_time()
            self._blocked_bytes_in = bytes_in
        with trio.move_on_at(self._blocked_since + timeout):
            await self._send_lot.park()
            return
        if self._state.bytes_in != self._blocked_bytes_in or self._mux.core.send_window(self.stream_id) > 0:
            return  # progress at the last moment: the caller looks again
        detail = f"no flow-control window and no data from the peer for {timeout:g}s"
        self._mux.report_limit(ev.LimitExceeded("stream_stall", detail, self.stream_id))
        self.abort()
        raise trio.BrokenResourceError(f"stream stalled: {detail}")

    async def send_eof(self, trailers: list[tuple[str, str]] | None = None) -> None:
        """End our side; with ``trailers``, on a HEADERS frame carrying them (after all data sent)."""
        with self._send_busy:
            await trio.lowlevel.checkpoint()
            if self._closed:
                raise trio.ClosedResourceError("stream was closed")
            if self._state.local_ended:
                return
            if self._state.reset_code is not None or self._mux.dead:
                raise trio.BrokenResourceError(self._broken_reason())
            self._mux.core.end_stream(self.stream_id, trailers)
            self._mux.kick()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None:
            if not isinstance(max_bytes, int):
                raise TypeError("max_bytes must be an int or None")
            if max_bytes < 1:
                raise ValueError("max_bytes must be >= 1")
        with self._receive_busy:
            await trio.lowlevel.checkpoint()
            return await self._receive(max_bytes or RECEIVE_SIZE)

    async def receive_batched(self, max_bytes: int) -> bytes:
        """:meth:`receive_some` (``max_bytes`` >= 1) that yields only every few calls, the relay's:
        bytes already buffered are taken at once (``transport.take_turn``)."""
        with self._receive_busy:
            await take_turn()
            return await self._receive(max_bytes)

    async def _receive(self, max_bytes: int) -> bytes:
        while True:
            if self._closed:
                raise trio.ClosedResourceError("stream was closed")
            state = self._state
            if state.buffered:
                data = self._mux.core.read(self.stream_id, max_bytes)
                self._mux.kick()
                return data
            if state.reset_code is not None:
                raise trio.BrokenResourceError(self._broken_reason())
            if state.remote_ended:
                return b""  # the data was complete before anything broke
            if self._mux.dead:
                raise trio.BrokenResourceError(self._broken_reason())
            await self._receive_lot.park()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()

    def abort(self) -> None:
        """Close with RST_STREAM: the peer sees an error, never a clean end of data."""
        if not self._closed and not self._mux.dead:
            self._mux.core.reset(self.stream_id)
            self._mux.kick()
        self.close()

    def close(self) -> None:
        """:meth:`aclose` without its checkpoint, for clean-up that cannot wait (like a socket's close)."""
        if self._closed:
            return
        self._closed = True
        self._mux.forget(self)
        self._wake()

    def take_reserve(self) -> int:
        """The bytes reserved with this stream for one opened on its behalf (core.TunnelCore.reserve),
        handed over to pay for it; 0 after the first call."""
        return self._mux.core.take_reserve(self.stream_id)

    @property
    def answerable(self) -> bool:
        """Not closed here, not reset by the peer, its connection alive: a response can still go out."""
        return not self._closed and self._state.reset_code is None and not self._mux.dead

    def raise_unless_answerable(self) -> None:
        if not self.answerable:
            raise trio.BrokenResourceError(self._broken_reason())

    async def wait_response(self) -> None:
        """Wait for the peer's response head; raises TunnelClosed if the stream broke first."""
        await self._response.wait()
        if self.status == 0:
            raise TunnelClosed(self._broken_reason())

    # -- called by the Mux as the peer's frames arrive ---------------------------------------------

    def on_response(self, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.response_headers = headers
        self._response.set()

    def on_readable(self) -> None:
        """Data or the peer's end of data arrived."""
        self._receive_lot.unpark_all()

    def on_writable(self) -> None:
        """A flow-control window opened."""
        self._send_lot.unpark_all()

    def on_broken(self) -> None:
        """Reset by the peer, or the connection died: every waiter wakes up to fail, and a handler
        that has not answered yet stops working for nobody."""
        self._response.set()
        if self.unanswered_work is not None:
            self.unanswered_work.cancel()
        self._wake()

    def _wake(self) -> None:
        self._send_lot.unpark_all()
        self._receive_lot.unpark_all()

    async def read_body(self, limit: int) -> bytes:
        """Read until EOF; more than ``limit`` bytes is an error."""
        body = bytearray()
        while chunk := await self.receive_some():
            body += chunk
            if len(body) > limit:
                raise TunnelError(f"body larger than {limit} bytes")
        return bytes(body)
