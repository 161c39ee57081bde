"""Sockets, TLS and the HTTP/2 tunnel of the floor (bench/floor/__init__.py says what it is).

What makes it fast, in one place: sockets and TLS are driven directly (non-blocking calls, trio only
to wait for readiness: no per-call locks or scheduler passes), reads are large, DATA frames bypass h2
both ways (h2 copies a payload several times; here an outbound payload is copied once, joined with
its frame header for TLS, and an inbound one not at all), one writer task per tunnel coalesces every
stream's frames into one TLS write, and WINDOW_UPDATEs are batched (a quarter of a window at a time).
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import ssl
import struct
from collections import deque
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import trio

READ = 256 << 10  # one socket read: a quarter of the wake-ups of trio's 64 KiB
RECORD = 16 << 10  # the most plaintext one TLS record holds
# Ours' tunnel settings (clusterproxy_protocol.core.TunnelSettings as the server and agent set them)
FIRST_WINDOW, STREAM_WINDOW, CONN_WINDOW = 64 << 10, 1 << 20, 32 << 20
MAX_FRAME, MAX_STREAMS, MAX_HEADER_LIST = 64 << 10, 20_000, 16 << 10
HIGH_WATER = 1 << 20  # bytes queued on a tunnel before a sender waits for the writer
FAIR_EVERY = 16  # direct socket operations in a row before one yields to the scheduler
DATA_HEAD = struct.Struct(">HBBBI")  # a frame header: length as 16 + 8 bits, type, flags, stream
WINDOW_UPDATE = struct.Struct(">HBBBII")
CANCEL = h2.errors.ErrorCodes.CANCEL


class Reset(Exception):
    """The stream was reset (by the peer or the tunnel's end)."""


_direct = 0


async def _turn() -> None:
    """A cancellation point; a real yield only every FAIR_EVERY calls (a bulk stream never waits)."""
    global _direct
    _direct += 1
    if _direct >= FAIR_EVERY:
        _direct = 0
        await trio.lowlevel.checkpoint()
    else:
        await trio.lowlevel.checkpoint_if_cancelled()


async def recv(sock: socket.socket) -> bytes:
    """What has arrived (up to READ), waiting for some; b"" at EOF. A fresh bytes per read, sized to
    what came: nothing is held between reads, so an idle connection costs no buffer."""
    await _turn()
    while True:
        try:
            return sock.recv(READ)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)


async def sendv(sock: socket.socket, chunks: list) -> None:
    """Send every chunk, several per syscall (sendmsg): no join, no copy."""
    await _turn()
    while chunks:
        try:
            sent = sock.sendmsg(chunks[:512])
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        while sent:
            if sent >= len(chunks[0]):
                sent -= len(chunks.pop(0))
            else:
                chunks[0], sent = memoryview(chunks[0])[sent:], 0


def abort(sock: socket.socket) -> None:
    """Close with RST, so no peer takes it for a clean end."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def prepare(sock: socket.socket) -> socket.socket:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small messages leave at once
    return sock


async def dial(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = (await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
    sock = prepare(socket.socket(family, kind, proto))
    try:
        sock.connect(address)
    except BlockingIOError:
        await trio.lowlevel.wait_writable(sock)
        error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            sock.close()
            raise OSError(error, f"connect to {host}:{port} failed") from None
    return sock


async def accept_loop(lsock: socket.socket, handler, nursery: trio.Nursery) -> None:
    lsock.setblocking(False)
    while True:
        try:
            sock, _ = lsock.accept()
        except BlockingIOError:
            await trio.lowlevel.wait_readable(lsock)
            continue
        nursery.start_soon(handler, prepare(sock))


def listener(text: str) -> socket.socket:
    host, _, port = text.rpartition(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    sock.listen(4096)
    return sock


def context(args: argparse.Namespace, server: bool, alpn: str) -> ssl.SSLContext:
    """Ours' TLS: 1.3 only, the peer's certificate verified against --ca both ways, no tickets."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.options |= ssl.OP_NO_COMPRESSION
    if server:
        ctx.num_tickets = 0  # as ours: nobody resumes, and tickets cost a third of the handshake
    ctx.set_alpn_protocols([alpn])
    ctx.load_cert_chain(args.cert, args.key)
    ctx.load_verify_locations(args.ca)
    return ctx


