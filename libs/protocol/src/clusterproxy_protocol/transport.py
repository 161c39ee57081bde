"""Moving bytes through transports with as few passes through trio's scheduler as the bytes need.

``trio.SSLStream`` is general: any number of tasks, renegotiation, any transport. Each call takes
an outer lock, an inner lock and the socket operation, and each of those is a schedule point: a
small message costs several times as much to send and receive through it as the same
``ssl.SSLObject`` and socket calls made directly (docs/benchmarks.md, "Sixth round"), and a socket
stream's send or receive adds a pass through the scheduler of its own. On the tunnel and relay
paths, where every small message crosses four of them per process, :func:`send_all` and
:func:`receive_batch` make those calls directly when the connection is in its steady state (TLS
handshake done, no trio operation inside it, a plain socket under it), and hand everything else
(handshake, EOF, errors, a full socket buffer's remainder) to trio, which then finds the connection
exactly as it left it. They check for cancellation before touching any byte, and yield to the
scheduler every :data:`FAIR_EVERY` direct operations so a busy connection cannot starve the others.

``trio.SSLStream.receive_some`` also decrypts at most one TLS record (16 KiB) per call even when the
socket read brought in several: :func:`receive_batch` returns everything already decryptable.

:func:`input_waiting` tells a deadline on the peer ("a frame started and did not finish") apart from
a reader that is behind: in a process busy elsewhere (an attack on another connection, a loaded
machine) the rest of a frame can sit in the socket unread for longer than the deadline.
"""

from __future__ import annotations

import os
import select
import ssl
import weakref

import trio

from clusterproxy_protocol.workarounds import (
    TlsParts,
    check_trio_ssl_internals,
    check_trio_ssl_object,
    ssl_object_of,
    tls_mark_broken,
    tls_parts,
)

__all__ = [
    "FAIR_EVERY",
    "TLS_RECORD",
    "input_waiting",
    "read_in_bulk",
    "receive_batch",
    "send_all",
    "take_turn",
]

TLS_RECORD = 16 << 10  # the most plaintext one TLS record holds: what one SSLObject.read can return
SOCKET_READ = 64 << 10  # trio's own socket read size
BULK_SOCKET_READ = 256 << 10  # a quarter of the wake-ups and syscalls (docs/benchmarks.md)
FAIR_EVERY = 16  # direct operations in a row before one yields to the scheduler

# trio's private TLS parts this module works with, checked on import rather than by
# workarounds.apply() alone: every program that moves bytes through here (the SDK and the CLI as well
# as the services) fails at once, naming what changed, instead of misbehaving at its first byte.
check_trio_ssl_object()
check_trio_ssl_internals()

_bulk_sockets: weakref.WeakSet[trio.SocketStream] = weakref.WeakSet()
_direct_in_a_row = 0


def read_in_bulk(stream: trio.abc.Stream) -> bool:
    """Read ``stream``'s socket :data:`BULK_SOCKET_READ` at a time from now on (trio: 64 KiB); False,
    changing nothing, when it is neither a socket nor TLS directly on one.

    Only for connections that move bulk: OpenSSL's read buffer keeps the size of the largest read
    for the connection's life, and on a client connection parsed as HTTP/2 a bigger read is a
    bigger batch of an attacker's frames at once."""
    socket_stream = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    if not isinstance(socket_stream, trio.SocketStream):
        return False
    _bulk_sockets.add(socket_stream)
    return True


def _read_size(socket_stream: trio.SocketStream) -> int:
    return BULK_SOCKET_READ if socket_stream in _bulk_sockets else SOCKET_READ


async def take_turn() -> None:
    """Where a direct operation may be cancelled, and every :data:`FAIR_EVERY` one yields: always
    before it takes any byte, so no byte is ever held by a task waiting for its turn (a frame
    deadline looking at the socket and the TLS buffers would not see it). The tunnel streams take
    their turns from the same count (``TunnelStream.send_all``, ``receive_some``)."""
    global _direct_in_a_row
    _direct_in_a_row += 1
    if _direct_in_a_row >= FAIR_EVERY:
        _direct_in_a_row = 0
        await trio.lowlevel.checkpoint()
    else:
        await trio.lowlevel.checkpoint_if_cancelled()


def _broken(exc: OSError) -> trio.BrokenResourceError:
    return trio.BrokenResourceError(f"socket connection broken: {exc}")


async def receive_batch(stream: trio.abc.ReceiveStream, max_bytes: int) -> bytes | bytearray:
    """Up to ``max_bytes`` of what ``stream`` has, waiting for some; b"" at its end."""
    if isinstance(stream, trio.SSLStream):
        if isinstance(stream.transport_stream, trio.SocketStream):
            data = await _receive_tls_direct(stream, max_bytes)
            if data is not None:
                return data
        return await _receive_tls_through_trio(stream, max_bytes)
    if isinstance(stream, trio.SocketStream):
        return await _receive_socket(stream, max_bytes)
    return await stream.receive_some(max_bytes)


async def _receive_socket(stream: trio.SocketStream, max_bytes: int) -> bytes:
    await take_turn()
    sock = stream.socket
    while True:
        fd = sock.fileno()
        if fd < 0:
            return await stream.receive_some(max_bytes)  # trio says how it was closed
        try:
            data = os.read(fd, min(max_bytes, _read_size(stream)))
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)
            continue
        except OSError as exc:
            raise _broken(exc) from exc
        return data


