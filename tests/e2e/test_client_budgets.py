"""One hub client identity that reads nothing cannot pin the proxy-server's memory (issue 32, finding 1),
against a real server and agent at their default flags.

The attack that took 709 MiB before the budgets: 20 HTTP/2 connections of one client certificate, each
opening 128 CONNECT streams to a target that sends without end, with SETTINGS_INITIAL_WINDOW_SIZE 0 so
the server can send the client nothing. Each admitted stream's window toward the agent fills and stays
full. The identity's budget (--client-buffer-budget, 128 MiB by default) admits 1,024 streams at their
first windows of 64 KiB each way (the stream's own and the reservation for its stream toward the agent);
the rest are refused with 429 and the budget's name in the reason. The relay reads no more than its
destination takes, so what the server holds is the windows' worth, plus each stream's bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import hpack
import pytest
import trio
from hyperframe.frame import GoAwayFrame, HeadersFrame, RstStreamFrame

from clusterproxy_protocol.pki import DevCA
from clusterproxy_protocol.wire import REASON_HEADER
from clusterproxy_sdk import open_tunnel
from tests.support.h2_attacker import Attacker
from tests.support.pki import PkiFiles
from tests.support.procs import Hub, http_get
from tests.support.targets import Target, digest_transfer, serve_digest, serve_source

pytestmark = pytest.mark.slow

CONNECTIONS = 20
STREAMS = 128  # per connection: the pending-dial bound of one connection
IDENTITY_BUDGET = 128 << 20  # the server's default --client-buffer-budget
FIRST_WINDOW = 64 << 10  # the server's default --initial-stream-window
RSS_BOUND = 256 << 20  # stated by the issue: at most 256 MiB for one identity
NEIGHBOUR_TRANSFERS = 4
NEIGHBOUR_SIZE = 4 << 20
QUIET = 1.0  # seconds without a byte more from the target: every admitted window is full


@dataclass
class Answers:
    """What the server answered each stream of one attacker connection."""

    statuses: dict[int, int] = field(default_factory=dict)  # stream id -> :status
    reasons: dict[int, str] = field(default_factory=dict)
    resets: dict[int, int] = field(default_factory=dict)  # stream id -> RST_STREAM code
    goaway: bool = False


async def attack(attacker: Attacker, authority: str, answers: Answers, all_answered: trio.Event) -> None:
    """Open STREAMS CONNECTs at once and read the answers; keep the connection (and its streams) open
    until cancelled."""
    await attacker.send(b"".join(attacker.connect_frame(sid, authority) for sid in range(1, 2 * STREAMS, 2)))
    decoder = hpack.Decoder()
    while (frame := await attacker.next_frame()) is not None:
        if isinstance(frame, HeadersFrame):
            fields = dict(decoder.decode(frame.data))
            status = int(fields.get(":status", 0))
            if status and frame.stream_id not in answers.statuses:
                answers.statuses[frame.stream_id] = status
                if REASON_HEADER in fields:
                    answers.reasons[frame.stream_id] = fields[REASON_HEADER]
        elif isinstance(frame, RstStreamFrame):
            answers.resets.setdefault(frame.stream_id, frame.error_code)
        elif isinstance(frame, GoAwayFrame):
            answers.goaway = True
        if len(answers.statuses.keys() | answers.resets.keys()) == STREAMS:
            all_answered.set()
    all_answered.set()  # the connection ended: nothing more will be answered


def plain_metric(hub: Hub, name: str, **labels: str) -> float:
    status, body = http_get(f"http://127.0.0.1:{hub.admin_port}/metrics")
    assert status == 200, body
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def wait_quiet(source: Target) -> None:
    """Until the target has sent nothing more for QUIET seconds: the admitted windows are full."""
    sent = -1
    while sum(source.sent.values()) != sent:
        sent = sum(source.sent.values())
        await trio.sleep(QUIET)


async def test_one_identity_that_reads_nothing_is_held_to_its_budget_and_others_go_on(
    hub: Hub, pki: PkiFiles, nursery: trio.Nursery, tmp_path: Path
) -> None:
    assert hub.server is not None
    source = await serve_source(nursery)
    digests = await serve_digest(nursery)
    neighbour = DevCA.create_or_load(pki.ca.parent).issue_client("budget-neighbour", tmp_path)
    async with open_tunnel(
        f"127.0.0.1:{hub.client_port}", pki.sdk_files(neighbour), server_hostname="localhost"
    ) as tunnel:
        await digest_transfer(tunnel, digests, "warm-up", NEIGHBOUR_SIZE, NEIGHBOUR_SIZE)
        rss_before = hub.server.rss_kib() << 10
        peak = rss_before
        attackers = [await Attacker.connect(hub.client_port, pki, _4=0) for _ in range(CONNECTIONS)]
        answers = [Answers() for _ in attackers]
        answered = [trio.Event() for _ in attackers]
        async with trio.open_nursery() as attacks:
            for attacker, answer, done in zip(attackers, answers, answered, strict=True):
                attacks.start_soon(attack, attacker, source.address, answer, done)

            async def sample_rss() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, hub.server.rss_kib() << 10)
                    await trio.sleep(0.1)

            attacks.start_soon(sample_rss)
            with trio.fail_after(120):
                for done in answered:
                    await done.wait()
                await wait_quiet(source)
                # The neighbour's transfers in the same seconds, each sha256-checked both ways.
                async with trio.open_nursery() as transfers:
                    for i in range(NEIGHBOUR_TRANSFERS):
                        transfers.start_soon(
                            digest_transfer, tunnel, digests, f"neighbour-{i}", NEIGHBOUR_SIZE, NEIGHBOUR_SIZE
                        )
            held_by_attack = peak - rss_before
            refusals = plain_metric(hub, "cluster_proxy_server_client_refusals_total", client="test-admin")
            trips = plain_metric(hub, "cluster_proxy_server_http2_limit_trips_total", limit="buffer_budget")
            pending = plain_metric(hub, "cluster_proxy_server_pending_dial_refusals_total")
            attacks.cancel_scope.cancel()
        for attacker in attackers:
            await attacker.aclose()

    statuses = [s for a in answers for s in a.statuses.values()]
    admitted = statuses.count(200)
    refused = [(a.statuses[sid], reason) for a in answers for sid, reason in a.reasons.items()]
    pushed = sum(source.sent.values())
    print(
        f"\n{CONNECTIONS}x{STREAMS} streams with window 0: {admitted} admitted, {len(refused)} refused with a "
        f"reason, {sum(len(a.resets) - sum(1 for s in a.resets if s in a.statuses) for a in answers)} reset "
        f"without one; the target pushed {pushed >> 20} MiB; server RSS +{held_by_attack >> 20} MiB "
        f"(peak {peak >> 20} MiB); refusals counted {refusals:g} (quota) + {trips:g} (first window) + "
        f"{pending:g} (pending dials)"
    )
    assert not any(a.goaway for a in answers), "a connection of the identity was closed"
    # Held to the budget: each admitted stream was charged its first window toward the agent and one
    # toward the client, so at most the budget's worth of streams got in.
    assert 0 < admitted <= IDENTITY_BUDGET // (2 * FIRST_WINDOW)
    assert len(refused) >= CONNECTIONS * STREAMS - admitted - CONNECTIONS  # nearly all the rest: 429 and why
    assert all(status == 429 for status, _ in refused), refused[:3]
    assert all("budget" in reason or "pending" in reason for _, reason in refused), refused[:3]
    assert any("--client-buffer-budget" in reason for _, reason in refused), refused[:3]
    assert trips > 0  # the budget refused some itself
    assert refusals + trips + pending >= len(refused)
    assert held_by_attack < RSS_BOUND, f"server RSS grew by {held_by_attack >> 20} MiB"
    assert pushed > admitted * FIRST_WINDOW  # the admitted windows were really filled
