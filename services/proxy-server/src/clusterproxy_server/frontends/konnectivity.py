"""Konnectivity's gRPC frontend: ``POST /ProxyService/Proxy`` streams on the client port's HTTP/2
connections, so that Go programs written for upstream cluster-proxy (``konnectivity-client``'s
``CreateSingleUseGrpcTunnel`` + ``tunnel.DialContext``) work unchanged.

One gRPC stream carries packets (``konnectivity_pb2.Packet``, each a gRPC length-prefixed message):
the client's ``DIAL_REQ`` (an address and its own ``random`` id) becomes one :class:`KonnectivityDial`
on the shared dial-and-relay path; its answer is a ``DIAL_RSP`` with our connection id, or with the
same reason text a curl user reads; then ``DATA`` both ways and ``CLOSE_REQ``/``CLOSE_RSP``. Several
dials may share a stream (the multi-dial form); each has its own inbound queue. Flow control is the
HTTP/2 stream's: a slow reader slows its own stream (one dial, in the single-use form), never the
connection's other streams. The stream ends with ``grpc-status`` trailers.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import trio

from clusterproxy_protocol import IncomingRequest, TunnelStream
from clusterproxy_server.authz import ClientIdentity
from clusterproxy_server.frontends import konnectivity_pb2 as pb
from clusterproxy_server.frontends.connection import ClientConnection
from clusterproxy_server.frontends.konnectivity_wire import (
    GRPC_INVALID_ARGUMENT,
    GRPC_OK,
    GrpcError,
    MessageReader,
    frame,
    frame_data,
    parse,
    parse_data,
)

__all__ = ["CONTENT_TYPE", "PATH", "GrpcError", "MessageReader", "frame", "matches", "serve"]

PATH = "/ProxyService/Proxy"
CONTENT_TYPE = "application/grpc"
# Bytes of target data per DATA packet: what one relay read brings (relay.CHUNK), so a read is one
# packet, one copy and one send, however the client's window slices it into HTTP/2 frames.
DATA_CHUNK = 256 << 10
INBOUND_PACKETS = 16  # DATA packets queued per dial before the stream's reader waits


class Inbound:
    """A dial's DATA packets from the stream's reader to the dial's relay: a bounded queue that, unlike
    a memory channel, hands a packet over without a pass through the scheduler when there is room
    (the reader goes on with the next packet of the same read) and gives it to a waiting relay at once."""

    __slots__ = ("_closed", "_packets", "_readers", "_room")

    def __init__(self) -> None:
        self._packets: collections.deque[bytes] = collections.deque()
        self._closed = False
        self._readers = trio.lowlevel.ParkingLot()
        self._room = trio.lowlevel.ParkingLot()

    async def put(self, data: bytes) -> None:
        """Queue ``data``, waiting while the queue is full; dropped once the queue is closed (the dial
        ended, or its client closed it: nobody will read it)."""
        while len(self._packets) >= INBOUND_PACKETS and not self._closed:
            await self._room.park()
        if not self._closed:
            self._packets.append(data)
            self._readers.unpark()

    async def get(self) -> bytes:
        """The next packet, waiting for one; b"" once the queue is closed and empty."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._packets:
            if self._closed:
                return b""
            await self._readers.park()
        data = self._packets.popleft()
        self._room.unpark()
        return data

    def take_more(self, data: bytes, limit: int) -> bytes:
        """``data`` and the packets queued behind it, as one, while they fit in ``limit`` bytes: a
        relay that fell behind catches up in one send toward the target rather than one per packet."""
        packets = self._packets
        if not packets or len(data) + len(packets[0]) > limit:
            return data
        parts = [data]
        size = len(data)
        while packets and size + len(packets[0]) <= limit:
            size += len(packets[0])
            parts.append(packets.popleft())
        self._room.unpark_all()
        return b"".join(parts)

    def close(self) -> None:
        self._closed = True
        self._readers.unpark_all()
        self._room.unpark_all()


def matches(request: IncomingRequest) -> bool:
    return request.method == "POST" and request.path == PATH


