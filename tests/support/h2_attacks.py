"""The HTTP/2 attacks of issue 10 (findings 2 to 6), each a function of a raw
:class:`tests.support.h2_attacker.Attacker`, shared by the abuse tests (in-process and against real
processes) and the bad-input battery. They perform the attack and read the server's answer; the
callers assert what the answer must be."""

from __future__ import annotations

from dataclasses import dataclass

import hpack
import trio
from hyperframe.frame import (
    DataFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    WindowUpdateFrame,
)

from clusterproxy_protocol.core import CANCEL
from tests.support.h2_attacker import Attacker

RAPID_RESET_PAIRS = 50_000  # what issue 10 measured: 50,000 HEADERS+RST_STREAM pairs on one connection
PING_BATCH = PingFrame(0, opaque_data=b"12345678").serialize() * 10_000  # 170 KB of PINGs, as many ACKs
OVERSIZED_FRAME = (16 << 20) - 1  # the largest frame HTTP/2 can announce: 16 MiB
HALF_SENT_MISSING = 10  # bytes of a frame never sent


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big") + payload


def rapid_reset_burst(attacker: Attacker, authority: str, pairs: int = RAPID_RESET_PAIRS) -> bytes:
    """``pairs`` CONNECT HEADERS to ``authority``, each followed by its RST_STREAM CANCEL, on stream ids
    1, 3, 5, ... Built from the raw frame layout (~40 ms) rather than hyperframe (~0.5 s), so a caller
    timing the server's answer times the server: the header block is the same after the first, once
    the headers sit in the HPACK dynamic table."""
    headers = [(":method", "CONNECT"), (":authority", authority), ("cluster-proxy-cluster", "cluster1")]
    first, indexed = attacker.encoder.encode(headers), attacker.encoder.encode(headers)
    end_headers, headers_type, rst_type = 0x4, 0x1, 0x3
    cancel = int(CANCEL).to_bytes(4, "big")
    return b"".join(
        _frame(headers_type, end_headers, sid, first if sid == 1 else indexed)
        + _frame(rst_type, 0, sid, cancel)
        for sid in range(1, 2 * pairs, 2)
    )


async def send_ignoring_close(attacker: Attacker, data: bytes) -> None:
    try:
        await attacker.send(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the server closed the connection while we were still sending


async def flood_until_goaway(attacker: Attacker, data: bytes) -> GoAwayFrame:
    """Send ``data`` while reading, until the server's GOAWAY: the server closes once it has said why,
    and a connection reset while the GOAWAY sits unread would lose it."""
    async with trio.open_nursery() as flood:
        flood.start_soon(send_ignoring_close, attacker, data)
        goaway = await attacker.until(GoAwayFrame)
        flood.cancel_scope.cancel()
    assert isinstance(goaway, GoAwayFrame)
    return goaway


async def ping_until_closed(attacker: Attacker, most: int = 200 << 20) -> int:
    """PINGs whose ACKs are never read, until the server closes the connection; the bytes sent.
    AssertionError when ``most`` bytes went without the server closing."""
    sent = 0
    try:
        while sent < most:
            await attacker.send(PING_BATCH)
            sent += len(PING_BATCH)
    except trio.BrokenResourceError:
        return sent
    raise AssertionError(f"{sent} bytes of PINGs with no ACK read and the connection is still open")


def oversized_frame_start(stream_id: int = 1, length: int = OVERSIZED_FRAME, sent: int = 1 << 20) -> bytes:
    """The header of a DATA frame of ``length`` bytes and the first ``sent`` bytes of its payload."""
    return length.to_bytes(3, "big") + bytes([0, 0]) + stream_id.to_bytes(4, "big") + b"x" * sent


async def send_half_frame(attacker: Attacker, authority: str, size: int = 60_000, stream_id: int = 1) -> None:
    """A CONNECT to ``authority`` and a DATA frame of ``size`` bytes on it, all but its last
    HALF_SENT_MISSING bytes sent: the server holds the frame's start until its frame deadline."""
    await attacker.send(attacker.connect_frame(stream_id, authority))
    await attacker.send(DataFrame(stream_id, b"x" * size).serialize()[:-HALF_SENT_MISSING])


async def stall_streams(attacker: Attacker, authority: str, stream_ids: list[int]) -> None:
    """CONNECTs to ``authority`` with 1000 bytes each; with the attacker's receive window at 0 (connect
    it with ``_4=0``) an echo target's reply can never be sent: the streams stall."""
    for stream_id in stream_ids:
        await attacker.send(attacker.connect_frame(stream_id, authority))
        await attacker.send(DataFrame(stream_id, b"e" * 1000).serialize())


async def resets_of(attacker: Attacker, stream_ids: list[int]) -> dict[int, int]:
    """Read until each of ``stream_ids`` got an RST_STREAM; stream id -> error code."""
    codes: dict[int, int] = {}
    while set(codes) != set(stream_ids):
        frame = await attacker.until(RstStreamFrame)
        if frame.stream_id in stream_ids:
            codes[frame.stream_id] = frame.error_code
    return codes


@dataclass
class TinyWindowRefusal:
    fields: dict[str, str]  # the reply's head
    first_chunk: bytes  # the DATA sent into the tiny window
    first_ended: bool  # whether that DATA ended the stream (a short body: the bug of finding 6)
    body: bytes  # the whole body, once the window opened

    @property
    def length(self) -> int:
        return int(self.fields["content-length"])


async def refusal_through_tiny_window(attacker: Attacker, stream_id: int = 1) -> TinyWindowRefusal:
    """A CONNECT the server must refuse (an authority that is no target), on an attacker whose stream
    window is tiny (connect it with ``_4=3``): reads the head and the DATA sent into the window, then
    opens the window and reads the rest of the body."""
    await attacker.send(attacker.connect_frame(stream_id, "not a target"))
    head = await attacker.until(HeadersFrame, stream_id)
    fields = {name: value for name, value in hpack.Decoder().decode(head.data)}
    first = await attacker.until(DataFrame, stream_id)
    body, ended = first.data, "END_STREAM" in first.flags
    if not ended:
        await attacker.send(WindowUpdateFrame(stream_id, window_increment=1 << 16).serialize())
        while not ended:
            frame = await attacker.until(DataFrame, stream_id)
            body += frame.data
            ended = "END_STREAM" in frame.flags
    return TinyWindowRefusal(fields, first.data, "END_STREAM" in first.flags, body)
