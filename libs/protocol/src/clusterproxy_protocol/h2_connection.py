"""The core's h2 connection: :class:`TunnelH2Connection`, an ``h2.connection.H2Connection`` that
counts its streams cheaply, refuses a stream beyond the limit instead of ending the connection,
queues DATA frames without h2's copies and lets go of itself when closed.

It subclasses h2 and relies on h2's private internals (``_open_streams``, ``_receive_headers_frame``,
``_data_to_send``, ``_frame_dispatch_table``, the windows :mod:`clusterproxy_protocol.flow_control`
charges). :func:`check_h2_open_streams` and :func:`check_h2_data_frames` check each against the
shape relied on, when the first connection is made (every use of these internals is through one)
and when a program calls :func:`clusterproxy_protocol.workarounds.apply` at its start, and raise
:class:`~clusterproxy_protocol.workarounds.InternalChanged` naming h2, its version and the internal
instead of misbehaving quietly. ``tests/unit/test_workarounds.py`` runs them against the pinned h2.

Sans-IO like the core: no clock, no I/O, no trio.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable

import h2.config
import h2.connection
import h2.events
import hyperframe.frame

from clusterproxy_protocol.flow_control import charge_received, charge_sent, grant_received
from clusterproxy_protocol.framing import DATA_HEADER, FRAME_HEADER_SIZE
from clusterproxy_protocol.workarounds import InternalChanged, parameter_names

__all__ = ["TunnelH2Connection", "check_h2_data_frames", "check_h2_internals", "check_h2_open_streams"]


class _FrameHandler:
    """One of h2's frame handlers, calling its connection through a weak reference."""

    __slots__ = ("_connection", "_function")

    def __init__(self, function: Callable[..., object], connection: h2.connection.H2Connection) -> None:
        self._function = function
        self._connection = weakref.ref(connection)

    def __call__(self, frame: hyperframe.frame.Frame) -> object:
        return self._function(self._connection(), frame)


class TunnelH2Connection(h2.connection.H2Connection):
    """The core's h2 connection: cheap stream counting, stream refusal, outbound buffer size, DATA
    frames without copies, no reference cycle.

    * h2 counts open streams, for every new stream, by walking all of them (dropping closed ones as it
      goes): O(n) per stream, so 10k streams cost O(n^2), a large share of the server's CPU in py-spy
      with a few thousand streams open (docs/benchmarks.md, "Profiling-driven improvements"). Here the count is exact only when it could matter: the number of known streams is an
      upper bound, and while it is below every stream limit it is returned as is. Closed streams are
      swept once the table has doubled since the last sweep, which keeps the cost amortized O(1).
    * h2 answers a HEADERS beyond our concurrent-stream limit by ending the connection. RFC 9113
      5.1.2 allows a stream error, which costs the peer one stream, not all of them: h2's check is
      made to pass (``open_inbound_streams`` reads 0 while h2 takes a HEADERS frame, so the header
      block still goes through HPACK), the stream is noted in :attr:`streams_over_limit`, and the
      core refuses it with ``REFUSED_STREAM``.
    * :attr:`queued_output` is the size of h2's outbound buffer, without copying it.
    * :meth:`send_data_frames` queues DATA frames without h2's copies: h2 copies a payload five times
      (``tobytes``, hyperframe's body join, header + body, its ``bytearray`` buffer, ``bytes`` out of
      it; a visible share of the server's CPU in an upload: docs/benchmarks.md, "Third round"). Here each frame is its 9-byte header and a view of the
      caller's bytes, joined once by :meth:`data_to_send`; h2's windows are charged exactly as its
      ``send_data`` charges them (:func:`~clusterproxy_protocol.flow_control.charge_sent`), and any
      stream or connection not plainly open goes through h2.
    * h2 keeps its frame handlers as bound methods in a dict on the connection
      (``_frame_dispatch_table``), a cycle: a closed connection would wait for a full collection of
      the cyclic collector. Here they hold the connection weakly."""

    _swept_size = 0
    _taking_headers = False

    def __init__(self, config: h2.config.H2Configuration | None = None, *, check: bool = True) -> None:
        if check:  # only the check itself makes one without
            check_h2_internals()
        super().__init__(config=config)
        # h2 keeps its frame handlers as this connection's bound methods in a dict on it: a cycle
        # that keeps a closed connection (its buffers, its streams) until a full collection.
        self._frame_dispatch_table = {
            frame_type: _FrameHandler(handler.__func__, self)  # type: ignore[attr-defined]  # h2 declares its table's values plain callables; they are its own bound methods
            for frame_type, handler in self._frame_dispatch_table.items()
        }
        self._frames: list[bytes | bytearray | memoryview] = []  # queued after h2's buffer, in order
        self._frames_size = 0

    def send_data_frames(self, stream_id: int, data: memoryview) -> None:
        """DATA frames (no flags) carrying ``data``, which the windows must already allow; ``data``
        is kept, not copied, when it views ``bytes``."""
        stream = self.streams.get(stream_id)
        frame_size = self.max_outbound_frame_size
        if stream is None or not charge_sent(self, stream, len(data)):  # charged here when it goes past h2
            for offset in range(0, len(data), frame_size):
                self.send_data(stream_id, data[offset : offset + frame_size])  # h2 raises what applies
            return
        if not isinstance(data.obj, bytes):
            data = memoryview(data.tobytes())  # the caller may change its buffer before we send
        frames = self._frames
        if self._data_to_send:
            frames.append(bytes(self._data_to_send))
            self._frames_size += len(self._data_to_send)
            self._data_to_send = bytearray()
        for offset in range(0, len(data), frame_size):
            payload = data[offset : offset + frame_size]
            frames.append(DATA_HEADER.pack(len(payload) << 8, 0, stream_id))
            frames.append(payload)
            self._frames_size += FRAME_HEADER_SIZE + len(payload)

    def data_to_send(self, amount: int | None = None) -> bytes:
        if not self._frames:
            return super().data_to_send(amount)
        self._frames.append(self._data_to_send)
        data = b"".join(self._frames)
        self._frames = []
        self._frames_size = 0
        self._data_to_send = bytearray()
        if amount is None or amount >= len(data):
            return data
        self._data_to_send = bytearray(data[amount:])
        return data[:amount]

    def clear_outbound_data_buffer(self) -> None:
        self._frames = []
        self._frames_size = 0
        super().clear_outbound_data_buffer()

    def _open_streams(self, remainder: int) -> int:
        if self._taking_headers:
            return 0
        bound = len(self.streams)
        limit = min(self.local_settings.max_concurrent_streams, self.remote_settings.max_concurrent_streams)
        if bound < limit and bound < 2 * self._swept_size + 64:
            return bound
        count = super()._open_streams(remainder)
        self._swept_size = len(self.streams)
        return count

    def _receive_headers_frame(
        self, frame: hyperframe.frame.HeadersFrame
    ) -> tuple[list[hyperframe.frame.Frame], list[h2.events.Event]]:
        over_limit = (
            frame.stream_id not in self.streams
            and self.open_inbound_streams >= self.local_settings.max_concurrent_streams
        )
        self._taking_headers = True
        try:
            result = super()._receive_headers_frame(frame)
        finally:
            self._taking_headers = False
        if over_limit:
            self.streams_over_limit.add(frame.stream_id)
        return result

    @functools.cached_property
    def streams_over_limit(self) -> set[int]:
        """Streams the peer opened beyond the concurrent-stream limit, counted when their HEADERS
        arrived; the core refuses each one and removes it from here."""
        return set()

    @property
    def queued_output(self) -> int:
        """Bytes queued for the peer that :meth:`data_to_send` has not taken yet."""
        return len(self._data_to_send) + self._frames_size