async def serve(request: IncomingRequest, connection: ClientConnection) -> None:
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith(CONTENT_TYPE):
        await request.refuse(415, f"{PATH} takes content-type {CONTENT_TYPE}, not {content_type or 'none'}")
        return
    stream = await request.accept([("content-type", CONTENT_TYPE)])
    session = Session(stream, connection, dict(request.headers))
    await session.run()


@dataclass(eq=False)
class KonnectivityDial:
    """One ``DIAL_REQ`` as a :class:`~clusterproxy_server.relaying.ClientRequest`."""

    session: Session
    random: int
    authority: str
    client: ClientIdentity
    headers: Mapping[str, str]
    frontend: str = "konnectivity"
    early_data: bytes = b""
    connect_id: int = 0
    client_closed: bool = False  # CLOSE_REQ came: the client reads nothing more of this connection
    inbound: Inbound = field(default_factory=Inbound)

    async def accept(self) -> trio.abc.Stream:
        self.connect_id = self.session.register(self)
        await self.session.send(
            pb.Packet(
                type=pb.DIAL_RSP, dialResponse=pb.DialResponse(connectID=self.connect_id, random=self.random)
            )
        )
        return DialStream(self)

    def take_reserve(self) -> int:
        return 0  # one gRPC stream carries many dials: each pays for its own stream toward an agent

    async def refuse(self, status: int, reason: str) -> None:
        del status  # Go's konnectivity client shows the error text only
        await self.session.send(
            pb.Packet(type=pb.DIAL_RSP, dialResponse=pb.DialResponse(error=reason, random=self.random))
        )


class DialStream(trio.abc.Stream):
    """The client's side of one dial: ``DATA`` packets in and out; the end is ``CLOSE_RSP``."""

    def __init__(self, dial: KonnectivityDial) -> None:
        self._dial = dial
        self._pending = b""
        self._closed = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the dial is closed")
        if self._dial.client_closed:  # Go's client stops reading at CLOSE_REQ: more DATA would block it
            await trio.lowlevel.checkpoint()
            return
        view = memoryview(data)
        if not view:
            await trio.lowlevel.checkpoint()
        for start in range(0, len(view), DATA_CHUNK):
            await self._dial.session.send_framed(
                frame_data(self._dial.connect_id, view[start : start + DATA_CHUNK])
            )

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if not self._pending:
            self._pending = await self._dial.inbound.get()
            if not self._pending:
                return b""  # CLOSE_REQ: the client is done with this connection
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        size = len(self._pending) if max_bytes is None else max_bytes
        if len(self._pending) < size:
            self._pending = self._dial.inbound.take_more(self._pending, size)
        data, self._pending = self._pending[:size], self._pending[size:]
        return data

    async def aclose(self) -> None:
        self._end("")
        await trio.lowlevel.checkpoint()

    def abort(self) -> None:
        self._end("connection aborted by the proxy-server (the target or its tunnel failed)")

    def _end(self, error: str) -> None:
        if self._closed:
            return
        self._closed = True
        self._dial.session.finish(self._dial, error)


