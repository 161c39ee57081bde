"""The core's own DATA path: plain DATA frames on open streams go into the stream buffers past h2,
piece by piece as they arrive; every other frame, and every DATA frame h2 must judge, goes through
h2. The wire comes from a plain h2 peer (or is built by hand for what h2 would never send), cut at
random places, and the bytes each stream delivers are compared by sha256."""

from __future__ import annotations

import hashlib

import h2.config
import h2.connection
import h2.errors
import hyperframe.frame
from hypothesis import given, settings, strategies as st

from clusterproxy_protocol import events as ev
from clusterproxy_protocol.core import Role, TunnelCore
from clusterproxy_protocol.settings import TunnelSettings

SMALL = TunnelSettings(stream_window=65535, connection_window=1 << 20, max_frame_size=16384)
CONNECT = [(":method", "CONNECT"), (":authority", "target:443")]


def peer_and_core() -> tuple[h2.connection.H2Connection, TunnelCore]:
    """An h2 client and an acceptor core that have exchanged SETTINGS."""
    peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    peer.initiate_connection()
    core = TunnelCore(Role.ACCEPTOR, SMALL)
    core.initiate()
    core.receive_bytes(peer.data_to_send())
    peer.receive_data(core.data_to_send())
    return peer, core


def frame(frame_type: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([frame_type, flags]) + stream_id.to_bytes(4, "big") + payload
    )


def feed(core: TunnelCore, wire: bytes, cuts: list[int]) -> list[ev.Event]:
    events: list[ev.Event] = []
    start = 0
    for cut in [*sorted({c % (len(wire) + 1) for c in cuts}), len(wire)]:
        if cut > start:
            events += core.receive_bytes(wire[start:cut])
            start = cut
    return events


@settings(max_examples=80, deadline=None)
@given(
    payloads=st.lists(st.binary(min_size=0, max_size=20_000), min_size=1, max_size=8),
    padded=st.lists(st.booleans(), min_size=8, max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=30),
)
def test_streams_get_their_bytes_whatever_the_cuts_padding_and_endings(
    payloads: list[bytes], padded: list[bool], cuts: list[int]
) -> None:
    peer, core = peer_and_core()
    sent: dict[int, bytes] = {}
    for index, payload in enumerate(payloads):  # streams opened and fed in turn, some padded, some ended
        stream_id = 1 + 2 * index
        peer.send_headers(stream_id, CONNECT)
        for offset in range(0, len(payload), 8000):
            peer.send_data(
                stream_id, payload[offset : offset + 8000], pad_length=7 if padded[index] else None
            )
        if index % 2:
            peer.end_stream(stream_id)
        sent[stream_id] = payload
    events = feed(core, peer.data_to_send(), cuts)
    assert not [e for e in events if isinstance(e, ev.ConnectionEnded)]
    opened = [e.stream_id for e in events if isinstance(e, ev.RequestReceived)]
    assert opened == sorted(sent)
    for stream_id, payload in sent.items():
        received = core.read(stream_id, 1 << 20)
        assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()
        assert core.stream(stream_id).remote_ended is bool((stream_id // 2) % 2)


def test_a_frame_is_delivered_as_its_pieces_arrive() -> None:
    peer, core = peer_and_core()
    peer.send_headers(1, CONNECT)
    core.receive_bytes(peer.data_to_send())
    payload = bytes(range(256)) * 64  # one 16 KiB frame
    peer.send_data(1, payload)
    wire = peer.data_to_send()
    first = core.receive_bytes(wire[:5000])
    assert first == [ev.DataArrived(1)] and core.stream(1).buffered == 5000 - 9
    core.receive_bytes(wire[5000:])
    assert core.read(1, 1 << 20) == payload
    assert core.partial_frame_since is None


def test_a_trickled_frame_is_kept_in_a_few_pieces_not_one_object_per_byte() -> None:
    peer, core = peer_and_core()
    peer.send_headers(1, CONNECT)
    core.receive_bytes(peer.data_to_send())
    payload = bytes(range(256)) * 64
    peer.send_data(1, payload)
    for byte in peer.data_to_send():
        core.receive_bytes(bytes([byte]))
    assert len(core.stream(1).chunks) == 1 and core.read(1, 1 << 20) == payload


def test_data_beyond_the_stream_window_ends_the_connection_with_flow_control_error() -> None:
    peer, core = peer_and_core()
    peer.send_headers(1, CONNECT)
    core.receive_bytes(peer.data_to_send())
    wire = b"".join(frame(0x0, 0, 1, bytes(16384)) for _ in range(4)) + frame(0x0, 0, 1, bytes(10))  # 65,546
    events = core.receive_bytes(wire)
    assert [type(e) for e in events][-1] is ev.ConnectionEnded
    goaway = [f for f in frames_of(core.data_to_send()) if isinstance(f, hyperframe.frame.GoAwayFrame)]
    assert goaway and goaway[0].error_code == h2.errors.ErrorCodes.FLOW_CONTROL_ERROR


def test_data_inside_a_header_block_is_a_protocol_error() -> None:
    peer, core = peer_and_core()
    peer.send_headers(1, CONNECT)
    core.receive_bytes(peer.data_to_send())
    headers_without_end = frame(0x1, 0, 3, b"")  # HEADERS, no END_HEADERS: CONTINUATION must follow
    events = core.receive_bytes(headers_without_end + frame(0x0, 0, 1, b"sneaked in"))
    ended = [e for e in events if isinstance(e, ev.ConnectionEnded)]
    assert ended and ended[0].error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR
    assert core.stream(1) is None or core.stream(1).buffered == 0


def test_data_on_a_stream_never_opened_is_a_protocol_error() -> None:
    _, core = peer_and_core()
    events = core.receive_bytes(frame(0x0, 0, 5, b"no such stream"))
    ended = [e for e in events if isinstance(e, ev.ConnectionEnded)]
    assert ended and ended[0].error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR


def test_a_stream_reset_in_the_middle_of_its_frame_drops_the_rest_and_keeps_the_window() -> None:
    peer, core = peer_and_core()
    peer.send_headers(1, CONNECT)
    peer.send_headers(3, CONNECT)
    core.receive_bytes(peer.data_to_send())
    wire = frame(0x0, 0, 3, bytes(16384)) + frame(0x0, 0, 1, b"after")
    core.receive_bytes(wire[:5000])
    core.reset(3)  # the application gives up on stream 3 while its frame is arriving
    events = core.receive_bytes(wire[5000:])
    assert not [e for e in events if isinstance(e, ev.ConnectionEnded)]
    assert core.read(1, 100) == b"after"
    assert (core.stream(3).buffered, core.stream(3).bytes_in) == (
        0,
        5000 - 9,
    )  # nothing taken after the reset
    # Every byte the peer sent is either still in h2's window or counted for our next WINDOW_UPDATE.
    assert core._conn.inbound_flow_control_window + core._conn_unacked == SMALL.connection_window


def frames_of(wire: bytes) -> list[hyperframe.frame.Frame]:
    found = []
    while wire:
        head, length = hyperframe.frame.Frame.parse_frame_header(memoryview(wire[:9]))
        head.parse_body(memoryview(wire[9 : 9 + length]))
        found.append(head)
        wire = wire[9 + length :]
    return found