def check_h2_open_streams() -> None:
    """h2 counts open streams through ``_open_streams(remainder)``, its ``streams`` table holds every
    stream not yet swept, both settings carry ``max_concurrent_streams``, a received HEADERS is
    checked against the limit through ``open_inbound_streams``, the outbound buffer is the
    bytearray ``_data_to_send``, and received frames go to the connection's own methods through the
    dict ``_frame_dispatch_table``."""
    base = h2.connection.H2Connection
    count = base.__dict__.get("_open_streams")
    if not inspect.isfunction(count) or parameter_names(count) != ["self", "remainder"]:
        raise InternalChanged("h2", "H2Connection._open_streams", "is not a method (self, remainder)")
    for name in ("open_outbound_streams", "open_inbound_streams"):
        counter = base.__dict__.get(name)
        if (
            not isinstance(counter, property)
            or counter.fget is None
            or "_open_streams" not in counter.fget.__code__.co_names
        ):
            raise InternalChanged("h2", f"H2Connection.{name}", "no longer counts through _open_streams")
    headers = base.__dict__.get("_receive_headers_frame")
    if (
        not inspect.isfunction(headers)
        or parameter_names(headers) != ["self", "frame"]
        or "open_inbound_streams" not in headers.__code__.co_names
    ):
        raise InternalChanged(
            "h2", "H2Connection._receive_headers_frame", "no longer checks open_inbound_streams"
        )
    connection = base()
    handlers = getattr(connection, "_frame_dispatch_table", None)
    if not isinstance(handlers, dict) or not all(
        inspect.ismethod(handler) and handler.__self__ is connection for handler in handlers.values()
    ):
        raise InternalChanged("h2", "H2Connection._frame_dispatch_table", "is not a dict of its own methods")
    if not isinstance(connection.streams, dict):
        raise InternalChanged("h2", "H2Connection.streams", "is not a dict")
    if not isinstance(getattr(connection, "_data_to_send", None), bytearray):
        raise InternalChanged("h2", "H2Connection._data_to_send", "is not a bytearray")
    for settings in ("local_settings", "remote_settings"):
        if not isinstance(getattr(getattr(connection, settings), "max_concurrent_streams", None), int):
            raise InternalChanged("h2", f"H2Connection.{settings}.max_concurrent_streams", "is not an int")


