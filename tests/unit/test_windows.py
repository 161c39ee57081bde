"""Receive windows that grow for streams that keep up, charged to budgets (sans-IO: two cores)."""

from __future__ import annotations

import hashlib

import pytest

from clusterproxy_protocol import events as ev
from clusterproxy_protocol.core import Role, TunnelCore
from clusterproxy_protocol.settings import TunnelSettings
from clusterproxy_protocol.windows import Budget, format_size, next_window
from clusterproxy_protocol.wire import REASON_HEADER
from tests.support.cores import pump

FIRST = 65535
LARGEST = 1 << 20
GROWING = TunnelSettings(initial_stream_window=FIRST, stream_window=LARGEST, connection_window=32 << 20)


def wired(settings: TunnelSettings, acceptor_budget: Budget | None = None) -> tuple[TunnelCore, TunnelCore]:
    opener = TunnelCore(Role.OPENER, settings)
    acceptor = TunnelCore(Role.ACCEPTOR, settings, budget=acceptor_budget)
    opener.initiate()
    acceptor.initiate()
    pump(opener, acceptor)
    return opener, acceptor


def open_stream(opener: TunnelCore, acceptor: TunnelCore, budget: Budget | None = None) -> int:
    sid = opener.open_connect("target:443", budget=budget)
    pump(opener, acceptor)
    acceptor.respond(sid, 200)
    pump(opener, acceptor)
    return sid


def send_what_the_window_allows(sender: TunnelCore, receiver: TunnelCore, sid: int) -> int:
    sent = sender.send_data(sid, b"x" * sender.send_window(sid))
    pump(sender, receiver)
    return sent


def test_a_stream_that_keeps_up_grows_from_the_first_window_to_the_largest() -> None:
    opener, acceptor = wired(GROWING)
    sid = open_stream(opener, acceptor)
    windows = []
    for _ in range(8):
        windows.append(send_what_the_window_allows(opener, acceptor, sid))
        assert acceptor.read(sid, 8 << 20)  # the reader takes everything at once: it keeps up
        pump(opener, acceptor)
    assert windows[0] == FIRST
    assert windows[-1] == LARGEST
    assert windows == sorted(windows)  # only ever grows while it keeps up
    assert acceptor.stream(sid).window == LARGEST


def test_a_reader_that_stops_holds_no_more_than_the_first_window() -> None:
    opener, acceptor = wired(GROWING)
    sid = open_stream(opener, acceptor)
    for _ in range(5):
        opener.send_data(sid, b"y" * 200_000)
        pump(opener, acceptor)
    state = acceptor.stream(sid)
    assert state.buffered == FIRST
    assert state.window == FIRST
    assert opener.send_window(sid) == 0


def test_a_reader_that_reads_part_of_its_buffer_does_not_grow_it() -> None:
    opener, acceptor = wired(GROWING)
    sid = open_stream(opener, acceptor)
    for _ in range(20):
        send_what_the_window_allows(opener, acceptor, sid)
        acceptor.read(sid, 1000)  # slower than the sender: the buffer never empties
        pump(opener, acceptor)
    assert acceptor.stream(sid).window == FIRST


def test_windows_are_charged_to_the_budget_and_given_back_when_the_stream_ends() -> None:
    process = Budget(0, name="process")
    client = Budget(4 * LARGEST, parent=process, name="client")
    opener, acceptor = wired(GROWING, acceptor_budget=None)
    upstream = open_stream(opener, acceptor, budget=client)
    assert client.used == process.used == FIRST  # charged at creation
    for _ in range(6):
        send_what_the_window_allows(acceptor, opener, upstream)  # the acceptor sends; the opener reads
        assert opener.read(upstream, 8 << 20)
        pump(opener, acceptor)
    assert opener.stream(upstream).window == LARGEST
    assert client.used == process.used == LARGEST
    opener.reset(upstream)
    opener.close_stream(upstream)  # the application is done with it: the core forgets it
    assert opener.stream(upstream) is None
    assert client.used == process.used == 0


