"""bench.soak_report: the levels-off verdict on synthetic samples (memory that settles, memory that
grows, a process restarted inside the window) and the transfers' verdicts (a transfer without its
digest is counted as such even beside an agent restart; only an error is a restart's doing)."""

from __future__ import annotations

import random
from typing import Any

from bench.soak_report import (
    Restart,
    Transfer,
    build,
    classify,
    levels_off,
    markdown,
    process_summary,
    transfer_summary,
    window_for,
)

MiB = 1024  # in KiB, as the samples hold RSS


def samples(rss: list[float], *, every: float = 10.0, pids: list[int] | None = None) -> list[dict[str, Any]]:
    """Sampler records of one process "p": ``rss`` in KiB every ``every`` s, 30 fds, CPU growing."""
    return [
        {
            "t": i * every,
            "processes": {
                "p": {"pid": (pids or [1] * len(rss))[i], "rss_kib": v, "fds": 30, "cpu_s": i * 0.1}
            },
        }
        for i, v in enumerate(rss)
    ]


def warm_then_flat(hours: float, every: float = 10.0) -> list[float]:
    """50 MiB climbing to 80 MiB over the first 20 minutes, then 80 MiB +-3 % of noise."""
    rng = random.Random(6)
    n = int(hours * 3600 / every)
    return [
        (50 + 30 * min(1.0, i * every / 1200)) * MiB * (1 + rng.uniform(-0.03, 0.03)) for i in range(n + 1)
    ]


def test_the_window_is_the_last_hour_or_the_last_half_of_a_shorter_run() -> None:
    assert window_for(4 * 3600) == 3600
    assert window_for(2 * 3600) == 3600
    assert window_for(180) == 90


def test_memory_that_warms_up_and_then_stays_flat_levels_off() -> None:
    summary = process_summary(samples(warm_then_flat(2)), "p", 7200)
    rss = summary["rss_kib"]
    assert rss["levels_off"] is True
    assert rss["samples"] == 361  # the last hour at one sample per 10 s, both ends included
    assert 78 * MiB < rss["mean"] < 82 * MiB
    assert rss["first"] < 52 * MiB and rss["max"] > 80 * MiB  # the warm-up is outside the window
    assert abs(rss["slope_per_hour"]) < 2 * MiB
    assert summary["fds"]["levels_off"] is True


def test_memory_that_keeps_growing_does_not_level_off() -> None:
    # 60 MiB + 40 MiB per hour: the last hour goes from 100 to 140 MiB, 16 % either side of its mean
    growing = [60 * MiB + 40 * MiB * (i * 10 / 3600) for i in range(721)]
    rss = process_summary(samples(growing), "p", 7200)["rss_kib"]
    assert rss["levels_off"] is False
    assert 0.15 < rss["worst_deviation"] < 0.17
    assert round(rss["slope_per_hour"] / MiB) == 40


def test_a_single_spike_beyond_the_band_is_enough_to_say_no() -> None:
    flat = [100.0] * 100
    flat[80] = 125.0
    assert levels_off([(float(i), v) for i, v in enumerate(flat)], window=50)["levels_off"] is False
    assert levels_off([(float(i), v) for i, v in enumerate(flat)], window=15)["levels_off"] is True


def test_descriptors_of_streams_in_flight_pass_and_descriptors_that_pile_up_do_not() -> None:
    def fds(values: list[int]) -> dict[str, Any]:
        records = samples([40 * MiB] * len(values))
        for record, value in zip(records, values, strict=True):
            record["processes"]["p"]["fds"] = value
        return process_summary(records, "p", 10.0 * len(values))["fds"]

    busy = [15 + (10 if i % 7 == 0 else 0) for i in range(360)]  # 15, and 25 while transfers are open
    assert fds(busy)["levels_off"] is True  # 60 % above a mean of 16.4, but within FD_SLACK of it
    leaking = [15 + i // 6 for i in range(720)]  # one more every minute: 75-135 in the last hour
    assert fds(leaking)["levels_off"] is False


def test_a_process_restarted_inside_the_window_gets_no_verdict_and_its_cpu_adds_up() -> None:
    rss = [40 * MiB] * 20
    summary = process_summary(samples(rss, pids=[1] * 15 + [2] * 5), "p", 200)
    assert summary["pids"] == 2
    assert summary["rss_kib"]["levels_off"] is None
    assert summary["rss_kib"]["why_none"] == "restarted within the window"
    # each incarnation's own counter: 0.0..1.4 for the first, 1.5..1.9 for the second
    assert summary["cpu_s"] == 1.8


def test_only_errors_on_the_restarted_cluster_while_it_was_down_are_a_restarts_doing() -> None:
    restarts = [Restart("cluster3", killed=100.0, back=103.0)]

    def transfer(cluster: str, started: float, ended: float, outcome: str) -> Transfer:
        return Transfer("sdk", cluster, started, ended, outcome, "BrokenResourceError: reset")

    assert classify(transfer("cluster3", 90, 101, "error"), restarts) == "broken by a restart"
    assert classify(transfer("cluster3", 106, 107, "error"), restarts) == "broken by a restart"  # grace
    assert classify(transfer("cluster3", 120, 121, "error"), restarts) == "failed"  # long after
    assert classify(transfer("cluster1", 90, 101, "error"), restarts) == "failed"  # another cluster
    # a clean end without the digest is never excused, not even through the restart
    assert classify(transfer("cluster3", 90, 101, "no-digest"), restarts) == "without digest"
    assert classify(transfer("cluster3", 90, 101, "ok"), restarts) == "ok"


def test_a_transfer_without_its_digest_is_counted_and_listed() -> None:
    transfers = [
        Transfer("connect", "cluster1", 1, 2, "ok", bytes=2048),
        Transfer("connect", "cluster2", 3, 4, "no-digest", "download: 100 of 4096 bytes, sha256 differs"),
        Transfer("sdk", "cluster1", 5, 6, "error", "TooSlowError: "),
        Transfer("sdk", "cluster3", 5, 6, "error", "BrokenResourceError: reset"),
    ]
    summary = transfer_summary(transfers, [Restart("cluster3", 5.5, 8)])
    assert summary["total"] == {"ok": 1, "failed": 1, "broken by a restart": 1, "without digest": 1}
    assert summary["by_flow"]["connect"] == {"ok": 1, "without digest": 1}
    assert summary["failures_by_kind"] == {"sdk: TooSlowError": 1}
    assert [t["cluster"] for t in summary["without_digest_first"]] == ["cluster2"]
    assert summary["bytes_checked"] == 2048

    report = build(
        run={
            "started_utc": "2026-12-01 10:00 UTC",
            "duration_s": 200.0,
            "mix": "test",
            "battery_every_s": 60,
            "restart_every_s": 60,
            "sample_every_s": 10,
            "restarted": "agent-cluster3",
            "skipped": [],
            "loadavg": "0.50",
        },
        samples=samples([40 * MiB] * 21),
        transfers=transfers,
        restarts=[Restart("cluster3", 5.5, 8)],
        battery_rounds=[
            {
                "t": 60.0,
                "results": [
                    {"name": "a", "ok": True, "answer": "closed", "seconds": 0.1, "bound": 5},
                    {"name": "b", "ok": False, "answer": "AssertionError: 200", "seconds": 0.2, "bound": 5},
                ],
            }
        ],
    )
    text = markdown(report)
    assert "**1 without their digest**" in text
    assert "download: 100 of 4096 bytes" in text
    assert "1 of 2 attacks got their right answer" in text
    assert "AssertionError: 200" in text
