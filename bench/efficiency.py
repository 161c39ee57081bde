"""CPU-seconds per unit of work (issue 17, point 3): per GiB moved (bulk), per 1,000 new streams
(connect: one at a time; idle: opened 64 at a time, the busiest a server gets from new connections)
and per 1,000 requests (rr), for the server, the agent and the two together.

The CPU-seconds are the deltas of each process's utime+stime (/proc/PID/stat, a server's
``--workers`` children counted as the server) between just before a loadgen client starts and just
after it exits; the work is what that client reports it moved, opened or completed in the same run.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable

GIB = 1 << 30
ROLES = ("server+agent", "server", "agent")
# workload -> the unit of work, as it reads in a column heading
UNITS = {"bulk": "GiB", "connect": "1,000 connects", "idle": "1,000 streams opened", "rr": "1,000 requests"}


def cpu_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU-seconds each process used between two snapshots ({role: cumulative CPU-seconds}).

    A role missing from either snapshot, or whose counter went backwards (the process was replaced
    by another, whose counter starts again at zero), is left out rather than reported as a guess.
    """
    deltas = {}
    for role, start in before.items():
        if role == "wall" or role not in after:
            continue
        used = after[role] - start
        if used >= 0:
            deltas[role] = round(used, 3)
    return deltas


def work_units(workload: str, raw: dict) -> float | None:
    """How many units of work (see UNITS) a loadgen result reports, or None if it reports none."""
    if workload == "bulk":
        done = raw.get("bytes", 0) / GIB
    elif workload == "connect":
        done = raw.get("ok", 0) / 1000
    elif workload == "idle":
        done = raw.get("established", 0) / 1000
    elif workload == "rr":
        done = raw.get("completed", 0) / 1000
    else:
        return None
    return done if done > 0 else None


def cpu_per_unit(workload: str, raw: dict, cpu_s: dict[str, float]) -> dict[str, float]:
    """{role: CPU-seconds per unit of work} for the server, the agent and both together."""
    units = work_units(workload, raw)
    if units is None:
        return {}
    out = {}
    if "server" in cpu_s and "agent" in cpu_s:
        out["server+agent"] = (cpu_s["server"] + cpu_s["agent"]) / units
    for role in ("server", "agent"):
        if role in cpu_s:
            out[role] = cpu_s[role] / units
    return out


def idle_tunnel_cost(cpu_s: dict[str, float], window_s: float, tunnels: int) -> dict[str, float]:
    """% of one core that 1,000 idle tunnels keep busy (keepalives and timers), server and agents.

    From the CPU-seconds ``cpu_s`` ({"server": .., "agents": ..}) used over ``window_s`` seconds by a
    server holding ``tunnels`` idle tunnels and by the agents holding them.
    """
    if window_s <= 0 or tunnels <= 0:
        return {}
    scale = 100 / window_s * 1000 / tunnels
    return {
        f"{role}_pct_per_1k_idle_tunnels": round(cpu_s[role] * scale, 3)
        for role in ("server", "agents")
        if role in cpu_s
    }


def summarize(records: Iterable[dict]) -> dict[tuple[str, str], dict[str, dict[str, float]]]:
    """Median over repeats: {(workload, variant): {system: {role: CPU-seconds per unit}}}.

    Only records with CPU-second deltas (``cpu_s``, written since this module exists) count: older
    results carry a utilisation percentage alone, and wall time x percentage is not a measurement.
    """
    acc: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in records:
        if r.get("error") or "cpu_s" not in r or r["workload"] not in UNITS:
            continue
        for role, value in cpu_per_unit(r["workload"], r.get("raw", {}), r["cpu_s"]).items():
            acc[(r["workload"], r["variant"])][r["system"]][role].append(value)
    return {
        key: {
            system: {role: statistics.median(vs) for role, vs in roles.items()}
            for system, roles in systems.items()
        }
        for key, systems in acc.items()
    }


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def markdown(records: list[dict], a: str = "ours", b: str = "upstream") -> list[str]:
    """The efficiency table, `a` and `b` side by side with a/b for server+agent (lower is better)."""
    summary = summarize(records)
    if not summary:
        return []
    order = {w: i for i, w in enumerate(UNITS)}

    def key(item: tuple[str, str]) -> tuple:
        digits = "".join(ch for ch in item[1] if ch.isdigit())
        direction = item[1].split("-")[0] if "-" in item[1] else ""  # bulk's up/down; rr's rates alone
        return (order[item[0]], direction, int(digits) if digits else 0, item[1])

    lines = [
        "## CPU-seconds per unit of work (median over repeats; lower is better)",
        "",
        "Server and agent CPU time (utime+stime from /proc/PID/stat, a server's worker processes",
        "included) used while one loadgen client ran, divided by what that client moved (bulk: GiB",
        "received by the far end), opened (connect: new streams answered, one at a time; idle: streams",
        "opened 64 at a time, counted until the last is open) or completed (rr: 1 KiB requests",
        "answered). The interval includes the client's own tunnel setup (rr: its 16 streams), so the",
        "connect cost is also inside the rr figure, a few percent of it at 500 req/s.",
        "",
        f"| workload | variant | unit | {a} server+agent | {b} server+agent | {a}/{b} "
        f"| {a} server | {b} server | {a} agent | {b} agent |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, variant in sorted(summary, key=key):
        by_system = summary[(workload, variant)]
        x, y = by_system.get(a, {}), by_system.get(b, {})
        both = x.get("server+agent"), y.get("server+agent")
        ratio = f"{both[0] / both[1]:.2f}" if both[0] is not None and both[1] else "-"
        lines.append(
            f"| {workload} | {variant} | CPU-s per {UNITS[workload]} | {_cell(both[0])} | {_cell(both[1])} "
            f"| {ratio} | {_cell(x.get('server'))} | {_cell(y.get('server'))} "
            f"| {_cell(x.get('agent'))} | {_cell(y.get('agent'))} |"
        )
    others = sorted({s for systems in summary.values() for s in systems} - {a, b})
    if others:
        lines += ["", "Other systems, server+agent:", ""]
        for workload, variant in sorted(summary, key=key):
            cells = [
                f"{s} {_cell(summary[(workload, variant)].get(s, {}).get('server+agent'))}" for s in others
            ]
            lines.append(f"- {workload} {variant} (CPU-s per {UNITS[workload]}): {', '.join(cells)}")
    lines.append("")
    return lines
