"""Copy bytes both ways between two streams, keeping half-close where both ends support it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import trio

from clusterproxy_protocol.closing import CLOSE_GRACE, abort, close_cleanly
from clusterproxy_protocol.transport import read_in_bulk, receive_batch, send_all
from clusterproxy_protocol.tunnel_stream import TunnelStream

__all__ = ["CHUNK", "RelayResult", "relay_streams"]

CHUNK = 256 << 10
# Toward a stream that says how much it takes now (``send_room``: a tunnel stream's flow-control
# window), a read takes at most that, and at least this: bytes read beyond what the destination can
# take wait in this process, and a destination that takes nothing (a client that reads nothing) would
# otherwise have a whole chunk held here per stream on top of the window buffered before it.
LEAST_READ = 16 << 10
# A read this long was most of a 64 KiB socket read: more waited. Streams of small messages
# (watches, requests and answers) never reach it and keep small reads and their memory.
BULK_HINT = 32 << 10
_TRANSPORT_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


async def _readable(dst: trio.abc.Stream, room: Callable[[], int]) -> int:
    """How much to read for ``dst`` (which has ``send_room``): once it takes something, what it takes."""
    if room() <= 0:
        await dst.wait_send_all_might_not_block()  # the same wait (and stall timeout) as send_all's
    return min(CHUNK, max(LEAST_READ, room()))


@dataclass
class RelayResult:
    bytes_to_target: int = 0
    bytes_to_client: int = 0
    error: str | None = None


async def relay_streams(client: trio.abc.Stream, target: trio.abc.Stream) -> RelayResult:
    """Relay between the stream toward the client and the stream toward the target until both
    directions ended, then close both streams.

    EOF in one direction becomes ``send_eof`` on the other stream when it is half-closeable. When
    it is not (TLS to a hub client), EOF toward it ends the whole relay, as an HTTP/1.1 CONNECT
    proxy does. A clean end closes both cleanly (TLS: ``close_notify``); a failure in either
    direction, or a cancellation from outside, aborts both (RST), so no peer takes it for the end of
    the data.
    """
    result = RelayResult()
    completed = False
    try:
        async with trio.open_nursery() as nursery:

            async def pump(src: trio.abc.Stream, dst: trio.abc.Stream, to_target: bool) -> None:
                bulk = False
                room = getattr(dst, "send_room", None)
                # Chosen once per direction: a tunnel stream's own batched calls (no scheduler pass
                # per call), else transport's.
                receive = (
                    src.receive_batched if isinstance(src, TunnelStream) else partial(receive_batch, src)
                )
                send = dst.send_all_batched if isinstance(dst, TunnelStream) else partial(send_all, dst)
                try:
                    while data := await receive(CHUNK if room is None else await _readable(dst, room)):
                        if not bulk and len(data) >= BULK_HINT:
                            bulk = True
                            read_in_bulk(src)  # an end moving bulk: big socket reads from now on
                        await send(data)
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

            nursery.start_soon(pump, target, client, False)
            await pump(client, target, True)  # in this task: one task less per stream
        completed = True
    finally:
        # Each close bounds its own time, so a slow first one cannot leave the second open.
        with trio.CancelScope(shield=True):
            for stream in (client, target):
                if result.error or not completed:  # failed, or cancelled from outside
                    await abort(stream)
                else:
                    await close_cleanly(stream, CLOSE_GRACE)
    return result
