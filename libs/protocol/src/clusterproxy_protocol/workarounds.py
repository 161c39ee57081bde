"""Patches of other libraries' private internals, and the readers of trio's, each checked.

The tunnel relies on four of hyperframe's and trio's private internals, three for speed and one for
memory (the numbers are in docs/benchmarks.md):

* **hyperframe** ``Frame._body_repr``: h2 builds ``repr(frame)`` of every received frame for a trace
  log, even with logging off, and for DATA frames hyperframe serializes and hexlifies the whole body
  to show its first 10 bytes: a large share of a receiver's CPU in a bulk transfer (docs/benchmarks.md,
  "Profiling-driven improvements"). :func:`apply` gives
  ``DataFrame`` a repr with the same text built from the first 11 bytes only. It changes a class for
  the whole process, so only programs apply it (the services' entry points), never an import.
  Checked by :func:`apply`.
* **trio** ``SSLStream._ssl_object``: ``SSLStream.receive_some`` decrypts one TLS record (16 KiB) per
  call even when the socket read brought in several; :func:`ssl_object_of` hands
  :func:`clusterproxy_protocol.transport.receive_batch` the ``ssl.SSLObject`` to take the rest from.
  Checked at every use (one ``isinstance``), on import of :mod:`clusterproxy_protocol.transport`
  and by :func:`apply`.
* **trio** ``SSLStream``'s state, memory BIOs and locks (:func:`tls_parts`): each of its sends and
  receives passes through trio's scheduler three times (two locks and the socket call): a small message
  costs several times what the same TLS and socket calls cost made directly (docs/benchmarks.md,
  "Sixth round").
  :mod:`clusterproxy_protocol.transport` makes them directly while a connection is in its steady
  state, under trio's own guards and send lock, and leaves everything else to trio. Checked on
  import of :mod:`clusterproxy_protocol.transport`, the one module that uses them: every program
  that moves bytes through it (services, CLI and SDK alike) has them checked before its first byte,
  whether or not it calls :func:`apply` (which checks them too).
* **trio** ``SSLStream._handshook``: each stream keeps its handshake as a ``_Once`` holding the
  stream's own bound ``_do_handshake``, a reference cycle for the stream's whole life: a closed TLS
  connection (its ``SSLObject``, BIOs, OpenSSL's buffers, whatever its owner hung on it) waits for
  the cyclic garbage collector instead of going when its last reference does. After an attack on the
  client port (hundreds of connections in seconds) that was megabytes of the server's RSS, all of it
  garbage (docs/benchmarks.md, "Seventh round"). :func:`apply` makes ``_Once.ensure`` drop the handshake function once it has run it (trio
  never calls it twice), for the whole process. Checked by :func:`apply`.

h2's internals are not here: the core's h2 connection subclasses h2 for behaviour of its own
(:mod:`clusterproxy_protocol.h2_connection`, with the windows it charges in
:mod:`clusterproxy_protocol.flow_control`), and checks them there when its first connection is made
(and :func:`apply` runs those checks as well, so a service stops at start-up).

Each is checked against the shape it relies on, and a change raises :class:`InternalChanged` naming
the library, its version and the attribute, instead of misbehaving quietly. Without :func:`apply`
everything works the same, only slower, and closed TLS streams wait for the cyclic collector. The
versions that were checked are pinned in ``libs/protocol/pyproject.toml``;
``tests/unit/test_workarounds.py`` fails when a pinned version moves an internal.

The sans-IO core imports :class:`InternalChanged` from here (through
:mod:`clusterproxy_protocol.h2_connection`), so this module never imports trio at module level: what
needs trio imports it when it runs.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import re
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NamedTuple

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
    and a trio one. The internals that are read rather than patched are checked where they are used
    as well (h2's at the first connection, trio's TLS parts on import of the transport); here too, so
    a program stops at start-up rather than at its first tunnel.
    """
    from clusterproxy_protocol import h2_connection  # here, not at the top: it imports this module

    h2_connection.check_h2_internals()
    check_trio_ssl_object()
    check_trio_ssl_internals()
    check_hyperframe_body_repr()
    check_trio_handshake_once()
    if hyperframe.frame.DataFrame.__dict__.get("_body_repr") is not _cheap_data_frame_repr:
        hyperframe.frame.DataFrame._body_repr = _cheap_data_frame_repr  # type: ignore[method-assign,assignment]  # the patch itself; ours reads DataFrame's fields, so it is declared for DataFrame, not Frame
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
    if not inspect.isfunction(body_repr) or parameter_names(body_repr) != ["self"]:
        raise InternalChanged("hyperframe", "Frame._body_repr", "is not a method taking only self")
    if "_body_repr" not in frame_class.__repr__.__code__.co_names:
        raise InternalChanged("hyperframe", "Frame.__repr__", "no longer calls _body_repr()")
    own = hyperframe.frame.DataFrame.__dict__.get("_body_repr")
    if own is not None and own is not _cheap_data_frame_repr:
        raise InternalChanged("hyperframe", "DataFrame._body_repr", "is defined by hyperframe itself now")
    raw_data_repr = getattr(hyperframe.frame, "_raw_data_repr", None)
    if not callable(raw_data_repr):
        raise InternalChanged("hyperframe", "frame._raw_data_repr", "is missing")
    # memoryview too: h2's send_data hands hyperframe slices of the caller's buffer as they come.
    samples: list[bytes | memoryview] = [
        b"",
        b"short",
        bytes(range(10)),
        bytes(range(11)),
        bytes(range(256)),
        memoryview(bytes(64)),
    ]
    for data in samples:
        for padding in ({}, {"flags": ["PADDED"], "pad_length": 3}):
            expected = body_repr(hyperframe.frame.DataFrame(1, data, **padding))  # type: ignore[arg-type]  # declared bytes, given memoryviews by h2 (above)
            if _cheap_data_frame_repr(hyperframe.frame.DataFrame(1, data, **padding)) != expected:  # type: ignore[arg-type]  # as above
                raise InternalChanged(
                    "hyperframe",
                    "Frame._body_repr",
                    f"shows {expected!r} for a DATA frame of {len(data)} bytes, padding {padding}",
                )


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
    async def ensure_then_let_go(self: Any, *, checkpoint: bool) -> None:  # trio's private _Once: untyped
        try:
            await ensure(self, checkpoint=checkpoint)
        finally:
            if self.started:  # run (or running, or failed): never again
                self._afn = _handshake_already_run
                self._args = ()

    ensure_then_let_go.lets_go = True  # type: ignore[attr-defined]  # a mark on the function, read back with getattr
    return ensure_then_let_go