def test_growth_stops_where_the_budget_ends_and_the_bytes_still_arrive() -> None:
    connection = Budget(2 * FIRST + 10, name="connection")  # room for the first window twice
    opener, acceptor = wired(GROWING, acceptor_budget=connection)
    sid = open_stream(opener, acceptor)
    assert connection.used == FIRST
    payload = bytes(range(256)) * 4096  # 1 MiB
    received = bytearray()
    pending = memoryview(payload)
    while pending or acceptor.stream(sid).buffered:
        pending = pending[opener.send_data(sid, pending) :]
        pump(opener, acceptor)
        received += acceptor.read(sid, 8 << 20)
        pump(opener, acceptor)
        assert connection.used <= connection.limit
    assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()
    assert acceptor.stream(sid).window == 2 * FIRST  # one doubling fitted, the next did not


def test_the_connection_budget_is_charged_for_streams_the_peer_opens_and_given_back() -> None:
    connection = Budget(0, name="connection")
    opener, acceptor = wired(GROWING, acceptor_budget=connection)
    streams = [open_stream(opener, acceptor) for _ in range(5)]
    assert connection.used == 5 * FIRST
    for sid in streams:
        opener.end_stream(sid)
        acceptor.end_stream(sid)
        pump(opener, acceptor)
        acceptor.close_stream(sid)
    assert connection.used == 0


def test_a_lost_connection_gives_every_window_back() -> None:
    connection = Budget(0, name="connection")
    opener, acceptor = wired(GROWING, acceptor_budget=connection)
    for _ in range(3):
        open_stream(opener, acceptor)
    acceptor.receive_bytes(b"")  # EOF: every stream broken
    assert connection.used == 0


def test_without_a_first_window_every_stream_gets_the_largest_at_once() -> None:
    settings = TunnelSettings(stream_window=LARGEST)
    opener, acceptor = wired(settings)
    sid = open_stream(opener, acceptor)
    assert opener.send_window(sid) == LARGEST
    assert acceptor.stream(sid).window == LARGEST


def test_budget_chain_names_the_scope_that_is_full() -> None:
    process = Budget(100, name="process")
    client = Budget(60, parent=process, name="client")
    connection = Budget(0, parent=client, name="connection")
    assert connection.try_take(50)
    assert connection.exhausted(20) is client
    assert not connection.try_take(20)
    other = Budget(0, parent=process, name="other client")
    assert other.try_take(40)
    assert other.exhausted(20) is process
    assert connection.room() == 10
    connection.give(50)
    other.give(40)
    assert (process.used, client.used, connection.used, other.used) == (0, 0, 0, 0)


@pytest.mark.parametrize("first", [1024, 65534, LARGEST + 1])
def test_a_first_window_outside_its_range_is_refused(first: int) -> None:
    with pytest.raises(ValueError, match="initial stream window"):
        TunnelSettings(initial_stream_window=first, stream_window=LARGEST)


