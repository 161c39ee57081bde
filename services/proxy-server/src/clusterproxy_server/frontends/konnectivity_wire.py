"""Konnectivity's packets on the wire, sans-IO: gRPC's length-prefixed messages out of a byte stream
(:class:`MessageReader`), and the ``DATA`` packet, the one every byte of a dial travels in, encoded
and decoded by hand.

Why by hand: a ``DATA`` packet through protobuf's library is a ``Packet`` and a ``Data`` object built,
serialized into a new buffer, then copied again behind gRPC's 5-byte prefix (sending); or parsed into
objects whose payload is copied out once more (receiving). Its layout is fixed and short (the type,
then the payload with a connection id and the bytes), so the prefix and the few bytes of protobuf
before the payload are written directly and the payload copied once, and a received ``DATA`` packet
in the layout every protobuf encoder writes is read the same way. Anything else (the rare control
packets, a ``DATA`` packet laid out otherwise, bytes that are no packet) goes through the library,
which has the last word on what a packet is.
"""

from __future__ import annotations

import struct

from clusterproxy_server.frontends import konnectivity_pb2 as pb

MAX_MESSAGE = 4 << 20  # gRPC's default receive limit
GRPC_OK, GRPC_INVALID_ARGUMENT, GRPC_UNIMPLEMENTED, GRPC_RESOURCE_EXHAUSTED = 0, 3, 12, 8
PREFIX = struct.Struct(">BI")  # compressed flag, message length

# Protobuf tags (field number << 3 | wire type) of the fields a DATA packet is written with.
_TYPE_DATA = bytes([1 << 3 | 0, pb.DATA])  # Packet.type = DATA
_PAYLOAD_DATA = 4 << 3 | 2  # Packet.data, length-delimited
_DATA_CONNECT_ID = 1 << 3 | 0  # Data.connectID, varint
_DATA_ERROR = 2 << 3 | 2  # Data.error, length-delimited
_DATA_BYTES = 3 << 3 | 2  # Data.data, length-delimited


class GrpcError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buffer: memoryview, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it); raises ValueError when it runs past ``end`` or over 64 bits."""
    value = shift = 0
    while pos < end and shift < 64:
        byte = buffer[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ValueError("bad varint")


def frame(packet: pb.Packet) -> bytes:
    """One packet as a gRPC message (through protobuf's library: the control packets)."""
    body = packet.SerializeToString()
    return PREFIX.pack(0, len(body)) + body


def frame_data(connect_id: int, data: bytes | bytearray | memoryview) -> bytes:
    """``Packet{type: DATA, data: Data{connectID, data}}`` as a gRPC message, as protobuf writes it
    (fields in number order, zero values left out), with ``data`` copied once."""
    size = len(data)
    inner = b""
    if connect_id:
        inner = bytes((_DATA_CONNECT_ID,)) + _varint(connect_id)
    if size:
        inner += bytes((_DATA_BYTES,)) + _varint(size)
    payload = len(inner) + size
    head = _TYPE_DATA + bytes((_PAYLOAD_DATA,)) + _varint(payload) + inner
    return b"".join((PREFIX.pack(0, len(head) + size), head, data))


def parse_data(message: memoryview) -> tuple[int, bytes] | None:
    """``(connectID, data)`` of a DATA packet in protobuf's own layout (the type, then the payload, and
    nothing else), else None: the caller hands the message to the library."""
    end = len(message)
    if end < 3 or message[0] != _TYPE_DATA[0] or message[1] != _TYPE_DATA[1] or message[2] != _PAYLOAD_DATA:
        return None
    try:
        length, pos = _read_varint(message, 3, end)
        if pos + length != end:
            return None
        connect_id, data = 0, b""
        while pos < end:
            tag = message[pos]
            pos += 1
            if tag == _DATA_CONNECT_ID:
                connect_id, pos = _read_varint(message, pos, end)
            elif tag in (_DATA_BYTES, _DATA_ERROR):
                size, pos = _read_varint(message, pos, end)
                if pos + size > end:
                    return None
                if tag == _DATA_BYTES:
                    data = bytes(message[pos : pos + size])
                pos += size
            else:
                return None
    except ValueError:
        return None
    if connect_id >= 1 << 63:
        return None  # a negative int64: the library's to read
    return connect_id, data


def parse(message: memoryview) -> pb.Packet:
    """Any packet, through protobuf's library; GrpcError when the bytes are none."""
    packet = pb.Packet()
    try:
        packet.ParseFromString(bytes(message))
    except Exception as exc:  # protobuf's DecodeError, or worse: either way not a packet
        raise GrpcError(GRPC_INVALID_ARGUMENT, f"not a konnectivity packet: {exc}") from None
    return packet


class MessageReader:
    """gRPC's length-prefixed messages out of a byte stream (sans-IO: :meth:`feed`, then :meth:`next`).

    The bytes fed are kept as they came, not appended to one buffer: a message inside one read is a
    view of it, and only a message that spans reads is joined (once, when it is complete)."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._offset = 0  # bytes of the first chunk already taken
        self._size = 0  # bytes fed and not taken yet

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if data:
            self._chunks.append(data if isinstance(data, bytes) else bytes(data))
            self._size += len(data)

    def next_view(self) -> memoryview | None:
        """The next whole message (a view: its bytes never change), or None until more is fed."""
        if self._size < PREFIX.size:
            return None
        first = self._chunks[0]
        if len(first) - self._offset < PREFIX.size:
            self._join()
            first = self._chunks[0]
        compressed, length = PREFIX.unpack_from(first, self._offset)
        if compressed:
            raise GrpcError(GRPC_UNIMPLEMENTED, "compressed messages are not supported")
        if length > MAX_MESSAGE:
            raise GrpcError(GRPC_RESOURCE_EXHAUSTED, f"message of {length} bytes exceeds {MAX_MESSAGE}")
        end = PREFIX.size + length
        if self._size < end:
            return None
        if len(first) - self._offset < end:
            self._join()
            first = self._chunks[0]
        start = self._offset + PREFIX.size
        message = memoryview(first)[start : start + length]
        self._size -= end
        self._offset += end
        if self._offset == len(first):
            self._chunks.pop(0)
            self._offset = 0
        return message

    def next(self) -> bytes | None:
        message = self.next_view()
        return None if message is None else bytes(message)

    def _join(self) -> None:
        self._chunks = [b"".join([memoryview(self._chunks[0])[self._offset :], *self._chunks[1:]])]
        self._offset = 0

    @property
    def partial(self) -> bool:
        return self._size > 0
