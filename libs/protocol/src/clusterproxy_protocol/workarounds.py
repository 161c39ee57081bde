"""Every use of a third-party library's private internals, each guarded.

The tunnel relies on five private internals, four for speed and one for memory (the numbers are in
docs/benchmarks.md):

* **hyperframe** ``Frame._body_repr``: h2 builds ``repr(frame)`` of every received frame for a trace
  log, even with logging off, and for DATA frames hyperframe serializes and hexlifies the whole body
  to show its first 10 bytes: ~20 % of a receiver's CPU in a bulk transfer. :func:`apply` gives
  ``DataFrame`` a repr with the same text built from the first 11 bytes only. It changes a class for
  the whole process, so only programs apply it (the services' entry points), never an import.
* **h2** ``H2Connection._open_streams``: h2 counts open streams, for every new stream, by walking all
  of them: O(n) per stream. :class:`TunnelH2Connection` (a subclass, no global patch) counts exactly only
  when a limit is near. The same subclass (not for speed, for the abuse limits) lets the core refuse a
  stream beyond the concurrent-stream limit with ``REFUSED_STREAM`` where h2 would end the whole
  connection, and reads the size of h2's outbound buffer (``_data_to_send``) to cap the replies queued
  for a peer that does not read; and it queues DATA frames, and takes received plain DATA frames,
  past h2's copies (:meth:`TunnelH2Connection.send_data_frames`, :meth:`take_data_frame`), charging
  h2's windows as h2 would. And its frame handlers hold it weakly (h2's ``_frame_dispatch_table``
  of bound methods is a cycle: a closed connection would wait for a full collection, below). Checked
  when the first one is made.
* **trio** ``SSLStream._ssl_object``: ``SSLStream.receive_some`` decrypts one TLS record (16 KiB) per
  call even when the socket read brought in several; :func:`ssl_object_of` hands
  :func:`clusterproxy_protocol.transport.receive_batch` the ``ssl.SSLObject`` to take the rest from.
  Checked at every use (one ``isinstance``).
* **trio** ``SSLStream``'s state, memory BIOs and locks (:func:`tls_parts`): each of its sends and
  receives passes through trio's scheduler three times (two locks and the socket call), ~45 µs for a
  1 KiB message against ~7 µs for the same TLS and socket calls made directly.
  :mod:`clusterproxy_protocol.transport` makes them directly while a connection is in its steady
  state, under trio's own guards and send lock, and leaves everything else to trio. Checked by
  :func:`apply`.
* **trio** ``SSLStream._handshook``: each stream keeps its handshake as a ``_Once`` holding the
  stream's own bound ``_do_handshake``, a reference cycle for the stream's whole life: a closed TLS
  connection (its ``SSLObject``, BIOs, OpenSSL's buffers, whatever its owner hung on it) waits for
  the cyclic garbage collector instead of going when its last reference does. After an attack on the
  client port that was 15-20 MiB of the server's RSS, all of it garbage (docs/benchmarks.md, seventh
  round). :func:`apply` makes ``_Once.ensure`` drop the handshake function once it has run it (trio
  never calls it twice), for the whole process.

Each is checked against the shape it relies on, and a change raises :class:`InternalChanged` naming
the library, its version and the attribute, instead of misbehaving quietly. Without :func:`apply`
everything works the same, only slower, and closed TLS streams wait for the cyclic collector. The
versions that were checked are pinned in ``libs/protocol/pyproject.toml``;
``tests/unit/test_workarounds.py`` fails when a pinned version moves an internal.

This module is used by the sans-IO core, so it never imports trio at module level: what needs trio
imports it when it runs.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import re
import ssl
import struct
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NamedTuple

import h2.config
import h2.connection
import h2.events
import h2.stream
import hyperframe.frame

DISTRIBUTION = "cluster-proxy-protocol"


class InternalChanged(RuntimeError):
    """A private internal of a third-party library is missing or no longer has the expected shape."""

    def __init__(self, library: str, attribute: str, problem: str) -> None:
        self.library = library
        self.version = _installed_version(library)
        self.attribute = attribute
        declared = _declared_requirement(library)
        super().__init__(
            f"{library} {self.version}: {attribute} {problem}; {DISTRIBUTION} relies on it for speed"
            + (f" and declares {declared}" if declared else "")
            + " (see docs/protocol.md, 'Third-party internals')"
        )


def apply() -> None:
    """Check every internal, then make hyperframe's DATA frame repr cheap and trio's TLS streams free
    of their handshake's reference cycle, for the whole process.

    For programs (the services' ``main``), before the event loop starts; calling it again does
    nothing more. A library using the tunnel may call it too, knowing it changes a hyperframe class
    and a trio one.
    """
    check_h2_open_streams()
    check_h2_data_frames()
    check_trio_ssl_object()
    check_trio_ssl_internals()
    check_hyperframe_body_repr()
    check_trio_handshake_once()
    if hyperframe.frame.DataFrame.__dict__.get("_body_repr") is not _cheap_data_frame_repr:
        hyperframe.frame.DataFrame._body_repr = _cheap_data_frame_repr  # type: ignore[method-assign]
    _let_trio_handshakes_go()


# -- hyperframe: DataFrame repr ---------------------------------------------------------------------


def _cheap_data_frame_repr(frame: hyperframe.frame.DataFrame) -> str:
    if "PADDED" in frame.flags:
        # The text starts with the pad length; padded frames are rare, so let hyperframe build it.
        return hyperframe.frame.Frame._body_repr(frame)
    return hyperframe.frame._raw_data_repr(frame.data[:11])


def check_hyperframe_body_repr() -> None:
    """``Frame.__repr__`` shows ``_body_repr()``, which ``DataFrame`` inherits from ``Frame``, and
    the cheap repr gives the same text."""
    frame_class = hyperframe.frame.Frame
    body_repr = frame_class.__dict__.get("_body_repr")
    if not inspect.isfunction(body_repr) or _parameter_names(body_repr) != ["self"]:
        raise InternalChanged("hyperframe", "Frame._body_repr", "is not a method taking only self")
    if "_body_repr" not in frame_class.__repr__.__code__.co_names:
        raise InternalChanged("hyperframe", "Frame.__repr__", "no longer calls _body_repr()")
    own = hyperframe.frame.DataFrame.__dict__.get("_body_repr")
    if own is not None and own is not _cheap_data_frame_repr:
        raise InternalChanged("hyperframe", "DataFrame._body_repr", "is defined by hyperframe itself now")
    raw_data_repr = getattr(hyperframe.frame, "_raw_data_repr", None)
    if not callable(raw_data_repr):
        raise InternalChanged("hyperframe", "frame._raw_data_repr", "is missing")
    samples = [b"", b"short", bytes(range(10)), bytes(range(11)), bytes(range(256)), memoryview(bytes(64))]
    for data in samples:
        for padding in ({}, {"flags": ["PADDED"], "pad_length": 3}):
            expected = body_repr(hyperframe.frame.DataFrame(1, data, **padding))
            if _cheap_data_frame_repr(hyperframe.frame.DataFrame(1, data, **padding)) != expected:
                raise InternalChanged(
                    "hyperframe",
                    "Frame._body_repr",
                    f"shows {expected!r} for a DATA frame of {len(data)} bytes, padding {padding}",
                )


# -- h2: the tunnel's connection -----------------------------------------------------------------------


class _FrameHandler:
    """One of h2's frame handlers, calling its connection through a weak reference."""

    __slots__ = ("_connection", "_function")

    def __init__(self, function: Callable[..., object], connection: h2.connection.H2Connection) -> None:
        self._function = function
        self._connection = weakref.ref(connection)

    def __call__(self, frame: hyperframe.frame.Frame) -> object:
        return self._function(self._connection(), frame)


class TunnelH2Connection(h2.connection.H2Connection):
    """The core's h2 connection: cheap stream counting, stream refusal, outbound buffer size.

    * h2 counts open streams, for every new stream, by walking all of them (dropping closed ones as it
      goes): O(n) per stream, so 10k streams cost O(n^2) (15 % of the server's CPU at 3k streams,
      py-spy). Here the count is exact only when it could matter: the number of known streams is an
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
      it; 11 % of the server in an upload). Here each frame is its 9-byte header and a view of the
      caller's bytes, joined once by :meth:`data_to_send`; h2's windows are charged exactly as its
      ``send_data`` charges them, and any stream or connection not plainly open goes through h2."""

    _swept_size = 0
    _taking_headers = False

    def __init__(self, config: h2.config.H2Configuration | None = None, *, check: bool = True) -> None:
        if check:  # only the check itself makes one without
            _check_h2_once()
        super().__init__(config=config)
        # h2 keeps its frame handlers as this connection's bound methods in a dict on it: a cycle
        # that keeps a closed connection (its buffers, its streams) until a full collection.
        self._frame_dispatch_table = {
            frame_type: _FrameHandler(handler.__func__, self)
            for frame_type, handler in self._frame_dispatch_table.items()
        }
        self._frames: list[bytes | memoryview] = []  # queued after h2's buffer, in order
        self._frames_size = 0

    def send_data_frames(self, stream_id: int, data: memoryview) -> None:
        """DATA frames (no flags) carrying ``data``, which the windows must already allow; ``data``
        is kept, not copied, when it views ``bytes``."""
        stream = self.streams.get(stream_id)
        frame_size = self.max_outbound_frame_size
        if (
            stream is None
            or stream.state_machine.state not in _SENDING_STREAM_STATES
            or self.state_machine.state not in _OPEN_CONNECTION_STATES
            or len(data) > self.local_flow_control_window(stream_id)
        ):
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
            frames.append(_DATA_HEADER.pack(len(payload) << 8, 0, stream_id))
            frames.append(payload)
            self._frames_size += FRAME_HEADER_SIZE + len(payload)
        stream.outbound_flow_control_window -= len(data)
        self.outbound_flow_control_window -= len(data)

    def take_data_frame(self, stream_id: int, length: int) -> bool:
        """A DATA frame without flags announced on ``stream_id``: when h2 would take it as plain data
        on an open stream, charge h2's inbound windows as its receive path does and return True (the
        caller delivers the payload itself); otherwise False, and the frame must go through h2."""
        stream = self.streams.get(stream_id)
        if (
            stream is None
            or stream.state_machine.state not in _RECEIVING_STREAM_STATES
            or not stream.state_machine.headers_received
            or stream._expected_content_length is not None
            or self.state_machine.state not in _OPEN_CONNECTION_STATES
            or length > self._inbound_flow_control_window_manager.current_window_size
            or length > stream._inbound_window_manager.current_window_size
        ):
            return False
        self._inbound_flow_control_window_manager.window_consumed(length)
        stream._inbound_window_manager.window_consumed(length)
        return True

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

    def _receive_headers_frame(self, frame: hyperframe.frame.HeadersFrame) -> tuple[list, list]:  # type: ignore[type-arg]
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
    if not inspect.isfunction(count) or _parameter_names(count) != ["self", "remainder"]:
        raise InternalChanged("h2", "H2Connection._open_streams", "is not a method (self, remainder)")
    for name in ("open_outbound_streams", "open_inbound_streams"):
        counter = base.__dict__.get(name)
        if not isinstance(counter, property) or "_open_streams" not in counter.fget.__code__.co_names:  # type: ignore[union-attr]
            raise InternalChanged("h2", f"H2Connection.{name}", "no longer counts through _open_streams")
    headers = base.__dict__.get("_receive_headers_frame")
    if (
        not inspect.isfunction(headers)
        or _parameter_names(headers) != ["self", "frame"]
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


FRAME_HEADER_SIZE = 9
_DATA_HEADER = struct.Struct(">IBI")  # 24-bit length and type 0 (DATA) in one word, flags, stream id
_SENDING_STREAM_STATES = (h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_REMOTE)
_RECEIVING_STREAM_STATES = (h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_LOCAL)
_OPEN_CONNECTION_STATES = (
    h2.connection.ConnectionState.CLIENT_OPEN,
    h2.connection.ConnectionState.SERVER_OPEN,
)


def _open_connect_stream(client: h2.connection.H2Connection) -> bytes:
    """Stream 1 of a new client connection opened with a CONNECT; the bytes written for it."""
    client.initiate_connection()
    client.send_headers(1, [(":method", "CONNECT"), (":authority", "x:1")])
    return client.data_to_send()


def check_h2_data_frames() -> None:
    """The DATA frames :meth:`TunnelH2Connection.send_data_frames` builds are byte for byte h2's,
    and leave h2's windows where its ``send_data`` leaves them; the same for the frames
    :meth:`TunnelH2Connection.take_data_frame` takes past h2's receive path."""
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


def _check_h2_taking_data() -> None:
    """A frame taken by :meth:`TunnelH2Connection.take_data_frame` leaves h2's inbound windows where
    h2's own receive path leaves them, for a frame h2 takes as plain data."""
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
                taken = connection.take_data_frame(1, len(payload))
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
            "h2", "H2Connection.receive_data", "charges its inbound windows another way than take_data_frame"
        )


@functools.cache
def _check_h2_once() -> None:
    check_h2_open_streams()
    check_h2_data_frames()


# -- trio: SSLStream's SSLObject ----------------------------------------------------------------------


def ssl_object_of(stream: object) -> ssl.SSLObject:
    """The ``ssl.SSLObject`` a ``trio.SSLStream`` decrypts with (trio keeps it private)."""
    ssl_object = getattr(stream, "_ssl_object", None)
    if not isinstance(ssl_object, ssl.SSLObject):
        raise InternalChanged("trio", "SSLStream._ssl_object", "is not an ssl.SSLObject")
    return ssl_object


def _unconnected_ssl_stream() -> Any:
    """A new ``trio.SSLStream`` over a stream that is never used: to look at, with no trio running."""
    import trio  # here, not at the top: the sans-IO core imports this module

    class Unconnected(trio.abc.Stream):
        async def send_all(self, data: bytes | bytearray | memoryview) -> None:
            raise trio.ClosedResourceError

        async def wait_send_all_might_not_block(self) -> None:
            raise trio.ClosedResourceError

        async def receive_some(self, max_bytes: int | None = None) -> bytes:
            raise trio.ClosedResourceError

        async def aclose(self) -> None:
            pass

    return trio.SSLStream(Unconnected(), ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), server_hostname="x")