class Tls:
    """TLS on a non-blocking socket through memory BIOs, without trio.SSLStream's locks and
    checkpoints; every read decrypts all the records that have arrived at once. One task reads and
    one task writes (trio runs one task at a time)."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, server_side: bool, name: str | None = None):
        self.sock = sock
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.incoming, self.outgoing, server_side=server_side, server_hostname=name)
        self.ended = False

    async def handshake(self) -> None:
        while True:
            try:
                self.obj.do_handshake()
                return await self.flush()
            except ssl.SSLWantReadError:
                await self.flush()
                if not await self._fill():
                    raise ConnectionError("EOF during the TLS handshake") from None

    async def flush(self) -> None:
        if self.outgoing.pending:
            await sendv(self.sock, [self.outgoing.read()])

    async def _fill(self) -> bool:
        data = await recv(self.sock)
        if data:
            self.incoming.write(data)
        self.ended = not data  # a record cut short stays unread: an EOF without close_notify ends it too
        return bool(data)

    async def recv(self, keep: bytes | memoryview = b"") -> memoryview | None:
        """``keep`` followed by all the plaintext that has arrived (waiting for some), in a fresh buffer
        (it is handed on, never reused: no copy); None at close_notify or EOF."""
        while not self.ended:
            size = self.incoming.pending + self.obj.pending()  # plaintext is never longer
            if size:
                view = memoryview(bytearray(len(keep) + size))
                view[: len(keep)] = keep
                n = len(keep)
                # Only while records wait: a read that finds none raises, and an exception costs.
                while n < len(view) and (self.incoming.pending or self.obj.pending()):
                    try:
                        got = self.obj.read(min(RECORD, len(view) - n), view[n:])
                    except ssl.SSLWantReadError:
                        break
                    except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                        got = 0
                    if not got:
                        self.ended = True
                        break
                    n += got
                if n > len(keep):
                    return view[:n]
            if not self.ended:
                await self._fill()
        return None

    async def send(self, chunks: list) -> None:
        """Encrypt and send the chunks; the list is emptied (nothing is pinned while the socket waits)."""
        for chunk in chunks:
            self.obj.write(chunk)
        chunks.clear()
        await self.flush()

    async def send_eof(self) -> None:
        """close_notify: TLS 1.3 half-close, the peer may go on sending (Go's CloseWrite reads it so)."""
        try:
            self.obj.unwrap()
        except ssl.SSLWantReadError:
            pass
        await self.flush()


class H2(h2.connection.H2Connection):
    """h2 counts open streams by walking all of them at every new stream (O(n) each). The size of its
    table bounds the count from above, which is all its limit checks need below the limit; closed
    streams are swept (by h2's own walk) once the table has doubled since the last sweep."""

    _swept = 0

    def _bound(self, exact) -> int:
        if len(self.streams) >= max(2 * self._swept, 64) or len(self.streams) >= MAX_STREAMS:
            count = exact.fget(self)
            self._swept = len(self.streams)
            return count
        return len(self.streams)

    open_outbound_streams = property(
        lambda self: self._bound(h2.connection.H2Connection.open_outbound_streams)
    )
    open_inbound_streams = property(lambda self: self._bound(h2.connection.H2Connection.open_inbound_streams))


@dataclass(slots=True, eq=False)
class Stream:
    sid: int
    chunks: deque[memoryview] = field(default_factory=deque)
    buffered: int = 0
    window: int = FIRST_WINDOW  # the receive window granted
    unacked: int = 0  # bytes read and not yet given back in a WINDOW_UPDATE
    starved: bool = False  # the peer used up the window since it last grew
    ended: bool = False  # the peer's half-close
    done: bool = False  # ours
    reset: bool = False
    status: int | None = None
    # Its reader (and opener) and its sender wait apart: data arriving does not wake a sender waiting
    # for window, nor a WINDOW_UPDATE a reader.
    lot: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)
    send_lot: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)


