"""The core's abuse limits against a raw attacker: frames built with hyperframe and hpack, so the
attacker can break every rule an h2 client would keep (issue 10, findings 2, 3, 5, 6 and h2spec 5.1.2
and 6.9.2)."""

from __future__ import annotations

import hpack
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from clusterproxy_protocol import events as ev
from clusterproxy_protocol.core import ENHANCE_YOUR_CALM, FRAME_SIZE_ERROR, REFUSED_STREAM, Role, TunnelCore
from clusterproxy_protocol.framing import PREFACE
from clusterproxy_protocol.settings import TunnelSettings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Attacker:
    """A client that writes raw frames (and reads the server's answers as frames)."""

    def __init__(self) -> None:
        self.encoder = hpack.Encoder()

    def preface(self, **settings: int) -> bytes:
        return PREFACE + SettingsFrame(0, settings={int(k[1:]): v for k, v in settings.items()}).serialize()

    def connect(self, stream_id: int, *, end_stream: bool = False) -> bytes:
        frame = HeadersFrame(stream_id)
        frame.data = self.encoder.encode([(":method", "CONNECT"), (":authority", "target:443")])
        frame.flags.add("END_HEADERS")
        if end_stream:
            frame.flags.add("END_STREAM")
        return frame.serialize()

    @staticmethod
    def reset(stream_id: int, code: int = 8) -> bytes:
        return RstStreamFrame(stream_id, error_code=code).serialize()


def frames(data: bytes) -> list[Frame]:
    out = []
    while data:
        frame, length = Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9 : 9 + length]))
        out.append(frame)
        data = data[9 + length :]
    return out


def server(settings: TunnelSettings, clock: Clock | None = None) -> TunnelCore:
    core = TunnelCore(Role.ACCEPTOR, settings, clock=clock or Clock())
    core.initiate()
    core.data_to_send()
    return core


def test_streams_beyond_the_advertised_limit_are_refused_and_the_connection_lives() -> None:
    core = TunnelCore(Role.ACCEPTOR, TunnelSettings(max_concurrent_streams=10))
    core.initiate()
    advertised = next(f for f in frames(core.data_to_send()) if isinstance(f, SettingsFrame))
    assert advertised.settings[SettingsFrame.MAX_CONCURRENT_STREAMS] == 10
    attacker = Attacker()
    # INITIAL_WINDOW_SIZE 0 (SETTINGS id 4): nothing the server answers can end a stream (h2spec 5.1.2)
    core.receive_bytes(attacker.preface(_4=0))
    events = core.receive_bytes(b"".join(attacker.connect(2 * i + 1, end_stream=True) for i in range(12)))
    accepted = [e.stream_id for e in events if isinstance(e, ev.RequestReceived)]
    refused = [e.stream_id for e in events if isinstance(e, ev.LimitExceeded)]
    assert accepted == [2 * i + 1 for i in range(10)]
    assert refused == [21, 23]
    resets = [f for f in frames(core.data_to_send()) if isinstance(f, RstStreamFrame)]
    assert [(f.stream_id, f.error_code) for f in resets] == [(21, REFUSED_STREAM), (23, REFUSED_STREAM)]
    assert not core.closed
    core.reset(1)
    core.close_stream(1)  # one stream done: a new one fits again
    events = core.receive_bytes(attacker.connect(25))
    assert [e.stream_id for e in events if isinstance(e, ev.RequestReceived)] == [25]


def test_streams_that_raced_our_settings_are_refused_but_not_charged_to_the_reset_budget() -> None:
    """A client opening many streams at once, before our SETTINGS reached it, is refused the excess
    (REFUSED_STREAM) and keeps its connection; once it acknowledged our limit, refusals count."""
    core = server(TunnelSettings(max_concurrent_streams=10, reset_budget=20))
    attacker = Attacker()
    core.receive_bytes(attacker.preface())
    events = core.receive_bytes(b"".join(attacker.connect(2 * i + 1) for i in range(100)))
    assert sum(isinstance(e, ev.LimitExceeded) for e in events) == 90
    assert not core.closed
    core.receive_bytes(SettingsFrame(0, flags=["ACK"]).serialize())
    events = core.receive_bytes(b"".join(attacker.connect(201 + 2 * i) for i in range(30)))
    assert core.closed
    assert any(isinstance(e, ev.LimitExceeded) and e.limit == "reset_budget" for e in events)


def test_rapid_reset_beyond_the_budget_ends_the_connection_with_enhance_your_calm() -> None:
    clock = Clock()
    core = server(TunnelSettings(reset_budget=100), clock)
    attacker = Attacker()
    core.receive_bytes(attacker.preface())
    core.data_to_send()
    # Within the budget, spread over time, resets are fine: 300 resets over 30 s at 100 per 10 s.
    stream_id = 1
    for _ in range(300):
        clock.now += 0.1
        core.receive_bytes(attacker.connect(stream_id) + attacker.reset(stream_id))
        stream_id += 2
    assert not core.closed
    # 50,000 pairs at once: the budget trips in the first read, and no request after it is handed on.
    burst = b"".join(
        attacker.connect(stream_id + 2 * i) + attacker.reset(stream_id + 2 * i) for i in range(50_000)
    )
    requests = 0
    events: list[ev.Event] = []
    for offset in range(0, len(burst), 256 << 10):
        events = core.receive_bytes(burst[offset : offset + (256 << 10)])
        requests += sum(isinstance(e, ev.RequestReceived) for e in events)
        if core.closed:
            break
    assert core.closed and offset == 0
    assert requests <= 101
    assert ev.LimitExceeded("reset_budget", events[-1].reason) in events
    goaway = [f for f in frames(core.data_to_send()) if isinstance(f, GoAwayFrame)]
    assert [f.error_code for f in goaway] == [ENHANCE_YOUR_CALM]
    assert b"reset" in goaway[0].additional_data