async def _receive_tls_direct(
    stream: trio.SSLStream[trio.abc.Stream], max_bytes: int
) -> bytes | bytearray | None:
    """Decrypted data, or None when trio must take this read (not in its steady state, the socket's
    end, an error, a close_notify): nothing was taken from the stream then that trio will miss."""
    await take_turn()
    socket_stream = stream.transport_stream
    assert isinstance(socket_stream, trio.SocketStream)
    parts = tls_parts(stream, sending=False)
    if parts is None:
        return None
    with parts.receive_guard:
        while True:
            data = _decrypt(parts.ssl_object, parts.incoming, max_bytes)
            if data is None:
                return None
            if data:
                return data
            fd = socket_stream.socket.fileno()
            if fd < 0:
                return None
            try:
                ciphertext = os.read(fd, _read_size(socket_stream))
            except BlockingIOError:
                await trio.lowlevel.wait_readable(socket_stream.socket)
                parts = tls_parts(stream, sending=False)
                if parts is None:
                    return None
                continue
            except OSError:
                return None
            if not ciphertext:
                return None
            parts.incoming.write(ciphertext)


def _decrypt(ssl_object: ssl.SSLObject, incoming: ssl.MemoryBIO | None, max_bytes: int) -> bytes | None:
    """What the records already in ``ssl_object`` hold, up to ``max_bytes``: b"" when it needs more
    ciphertext, None when it has something else to say (close_notify, an alert, an error). With its
    ``incoming`` BIO, it does not ask when nothing can be there (an exception per empty read)."""
    parts: list[bytes] = []
    total = 0
    while total < max_bytes and (incoming is None or incoming.pending or ssl_object.pending()):
        try:
            # At most a record per read: SSLObject.read allocates the size asked for, then shrinks
            # it to the record (a 256 KiB allocation per 16 KiB record otherwise).
            more = ssl_object.read(min(max_bytes - total, TLS_RECORD))
        except ssl.SSLWantReadError:
            break
        except ssl.SSLError:
            if parts:
                break  # this much first; the next call meets the same and gives it to trio
            return None
        if not more:
            return None if not parts else b"".join(parts)
        parts.append(more)
        total += len(more)
    if not parts:
        return b""
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _receive_tls_through_trio(
    stream: trio.SSLStream[trio.abc.Stream], max_bytes: int
) -> bytes | bytearray:
    data = await stream.receive_some(min(max_bytes, TLS_RECORD))
    if not data:
        return data
    # Taking records already decrypted-able from trio's SSLObject is safe: we are the stream's only
    # reader and we never touch the socket here.
    more = _decrypt(ssl_object_of(stream), None, max_bytes - len(data))
    return data + more if more else data


async def send_all(stream: trio.abc.SendStream, data: bytes | bytearray | memoryview) -> None:
    """``stream.send_all(data)``, directly where :mod:`this module <clusterproxy_protocol.transport>`
    can: on a socket, or TLS on a socket in its steady state."""
    if isinstance(stream, trio.SSLStream):
        socket_stream = stream.transport_stream
        if data and isinstance(socket_stream, trio.SocketStream):
            await take_turn()
            parts = tls_parts(stream, sending=True)
            if parts is not None:
                with parts.send_guard:
                    await _send_tls_direct(stream, parts, socket_stream, data)
                return
        await stream.send_all(data)
    elif isinstance(stream, trio.SocketStream) and data and not stream.socket.did_shutdown_SHUT_WR:
        await take_turn()
        await _write_socket(stream, data)
    else:
        await stream.send_all(data)


async def _send_tls_direct(
    stream: trio.SSLStream[trio.abc.Stream],
    parts: TlsParts,
    socket_stream: trio.SocketStream,
    data: bytes | bytearray | memoryview,
) -> None:
    # Held from before the ciphertext leaves the BIO until it is all in the socket, as trio's own
    # sends hold it: whoever reads the BIO next writes after us.
    parts.send_lock.acquire_nowait()
    try:
        try:
            parts.ssl_object.write(data)
        except (ssl.SSLError, ssl.CertificateError) as exc:
            tls_mark_broken(stream)
            raise trio.BrokenResourceError from exc
        try:
            await _write_socket(socket_stream, parts.outgoing.read())
        except BaseException:
            tls_mark_broken(stream)  # part of a record may have gone out: nothing after it could be read
            raise
    finally:
        parts.send_lock.release()


async def _write_socket(socket_stream: trio.SocketStream, data: bytes | bytearray | memoryview) -> None:
    """All of ``data`` into the socket: what it takes at once directly, the rest through trio, which
    waits for room (and says how the socket was closed, if it was)."""
    fd = socket_stream.socket.fileno()
    sent = 0
    if fd >= 0:
        try:
            sent = os.write(fd, data)
        except BlockingIOError:
            pass
        except OSError as exc:
            raise _broken(exc) from exc
    if sent < len(data):
        await socket_stream.send_all(memoryview(data)[sent:])


def input_waiting(stream: object) -> bool:
    """Whether bytes the peer sent wait unread in ``stream``: decrypted in a ``trio.SSLStream``'s TLS
    object or in the kernel's buffer of the socket under it. False for a transport it cannot look
    into (a WebSocket carrier, memory streams): a deadline then counts as before."""
    while isinstance(stream, trio.SSLStream):
        if ssl_object_of(stream).pending():
            return True
        stream = stream.transport_stream
    if isinstance(stream, trio.SocketStream):
        poller = select.poll()
        poller.register(stream.socket.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    return False