class Tunnel:
    """One HTTP/2 connection. h2 keeps the stream states and every frame but DATA; DATA frames and
    WINDOW_UPDATEs for received data are read and written here. ``on_request`` (the agent) is started
    for every CONNECT the peer opens."""

    def __init__(self, tls: Tls, client_side: bool, on_request=None) -> None:
        self.tls, self.on_request = tls, on_request
        self.h2 = H2(h2.config.H2Configuration(client_side=client_side, header_encoding="utf-8"))
        S = h2.settings.SettingCodes
        self.h2.local_settings = h2.settings.Settings(
            client=client_side,
            initial_values={
                S.INITIAL_WINDOW_SIZE: FIRST_WINDOW,
                S.MAX_FRAME_SIZE: MAX_FRAME,
                S.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
                S.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
            },
        )
        # h2 applies these two only when a changed value is acknowledged, and values given up front
        # never change: set by hand, as ours does.
        self.h2.max_inbound_frame_size, self.h2.decoder.max_header_list_size = MAX_FRAME, MAX_HEADER_LIST
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(CONN_WINDOW - 65535)
        self.streams: dict[int, Stream] = {}
        self.out: list[bytes | memoryview] = []  # frames for the writer, in order
        self.queued = 0  # their bytes
        self.conn_unacked = 0
        self.preface = 0 if client_side else 24
        self.closed = False
        self.writer_lot, self.drained = trio.lowlevel.ParkingLot(), trio.lowlevel.ParkingLot()

    async def run(self) -> None:
        """Read and write until the connection ends; then every stream is reset."""
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                nursery.start_soon(self._writer)
                await self._reader()
                nursery.cancel_scope.cancel()
        finally:
            self.closed = True
            for st in list(self.streams.values()):
                self._gone(st)
            self.drained.unpark_all()

    def _queue(self, *frames) -> None:
        """Hand frames to the writer (kept, not copied: the relays never reuse a buffer they send)."""
        queued = self.queued
        for frame in (self.h2.data_to_send(), *frames):  # h2's first: a stream's HEADERS before its DATA
            if frame:
                self.out.append(frame)
                self.queued += len(frame)
        if self.queued > queued:
            self.writer_lot.unpark_all()  # only then: a wake-up with nothing to write costs a pass

    async def _writer(self) -> None:
        while True:
            self._queue()
            if not self.out:
                await self.writer_lot.park()
                continue
            # Everything every stream queued, one TLS write: joined once (the one copy of an outbound
            # payload: TLS records need frame headers and payloads side by side).
            data = [b"".join(self.out)]
            self.out.clear()
            self.queued = 0
            self.drained.unpark_all()
            await self.tls.send(data)

    async def _reader(self) -> None:
        keep: bytes | memoryview = b""
        while (view := await self.tls.recv(keep)) is not None:
            used = self._frames(view, len(view))
            # A frame still arriving (copied once, into the next buffer); an empty view would still pin
            # this buffer for as long as the tunnel idles.
            keep = view[used:] if used < len(view) else b""

    def _frames(self, view: memoryview, have: int) -> int:
        """Take every whole frame in ``view[:have]``; return how far that went."""
        pos = min(self.preface, have)  # the client's preface is no frame: h2 reads it
        to_h2, self.preface = [view[:pos]] if pos else [], self.preface - pos
        while have - pos >= 9:
            end = pos + 9 + (view[pos] << 16 | view[pos + 1] << 8 | view[pos + 2])
            if end > have:
                break
            if view[pos + 3] == 0 and not view[pos + 4] & 0x8:  # DATA, not padded: not through h2
                self._to_h2(to_h2)  # what came before may open or reset its stream
                sid = int.from_bytes(view[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
                self._data(sid, view[pos + 9 : end])
                if view[pos + 4] & 0x1:  # END_STREAM: h2 keeps the stream's state, from an empty frame
                    to_h2.append(b"\0\0\0" + bytes(view[pos + 3 : pos + 9]))
            else:
                to_h2.append(view[pos:end])
            pos = end
        self._to_h2(to_h2)
        return pos

    def _to_h2(self, frames: list) -> None:
        if not frames:
            return
        events = self.h2.receive_data(b"".join(frames))
        frames.clear()
        for event in events:
            st = self.streams.get(getattr(event, "stream_id", 0) or 0)
            if isinstance(event, h2.events.RequestReceived):
                st = self.streams[event.stream_id] = Stream(event.stream_id)
                self.nursery.start_soon(self.on_request, self, st, dict(event.headers).get(":authority", ""))
            elif isinstance(event, h2.events.ResponseReceived) and st:
                st.status = int(dict(event.headers)[":status"])
                st.lot.unpark_all()
            elif isinstance(event, h2.events.StreamEnded) and st:
                st.ended = True
                st.lot.unpark_all()
                self._forget(st)
            elif isinstance(event, h2.events.StreamReset) and st:
                self._gone(st)
            elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
                for waiting in [st] if st else list(self.streams.values()):
                    waiting.send_lot.unpark_all()
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.closed = True
        self._queue()  # SETTINGS and PING ACKs

    def _data(self, sid: int, payload: memoryview) -> None:
        # The connection window reopens as data lands (stream windows bound the memory), in batches.
        self.conn_unacked += len(payload)
        if self.conn_unacked >= CONN_WINDOW // 4:
            self._queue(WINDOW_UPDATE.pack(0, 4, 0x8, 0, 0, self.conn_unacked))
            self.conn_unacked = 0
        st = self.streams.get(sid)
        if st is None or st.reset or not payload:
            return  # late data for a stream already gone
        # Kept as a view of the decrypted buffer, not copied: a reader that stops pins the buffers its
        # window's worth of bytes is in, the fast path never copies an inbound payload.
        st.chunks.append(payload)
        st.buffered += len(payload)
        if st.window < STREAM_WINDOW and st.window - st.buffered - st.unacked <= st.window // 8:
            st.starved = True  # the peer used (almost) the whole window: it waits for us
        st.lot.unpark_all()

    # -- what the relays call -------------------------------------------------------------------

    def open(self, authority: str) -> Stream:
        sid = self.h2.get_next_available_stream_id()
        self.h2.send_headers(sid, [(":method", "CONNECT"), (":authority", authority)])
        st = self.streams[sid] = Stream(sid)
        self._queue()
        return st

    async def response(self, st: Stream) -> int:
        while st.status is None and not st.reset:
            await st.lot.park()
        return st.status or 0

    def respond(self, st: Stream, status: int) -> None:
        if st.reset or self.closed:
            return  # reset while the target was dialed: its relay finds out (an error here ends the tunnel)
        self.h2.send_headers(st.sid, [(":status", str(status))], end_stream=status != 200)
        st.done = status != 200
        self._queue()

    async def recv(self, st: Stream) -> list[memoryview]:
        """Every buffered chunk, waiting for some; [] once the peer ended the stream."""
        while not st.chunks:
            if st.reset:
                raise Reset
            if st.ended:
                return []
            await st.lot.park()
        chunks, taken = list(st.chunks), st.buffered
        st.chunks.clear()
        st.buffered = 0
        st.unacked += taken
        if not st.ended and not st.reset:
            growth = 0
            if st.starved:  # the peer sent as fast as the window let it and we took it all: double it
                st.starved = False
                growth = min(2 * st.window, STREAM_WINDOW) - st.window
                st.window += growth
            if growth or st.unacked >= st.window // 4:
                self._queue(WINDOW_UPDATE.pack(0, 4, 0x8, 0, st.sid, st.unacked + growth))
                st.unacked = 0
        return chunks

    def room(self, st: Stream) -> int:
        try:
            return 0 if st.reset or self.closed else max(0, self.h2.local_flow_control_window(st.sid))
        except h2.exceptions.NoSuchStreamError:
            return 0

    async def send(self, st: Stream, view: memoryview) -> None:
        """Frame all of ``view`` as the windows allow; ``view``'s buffer must not change afterwards."""
        while view:
            room = self.room(st)
            if not room:
                if st.reset or self.closed:
                    raise Reset
                await st.send_lot.park()
                continue
            count, size = min(room, len(view)), self.h2.max_outbound_frame_size
            frames = []
            for offset in range(0, count, size):
                piece = view[offset : min(offset + size, count)]
                frames += (DATA_HEAD.pack(len(piece) >> 8, len(piece) & 0xFF, 0, 0, st.sid), piece)
            # h2 must know what was sent, or its windows overflow with the peer's WINDOW_UPDATEs
            self.h2.streams[st.sid].outbound_flow_control_window -= count
            self.h2.outbound_flow_control_window -= count
            self._queue(*frames)
            view = view[count:]
            if self.queued >= HIGH_WATER:
                await self.drained.park()

    def end(self, st: Stream) -> None:
        """END_STREAM: our half-close."""
        if not (st.done or st.reset or self.closed):
            st.done = True
            self.h2.end_stream(st.sid)
            self._queue()
            self._forget(st)

    def reset(self, st: Stream) -> None:
        if not (st.reset or self.closed or (st.ended and st.done)):
            try:
                self.h2.reset_stream(st.sid, CANCEL)
            except h2.exceptions.ProtocolError:
                pass  # closed on the wire already
            self._queue()
        self._gone(st)

    def _gone(self, st: Stream) -> None:
        st.reset = True
        st.chunks.clear()
        self.streams.pop(st.sid, None)
        st.lot.unpark_all()
        st.send_lot.unpark_all()

    def _forget(self, st: Stream) -> None:
        if st.ended and st.done:  # no frame can come for it; its reader keeps what is buffered
            self.streams.pop(st.sid, None)