def _trio_once() -> type[Any]:  # trio's private _Once: its shape is checked, not declared
    import trio._ssl  # here, not at the top: the sans-IO core imports this module

    once = getattr(trio._ssl, "_Once", None)
    if not isinstance(once, type):
        raise InternalChanged("trio", "_ssl._Once", "is missing")
    return once


def _let_trio_handshakes_go() -> None:
    once = _trio_once()
    if not getattr(once.ensure, "lets_go", False):
        once.ensure = _ensure_then_let_go(once.ensure)


def check_trio_handshake_once() -> None:
    """A new ``trio.SSLStream`` keeps its bound ``_do_handshake`` in ``_handshook``, a ``_Once`` with
    ``_afn``, ``_args`` and ``started`` that runs it from ``ensure(*, checkpoint)``."""

    once = _trio_once()
    ensure = getattr(once, "ensure", None)
    if ensure is None or parameter_names(inspect.unwrap(ensure)) != ["self", "checkpoint"]:
        raise InternalChanged("trio", "_ssl._Once.ensure", "is not ensure(self, *, checkpoint)")
    stream = _unconnected_ssl_stream()
    handshook = getattr(stream, "_handshook", None)
    if not isinstance(handshook, once):
        raise InternalChanged("trio", "SSLStream._handshook", "is not a _ssl._Once")
    function = getattr(handshook, "_afn", None)
    if getattr(function, "__self__", None) is not stream or handshook.started is not False:
        raise InternalChanged("trio", "_ssl._Once._afn", "is not the stream's handshake, not yet run")
    if getattr(handshook, "_args", None) != ():
        raise InternalChanged("trio", "_ssl._Once._args", "is not the handshake's (empty) arguments")


# -- messages ------------------------------------------------------------------------------------------


def parameter_names(function: Callable[..., object]) -> list[str]:
    """The names of ``function``'s parameters, in order: the shape a check compares."""
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
