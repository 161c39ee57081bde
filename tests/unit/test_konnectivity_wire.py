"""The konnectivity frontend's hand-written DATA packets against protobuf's library: the same bytes out,
the same packet read back, and everything that is not a plain DATA packet left to the library."""

from __future__ import annotations

import pytest

from clusterproxy_server.frontends import konnectivity_pb2 as pb
from clusterproxy_server.frontends.konnectivity_wire import (
    GrpcError,
    MessageReader,
    frame,
    frame_data,
    parse,
    parse_data,
)


@pytest.mark.parametrize("connect_id", [0, 1, 127, 128, 300, 2**31, 2**62])
@pytest.mark.parametrize("size", [0, 1, 127, 128, 70_000])
def test_a_data_packet_is_written_as_protobuf_writes_it(connect_id: int, size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    library = frame(pb.Packet(type=pb.DATA, data=pb.Data(connectID=connect_id, data=data)))
    assert frame_data(connect_id, memoryview(data)) == library
    assert parse_data(memoryview(library)[5:]) == (connect_id, data)


def test_a_data_packet_with_an_error_text_is_read_by_hand() -> None:
    body = pb.Packet(type=pb.DATA, data=pb.Data(connectID=7, error="x", data=b"abc")).SerializeToString()
    assert parse_data(memoryview(body)) == (7, b"abc")


@pytest.mark.parametrize(
    "packet",
    [
        pb.Packet(type=pb.DIAL_REQ, dialRequest=pb.DialRequest(protocol="tcp", address="a:1", random=5)),
        pb.Packet(type=pb.CLOSE_REQ, closeRequest=pb.CloseRequest(connectID=3)),
        pb.Packet(type=pb.DATA, data=pb.Data(connectID=-1, data=b"x")),  # a negative int64
        pb.Packet(type=pb.DATA),  # no payload at all
    ],
)
def test_other_packets_are_left_to_the_library(packet: pb.Packet) -> None:
    body = memoryview(packet.SerializeToString())
    assert parse_data(body) is None
    assert parse(body) == packet


def test_a_data_packet_laid_out_otherwise_is_left_to_the_library() -> None:
    # Two payloads (protobuf merges them) and a field after the payload: not the canonical layout.
    first = pb.Packet(type=pb.DATA, data=pb.Data(connectID=1, data=b"a")).SerializeToString()
    merged = first + pb.Packet(data=pb.Data(data=b"b")).SerializeToString()
    assert parse_data(memoryview(merged)) is None
    assert parse(memoryview(merged)).data.data == b"b"
    truncated = memoryview(first[:-1])
    assert parse_data(truncated) is None
    with pytest.raises(GrpcError):
        parse(memoryview(b"\xff\xff\xff"))


def test_messages_come_out_whole_however_the_bytes_are_cut() -> None:
    messages = [frame_data(i, bytes([i]) * (i * 3000)) for i in range(1, 6)]
    wire = b"".join(messages)
    for step in (1, 4, 5, 777, 4096, len(wire)):
        reader = MessageReader()
        out = []
        for i in range(0, len(wire), step):
            reader.feed(wire[i : i + step])
            while (message := reader.next_view()) is not None:
                out.append(parse_data(message))
        assert out == [(i, bytes([i]) * (i * 3000)) for i in range(1, 6)] and not reader.partial