def check_trio_ssl_object() -> None:
    """A new ``trio.SSLStream`` holds its ``ssl.SSLObject`` as ``_ssl_object``."""
    ssl_object_of(_unconnected_ssl_stream())


class TlsParts(NamedTuple):
    """What :mod:`clusterproxy_protocol.transport` needs to encrypt, decrypt and move a
    ``trio.SSLStream``'s bytes itself: its TLS object, the two memory BIOs, the lock that orders
    writes to its socket, and the guards against two concurrent senders or receivers."""

    ssl_object: ssl.SSLObject
    incoming: ssl.MemoryBIO
    outgoing: ssl.MemoryBIO
    send_lock: Any  # trio.StrictFIFOLock
    send_guard: Any  # trio's ConflictDetector: a context manager
    receive_guard: Any


@functools.cache
def _trio_ssl_states() -> tuple[object, object]:
    from trio import _ssl  # here, not at the top: the sans-IO core imports this module

    return _ssl._State.OK, _ssl._State.BROKEN


def tls_parts(stream: Any, *, sending: bool) -> TlsParts | None:
    """``stream``'s parts when its bytes may go past trio's machinery right now: handshake done,
    neither broken nor closed, no trio receive inside its socket; and to send, no trio send inside
    it either and no ciphertext trio is holding back. Else None (trio's own path then does what it
    must). A receive does not wait on the sending side: decrypting adds nothing to the socket, and
    trio's receive would take bytes off the socket and yield before decrypting them, where a frame
    deadline's look (:func:`clusterproxy_protocol.transport.input_waiting`) cannot see them."""
    ok, _broken = _trio_ssl_states()
    if stream._state is not ok or not stream._handshook.done or stream._inner_recv_lock.locked():
        return None
    if sending and (stream._delayed_outgoing is not None or stream._inner_send_lock.locked()):
        return None
    return TlsParts(
        stream._ssl_object,
        stream._incoming,
        stream._outgoing,
        stream._inner_send_lock,
        stream._outer_send_conflict_detector,
        stream._outer_recv_conflict_detector,
    )


