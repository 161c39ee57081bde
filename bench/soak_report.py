"""What ``python -m bench.soak`` concludes from a run: whether each process's memory and descriptors
level off, every transfer's outcome (and which failures an agent restart explains), the battery's
answers; as JSON, markdown and a plot. Pure functions of the recorded data, so they are tested on
synthetic samples (tests/unit/test_bench_soak.py).

*Levels off* is the issue's criterion, nothing cleverer: over the last hour of the run (the last half
when the run is shorter than two hours) every sample lies within 10 % of those samples' own mean. The
least-squares slope over the same window is reported beside it, so that a slow climb that stays in
the band is still visible. Open descriptors get the same test with an absolute allowance (FD_SLACK).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HOUR = 3600.0
BAND = 0.10  # a sample more than this far from the window's mean means the level has not settled
# Descriptors are few (10-20 per process) and the mix's own connections in flight at a sample move
# them by up to ~10 in the server or an agent: a 10 % band alone would flag every busy sample. So a
# count of descriptors within FD_SLACK of the mean passes too; a leak still climbs out of it.
FD_SLACK = 16
RESTART_GRACE = 5.0  # seconds after a restarted agent is back in which its cluster's failures are its doing
LISTED = 20  # failures and transfers without their digest listed by name in the report


def window_for(duration: float) -> float:
    """The stretch the verdict looks at: the last hour, or the last half of a run shorter than 2 h."""
    return min(HOUR, duration / 2)


def levels_off(
    points: list[tuple[float, float]], window: float, band: float = BAND, slack: float = 0.0
) -> dict[str, Any]:
    """``points`` as (seconds since the start, value), in time order. Over those of the last
    ``window`` seconds: their mean, the largest relative deviation from it, the slope (per hour), and
    whether every one lies within ``band`` of the mean (or within ``slack`` of it, in the values'
    unit)."""
    if not points:
        return {"samples": 0, "levels_off": None}
    end = points[-1][0]
    inside = [(t, v) for t, v in points if t >= end - window]
    values = [v for _, v in inside]
    mean = sum(values) / len(values)
    farthest = max(abs(v - mean) for v in values)
    worst = farthest / mean if mean else 0.0
    return {
        "window_s": round(window, 1),
        "samples": len(values),
        "mean": round(mean, 1),
        "worst_deviation": round(worst, 4),
        "slope_per_hour": round(_slope(inside) * HOUR, 1),
        "levels_off": worst <= band or farthest <= slack,
    }


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of value over seconds (0 for fewer than two distinct times)."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return 0.0
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / spread


def series(samples: list[dict[str, Any]], process: str, key: str) -> list[tuple[float, float, int]]:
    """(t, value, pid) of ``process``'s ``key`` in the sampler's records (a process gone at that
    sample is absent from it)."""
    return [
        (s["t"], s["processes"][process][key], s["processes"][process]["pid"])
        for s in samples
        if process in s["processes"]
    ]


def process_summary(samples: list[dict[str, Any]], process: str, duration: float) -> dict[str, Any]:
    """RSS (KiB) and open descriptors of one process: first, min, max, last, and the verdict over
    :func:`window_for` the run; the CPU it used. A process restarted within the window gets no
    verdict: its samples there belong to two processes."""
    window = window_for(duration)
    rss = series(samples, process, "rss_kib")
    if not rss:
        return {"samples": 0}
    end = rss[-1][0]
    pids = list(dict.fromkeys(pid for _, _, pid in rss))
    restarted_inside = len({pid for t, _, pid in rss if t >= end - window}) > 1
    out: dict[str, Any] = {"samples": len(rss), "pids": len(pids)}
    for key in ("rss_kib", "fds"):
        points = [(t, v) for t, v, _ in series(samples, process, key)]
        values = [v for _, v in points]
        figures = {"first": values[0], "min": min(values), "max": max(values), "last": values[-1]}
        verdict = levels_off(points, window, slack=FD_SLACK if key == "fds" else 0.0)
        if restarted_inside:
            verdict["levels_off"] = None
            verdict["why_none"] = "restarted within the window"
        out[key] = figures | verdict
    # CPU: each incarnation's own counter, from its first sample to its last
    cpu = 0.0
    for pid in pids:
        used = [v for _, v, p in series(samples, process, "cpu_s") if p == pid]
        cpu += used[-1] - used[0]
    out["cpu_s"] = round(cpu, 1)
    out["cpu_share"] = round(cpu / duration, 4) if duration else 0.0
    return out


@dataclass(frozen=True)
class Transfer:
    """One stream of the load mix, as it ended. ``outcome``: ``ok`` (both digests match), ``no-digest``
    (it ended cleanly, yet a digest is missing or differs: the integrity failure), ``error`` (it
    ended with an error: a reset, a refusal, a timeout; ``detail`` names it)."""

    flow: str
    cluster: str
    started: float  # seconds since the run's start
    ended: float
    outcome: str
    detail: str = ""
    bytes: int = 0  # both ways, of the transfers that completed


@dataclass(frozen=True)
class Restart:
    """An agent SIGKILLed at ``killed`` and registered again at ``back`` (seconds since the start)."""

    cluster: str
    killed: float
    back: float


def classify(transfer: Transfer, restarts: list[Restart], grace: float = RESTART_GRACE) -> str:
    """``ok``, ``without digest``, ``broken by a restart`` or ``failed``. Only an error can be a
    restart's doing, and only on that agent's cluster while it was down (plus ``grace``): a clean end
    without the digest is never excused."""
    if transfer.outcome == "ok":
        return "ok"
    if transfer.outcome == "no-digest":
        return "without digest"
    for restart in restarts:
        if (
            restart.cluster == transfer.cluster
            and transfer.started <= restart.back + grace
            and transfer.ended >= restart.killed
        ):
            return "broken by a restart"
    return "failed"


def transfer_summary(transfers: list[Transfer], restarts: list[Restart]) -> dict[str, Any]:
    """Counts per flow and in total; failures by kind; the first transfers without their digest."""
    flows: dict[str, Counter[str]] = {}
    kinds: Counter[str] = Counter()
    failed: list[dict[str, Any]] = []
    undigested: list[dict[str, Any]] = []
    moved = 0
    for transfer in transfers:
        verdict = classify(transfer, restarts)
        flows.setdefault(transfer.flow, Counter())[verdict] += 1
        moved += transfer.bytes
        if verdict == "failed":
            kinds[f"{transfer.flow}: {transfer.detail.split(':', 1)[0]}"] += 1
            failed.append(asdict(transfer))
        elif verdict == "without digest":
            undigested.append(asdict(transfer))
    total: Counter[str] = Counter()
    for counts in flows.values():
        total.update(counts)
    return {
        "total": {k: total[k] for k in ("ok", "failed", "broken by a restart", "without digest")},
        "by_flow": {flow: dict(counts) for flow, counts in sorted(flows.items())},
        "failures_by_kind": dict(kinds.most_common()),
        "bytes_checked": moved,
        "failed_first": failed[:LISTED],
        "without_digest_first": undigested[:LISTED],
    }


def battery_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of the battery, each ``{"t", "server_rss_kib_before", "server_rss_kib_after", "results":
    [{"name", "ok", "answer", "seconds", "bound"}]}``: how many attacks got their right answer, the
    wrong ones, and each attack's answer times over the rounds."""
    results = [r | {"t": round_["t"]} for round_ in rounds for r in round_["results"]]
    by_case: dict[str, list[float]] = {}
    for r in results:
        by_case.setdefault(r["name"], []).append(r["seconds"])
    return {
        "rounds": len(rounds),
        "attacks": len(results),
        "answered_right": sum(r["ok"] for r in results),
        "wrong": [r for r in results if not r["ok"]],
        "seconds_by_case": {
            name: {"min": round(min(s), 3), "max": round(max(s), 3)} for name, s in by_case.items()
        },
        "last_answers": {r["name"]: r["answer"] for r in (rounds[-1]["results"] if rounds else [])},
    }


