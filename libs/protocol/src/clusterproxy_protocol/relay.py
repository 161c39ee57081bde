"""Copy bytes both ways between two streams, keeping half-close where both ends support it."""

from __future__ import annotations

import contextlib
import socket
import struct
from dataclasses import dataclass

import trio

from clusterproxy_protocol.transport import receive_batch

CHUNK = 256 << 10
CLOSE_GRACE = 2.0  # seconds a graceful close (TLS close_notify) may take before we cut
_TRANSPORT_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


@dataclass
class RelayResult:
    bytes_to_target: int = 0
    bytes_to_client: int = 0
    error: str | None = None


async def relay(client: trio.abc.Stream, target: trio.abc.Stream) -> RelayResult:
    """Relay between the stream toward the client and the stream toward the target until both
    directions ended, then close both streams.

    EOF in one direction becomes ``send_eof`` on the other stream when it is half-closeable. When
    it is not (TLS to a hub client), EOF toward it ends the whole relay, as an HTTP/1.1 CONNECT
    proxy does. A failure in either direction aborts both.
    """
    result = RelayResult()
    completed = False
    try:
        async with trio.open_nursery() as nursery:

            async def pump(src: trio.abc.Stream, dst: trio.abc.Stream, to_target: bool) -> None:
                try:
                    while data := await receive_batch(src, CHUNK):
                        await dst.send_all(data)
                        if to_target:
                            result.bytes_to_target += len(data)
                        else:
                            result.bytes_to_client += len(data)
                    if isinstance(dst, trio.abc.HalfCloseableStream):
                        await dst.send_eof()
                    else:
                        nursery.cancel_scope.cancel()
                except _TRANSPORT_ERRORS as exc:
                    result.error = result.error or f"{type(exc).__name__}: {exc}"
                    nursery.cancel_scope.cancel()

            nursery.start_soon(pump, client, target, True)
            nursery.start_soon(pump, target, client, False)
        completed = True
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_GRACE):
            for stream in (client, target):
                if result.error or not completed:  # failed, or cancelled from outside
                    await abort(stream)
                else:
                    try:
                        await stream.aclose()
                    except _TRANSPORT_ERRORS:
                        pass
    return result


async def abort(stream: trio.abc.Stream) -> None:
    """Close so that the peer sees an abort (RST), not a clean EOF: a failure must never look like the
    end of the data."""
    abort_method = getattr(stream, "abort", None)
    if abort_method is not None:  # TunnelStream: RST_STREAM
        abort_method()
        return
    inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    if isinstance(inner, trio.SocketStream):  # TCP: SO_LINGER 0 makes close() send RST
        with contextlib.suppress(OSError):
            inner.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await trio.aclose_forcefully(stream)