def tls_mark_broken(stream: Any) -> None:
    """What trio does when a send through it fails part-way: the stream is unusable from now on."""
    stream._state = _trio_ssl_states()[1]


def check_trio_ssl_internals() -> None:
    """A new ``trio.SSLStream`` has the private parts :func:`tls_parts` reads, with their shapes."""
    import trio  # here, not at the top: the sans-IO core imports this module

    try:
        ok, broken = _trio_ssl_states()
    except (ImportError, AttributeError):
        raise InternalChanged("trio", "_ssl._State", "has no OK and BROKEN") from None
    stream = _unconnected_ssl_stream()
    expected: dict[str, Callable[[object], bool]] = {
        "_state": lambda v: v is ok and v is not broken,
        "_handshook": lambda v: getattr(v, "done", None) is False,
        "_delayed_outgoing": lambda v: v is None,
        "_incoming": lambda v: isinstance(v, ssl.MemoryBIO),
        "_outgoing": lambda v: isinstance(v, ssl.MemoryBIO),
        "_inner_send_lock": lambda v: isinstance(v, trio.StrictFIFOLock),
        "_inner_recv_lock": lambda v: isinstance(v, trio.Lock),
        "_outer_send_conflict_detector": lambda v: hasattr(v, "__enter__") and hasattr(v, "__exit__"),
        "_outer_recv_conflict_detector": lambda v: hasattr(v, "__enter__") and hasattr(v, "__exit__"),
    }
    for name, shaped in expected.items():
        if not shaped(getattr(stream, name, None)):
            raise InternalChanged("trio", f"SSLStream.{name}", "is missing or has another shape")


