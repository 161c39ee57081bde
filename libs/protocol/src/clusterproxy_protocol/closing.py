"""Ending a connection so that the peer can tell a clean end from a failure.

* :func:`close_cleanly`: TLS ``close_notify``, then a TCP FIN. ``trio.SSLStream(https_compatible=True)``
  (what the proxy-server accepts clients with, so that clients which skip ``close_notify`` still
  work) never sends one on ``aclose()``; without it a client that requires ``close_notify`` reports
  an error on every clean transfer, and one that does not cannot tell our clean end from a crash.
* :func:`abort`: a TCP RST (or RST_STREAM on a tunnel stream): a failure never looks like the end
  of the data.
* :func:`reset_if_process_dies`: makes every close of the socket a RST until :func:`close_cleanly`
  runs, so that the kernel, closing the sockets of a killed process, resets them instead of ending
  them with a FIN that clients ignoring a missing ``close_notify`` (curl, Go) take for a clean end.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct

import trio

from clusterproxy_protocol.workarounds import ssl_object_of

CLOSE_GRACE = 2.0  # seconds a clean close may take (close_notify out, the peer's close in) before we cut
_LINGER_RESET = struct.pack("ii", 1, 0)  # on, 0 s: close() sends RST and drops unsent data
_LINGER_OFF = struct.pack("ii", 0, 0)  # the default: close() sends FIN after the unsent data
_TRANSPORT_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, OSError)


def _socket_of(stream: trio.abc.Stream) -> trio.SocketStream | None:
    inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    return inner if isinstance(inner, trio.SocketStream) else None


def _set_linger(stream: trio.abc.Stream, linger: bytes) -> None:
    tcp = _socket_of(stream)
    if tcp is not None:
        with contextlib.suppress(OSError):
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)


def reset_if_process_dies(stream: trio.abc.Stream) -> None:
    """From now on, any close of ``stream``'s socket other than :func:`close_cleanly` (this process
    killed, a crash, :func:`abort`) sends RST."""
    _set_linger(stream, _LINGER_RESET)


async def close_cleanly(stream: trio.abc.Stream, grace: float = CLOSE_GRACE) -> None:
    """Close ``stream`` as a clean end: for TLS, send ``close_notify`` and give the peer up to
    ``grace`` seconds to answer with its own (or close), then end the stream under it (TCP: a FIN; a
    WebSocket: its close frame) within what is left of ``grace``. Never raises for a peer that is gone
    already; it is closed in the end whatever happens."""
    inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else None
    _set_linger(stream, _LINGER_OFF)
    closed = False
    try:
        with trio.move_on_after(grace), contextlib.suppress(*_TRANSPORT_ERRORS):
            if isinstance(stream, trio.SSLStream):
                # unwrap() is trio's public way to send close_notify whatever https_compatible says;
                # it waits for the peer's answer, which lets the peer read ours before our socket
                # closes (closing with its bytes unread would send RST, which can destroy our last).
                _drop_buffered_input(stream)
                transport, _ = await stream.unwrap()
                await transport.aclose()  # after unwrap() the SSLStream no longer closes it (nor holds it)
            else:
                await stream.aclose()
            closed = True
    finally:
        if not closed:
            if inner is not None:
                await trio.aclose_forcefully(inner)
            await trio.aclose_forcefully(stream)


def _drop_buffered_input(stream: trio.SSLStream[trio.abc.Stream]) -> None:
    """Discard the peer's records already received but not yet read. Python's ``unwrap()`` calls
    SSL_shutdown twice in a row, and the second call fails on such a record (OpenSSL 3:
    APPLICATION_DATA_AFTER_CLOSE_NOTIFY) before trio has sent the close_notify the first one queued:
    the peer would get a bare FIN. Only records in trio's buffer are read; the socket is not."""
    ssl_object = ssl_object_of(stream)
    with contextlib.suppress(ssl.SSLError):  # want-read: the buffer is empty; or the peer closed
        while ssl_object.read(1 << 16):
            pass


async def abort(stream: trio.abc.Stream) -> None:
    """Close so that the peer sees an abort (RST), not a clean EOF: a failure must never look like the
    end of the data."""
    abort_method = getattr(stream, "abort", None)
    if abort_method is not None:  # TunnelStream: RST_STREAM
        abort_method()
        return
    _set_linger(stream, _LINGER_RESET)
    await trio.aclose_forcefully(stream)
