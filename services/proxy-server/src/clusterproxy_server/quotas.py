"""What one client identity (a hub client certificate's subject) may hold of the proxy-server: client
connections, concurrent streams, new streams per second, and bytes of receive window (memory).

A client that does not read what it asked for still makes the server hold what the agent sends toward
it, up to each stream's receive window; a client that sends toward a target that does not read makes
the server hold that, up to the window of its own stream. Every such window is charged to a
:class:`~clusterproxy_protocol.windows.Budget` chain: the client connection's, then the client
identity's, then the process's (``clusterproxy_protocol.core``: windows start at 64 KiB and grow only
for streams that keep up, and only while the chain has room). A stream is admitted only when its first
window fits, so past a budget the identity's new streams are refused (429, or 503 when the process is
full) and its open streams keep the windows they have, while other identities are not slowed down.

The counts and the rate (a token bucket per identity) keep one noisy client from starving the others of
the server's CPU: refused with 429 and a reason naming the flag. Refusals are counted per identity and
reason (``cluster_proxy_server_client_refusals_total``) and logged once per burst: the first refusal
of a burst is logged, the next only after ``BURST_GAP`` seconds without one, with how many were refused
in between.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import structlog
import trio

from clusterproxy_protocol import Budget, ConnectRefused, TooManyRequests, format_size
from clusterproxy_server.authz import ClientIdentity
from clusterproxy_server.metrics import ServerMetrics

BURST_GAP = 10.0  # seconds without a refusal that end a burst (the next refusal is logged)


@dataclass(frozen=True)
class QuotaSettings:
    """Per client identity unless named otherwise; 0 turns a bound off (main.py's flags say the same)."""

    max_connections: int = 1024  # HTTP/1.1 clients open one per stream: as many as streams
    max_streams: int = 1024  # concurrent streams
    stream_rate: float = 500.0  # new streams per second, refilled evenly ...
    stream_burst: int = 1000  # ... into a bucket of this many
    buffer: int = 128 << 20  # bytes of receive window held for the identity's streams
    connection_buffer: int = 32 << 20  # the same for one client connection
    process_buffer: int = 1 << 30  # the same for every client together

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_streams", "stream_burst", "buffer", "connection_buffer"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', ' ')} {getattr(self, name)} is negative")
        if self.stream_rate < 0 or self.process_buffer < 0:
            raise ValueError("stream rate and process buffer must not be negative")
        if self.stream_rate and self.stream_burst < 1:
            raise ValueError("stream burst must be at least 1 when a stream rate is set")


class QuotaExceeded(TooManyRequests):
    """A 429 that names the bound (``connections``, ``streams``, ``rate``, ``buffer``), for the metrics."""

    def __init__(self, bound: str, reason: str) -> None:
        super().__init__(reason)
        self.bound = bound


class ServerBufferFull(ConnectRefused):
    """Every client together holds the process's buffer budget: 503, try later or another replica."""

    status = 503
    bound = "server_buffer"


@dataclass(eq=False)
class ClientLedger:
    """What one identity holds now, kept while it has a connection."""

    name: str  # what logs and metrics call it (the common name)
    key: str  # the subject: what the quotas are per
    budget: Budget
    tokens: float
    refilled_at: float
    connections: int = 0
    streams: int = 0
    last_refusal: dict[str, float] = field(default_factory=dict)  # bound -> trio clock
    unlogged: dict[str, int] = field(default_factory=dict)  # bound -> refusals since the last line


@dataclass(eq=False)
class Prepaid:
    """Bytes of a client stream's reservation (``TunnelStream.take_reserve``), still charged to
    ``budget``, that pay for the window of the stream opened toward an agent on its behalf; what is
    not spent on one is given back with :meth:`refund`."""

    budget: Budget | None
    amount: int = 0

    def spend(self) -> int:
        spent, self.amount = self.amount, 0
        return spent

    def refund(self) -> None:
        if self.budget is not None and self.amount:
            self.budget.give(self.spend())


@dataclass(eq=False)
class ConnectionQuota:
    """One client connection's share: its buffer budget (charged to the identity's) and its ledger."""

    ledger: ClientLedger
    budget: Budget