def test_windows_double_up_to_the_largest() -> None:
    assert next_window(FIRST, LARGEST) == 2 * FIRST
    assert next_window(LARGEST // 2 + 1, LARGEST) == LARGEST


def test_a_stream_whose_first_window_does_not_fit_the_budget_is_refused_before_any_data() -> None:
    connection = Budget(3 * FIRST, name="connection")
    opener, acceptor = wired(GROWING, acceptor_budget=connection)
    admitted = [open_stream(opener, acceptor) for _ in range(3)]
    sid = opener.open_connect("target:443")
    opener.send_data(sid, b"z" * 1000)
    seen_by_opener, seen_by_acceptor = pump(opener, acceptor)
    assert [e.limit for e in seen_by_acceptor if isinstance(e, ev.LimitExceeded)] == ["buffer_budget"]
    answer = next(e for e in seen_by_opener if isinstance(e, ev.ResponseReceived) and e.stream_id == sid)
    assert answer.status == 503  # the budget has no parent: the whole process is full
    assert answer.headers[REASON_HEADER] == (
        "stream refused: connection: 192KiB of stream windows held for data not read yet, of 192KiB"
    )
    assert any(isinstance(e, ev.StreamReset) and e.stream_id == sid for e in seen_by_opener)
    assert acceptor.stream(sid) is None
    assert connection.used == 3 * FIRST
    assert all(acceptor.stream(s) is not None for s in admitted)


def test_an_identity_budget_refusal_is_a_429_naming_it() -> None:
    process = Budget(0, name="process")
    identity = Budget(FIRST, parent=process, name="client 'CN=alice'")
    opener, acceptor = wired(GROWING, acceptor_budget=Budget(0, parent=identity, name="connection"))
    open_stream(opener, acceptor)
    sid = opener.open_connect("target:443")
    seen_by_opener, _ = pump(opener, acceptor)
    answer = next(e for e in seen_by_opener if isinstance(e, ev.ResponseReceived) and e.stream_id == sid)
    assert answer.status == 429
    assert "client 'CN=alice': 64KiB of stream windows held" in answer.headers[REASON_HEADER]


@pytest.mark.parametrize(
    ("count", "text"), [(900, "900B"), (64 << 10, "64KiB"), (1536 << 20, "1.5GiB"), (64 << 20, "64MiB")]
)
def test_sizes_read_as_the_flags_write_them(count: int, text: str) -> None:
    assert format_size(count) == text


def test_streams_the_peer_resets_or_ends_give_their_windows_back_at_once() -> None:
    """50 streams opened and reset in one read, against a budget of 3 first windows: none is refused
    (a reset stream can receive nothing more, whether or not the application has seen it yet)."""
    connection = Budget(3 * FIRST, name="connection")
    opener, acceptor = wired(GROWING, acceptor_budget=connection)
    for _ in range(50):
        opener.reset(opener.open_connect("target:443"))
    _, seen = pump(opener, acceptor)
    assert not [e for e in seen if isinstance(e, ev.LimitExceeded)]
    assert connection.used == 0
    ended = open_stream(opener, acceptor)
    opener.send_data(ended, b"last words")
    opener.end_stream(ended)
    pump(opener, acceptor)
    assert connection.used == len(b"last words")  # only what still waits to be read
    assert acceptor.read(ended, 100) == b"last words"
    acceptor.close_stream(ended)
    assert connection.used == 0


def test_a_reservation_pays_for_the_stream_opened_on_its_behalf() -> None:
    """A proxy: each stream a client opens is charged its window and the window of the stream toward
    the agent, which takes the reservation over: a burst of client streams cannot spend the budget on
    their own windows and leave the streams that serve them none."""
    identity = Budget(4 * FIRST, name="identity")
    client = TunnelCore(Role.OPENER, GROWING)
    proxy_side = TunnelCore(Role.ACCEPTOR, GROWING, budget=identity, reserve=FIRST)
    client.initiate()
    proxy_side.initiate()
    pump(client, proxy_side)
    toward_agent, _agent = wired(GROWING)
    first, second, third = (client.open_connect(f"{name}:1") for name in "abc")
    seen_by_client, _ = pump(client, proxy_side)
    assert identity.used == 4 * FIRST  # two streams, each with its reservation
    refusal = next(e for e in seen_by_client if isinstance(e, ev.ResponseReceived) and e.stream_id == third)
    assert refusal.status == 503  # the third did not fit, reservation included
    paid = proxy_side.take_reserve(first)
    assert paid == FIRST and proxy_side.take_reserve(first) == 0
    upstream = toward_agent.open_connect("a:1", budget=identity, prepaid=paid)
    assert identity.used == 4 * FIRST  # moved over, not charged twice
    toward_agent.reset(upstream)
    toward_agent.close_stream(upstream)
    assert identity.used == 3 * FIRST
    client.reset(second)
    pump(client, proxy_side)
    assert identity.used == FIRST  # the second's window and unspent reservation are back
