"""HTTP/2 frame boundaries in the bytes a peer sends, followed before h2 sees them.

h2 parses frames only once a whole frame has arrived, into a buffer of its own, and copies a DATA
frame's payload three times on the way to its event. :class:`FrameScanner` stands in front of it and
follows the frames as the bytes arrive, which buys the core three things:

* an oversized frame is refused at its 9-byte header, before any of its body is buffered;
* the driver learns when the frame (or header block) now arriving started
  (:attr:`FrameScanner.partial_frame_since`), for its frame deadline;
* a plain DATA frame on an open stream (no flags: no padding, no END_STREAM) goes straight into the
  stream's buffer, piece by piece as it arrives, with h2's windows charged as h2 would charge them
  (:func:`clusterproxy_protocol.flow_control.charge_received`). Every other frame goes to h2 whole.

The outgoing side's frames of our own are DATA (:data:`DATA_HEADER` packs its header:
:meth:`clusterproxy_protocol.h2_connection.TunnelH2Connection.send_data_frames`) and WINDOW_UPDATE
(:func:`clusterproxy_protocol.flow_control.grant_received`).

Sans-IO like the core: a clock is passed in, no I/O, no trio.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import h2.connection

from clusterproxy_protocol import events as ev
from clusterproxy_protocol.flow_control import charge_received

__all__ = ["DATA_HEADER", "FRAME_HEADER_SIZE", "PREFACE", "FrameScanner"]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_SIZE = 9
DATA = 0x0
HEADERS_TYPES = (0x1, 0x5)  # HEADERS, PUSH_PROMISE: may start a header block
CONTINUATION = 0x9
END_HEADERS = 0x4
DATA_HEADER = struct.Struct(">IBI")  # 24-bit length and type 0 (DATA) in one word, flags, stream id

# The core's: a piece of a DATA frame's payload for the stream, with its flow-controlled length.
Deliver = Callable[[int, bytes, int, list[ev.Event]], None]
# The core's: hand h2 the gathered bytes (and empty the list), translate its events; True once the
# connection is closed (a limit tripped), when the rest of the input is not acted on.
Feed = Callable[[list[bytes], list[ev.Event]], bool]


class FrameScanner:
    """Where the peer's byte stream stands between frames, across reads.

    :meth:`scan` takes each read; the core's callbacks are passed with it, not kept, so a scanner
    holds no reference back to its core (a closed connection goes with its last reference, without
    waiting for the cyclic collector)."""

    __slots__ = (
        "_clock",
        "_connection",
        "_data_stream",
        "_frame_head",
        "_frame_left",
        "_frame_since",
        "_header_block_since",
        "_max_frame_size",
        "_preface_left",
        "_to_h2",
        "partial_frame_since",
    )

    def __init__(
        self,
        connection: h2.connection.H2Connection,
        *,
        preface: bool,
        max_frame_size: int,
        clock: Callable[[], float],
    ) -> None:
        self._connection = connection  # the core's TunnelH2Connection, whose windows a DATA frame charges
        self._max_frame_size = max_frame_size
        self._clock = clock
        self._preface_left = len(PREFACE) if preface else 0  # the acceptor reads the client's preface
        self._frame_head = b""
        self._frame_left = 0
        self._data_stream = 0  # the stream whose DATA frame is arriving past h2, 0 when none
        self._to_h2: list[bytes] = []
        self._header_block_since: float | None = None
        self._frame_since: float | None = None
        # When the frame (or header block) that started but has not finished arriving began; None
        # when the input so far ends on a boundary.
        self.partial_frame_since: float | None = None

    def scan(self, data: bytes, out: list[ev.Event], deliver: Deliver, feed: Feed) -> int:
        """Split ``data`` at frame boundaries: a plain DATA frame on an open stream goes to
        ``deliver`` piece by piece as it arrives (h2 would copy it three times and wait for the whole
        frame); every other frame goes to ``feed``, for h2. Returns the length of an oversized frame,
        else 0; stops early when ``feed`` says a limit closed the connection."""
        pos, end = 0, len(data)
        to_h2 = self._to_h2
        if self._preface_left > 0:
            done = len(PREFACE) - self._preface_left
            take = min(self._preface_left, end)
            if data[:take] != PREFACE[done : done + take]:
                self._preface_left = -1  # not HTTP/2: h2 says so with a protocol error
            else:
                self._preface_left -= take
                to_h2.append(data[:take])
                pos = take
        if self._preface_left < 0:
            to_h2.append(data[pos:] if pos else data)
            feed(to_h2, out)
            return 0
        started_here = False
        while pos < end:
            if self._frame_left:
                step = min(self._frame_left, end - pos)
                piece = data[pos : pos + step] if step < end or pos else data
                if self._data_stream:
                    deliver(self._data_stream, piece, step, out)
                else:
                    to_h2.append(piece)
                pos += step
                self._frame_left -= step
                continue
            need = FRAME_HEADER_SIZE - len(self._frame_head)
            started_here = started_here or not self._frame_head  # a frame starts at its header's first byte
            if end - pos < need:
                self._frame_head += data[pos:]
                break
            head = self._frame_head + data[pos : pos + need] if self._frame_head else data[pos : pos + need]
            self._frame_head = b""
            pos += need
            length = int.from_bytes(head[:3], "big")
            if length > self._max_frame_size:
                return length
            frame_type, flags = head[3], head[4]
            self._data_stream = 0
            if frame_type == DATA and not flags and length and self._header_block_since is None:
                if feed(to_h2, out):  # what came before may open, end or reset the stream
                    return 0
                stream_id = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                if charge_received(self._connection, stream_id, length):
                    self._data_stream = stream_id
            if not self._data_stream:
                if frame_type in HEADERS_TYPES and not flags & END_HEADERS:
                    self._header_block_since = self._clock()
                elif frame_type == CONTINUATION and flags & END_HEADERS:
                    self._header_block_since = None
                to_h2.append(head)
            self._frame_left = length
        feed(to_h2, out)
        if self._frame_left or self._frame_head:
            if started_here or self._frame_since is None:
                self._frame_since = self._clock()
        else:
            self._frame_since = None
        since = self._frame_since
        if self._header_block_since is not None and (since is None or self._header_block_since < since):
            since = self._header_block_since
        self.partial_frame_since = since
        return 0

    def skip_unseen_data(self, data: bytes | bytearray) -> bytes | bytearray:
        """``data`` without the rest of a DATA frame h2 never saw the start of (it went past h2), so
        h2 can read what follows: after our own close, the peer's GOAWAY."""
        if self._data_stream and self._frame_left:
            skip = min(self._frame_left, len(data))
            self._frame_left -= skip
            data = data[skip:]
        return data