class ClientQuotas:
    def __init__(
        self,
        settings: QuotaSettings,
        metrics: ServerMetrics,
        log: structlog.typing.FilteringBoundLogger,
        first_window: int,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.log = log
        self.first_window = first_window  # what a new stream toward an agent is charged at once
        self.clock = clock
        self.process = Budget(settings.process_buffer, name="the proxy-server (--buffer-budget)")
        self._ledgers: dict[str, ClientLedger] = {}
        metrics.buffer_bytes.labels("process").set_function(lambda: self.process.used)
        metrics.watch_client_buffers(self._buffers)

    def _buffers(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for ledger in self._ledgers.values():  # two subjects may share a common name
            held[ledger.name] = held.get(ledger.name, 0) + ledger.budget.used
        return held

    def ledger(self, client: ClientIdentity) -> ClientLedger | None:
        return self._ledgers.get(client.describe())

    def ledger_count(self) -> int:
        """Identities with a connection or a stream now."""
        return len(self._ledgers)

    # -- connections ------------------------------------------------------------------------------

    def open_connection(self, client: ClientIdentity) -> ConnectionQuota:
        """Count a new connection of ``client``; raises :class:`QuotaExceeded` past its bound."""
        key = client.describe()
        ledger = self._ledgers.get(key)
        if ledger is None:
            ledger = ClientLedger(
                client.name,
                key,
                Budget(self.settings.buffer, self.process, name=f"client {key!r} (--client-buffer-budget)"),
                float(self.settings.stream_burst),
                self.clock(),
            )
            self._ledgers[key] = ledger
        cap = self.settings.max_connections
        if cap and ledger.connections >= cap:
            self._forget_if_idle(ledger)
            raise self._refusal(
                ledger,
                "connections",
                f"client {key!r} already has {ledger.connections} connections open "
                f"(--client-max-connections {cap}): reuse them (HTTP/2 carries many streams on one)",
            )
        ledger.connections += 1
        return ConnectionQuota(
            ledger,
            Budget(
                self.settings.connection_buffer,
                ledger.budget,
                name="this connection (--connection-buffer-budget)",
            ),
        )

    def close_connection(self, quota: ConnectionQuota) -> None:
        quota.ledger.connections -= 1
        self._forget_if_idle(quota.ledger)

    def _forget_if_idle(self, ledger: ClientLedger) -> None:
        if not ledger.connections and not ledger.streams:
            del self._ledgers[ledger.key]

    # -- streams ----------------------------------------------------------------------------------

    @contextmanager
    def stream(self, quota: ConnectionQuota, prepaid: int = 0) -> Iterator[None]:
        """One stream of the connection for the duration of the block. Raises :class:`QuotaExceeded`
        (429) past the identity's concurrent streams, its rate, or a buffer budget of the connection or
        the identity, and :class:`ServerBufferFull` (503) past the process's. ``prepaid``: bytes of the
        window toward the agent already charged (a reservation)."""
        ledger = quota.ledger
        self._admit(quota, max(0, self.first_window - prepaid))
        ledger.streams += 1
        try:
            yield
        finally:
            ledger.streams -= 1
            self._forget_if_idle(ledger)

    def _admit(self, quota: ConnectionQuota, need: int) -> None:
        s, ledger = self.settings, quota.ledger
        if s.max_streams and ledger.streams >= s.max_streams:
            raise self._refusal(
                ledger,
                "streams",
                f"client {ledger.key!r} already has {ledger.streams} streams open "
                f"(--client-max-concurrent-streams {s.max_streams}): close some, or ask for a higher bound",
            )
        full = quota.budget.exhausted(need) if need else None
        if full is self.process:
            raise self._refusal(
                ledger,
                "server_buffer",
                f"the proxy-server holds {format_size(full.used)} of stream windows for its clients, its "
                f"whole budget (--buffer-budget {format_size(full.limit)}): retry later or on another replica",
                ServerBufferFull,
            )
        if full is not None:
            scope = "this connection" if full is quota.budget else f"client {ledger.key!r}"
            flag = "--connection-buffer-budget" if full is quota.budget else "--client-buffer-budget"
            raise self._refusal(
                ledger,
                "buffer",
                f"{scope} holds {format_size(full.used)} of stream windows for data it has not read yet "
                f"({flag} {format_size(full.limit)}): read what its open streams receive, or close some",
            )
        if s.stream_rate:
            now = self.clock()
            ledger.tokens = min(
                float(s.stream_burst), ledger.tokens + (now - ledger.refilled_at) * s.stream_rate
            )
            ledger.refilled_at = now
            if ledger.tokens < 1:
                raise self._refusal(
                    ledger,
                    "rate",
                    f"client {ledger.key!r} opens streams faster than {s.stream_rate:g} per second "
                    f"(burst {s.stream_burst}; --client-stream-rate, --client-stream-burst): slow down",
                )
            ledger.tokens -= 1

    def _refusal(
        self,
        ledger: ClientLedger,
        bound: str,
        reason: str,
        kind: type[ConnectRefused] = QuotaExceeded,
    ) -> ConnectRefused:
        """Count the refusal; log it when it starts a burst."""
        self.metrics.client_refusals.labels(ledger.name, bound).inc()
        now = self.clock()
        last = ledger.last_refusal.get(bound)
        ledger.last_refusal[bound] = now
        if last is None or now - last >= BURST_GAP:
            self.log.warning(
                "client_quota_exceeded",
                client=ledger.name,
                bound=bound,
                error=reason,
                refused_in_previous_burst=ledger.unlogged.pop(bound, 0) or None,
            )
        else:
            ledger.unlogged[bound] = ledger.unlogged.get(bound, 0) + 1
        return QuotaExceeded(bound, reason) if kind is QuotaExceeded else kind(reason)
