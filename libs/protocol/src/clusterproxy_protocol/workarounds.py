"""Every use of a third-party library's private internals, each guarded.

The tunnel relies on three private internals, all for speed (the numbers are in docs/benchmarks.md):

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
  for a peer that does not read. Checked when the first one is made.
* **trio** ``SSLStream._ssl_object``: ``SSLStream.receive_some`` decrypts one TLS record (16 KiB) per
  call even when the socket read brought in several; :func:`ssl_object_of` hands
  :func:`clusterproxy_protocol.transport.receive_batch` the ``ssl.SSLObject`` to take the rest from.
  Checked at every use (one ``isinstance``).

Each is checked against the shape it relies on, and a change raises :class:`InternalChanged` naming
the library, its version and the attribute, instead of misbehaving quietly. Without :func:`apply`
everything works the same, only slower. The versions that were checked are pinned in
``libs/protocol/pyproject.toml``; ``tests/unit/test_workarounds.py`` fails when a pinned version
moves an internal.

This module is used by the sans-IO core, so it never imports trio at module level: the one check
that needs trio imports it when it runs.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import re
import ssl
from collections.abc import Callable

import h2.config
import h2.connection
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
    """Check every internal, then make hyperframe's DATA frame repr cheap for the whole process.

    For programs (the services' ``main``), before the event loop starts; calling it again does
    nothing more. A library using the tunnel may call it too, knowing it changes a hyperframe class.
    """
    check_h2_open_streams()
    check_trio_ssl_object()
    check_hyperframe_body_repr()
    if hyperframe.frame.DataFrame.__dict__.get("_body_repr") is not _cheap_data_frame_repr:
        hyperframe.frame.DataFrame._body_repr = _cheap_data_frame_repr  # type: ignore[method-assign]


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


# -- h2: counting open streams -----------------------------------------------------------------------


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
    * :attr:`queued_output` is the size of h2's outbound buffer, without copying it."""

    _swept_size = 0
    _taking_headers = False

    def __init__(self, config: h2.config.H2Configuration | None = None) -> None:
        _check_h2_open_streams_once()
        super().__init__(config=config)

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
        """Bytes h2 has queued for the peer and :meth:`data_to_send` has not taken yet."""
        return len(self._data_to_send)


def check_h2_open_streams() -> None:
    """h2 counts open streams through ``_open_streams(remainder)``, its ``streams`` table holds every
    stream not yet swept, both settings carry ``max_concurrent_streams``, a received HEADERS is
    checked against the limit through ``open_inbound_streams``, and the outbound buffer is the
    bytearray ``_data_to_send``."""
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
    if not isinstance(connection.streams, dict):
        raise InternalChanged("h2", "H2Connection.streams", "is not a dict")
    if not isinstance(getattr(connection, "_data_to_send", None), bytearray):
        raise InternalChanged("h2", "H2Connection._data_to_send", "is not a bytearray")
    for settings in ("local_settings", "remote_settings"):
        if not isinstance(getattr(getattr(connection, settings), "max_concurrent_streams", None), int):
            raise InternalChanged("h2", f"H2Connection.{settings}.max_concurrent_streams", "is not an int")


@functools.cache
def _check_h2_open_streams_once() -> None:
    check_h2_open_streams()


# -- trio: SSLStream's SSLObject ----------------------------------------------------------------------


def ssl_object_of(stream: object) -> ssl.SSLObject:
    """The ``ssl.SSLObject`` a ``trio.SSLStream`` decrypts with (trio keeps it private)."""
    ssl_object = getattr(stream, "_ssl_object", None)
    if not isinstance(ssl_object, ssl.SSLObject):
        raise InternalChanged("trio", "SSLStream._ssl_object", "is not an ssl.SSLObject")
    return ssl_object


def check_trio_ssl_object() -> None:
    """A new ``trio.SSLStream`` holds its ``ssl.SSLObject`` as ``_ssl_object``."""
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

    ssl_object_of(trio.SSLStream(Unconnected(), ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), server_hostname="x"))


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