# -- trio: SSLStream's handshake, a reference cycle ------------------------------------------------------


async def _handshake_already_run() -> None:
    raise RuntimeError("trio ran an SSLStream's handshake twice")  # trio's _Once never does


def _ensure_then_let_go(
    ensure: Callable[..., Awaitable[None]],
) -> Callable[..., Coroutine[object, object, None]]:
    @functools.wraps(ensure)
    async def ensure_then_let_go(self: object, *, checkpoint: bool) -> None:
        try:
            await ensure(self, checkpoint=checkpoint)
        finally:
            if self.started:  # type: ignore[attr-defined]  # run (or running, or failed): never again
                self._afn = _handshake_already_run  # type: ignore[attr-defined]
                self._args = ()  # type: ignore[attr-defined]

    ensure_then_let_go.lets_go = True  # type: ignore[attr-defined]
    return ensure_then_let_go


def _trio_once() -> type:
    import trio._ssl  # here, not at the top: the sans-IO core imports this module

    once = getattr(trio._ssl, "_Once", None)
    if not isinstance(once, type):
        raise InternalChanged("trio", "_ssl._Once", "is missing")
    return once


def _let_trio_handshakes_go() -> None:
    once = _trio_once()
    if not getattr(once.ensure, "lets_go", False):
        once.ensure = _ensure_then_let_go(once.ensure)  # type: ignore[attr-defined]