def _open_connect_stream(client: h2.connection.H2Connection) -> bytes:
    """Stream 1 of a new client connection opened with a CONNECT; the bytes written for it."""
    client.initiate_connection()
    client.send_headers(1, [(":method", "CONNECT"), (":authority", "x:1")])
    return client.data_to_send()


def check_h2_data_frames() -> None:
    """The DATA frames :meth:`TunnelH2Connection.send_data_frames` builds are byte for byte h2's,
    and leave h2's windows where its ``send_data`` leaves them; the same for the frames
    :func:`~clusterproxy_protocol.flow_control.charge_received` takes past h2's receive path, and
    for the WINDOW_UPDATEs :func:`~clusterproxy_protocol.flow_control.grant_received` queues."""
    payload = bytes(range(256)) * 160  # two frames at the default 16 KiB maximum and a short one
    sent = []
    for fast in (False, True):
        connection = TunnelH2Connection(h2.config.H2Configuration(client_side=True), check=False)
        _open_connect_stream(connection)
        view = memoryview(payload)
        if fast:
            try:
                connection.send_data_frames(1, view)
            except AttributeError as exc:
                raise InternalChanged("h2", f"H2Stream.{exc.name}", "is missing") from exc
        else:
            for offset in range(0, len(view), connection.max_outbound_frame_size):
                connection.send_data(1, view[offset : offset + connection.max_outbound_frame_size])
        windows = (connection.outbound_flow_control_window, connection.local_flow_control_window(1))
        sent.append((connection.data_to_send(), windows))
    if sent[0] != sent[1]:
        raise InternalChanged(
            "h2",
            "H2Connection.send_data",
            "frames DATA or charges its windows another way than send_data_frames",
        )
    _check_h2_taking_data()
    _check_h2_granting()


def _check_h2_taking_data() -> None:
    """A frame taken by :func:`~clusterproxy_protocol.flow_control.charge_received` leaves h2's
    inbound windows where h2's own receive path leaves them, for a frame h2 takes as plain data."""
    peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    opening = _open_connect_stream(peer)
    payload = bytes(range(256)) * 40
    peer.send_data(1, payload)
    data_frame = peer.data_to_send()
    windows = []
    for fast in (False, True):
        connection = TunnelH2Connection(h2.config.H2Configuration(client_side=False), check=False)
        connection.initiate_connection()
        events = connection.receive_data(opening if fast else opening + data_frame)
        if fast:
            try:
                taken = charge_received(connection, 1, len(payload))
            except AttributeError as exc:
                raise InternalChanged("h2", f"H2Stream.{exc.name}", "is missing") from exc
            if not taken:
                raise InternalChanged("h2", "H2Connection.receive_data", "no longer takes plain DATA here")
        elif b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived)) != payload:
            raise InternalChanged("h2", "H2Connection.receive_data", "no longer delivers plain DATA")
        stream_window = connection.streams[1].inbound_flow_control_window
        windows.append((stream_window, connection._inbound_flow_control_window_manager.current_window_size))
    if windows[0] != windows[1]:
        raise InternalChanged(
            "h2", "H2Connection.receive_data", "charges its inbound windows another way than charge_received"
        )


def _check_h2_granting() -> None:
    """A WINDOW_UPDATE queued by :func:`~clusterproxy_protocol.flow_control.grant_received`, for a
    stream and for the connection, is byte for byte h2's and leaves h2's inbound windows where its
    ``increment_flow_control_window`` leaves them."""
    peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    opening = _open_connect_stream(peer)
    sent = []
    for fast in (False, True):
        connection = TunnelH2Connection(h2.config.H2Configuration(client_side=False), check=False)
        connection.initiate_connection()
        connection.receive_data(opening)
        connection.data_to_send()
        for stream_id, increment in ((1, 40000), (0, 70000)):
            if fast:
                try:
                    grant_received(connection, stream_id, increment)
                except AttributeError as exc:
                    raise InternalChanged("h2", f"H2Connection.{exc.name}", "is missing") from exc
            else:
                connection.increment_flow_control_window(increment, stream_id=stream_id or None)
        windows = (
            connection.streams[1]._inbound_window_manager.current_window_size,
            connection._inbound_flow_control_window_manager.current_window_size,
        )
        sent.append((connection.data_to_send(), windows))
    if sent[0] != sent[1]:
        raise InternalChanged(
            "h2",
            "H2Connection.increment_flow_control_window",
            "frames WINDOW_UPDATE or grows its windows another way than grant_received",
        )


@functools.cache
def check_h2_internals() -> None:
    """Every check of h2's internals, once per process: when the first connection is made, and by
    :func:`clusterproxy_protocol.workarounds.apply` at a program's start."""
    check_h2_open_streams()
    check_h2_data_frames()
