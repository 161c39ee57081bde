"""The konnectivity gRPC frontend against peers that are not well-behaved Go clients: raw HTTP/2 frames
(tests/support/h2_attacker.py) to a real in-process proxy-server's client port. Each bad input gets its
gRPC status in the trailers, and nothing else on the connection is disturbed. The well-behaved client
is the real Go one: tests/e2e/test_konnectivity_grpc.py."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator, Callable

import hpack
import pytest
import trio
from hyperframe.frame import DataFrame, HeadersFrame

from clusterproxy_agent.app import Service
from clusterproxy_agent.config import AgentSettings
from clusterproxy_agent.egress import parse_rule
from clusterproxy_server.frontends import konnectivity_pb2 as pb
from clusterproxy_server.frontends.konnectivity import MessageReader, frame
from tests.support.h2_attacker import Attacker
from tests.support.inprocess import start_server
from tests.support.pki import PkiFiles
from tests.support.targets import serve_echo
from tests.support.waiting import wait_until


def grpc_headers(
    attacker: Attacker,
    stream_id: int,
    content_type: str = "application/grpc",
    metadata: list[tuple[str, str]] = (),  # type: ignore[assignment]
) -> bytes:
    headers = [
        (":method", "POST"),
        (":scheme", "https"),
        (":authority", "hub"),
        (":path", "/ProxyService/Proxy"),
        ("content-type", content_type),
        ("te", "trailers"),
        *metadata,
    ]
    headers_frame = HeadersFrame(stream_id, data=attacker.encoder.encode(headers))
    headers_frame.flags.add("END_HEADERS")
    return headers_frame.serialize()


def data(stream_id: int, payload: bytes, *, end: bool = False) -> bytes:
    data_frame = DataFrame(stream_id, data=payload)
    if end:
        data_frame.flags.add("END_STREAM")
    return data_frame.serialize()


async def answer(
    attacker: Attacker, stream_id: int
) -> tuple[dict[str, str], list[pb.Packet], dict[str, str]]:
    """The response headers, the packets, and the trailers of ``stream_id``."""
    decoder = vars(attacker).setdefault("decoder", hpack.Decoder())  # one per connection, as HPACK's table
    head: dict[str, str] = {}
    trailers: dict[str, str] = {}
    reader = MessageReader()
    packets: list[pb.Packet] = []
    with trio.fail_after(10):
        while (received := await attacker.next_frame()) is not None:
            if received.stream_id != stream_id:
                continue
            if isinstance(received, HeadersFrame):
                fields = {
                    k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
                    for k, v in decoder.decode(received.data)
                }
                if head:
                    trailers = fields
                else:
                    head = fields
            elif isinstance(received, DataFrame) and head.get("content-type") == "application/grpc":
                reader.feed(received.data)
                while (message := reader.next()) is not None:
                    packet = pb.Packet()
                    packet.ParseFromString(message)
                    packets.append(packet)
            if "END_STREAM" in received.flags:
                return head, packets, trailers
    raise AssertionError("the connection ended before the stream did")


async def read_packets(
    attacker: Attacker, stream_id: int, enough: Callable[[list[pb.Packet]], bool]
) -> list[pb.Packet]:
    """Packets of ``stream_id`` (an open stream: its response headers skipped) until ``enough``."""
    decoder = vars(attacker).setdefault("decoder", hpack.Decoder())
    reader = vars(attacker).setdefault("reader", MessageReader())
    got: list[pb.Packet] = []
    with trio.fail_after(10):
        while not enough(got):
            received = await attacker.next_frame()
            assert received is not None, "the connection ended"
            if isinstance(received, HeadersFrame):
                decoder.decode(received.data)
            elif isinstance(received, DataFrame) and received.stream_id == stream_id:
                reader.feed(received.data)
                while (message := reader.next()) is not None:
                    packet = pb.Packet()
                    packet.ParseFromString(message)
                    got.append(packet)
    return got


@pytest.fixture
async def client_port(pki: PkiFiles, nursery: trio.Nursery) -> AsyncIterator[int]:
    _server, bound = await start_server(nursery, pki)
    yield bound.client[1]
    for attacker in _attackers:  # closed by us, not left to the server's close grace at teardown
        await attacker.aclose()
    _attackers.clear()


_attackers: list[Attacker] = []


async def connect(port: int, pki: PkiFiles) -> Attacker:
    attacker = await Attacker.connect(port, pki)
    _attackers.append(attacker)
    return attacker


async def test_a_dial_to_an_unknown_cluster_is_answered_with_the_reason(
    client_port: int, pki: PkiFiles
) -> None:
    attacker = await connect(client_port, pki)
    dial = pb.Packet(
        type=pb.DIAL_REQ, dialRequest=pb.DialRequest(protocol="tcp", address="nowhere:443", random=42)
    )
    await attacker.send(grpc_headers(attacker, 1) + data(1, frame(dial)))
    udp = pb.Packet(type=pb.DIAL_REQ, dialRequest=pb.DialRequest(protocol="udp", address="x:53", random=43))
    await attacker.send(data(1, frame(udp), end=True))
    head, packets, trailers = await answer(attacker, 1)
    assert head[":status"] == "200" and head["content-type"] == "application/grpc"
    answers = {p.dialResponse.random: p.dialResponse.error for p in packets if p.type == pb.DIAL_RSP}
    assert "nowhere" in answers[42] and answers[42] == answers[42].strip()
    assert answers[43] == "protocol 'udp' is not supported: tcp only"
    assert trailers["grpc-status"] == "0"


@pytest.mark.parametrize(
    ("payload", "status", "message"),
    [
        (struct.pack(">BI", 1, 3) + b"abc", "12", "compressed messages are not supported"),
        (struct.pack(">BI", 0, 5 << 20), "8", "exceeds"),
        (struct.pack(">BI", 0, 3) + b"\xff\xff\xff", "3", "not a konnectivity packet"),
        (struct.pack(">BI", 0, 10) + b"abc", "3", "the stream ended inside a message"),
    ],
)
async def test_bad_grpc_input_ends_the_stream_with_its_status(
    client_port: int, pki: PkiFiles, payload: bytes, status: str, message: str
) -> None:
    attacker = await connect(client_port, pki)
    await attacker.send(grpc_headers(attacker, 1) + data(1, payload, end=True))
    _head, _packets, trailers = await answer(attacker, 1)
    assert trailers["grpc-status"] == status and message in trailers["grpc-message"], trailers
    # the connection is still fine: another stream on it is answered
    await attacker.send(grpc_headers(attacker, 3) + data(3, b"", end=True))
    _head, _packets, trailers = await answer(attacker, 3)
    assert trailers["grpc-status"] == "0"


async def test_another_content_type_is_refused(client_port: int, pki: PkiFiles) -> None:
    attacker = await connect(client_port, pki)
    await attacker.send(grpc_headers(attacker, 1, "application/json") + data(1, b"{}", end=True))
    head, _packets, _trailers = await answer(attacker, 1)
    assert head[":status"] == "415"


def test_messages_split_across_reads_are_reassembled() -> None:
    packets = [
        pb.Packet(type=pb.DATA, data=pb.Data(connectID=i, data=bytes([i]) * i * 1000)) for i in range(1, 5)
    ]
    wire = b"".join(frame(p) for p in packets)
    reader = MessageReader()
    out = []
    for i in range(0, len(wire), 777):
        reader.feed(wire[i : i + 777])
        while (message := reader.next()) is not None:
            packet = pb.Packet()
            packet.ParseFromString(message)
            out.append(packet)
    assert out == packets and not reader.partial


async def test_several_dials_on_one_stream_each_carry_their_own_bytes(
    pki: PkiFiles, nursery: trio.Nursery
) -> None:
    """The multi-dial form (CreateGrpcTunnel-style clients): two connections on one gRPC stream, each
    echoing its own bytes, each ended by its CLOSE_REQ with a CLOSE_RSP."""
    server, bound = await start_server(nursery, pki)
    echo = await serve_echo(nursery)
    pair = pki.agent("cluster1", "agent-a")
    agent = Service(
        AgentSettings(
            server=("127.0.0.1", bound.agent[1]),
            server_name="localhost",
            cluster="cluster1",
            agent_id="agent-a",
            ca=pki.ca,
            cert=pair.cert,
            key=pair.key,
            admin_listen=("127.0.0.1", 0),
            allow=[parse_rule("127.0.0.0/8")],
        )
    )
    await nursery.start(agent.run)
    await wait_until(lambda: server.registry.find("cluster1", "agent-a"), what="the agent registered")
    attacker = await connect(bound.client[1], pki)
    head = grpc_headers(attacker, 1, metadata=[("cluster-proxy-cluster", "cluster1")])
    dials = b"".join(
        frame(
            pb.Packet(
                type=pb.DIAL_REQ, dialRequest=pb.DialRequest(protocol="tcp", address=echo.address, random=r)
            )
        )
        for r in (7, 8)
    )
    await attacker.send(head + data(1, dials))
    packets = await read_packets(attacker, 1, lambda got: sum(p.type == pb.DIAL_RSP for p in got) == 2)
    ids = {p.dialResponse.random: p.dialResponse.connectID for p in packets if p.type == pb.DIAL_RSP}
    assert set(ids) == {7, 8} and ids[7] != ids[8] and all(p.dialResponse.error == "" for p in packets)

    payloads = {ids[7]: b"first connection " * 50, ids[8]: b"second, another one " * 50}
    await attacker.send(
        data(
            1,
            b"".join(
                frame(pb.Packet(type=pb.DATA, data=pb.Data(connectID=c, data=d))) for c, d in payloads.items()
            ),
        )
    )
    echoed: dict[int, bytes] = {c: b"" for c in payloads}

    def all_echoed(got: list[pb.Packet]) -> bool:
        for p in got:
            if p.type == pb.DATA:
                echoed[p.data.connectID] += p.data.data
        got.clear()
        return all(echoed[c] == payloads[c] for c in payloads)

    await read_packets(attacker, 1, all_echoed)
    closes = b"".join(
        frame(pb.Packet(type=pb.CLOSE_REQ, closeRequest=pb.CloseRequest(connectID=c))) for c in payloads
    )
    await attacker.send(data(1, closes))
    closed = await read_packets(attacker, 1, lambda got: sum(p.type == pb.CLOSE_RSP for p in got) == 2)
    assert {p.closeResponse.connectID for p in closed if p.type == pb.CLOSE_RSP} == set(payloads)