def check_trio_handshake_once() -> None:
    """A new ``trio.SSLStream`` keeps its bound ``_do_handshake`` in ``_handshook``, a ``_Once`` with
    ``_afn``, ``_args`` and ``started`` that runs it from ``ensure(*, checkpoint)``."""

    once = _trio_once()
    ensure = getattr(once, "ensure", None)
    if ensure is None or _parameter_names(inspect.unwrap(ensure)) != ["self", "checkpoint"]:
        raise InternalChanged("trio", "_ssl._Once.ensure", "is not ensure(self, *, checkpoint)")
    stream = _unconnected_ssl_stream()
    handshook = getattr(stream, "_handshook", None)
    if not isinstance(handshook, once):
        raise InternalChanged("trio", "SSLStream._handshook", "is not a _ssl._Once")
    function = getattr(handshook, "_afn", None)
    if getattr(function, "__self__", None) is not stream or handshook.started is not False:  # type: ignore[attr-defined]
        raise InternalChanged("trio", "_ssl._Once._afn", "is not the stream's handshake, not yet run")
    if getattr(handshook, "_args", None) != ():
        raise InternalChanged("trio", "_ssl._Once._args", "is not the handshake's (empty) arguments")


# -- messages ------------------------------------------------------------------------------------------


def _parameter_names(function: Callable[..., object]) -> list[str]:
    return list(inspect.signature(function).parameters)


def _installed_version(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _declared_requirement(library: str) -> str:
    try:
        requirements = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return ""
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9._-]+", requirement)
        if name is not None and name.group().lower() == library.lower():
            return requirement
    return ""
