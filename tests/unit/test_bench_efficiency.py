"""bench.efficiency: CPU-seconds per GiB, per 1,000 connects, per 1,000 streams opened and per 1,000
requests."""

from __future__ import annotations

import os
import time

import pytest

from bench import efficiency
from bench.procs import cpu_seconds

GIB = 1 << 30


def test_cpu_deltas_are_the_differences_of_the_counters_without_the_clock() -> None:
    before = {"target": 10.0, "wall": 100.0, "server": 2.5, "agent": 7.25}
    after = {"target": 10.5, "wall": 104.0, "server": 5.75, "agent": 9.0}
    assert efficiency.cpu_deltas(before, after) == {"target": 0.5, "server": 3.25, "agent": 1.75}


def test_cpu_deltas_leave_out_a_process_that_was_replaced_or_vanished() -> None:
    # the agent restarted (its counter began again at 0.4 s); the server is gone from the second snapshot
    before = {"wall": 0.0, "server": 3.0, "agent": 5.0, "target": 1.0}
    after = {"wall": 4.0, "agent": 0.4, "target": 1.2}
    assert efficiency.cpu_deltas(before, after) == {"target": 0.2}


def test_bulk_cost_is_per_gibibyte_received() -> None:
    # 1.5 GiB moved; server 0.9 s, agent 0.6 s
    raw = {"bytes": 3 * GIB // 2, "elapsed_s": 4.0}
    per = efficiency.cpu_per_unit("bulk", raw, {"server": 0.9, "agent": 0.6, "loadgen": 0.3})
    assert per == pytest.approx({"server+agent": 1.0, "server": 0.6, "agent": 0.4})


def test_bulk_in_decimal_gigabytes_would_be_a_different_figure() -> None:
    # 10^9 bytes is 0.931 GiB: per GiB costs 7.4 % more than per GB
    per = efficiency.cpu_per_unit("bulk", {"bytes": 10**9}, {"server": 1.0, "agent": 0.0})
    assert per["server"] == pytest.approx(GIB / 10**9)
    assert per["server"] == pytest.approx(1.0737, abs=1e-4)


def test_connect_cost_is_per_thousand_streams_answered_not_attempted() -> None:
    # 500 tried, 400 answered; 2 s of server, 1 s of agent
    raw = {"ok": 400, "errors": {"count": 100}}
    per = efficiency.cpu_per_unit("connect", raw, {"server": 2.0, "agent": 1.0})
    assert per == pytest.approx({"server+agent": 7.5, "server": 5.0, "agent": 2.5})


def test_idle_cost_is_per_thousand_streams_established_not_requested() -> None:
    # 10,000 asked for, 8,000 open when the client said ready; 40 s of server, 12 of agent
    raw = {"requested": 10000, "established": 8000, "alive": 7990, "open_per_s": 200.0}
    per = efficiency.cpu_per_unit("idle", raw, {"server": 40.0, "agent": 12.0})
    assert per == pytest.approx({"server+agent": 6.5, "server": 5.0, "agent": 1.5})


def test_rr_cost_is_per_thousand_requests_completed_not_scheduled() -> None:
    # saturated: 20,000 scheduled, 13,980 completed
    raw = {"scheduled": 20000, "completed": 13980, "achieved_rps": 3495}
    per = efficiency.cpu_per_unit("rr", raw, {"server": 2.16, "agent": 1.76})
    assert per["server+agent"] == pytest.approx(3.92 / 13.98)
    assert per["server"] == pytest.approx(0.154506, rel=1e-5)


def test_no_work_done_gives_no_figure_rather_than_a_division_by_zero() -> None:
    assert efficiency.cpu_per_unit("bulk", {"bytes": 0}, {"server": 1.0, "agent": 1.0}) == {}
    assert efficiency.cpu_per_unit("connect", {"ok": 0}, {"server": 1.0, "agent": 1.0}) == {}
    assert efficiency.cpu_per_unit("idle", {"established": 0}, {"server": 1.0}) == {}
    assert efficiency.cpu_per_unit("hol", {"bytes": 5}, {"server": 1.0}) == {}


def test_server_plus_agent_needs_both_processes_measured() -> None:
    per = efficiency.cpu_per_unit("rr", {"completed": 2000}, {"server": 1.0})
    assert per == pytest.approx({"server": 0.5})


def record(workload: str, variant: str, system: str, raw: dict, server: float, agent: float) -> dict:
    return {
        "workload": workload,
        "variant": variant,
        "system": system,
        "rep": 0,
        "metrics": {},
        "raw": raw,
        "cpu": {"server": 50.0, "agent": 50.0},
        "cpu_s": {"server": server, "agent": agent},
    }


def test_summary_is_the_median_over_repeats_of_each_repeat_s_quotient() -> None:
    # per repeat: 1.0, 3.0 and 2.5 CPU-s per GiB; the median of the quotients is 2.5, while the
    # quotient of the summed CPU by the summed bytes would be 6.25 / 3 = 2.08
    records = [
        record("bulk", "down-1stream", "ours", {"bytes": GIB}, 0.5, 0.5),
        record("bulk", "down-1stream", "ours", {"bytes": GIB // 2}, 1.0, 0.5),
        record("bulk", "down-1stream", "ours", {"bytes": 3 * GIB // 2}, 2.0, 1.75),
    ]
    summary = efficiency.summarize(records)
    assert summary[("bulk", "down-1stream")]["ours"]["server+agent"] == pytest.approx(2.5)
    assert summary[("bulk", "down-1stream")]["ours"]["server"] == pytest.approx(4 / 3)  # 0.5, 2, 4/3


def test_summary_skips_failed_runs_and_records_without_cpu_seconds() -> None:
    old = record("rr", "500rps", "ours", {"completed": 2000}, 1.0, 1.0)
    del old["cpu_s"]  # a results.json from before cpu_s was recorded: percent alone
    failed = {**record("rr", "500rps", "ours", {"completed": 2000}, 9.0, 9.0), "error": "loadgen exited 1"}
    good = record("rr", "500rps", "ours", {"completed": 2000}, 0.5, 0.3)
    summary = efficiency.summarize([old, failed, good])
    assert summary[("rr", "500rps")]["ours"]["server+agent"] == pytest.approx(0.4)
    assert efficiency.summarize([old]) == {}


def test_markdown_puts_ours_and_upstream_side_by_side_with_their_quotient() -> None:
    records = [
        record("connect", "seq-500", "ours", {"ok": 500}, 2.0, 1.0),
        record("connect", "seq-500", "upstream", {"ok": 500}, 0.5, 0.5),
        record("bulk", "up-8streams", "ours", {"bytes": 2 * GIB}, 1.2, 1.0),
        record("bulk", "up-8streams", "upstream", {"bytes": 4 * GIB}, 1.0, 1.2),
        record("bulk", "down-1stream", "ours", {"bytes": GIB}, 0.4, 0.3),
    ]
    text = "\n".join(efficiency.markdown(records))
    assert "| connect | seq-500 | CPU-s per 1,000 connects | 6 | 2 | 3.00 | 4 | 1 | 2 | 1 |" in text
    assert "| bulk | up-8streams | CPU-s per GiB | 1.1 | 0.55 | 2.00 | 0.6 | 0.25 | 0.5 | 0.3 |" in text
    # only ours ran it: no quotient
    assert "| bulk | down-1stream | CPU-s per GiB | 0.7 | - | - | 0.4 | - | 0.3 | - |" in text
    rows = [line for line in text.splitlines() if line.startswith("| bulk") or line.startswith("| connect")]
    assert [row.split(" | ")[1] for row in rows] == ["down-1stream", "up-8streams", "seq-500"]


def test_own_cpu_counter_moves_with_work() -> None:
    """The counter the deltas come from (/proc/self/stat) advances when this process computes."""
    start, wall_deadline = cpu_seconds(os.getpid()), time.monotonic() + 10
    while cpu_seconds(os.getpid()) - start < 0.05 and time.monotonic() < wall_deadline:
        sum(range(10000))
    assert cpu_seconds(os.getpid()) - start >= 0.05


def test_idle_tunnel_cost_is_percent_of_a_core_scaled_to_a_thousand_tunnels() -> None:
    # 500 idle tunnels; over 20 s the server used 0.6 CPU-s (3 % of a core), the agents 0.2 (1 %)
    cost = efficiency.idle_tunnel_cost({"server": 0.6, "agents": 0.2}, 20.0, 500)
    assert cost == pytest.approx(
        {"server_pct_per_1k_idle_tunnels": 6.0, "agents_pct_per_1k_idle_tunnels": 2.0}
    )
    assert efficiency.idle_tunnel_cost({"server": 0.6}, 0.0, 500) == {}
    assert efficiency.idle_tunnel_cost({"server": 0.6}, 20.0, 0) == {}


def test_markdown_orders_rates_by_number_not_by_text() -> None:
    records = [
        record("rr", f"{rate}rps", "ours", {"completed": 1000}, 0.1, 0.1) for rate in (5000, 500, 2000)
    ]
    rows = [line for line in efficiency.markdown(records) if line.startswith("| rr")]
    assert [row.split(" | ")[1] for row in rows] == ["500rps", "2000rps", "5000rps"]
