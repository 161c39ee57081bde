"""Reading from transports in batches.

``trio.SSLStream.receive_some`` decrypts at most one TLS record (16 KiB) per call even when the
socket read brought in several, so a bulk transfer costs one trip through the whole receive path per
16 KiB. :func:`receive_batch` returns, after that first record, everything already decrypted-able
without touching the socket again.
"""

from __future__ import annotations

import ssl

import trio

from clusterproxy_protocol.workarounds import ssl_object_of


async def receive_batch(stream: trio.abc.ReceiveStream, max_bytes: int) -> bytes | bytearray:
    data = await stream.receive_some(max_bytes)
    if not data or not isinstance(stream, trio.SSLStream):
        return data
    # Reading from trio's SSLObject here is safe because we are the stream's only reader and we never
    # touch the socket: records already in its buffer are all we take.
    ssl_object = ssl_object_of(stream)
    parts = [data]
    total = len(data)
    while total < max_bytes:
        try:
            more = ssl_object.read(max_bytes - total)
        except ssl.SSLError:  # want-read (buffer empty), close_notify, key update: leave it to trio
            break
        if not more:
            break
        parts.append(more)
        total += len(more)
    return data if len(parts) == 1 else b"".join(parts)