def _span(seconds: float) -> str:
    """``45 s``, ``3 min``, ``2 h 05 min``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * HOUR:
        return f"{seconds / 60:.0f} min"
    return f"{seconds // HOUR:.0f} h {seconds % HOUR / 60:02.0f} min"


def _mib(kib: float) -> str:
    return f"{kib / 1024:.1f}"


def _verdict(figures: dict[str, Any]) -> str:
    if figures.get("levels_off") is None:
        return f"n/a ({figures.get('why_none', 'no samples')})"
    return "yes" if figures["levels_off"] else "**no**"


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown (the figures docs/benchmarks.md takes)."""
    run, transfers, battery = report["run"], report["transfers"], report["battery"]
    lines = [
        f"# Soak: {_span(run['duration_s'])}, {run['started_utc']}",
        "",
        f"Mix: {run['mix']}. Battery every {run['battery_every_s']:g} s, one agent "
        f"(`{run['restarted']}`) SIGKILLed and restarted every {run['restart_every_s']:g} s, samples "
        f"every {run['sample_every_s']:g} s. Verdict window: the last {_span(run['window_s'])} (every "
        f"sample within {BAND:.0%} of their mean; descriptors also within {FD_SLACK} of it). Load "
        f"average at the end: {run['loadavg']}.",
    ]
    if run.get("skipped"):
        lines += ["", *(f"- skipped: {s}" for s in run["skipped"])]
    lines += [
        "",
        "| process | RSS MiB first / min / max / last | mean (window) | slope MiB/h | levels off | "
        "fds first / min / max / last | fds levels off | CPU (share of a core) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, p in report["processes"].items():
        if not p.get("samples"):
            lines.append(f"| {name} | no samples | | | | | | |")
            continue
        r, f = p["rss_kib"], p["fds"]
        restarts = f" ({p['pids'] - 1} restart{'s' if p['pids'] > 2 else ''})" if p["pids"] > 1 else ""
        lines.append(
            f"| {name}{restarts} | {' / '.join(_mib(r[k]) for k in ('first', 'min', 'max', 'last'))} | "
            f"{_mib(r['mean'])} | {r['slope_per_hour'] / 1024:+.2f} | {_verdict(r)} | "
            f"{' / '.join(str(f[k]) for k in ('first', 'min', 'max', 'last'))} | {_verdict(f)} | "
            f"{p['cpu_share']:.1%} |"
        )
    total = transfers["total"]
    lines += [
        "",
        f"Transfers: **{total['ok']} ok**, {total['failed']} failed, {total['broken by a restart']} broken "
        f"by a restart (an error on the restarted agent's cluster while it was down), "
        f"**{total['without digest']} without their digest**; "
        f"{transfers['bytes_checked'] / (1 << 20):.0f} MiB sha256-checked.",
        "",
        "| flow | ok | failed | broken by a restart | without digest |",
        "|---|---|---|---|---|",
    ]
    for flow, counts in transfers["by_flow"].items():
        lines.append(
            f"| {flow} | {counts.get('ok', 0)} | {counts.get('failed', 0)} | "
            f"{counts.get('broken by a restart', 0)} | {counts.get('without digest', 0)} |"
        )
    if transfers["failures_by_kind"]:
        lines += [
            "",
            "Failures by kind: " + ", ".join(f"{k} x{n}" for k, n in transfers["failures_by_kind"].items()),
        ]
    for t in transfers["without_digest_first"]:
        lines.append(
            f"- without digest: {t['flow']} to {t['cluster']} at {t['started']:.0f} s: {t['detail']}"
        )
    lines += [
        "",
        f"Battery: {battery['rounds']} rounds, {battery['answered_right']} of {battery['attacks']} attacks "
        f"got their right answer.",
    ]
    for wrong in battery["wrong"][:LISTED]:
        lines.append(f"- at {wrong['t']:.0f} s, {wrong['name']}: {wrong['answer']}")
    if battery["seconds_by_case"]:
        lines += ["", "| attack | answer (last round) | seconds min-max |", "|---|---|---|"]
        for name, s in battery["seconds_by_case"].items():
            answer = battery["last_answers"].get(name, "")
            answer = answer if len(answer) <= 100 else answer[:97] + "..."
            lines.append(f"| {name} | {answer} | {s['min']:.2f}-{s['max']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(samples: list[dict[str, Any]], report: dict[str, Any], path: Path) -> str | None:
    """RSS and open descriptors of every process over the run, battery rounds and agent restarts
    marked; None when written, else why not (no matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot (matplotlib missing: {exc})"
    fig, (rss_axis, fd_axis) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name in report["processes"]:
        rss = series(samples, name, "rss_kib")
        if not rss:
            continue
        minutes = [t / 60 for t, _, _ in rss]
        rss_axis.plot(minutes, [v / 1024 for _, v, _ in rss], label=name, linewidth=1)
        fd_axis.plot(minutes, [v for _, v, _ in series(samples, name, "fds")], label=name, linewidth=1)
    end = samples[-1]["t"] if samples else 0.0
    window = report["run"]["window_s"]
    for axis in (rss_axis, fd_axis):
        axis.axvspan((end - window) / 60, end / 60, color="green", alpha=0.05)
        for t in report["battery_times"]:
            axis.axvline(t / 60, color="red", alpha=0.25, linewidth=1)
        for restart in report["restarts"]:
            axis.axvline(restart["killed"] / 60, color="black", alpha=0.6, linestyle=":", linewidth=1)
        axis.grid(alpha=0.3)
    rss_axis.set_ylabel("RSS (MiB)")
    fd_axis.set_ylabel("open fds")
    fd_axis.set_xlabel("minutes (red: battery rounds, dotted: agent restarts, shaded: the verdict's window)")
    rss_axis.set_title(f"Soak: {_span(report['run']['duration_s'])}, {report['run']['started_utc']}")
    rss_axis.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def build(
    *,
    run: dict[str, Any],
    samples: list[dict[str, Any]],
    transfers: list[Transfer],
    restarts: list[Restart],
    battery_rounds: list[dict[str, Any]],
) -> dict[str, Any]:
    """The whole report (JSON-able)."""
    names = list(dict.fromkeys(name for s in samples for name in s["processes"]))
    return {
        "run": run | {"window_s": window_for(run["duration_s"])},
        "processes": {name: process_summary(samples, name, run["duration_s"]) for name in names},
        "transfers": transfer_summary(transfers, restarts),
        "battery": battery_summary(battery_rounds),
        "battery_times": [r["t"] for r in battery_rounds],
        "restarts": [asdict(r) for r in restarts],
    }


def write(out: Path, report: dict[str, Any], samples: list[dict[str, Any]]) -> list[str]:
    """report.json, report.md and rss_fds.png in ``out``; the notes (a plot that could not be made)."""
    (out / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    (out / "report.md").write_text(markdown(report))
    why = plot(samples, report, out / "rss_fds.png")
    return [why] if why else []
