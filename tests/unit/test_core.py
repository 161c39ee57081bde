"""The sans-IO tunnel core on its own: two cores wired back to back, no sockets, no trio."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings, strategies as st

from clusterproxy_protocol import events as ev
from clusterproxy_protocol.core import Role, TunnelCore
from clusterproxy_protocol.settings import TunnelSettings
from tests.support.cores import connected, pump

SMALL = TunnelSettings(stream_window=65535, connection_window=1 << 20, max_frame_size=16384)


def open_stream(opener: TunnelCore, acceptor: TunnelCore) -> int:
    sid = opener.open_connect("target:443", [("cluster-proxy-cluster", "c1")])
    _, seen = pump(opener, acceptor)
    request = next(e for e in seen if isinstance(e, ev.RequestReceived))
    assert (request.method, request.authority, request.headers) == (
        "CONNECT",
        "target:443",
        {"cluster-proxy-cluster": "c1"},
    )
    acceptor.respond(sid, 200)
    seen, _ = pump(opener, acceptor)
    assert any(isinstance(e, ev.ResponseReceived) and e.status == 200 for e in seen)
    return sid


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.binary(min_size=1, max_size=40_000), min_size=1, max_size=12),
    read_sizes=st.lists(st.integers(min_value=1, max_value=70_000), min_size=1, max_size=20),
)
def test_bytes_arrive_intact_and_buffers_never_exceed_the_stream_window(
    chunks: list[bytes], read_sizes: list[int]
) -> None:
    opener, acceptor = connected(SMALL)
    sid = open_stream(opener, acceptor)
    sent = b"".join(chunks)
    pending = memoryview(sent)
    received = bytearray()
    reads = iter(read_sizes * 200)
    while pending or acceptor.stream(sid).buffered:
        if pending:
            taken = opener.send_data(sid, pending)
            pending = pending[taken:]
        pump(opener, acceptor)
        state = acceptor.stream(sid)
        assert state.buffered <= SMALL.stream_window  # flow control bounds the receiver's memory
        received += acceptor.read(sid, next(reads))
        pump(opener, acceptor)
    assert hashlib.sha256(received).digest() == hashlib.sha256(sent).digest()


def test_a_stalled_stream_does_not_hold_the_connection_window() -> None:
    opener, acceptor = connected(SMALL)
    stalled = open_stream(opener, acceptor)
    other = open_stream(opener, acceptor)
    # Fill the stalled stream's window and never read it.
    assert opener.send_data(stalled, b"s" * 100_000) == SMALL.stream_window
    pump(opener, acceptor)
    assert opener.send_window(stalled) == 0
    # The other stream can still move far more than one connection window's worth.
    moved = 0
    while moved < 3 * SMALL.connection_window:
        moved += opener.send_data(other, b"o" * 60_000)
        pump(opener, acceptor)
        while acceptor.read(other, 1 << 20):
            pass
        pump(opener, acceptor)
    assert acceptor.stream(stalled).buffered == SMALL.stream_window


def test_end_stream_is_a_half_close() -> None:
    opener, acceptor = connected(SMALL)
    sid = open_stream(opener, acceptor)
    opener.send_data(sid, b"request")
    opener.end_stream(sid)
    _, seen = pump(opener, acceptor)
    assert any(isinstance(e, ev.RemoteEnded) for e in seen)
    assert acceptor.read(sid, 100) == b"request"
    acceptor.send_data(sid, b"reply after EOF")
    acceptor.end_stream(sid)
    seen, _ = pump(opener, acceptor)
    assert opener.read(sid, 100) == b"reply after EOF"
    assert any(isinstance(e, ev.RemoteEnded) for e in seen)


def test_closing_with_unread_data_resets_like_tcp() -> None:
    opener, acceptor = connected(SMALL)
    sid = open_stream(opener, acceptor)
    opener.send_data(sid, b"unread")
    pump(opener, acceptor)
    acceptor.close_stream(sid)
    seen, _ = pump(opener, acceptor)
    assert [e for e in seen if isinstance(e, ev.StreamReset)] == [ev.StreamReset(sid, 8)]  # CANCEL


def test_refusal_carries_status_and_reason() -> None:
    opener, acceptor = connected(SMALL)
    sid = opener.open_connect("10.0.0.1:22")
    pump(opener, acceptor)
    acceptor.refuse(sid, 403, "target 10.0.0.1:22 denied by rule\nwith a newline")
    seen, _ = pump(opener, acceptor)
    response = next(e for e in seen if isinstance(e, ev.ResponseReceived))
    assert response.status == 403
    assert response.headers["cluster-proxy-reason"] == "target 10.0.0.1:22 denied by rule with a newline"


def test_drain_is_announced_with_max_concurrent_streams_zero() -> None:
    opener, acceptor = connected(SMALL)
    assert opener.can_open_stream()
    acceptor.drain()
    seen, _ = pump(opener, acceptor)
    assert ev.PeerSettingsChanged(0) in seen
    assert not opener.can_open_stream()


def test_garbage_ends_the_connection_with_a_reason() -> None:
    acceptor = TunnelCore(Role.ACCEPTOR, SMALL)
    acceptor.initiate()
    events = acceptor.receive_bytes(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert len(events) == 1 and isinstance(events[0], ev.ConnectionEnded)
    assert "protocol error" in events[0].reason
    assert acceptor.closed
    assert acceptor.data_to_send()  # a GOAWAY goes out


def test_stream_limit_still_holds_with_the_cheap_open_stream_count() -> None:
    limited = TunnelSettings(stream_window=65535, connection_window=1 << 20, max_concurrent_streams=10)
    opener, acceptor = TunnelCore(Role.OPENER, SMALL), TunnelCore(Role.ACCEPTOR, limited)
    opener.initiate()
    acceptor.initiate()
    pump(opener, acceptor)
    sids = [opener.open_connect(f"t:{i + 1}") for i in range(10)]
    assert not opener.can_open_stream()
    # Finish them all; the closed streams are swept and new ones may open again, many times over.
    for sid in sids:
        opener.reset(sid)
        opener.close_stream(sid)
    pump(opener, acceptor)
    assert opener.can_open_stream()
    for round_ in range(300):
        sid = opener.open_connect(f"t:{round_ + 100}")
        opener.reset(sid)
        opener.close_stream(sid)
        pump(opener, acceptor)
    assert len(opener._conn.streams) < 200  # swept, not accumulated


def test_data_then_goaway_in_one_read_does_not_break_the_receiver() -> None:
    """A DATA frame for a stream we closed, followed by GOAWAY in the same bytes: no h2 error."""
    opener, acceptor = connected(SMALL)
    sid = open_stream(opener, acceptor)
    acceptor.close_stream(sid)  # our side is done: late data would be answered with RST_STREAM
    pump(opener, acceptor)
    opener.send_data(sid, b"late")
    opener.close(reason="bye")
    events = acceptor.receive_bytes(opener.data_to_send())
    assert any(isinstance(e, ev.ConnectionEnded) and "bye" in e.reason for e in events)