class Session:
    """One gRPC ``Proxy`` stream: reads packets, runs dials, writes packets in order."""

    def __init__(
        self, stream: TunnelStream, connection: ClientConnection, headers: Mapping[str, str]
    ) -> None:
        self.stream = stream
        self.connection = connection
        self.headers = {k: v for k, v in headers.items() if not k.startswith(":")}
        self._send_lock = trio.Lock()
        self._ids = itertools.count(1)
        self.dials: dict[int, KonnectivityDial] = {}  # by connect id, once answered
        self._pending: dict[int, trio.CancelScope] = {}  # by the client's random, until answered
        self._tasks: trio.Nursery | None = None
        self._client_done = False  # the client ended its side of the gRPC stream

    def register(self, dial: KonnectivityDial) -> int:
        self._pending.pop(dial.random, None)
        connect_id = next(self._ids)
        self.dials[connect_id] = dial
        if self._client_done:
            dial.inbound.close()
        return connect_id

    async def send(self, packet: pb.Packet) -> None:
        await self.send_framed(frame(packet))

    async def send_framed(self, message: bytes) -> None:
        """Send one whole gRPC message, after any other sender's (a message is never split by another).
        The stream's ``send_all`` is the checkpoint: the lock adds no pass through the scheduler of its
        own unless another sender holds it."""
        lock = self._send_lock
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            await self.stream.send_all(message)
        finally:
            lock.release()

    def finish(self, dial: KonnectivityDial, error: str) -> None:
        """The relay ended this dial: tell the client with ``CLOSE_RSP`` (sent in order, from a task)."""
        if self.dials.pop(dial.connect_id, None) is None:
            return
        dial.inbound.close()
        packet = pb.Packet(
            type=pb.CLOSE_RSP, closeResponse=pb.CloseResponse(connectID=dial.connect_id, error=error)
        )
        if self._tasks is not None:
            self._tasks.start_soon(self._send_quietly, packet)

    async def _send_quietly(self, packet: pb.Packet) -> None:
        try:
            await self.send(packet)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client is gone: nobody to tell

    async def run(self) -> None:
        status, message = GRPC_OK, ""
        async with trio.open_nursery() as tasks:
            self._tasks = tasks
            try:
                await self._read_packets(tasks)
            except GrpcError as exc:
                status, message = exc.status, str(exc)
                tasks.cancel_scope.cancel()  # a broken stream: its dials end with it
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                tasks.cancel_scope.cancel()  # the stream is gone: its dials with it
                return
            else:
                # The client ended its side (gRPC's half-close): it sends nothing more to any of its
                # connections, while dials still get their answers and targets their say.
                for dial in list(self.dials.values()):
                    dial.inbound.close()
                self._client_done = True
        trailers = [("grpc-status", str(status))]
        if message:
            trailers.append(("grpc-message", message))
        try:
            async with self._send_lock:
                await self.stream.send_eof(trailers)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _read_packets(self, tasks: trio.Nursery) -> None:
        reader = MessageReader()
        dials = self.dials
        while data := await self.stream.receive_some():
            reader.feed(data)
            while (message := reader.next_view()) is not None:
                fast = parse_data(message)  # DATA, the packet of every byte, without protobuf's objects
                if fast is None:
                    await self._handle(parse(message), tasks)
                    continue
                open_dial = dials.get(fast[0])
                if open_dial is not None and fast[1]:
                    await open_dial.inbound.put(fast[1])
        if reader.partial:
            raise GrpcError(GRPC_INVALID_ARGUMENT, "the stream ended inside a message")

    async def _handle(self, packet: pb.Packet, tasks: trio.Nursery) -> None:
        kind = packet.type
        if kind == pb.DIAL_REQ:
            request = packet.dialRequest
            if request.protocol != "tcp":
                reason = f"protocol {request.protocol!r} is not supported: tcp only"
                await self.send(
                    pb.Packet(
                        type=pb.DIAL_RSP, dialResponse=pb.DialResponse(error=reason, random=request.random)
                    )
                )
                return
            dial = KonnectivityDial(
                self, request.random, request.address, self.connection.client, self.headers
            )
            scope = trio.CancelScope()
            self._pending[request.random] = scope
            tasks.start_soon(self._dial, dial, scope)
        elif kind == pb.DATA:
            open_dial = self.dials.get(packet.data.connectID)
            if open_dial is not None and packet.data.data:
                await open_dial.inbound.put(packet.data.data)  # dropped if the dial ended meanwhile
        elif kind == pb.CLOSE_REQ:
            open_dial = self.dials.get(packet.closeRequest.connectID)
            if open_dial is not None:
                open_dial.client_closed = True
                open_dial.inbound.close()
        elif kind == pb.DIAL_CLS:
            pending = self._pending.pop(packet.closeDial.random, None)
            if pending is not None:
                pending.cancel()

    async def _dial(self, dial: KonnectivityDial, scope: trio.CancelScope) -> None:
        with scope:
            try:
                await self.connection.proxy(dial)
            finally:
                self._pending.pop(dial.random, None)
