"""Per client identity bounds of the proxy-server (quotas.py), on a fake clock."""

from __future__ import annotations

import pytest
import structlog
from prometheus_client import generate_latest

from clusterproxy_protocol.errors import TooManyRequests
from clusterproxy_server.authz import ClientIdentity
from clusterproxy_server.metrics import ServerMetrics
from clusterproxy_server.quotas import (
    BURST_GAP,
    ClientQuotas,
    QuotaExceeded,
    QuotaSettings,
    ServerBufferFull,
)

FIRST = 64 << 10


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def client(name: str) -> ClientIdentity:
    return ClientIdentity({"common_name": name, "subject": f"CN={name}"}, frozenset({("2.5.4.3", name)}))


def quotas(**settings: float) -> tuple[ClientQuotas, Clock, ServerMetrics, list[dict[str, object]]]:
    clock, metrics = Clock(), ServerMetrics()
    logged: list[dict[str, object]] = []

    def capture(_logger: object, _name: str, event: dict[str, object]) -> dict[str, object]:
        logged.append(event)
        raise structlog.DropEvent

    log = structlog.wrap_logger(None, processors=[capture])
    return ClientQuotas(QuotaSettings(**settings), metrics, log, FIRST, clock), clock, metrics, logged  # type: ignore[arg-type]


def refusals(metrics: ServerMetrics, name: str, bound: str) -> float:
    value = metrics.registry.get_sample_value(
        "cluster_proxy_server_client_refusals_total", {"client": name, "bound": bound}
    )
    return value or 0.0


def test_connections_beyond_the_bound_are_refused_and_counted_and_others_unaffected() -> None:
    q, _, metrics, _ = quotas(max_connections=2)
    held = [q.open_connection(client("alice")) for _ in range(2)]
    with pytest.raises(QuotaExceeded, match=r"already has 2 connections open \(--client-max-connections 2\)"):
        q.open_connection(client("alice"))
    q.open_connection(client("bob"))  # another identity has its own bound
    assert refusals(metrics, "alice", "connections") == 1
    q.close_connection(held[0])
    q.open_connection(client("alice"))  # room again


def test_concurrent_streams_are_bounded_per_identity_over_all_its_connections() -> None:
    q, _, metrics, _ = quotas(max_streams=3, stream_rate=0)
    first, second = q.open_connection(client("alice")), q.open_connection(client("alice"))
    with q.stream(first), q.stream(first), q.stream(second):
        with pytest.raises(QuotaExceeded, match="already has 3 streams open") as refused, q.stream(second):
            pass
        assert refused.value.status == 429 and refused.value.bound == "streams"
    with q.stream(second):  # the three ended: admitted again
        pass
    assert refusals(metrics, "alice", "streams") == 1


def test_the_stream_rate_is_a_token_bucket_per_identity() -> None:
    q, clock, _, _ = quotas(stream_rate=10, stream_burst=5)
    alice, bob = q.open_connection(client("alice")), q.open_connection(client("bob"))
    for _ in range(5):
        with q.stream(alice):
            pass
    with pytest.raises(QuotaExceeded, match="faster than 10 per second"), q.stream(alice):
        pass
    with q.stream(bob):  # a noisy neighbour does not slow bob down
        pass
    clock.now += 0.11  # one token back (and a little: 0.1 s is not exactly 0.1 in binary)
    with q.stream(alice):
        pass
    with pytest.raises(QuotaExceeded), q.stream(alice):
        pass


def test_a_stream_is_admitted_only_while_its_first_window_fits_every_budget() -> None:
    q, _, metrics, _ = quotas(buffer=4 * FIRST, connection_buffer=3 * FIRST, process_buffer=0, stream_rate=0)
    one, two = q.open_connection(client("alice")), q.open_connection(client("alice"))
    one.budget.take(3 * FIRST)  # windows the connection's streams hold
    with (
        pytest.raises(
            QuotaExceeded, match=r"this connection holds 192KiB .*--connection-buffer-budget 192KiB"
        ),
        q.stream(one),
    ):
        pass
    with q.stream(two):  # the identity still has room for one more first window
        two.budget.take(FIRST)
    with (
        pytest.raises(QuotaExceeded, match=r"client 'CN=alice' holds 256KiB .*--client-buffer-budget 256KiB"),
        q.stream(two),
    ):
        pass
    assert refusals(metrics, "alice", "buffer") == 2
    bob = q.open_connection(client("bob"))
    with q.stream(bob):  # bob's budget is his own
        pass


def test_a_full_process_budget_is_a_503_for_everyone() -> None:
    q, _, metrics, _ = quotas(buffer=0, connection_buffer=0, process_buffer=2 * FIRST, stream_rate=0)
    alice, bob = q.open_connection(client("alice")), q.open_connection(client("bob"))
    alice.budget.take(2 * FIRST)
    with pytest.raises(ServerBufferFull, match="--buffer-budget 128KiB") as refused, q.stream(bob):
        pass
    assert refused.value.status == 503 and not isinstance(refused.value, TooManyRequests)
    assert refusals(metrics, "bob", "server_buffer") == 1


def test_refusals_are_logged_once_per_burst_with_the_count_of_the_previous_one() -> None:
    q, clock, _, logged = quotas(max_streams=1, stream_rate=0)
    conn = q.open_connection(client("alice"))
    with q.stream(conn):
        for _ in range(5):
            with pytest.raises(QuotaExceeded), q.stream(conn):
                pass
            clock.now += 1
        clock.now += BURST_GAP
        with pytest.raises(QuotaExceeded), q.stream(conn):
            pass
    assert [(e["event"], e["bound"], e["refused_in_previous_burst"]) for e in logged] == [
        ("client_quota_exceeded", "streams", None),
        ("client_quota_exceeded", "streams", 4),
    ]


def test_an_identity_with_nothing_open_is_forgotten_and_its_buffer_series_goes() -> None:
    q, _, metrics, _ = quotas()
    conn = q.open_connection(client("alice"))
    conn.budget.take(FIRST)
    text = generate_latest(metrics.registry).decode()
    assert 'cluster_proxy_server_client_buffer_bytes{client="alice"} 65536.0' in text
    assert 'cluster_proxy_server_buffer_bytes{scope="process"} 65536.0' in text
    conn.budget.give(FIRST)
    q.close_connection(conn)
    assert q.ledger(client("alice")) is None
    assert 'client="alice"' not in generate_latest(metrics.registry).decode().split("client_buffer_bytes")[-1]


@pytest.mark.parametrize(
    "settings",
    [{"max_streams": -1}, {"buffer": -5}, {"stream_rate": -1}, {"stream_rate": 5, "stream_burst": 0}],
)
def test_bad_settings_are_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        QuotaSettings(**settings)  # type: ignore[arg-type]