def test_unread_ping_acks_beyond_the_cap_end_the_connection() -> None:
    core = server(TunnelSettings(max_reply_backlog=64 << 10))
    attacker = Attacker()
    core.receive_bytes(attacker.preface())
    pings = PingFrame(0, opaque_data=b"12345678").serialize() * 1000  # 17 KB of PINGs, 17 KB of ACKs
    sent = 0
    while not core.closed:
        events = core.receive_bytes(pings)  # the server's output is never taken: the peer does not read
        sent += len(pings)
        assert sent < 1 << 20, "no limit on queued replies"
    assert any(isinstance(e, ev.LimitExceeded) and e.limit == "reply_backlog" for e in events)
    assert sent <= (64 << 10) + len(pings)
    assert core._conn.queued_output < (64 << 10) + 2 * len(pings)  # memory stays at the cap
    goaway = [f for f in frames(core.data_to_send()) if isinstance(f, GoAwayFrame)]
    assert [f.error_code for f in goaway] == [ENHANCE_YOUR_CALM]


def test_a_reader_that_reads_is_never_cut_off_by_the_reply_cap() -> None:
    core = server(TunnelSettings(max_reply_backlog=8 << 10))
    attacker = Attacker()
    core.receive_bytes(attacker.preface())
    for _ in range(200):
        core.receive_bytes(PingFrame(0, opaque_data=b"12345678").serialize() * 100)
        assert core.data_to_send()
    assert not core.closed


def test_an_oversized_frame_is_refused_at_its_header() -> None:
    core = server(TunnelSettings())
    attacker = Attacker()
    core.receive_bytes(attacker.preface() + attacker.connect(1))
    header = (16 << 20) - 1
    announced = header.to_bytes(3, "big") + bytes([0x0, 0x0]) + (1).to_bytes(4, "big")
    events = core.receive_bytes(announced + b"x" * 1000)  # 16 MiB announced, 1000 bytes sent
    assert core.closed
    assert isinstance(events[-1], ev.ConnectionEnded) and events[-1].error_code == FRAME_SIZE_ERROR
    assert events[0] == ev.LimitExceeded("frame_size", events[-1].reason)
    assert core._conn.incoming_buffer._data == bytearray()  # nothing of it buffered


def test_partial_frame_since_is_when_the_frame_now_arriving_started() -> None:
    clock = Clock()
    core = server(TunnelSettings(), clock)
    attacker = Attacker()
    core.receive_bytes(attacker.preface() + attacker.connect(1))
    assert core.partial_frame_since is None
    data = DataFrame(1, b"d" * 60_000).serialize()
    core.receive_bytes(data[:5])  # part of a header
    assert core.partial_frame_since == 1000.0
    clock.now = 1001.0
    core.receive_bytes(data[5:30_000])
    assert core.partial_frame_since == 1000.0  # the same frame: its start counts
    clock.now = 1002.0
    core.receive_bytes(data[30_000:] + data[:100])  # that one done, the next one started now
    assert core.partial_frame_since == 1002.0
    core.receive_bytes(data[100:])
    assert core.partial_frame_since is None
    # A header block left open (HEADERS without END_HEADERS) counts as a frame still arriving.
    block = HeadersFrame(3, data=attacker.encoder.encode([(":method", "CONNECT"), (":authority", "t:1")]))
    clock.now = 1003.0
    core.receive_bytes(block.serialize())
    assert core.partial_frame_since == 1003.0


def test_a_refusal_into_a_tiny_window_is_never_a_short_body() -> None:
    core = server(TunnelSettings())
    attacker = Attacker()
    core.receive_bytes(attacker.preface(_4=3) + attacker.connect(1))
    core.data_to_send()
    assert core.refuse(1, 400, "a reason longer than three bytes") is False
    sent = frames(core.data_to_send())
    assert [type(f) for f in sent] == [RstStreamFrame]
    assert sent[0].error_code == REFUSED_STREAM


def test_a_negative_window_after_a_settings_change_is_tracked() -> None:
    """h2spec 6.9.2: INITIAL_WINDOW_SIZE 3, 3 bytes sent, then INITIAL_WINDOW_SIZE 2: the window is -1,
    and a WINDOW_UPDATE of 2 allows exactly 1 byte."""
    core = server(TunnelSettings())
    attacker = Attacker()
    core.receive_bytes(attacker.preface(_4=3) + attacker.connect(1))
    core.respond(1, 200)
    assert core.send_data(1, b"abcdef") == 3
    core.receive_bytes(SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 2}).serialize())
    assert core.send_window(1) == 0
    assert core.send_data(1, b"def") == 0
    core.receive_bytes(WindowUpdateFrame(1, window_increment=2).serialize())
    assert core.send_window(1) == 1
    assert core.send_data(1, b"def") == 1
    data = [f for f in frames(core.data_to_send()) if isinstance(f, DataFrame)]
    assert [bytes(f.data) for f in data] == [b"abc", b"d"]
