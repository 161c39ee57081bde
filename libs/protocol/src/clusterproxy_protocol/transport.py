"""Reading from transports in batches, and knowing whether input waits unread.

``trio.SSLStream.receive_some`` decrypts at most one TLS record (16 KiB) per call even when the
socket read brought in several, so a bulk transfer costs one trip through the whole receive path per
16 KiB. :func:`receive_batch` returns, after that first record, everything already decrypted-able
without touching the socket again.

:func:`input_waiting` tells a deadline on the peer ("a frame started and did not finish") apart from
a reader that is behind: in a process busy elsewhere (an attack on another connection, a loaded
machine) the rest of a frame can sit in the socket unread for longer than the deadline.
"""

from __future__ import annotations

import select
import ssl

import trio

from clusterproxy_protocol.workarounds import ssl_object_of

TLS_RECORD = 16 << 10  # the most plaintext one TLS record holds: what one SSLObject.read can return


async def receive_batch(stream: trio.abc.ReceiveStream, max_bytes: int) -> bytes | bytearray:
    if not isinstance(stream, trio.SSLStream):
        return await stream.receive_some(max_bytes)
    # At most a record per read: SSLObject.read allocates the size asked for, then shrinks it to
    # the record (a 256 KiB allocation per 16 KiB record otherwise).
    data = await stream.receive_some(min(max_bytes, TLS_RECORD))
    if not data:
        return data
    # Reading from trio's SSLObject here is safe because we are the stream's only reader and we never
    # touch the socket: records already in its buffer are all we take.
    ssl_object = ssl_object_of(stream)
    parts = [data]
    total = len(data)
    while total < max_bytes:
        try:
            more = ssl_object.read(min(max_bytes - total, TLS_RECORD))
        except ssl.SSLError:  # want-read (buffer empty), close_notify, key update: leave it to trio
            break
        if not more:
            break
        parts.append(more)
        total += len(more)
    return data if len(parts) == 1 else b"".join(parts)


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
