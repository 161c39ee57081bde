"""results.json -> results.md (tables) and PNG plots."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from bench import efficiency


def results_folder(out: Path, *, fresh: bool = False) -> str | None:
    """Make the folder a tool writes its results into; with ``fresh``, one that already holds
    anything is refused (the reason is returned), so that no run's files mix with another's."""
    out.mkdir(parents=True, exist_ok=True)
    if fresh and any(out.iterdir()):
        return f"{out} is not empty; give a new folder"
    return None


def write_results(out: Path, results: dict, markdown_text: str) -> None:
    """``results.json`` (what is not JSON written as its ``str``) and ``results.md`` in ``out``."""
    results_folder(out)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "results.md").write_text(markdown_text if markdown_text.endswith("\n") else markdown_text + "\n")


SYSTEM_ORDER = ("direct", "ours", "upstream", "ours-websocket", "ours-grpc", "upstream-grpc", "floor")
# Quotients shown where both systems ran: (numerator, denominator). The first is this project against
# upstream as cluster-proxy runs it; the second the same in konnectivity gRPC (the seed's own mode);
# the third what the WebSocket carrier costs against the plain tunnel; the fourth what ours' features
# cost over the floor of the same stack (bench/floor).
RATIOS = (("ours", "upstream"), ("ours-grpc", "upstream-grpc"), ("ours-websocket", "ours"), ("ours", "floor"))

# (workload, metric) -> (label, unit, higher_is_better); only these appear in the main table.
METRICS: dict[tuple[str, str], tuple[str, str, bool]] = {
    ("bulk", "mbit_s"): ("throughput", "Mbit/s", True),
    ("connect", "first_byte_p50_ms"): ("new stream to first byte p50", "ms", False),
    ("connect", "first_byte_p99_ms"): ("new stream to first byte p99", "ms", False),
    ("connect", "connect_200_p50_ms"): ("CONNECT answered (200) / DIAL_RSP p50", "ms", False),
    ("rr", "p50_ms"): ("1 KiB req/resp latency p50", "ms", False),
    ("rr", "p99_ms"): ("1 KiB req/resp latency p99", "ms", False),
    ("rr", "achieved_rps"): ("achieved rate", "req/s", True),
    ("idle", "established"): ("streams opened within the time limit", "streams", True),
    ("idle", "alive"): ("streams alive after hold", "streams", True),
    ("idle", "server_kib_per_stream"): ("server RSS per stream", "KiB", False),
    ("idle", "agent_kib_per_stream"): ("agent RSS per stream", "KiB", False),
    ("idle", "open_per_s"): ("streams opened per second", "1/s", True),
    ("fanin", "connect_all_s"): ("all agents routable after start", "s", False),
    ("fanin", "reconnect_all_s"): ("all agents routable after server SIGKILL+restart", "s", False),
    ("fanin", "server_kib_per_tunnel"): ("server RSS per tunnel", "KiB", False),
    ("fanin", "agent_kib_per_agent"): (
        "agent RSS per agent (all agents in one process, both systems)",
        "KiB",
        False,
    ),
    ("fanin", "server_pct_per_1k_idle_tunnels"): ("server CPU per 1,000 idle tunnels", "% of a core", False),
    ("fanin", "agents_pct_per_1k_idle_tunnels"): ("agents' CPU per 1,000 idle tunnels", "% of a core", False),
    ("hol", "ratio"): ("4 streams' throughput with a stalled stream / without", "ratio", True),
    ("hol", "alone_mbit_s"): ("4 streams alone", "Mbit/s", True),
    ("hol", "new_stream_ok"): ("new stream opens during the stall", "1=yes", True),
    ("failover", "failover_s"): ("signal to the first new stream through haproxy that worked", "s", False),
    ("failover", "failed_between"): ("new streams failed before that one", "streams", False),
    ("failover", "failed_after"): ("streams failed after the signal (in flight or new)", "streams", False),
    ("failover", "exit_s"): ("signal to the replica's exit", "s", False),
    ("failover", "rejoin_s"): ("successor listening to every agent holding it", "s", False),
    ("failover", "slowest_s"): ("slowest new stream begun after the signal", "s", False),
    ("failover", "successor_slowest_s"): ("slowest new stream begun after the successor started", "s", False),
    ("failover", "successor_failed"): ("new streams failed after the successor started", "streams", False),
    ("gateway", "p50_ms"): ("GET /healthz of cluster1's kube-apiserver p50", "ms", False),
    ("gateway", "p99_ms"): ("GET /healthz of cluster1's kube-apiserver p99", "ms", False),
}

WORKLOAD_TITLES = {
    "bulk": "Bulk throughput (variant: direction-streams)",
    "connect": "New-stream latency (sequential)",
    "rr": "Request/response 1 KiB at a fixed rate",
    "idle": "Idle concurrent streams (variant: streams held)",
    "fanin": "Fan-in: many agents on one server (variant: agents)",
    "hol": "Head-of-line blocking (variant: direction of the stalled stream)",
    "failover": "Failover: 3 replicas behind haproxy, one stopped (variant: the signal)",
    "gateway": "Cluster gateway: direct = cluster1's kube-apiserver, ours = through the hub and the gateway",
}


def summarize(records: list[dict]) -> dict:
    """Median over repeats: {workload: {variant: {metric: {system: value}}}}."""
    acc: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
    for r in records:
        for k, v in r.get("metrics", {}).items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                acc[r["workload"]][r["variant"]][k][r["system"]].append(v)
    out: dict = {}
    for w, variants in acc.items():
        out[w] = {}
        for var, metrics in variants.items():
            out[w][var] = {
                m: {s: round(statistics.median(vals), 3) for s, vals in systems.items()}
                for m, systems in metrics.items()
            }
    return out


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def _variant_key(v: str) -> tuple:
    digits = "".join(ch for ch in v if ch.isdigit())
    return (int(digits) if digits else 0, v)


def markdown(results: dict) -> str:
    summary = results["summary"]
    meta = results["meta"]
    lines = [
        "# Benchmark results",
        "",
        f"- run: {meta['started']} ({'quick' if meta['quick'] else 'full'} mode), {meta['elapsed_s']} s",
        f"- command: `{meta['command']}`",
        f"- machine: {meta['machine']}",
        f"- upstream: apiserver-network-proxy {meta.get('anp_version', '?')} (upstream: --mode=http-connect;"
        " upstream-grpc: --mode=grpc; destHost, mTLS)",
        f"- systems run: {', '.join(meta['systems'])}",
        f"- load average (1/5/15 min) before: {meta.get('loadavg_before', '?')}, after: {meta.get('loadavg_after', '?')}"
        " (other work on the machine shows here; the run itself adds ~2)",
        "",
        "Values are medians over repeats. a/b is the plain quotient; `better` says which of the two",
        "wins on that metric (within 5 %: even): higher is better for throughput, rates, counts and the",
        "head-of-line ratio; lower is better for latencies, times and memory. Systems: ours and upstream",
        "through HTTP/1.1 CONNECT; ours-websocket: ours with its agent's tunnel in a WebSocket (ws://",
        "to the server's --agent-websocket-listen port, no ingress); ours-grpc and upstream-grpc: the",
        "same loadgen as a konnectivity gRPC client (CreateSingleUseGrpcTunnel per stream) to our",
        "client port and to upstream's proxy-server --mode=grpc.",
        "",
    ]
    if results.get("skipped"):
        lines += ["Skipped or failed to start:", ""]
        lines += [f"- {k}: {v.splitlines()[0][:300]}" for k, v in results["skipped"].items()]
        lines.append("")
    errors = [r for r in results["records"] if r.get("error")]
    if errors:
        lines += ["Failed runs:", ""]
        for r in errors:
            first = r["error"].strip().splitlines()[0][:300] if r["error"].strip() else ""
            lines.append(f"- {r['workload']}/{r['variant']}/{r['system']} rep {r['rep']}: {first}")
        lines.append("")
    for w in WORKLOAD_TITLES:
        if w not in summary:
            continue
        ran = {s for var in summary[w].values() for vals in var.values() for s in vals}
        # direct, ours and upstream always (as before); the variants where they ran; unknown names last.
        columns = [s for s in SYSTEM_ORDER if s in ran or s in SYSTEM_ORDER[:3]]
        columns += sorted(ran - set(columns))
        pairs = [(a, b) for a, b in RATIOS if a in ran and b in ran]
        lines += [f"## {WORKLOAD_TITLES[w]}", ""]
        lines += [
            (
                "| variant | metric | "
                + "".join(f"{c} | " for c in columns)
                + "".join(f"{a}/{b} | better | " for a, b in pairs)
            ).rstrip(),
            "|---|---|" + "---:|" * len(columns) + "---:|---|" * len(pairs),
        ]
        for var in sorted(summary[w], key=_variant_key):
            for (wk, m), (label, unit, higher) in METRICS.items():
                if wk != w or m not in summary[w][var]:
                    continue
                vals = summary[w][var][m]
                cells = "".join(f"{_fmt(vals.get(c))} | " for c in columns)
                quotients = "".join(
                    f"{q} | {win} | " for q, win in (_compare(vals, a, b, higher) for a, b in pairs)
                )
                lines.append(f"| {var} | {label} ({unit}) | {cells}{quotients}".rstrip())
        lines.append("")
        loads = [
            float(r["loadavg"].split()[0])
            for r in results["records"]
            if r["workload"] == w and r.get("loadavg") and w != "failover"
        ]
        if loads:
            lines += [
                f"1-minute load average as each measurement ended: {min(loads):.2f}-{max(loads):.2f}"
                f" (median {statistics.median(loads):.2f}).",
                "",
            ]
        if w == "failover":
            lines += failover_details(results["records"], results.get("settings", {}).get("failover", {}))
        if w == "gateway":
            lines += gateway_details(summary[w])
    if meta.get("commands"):
        lines += ["## How the systems were started", ""]
        for name, roles in meta["commands"].items():
            for role, argv in roles.items():
                lines += [
                    f"{name} {role}:",
                    "",
                    "```",
                    " ".join(_shell_word(_short(a)) for a in argv),
                    "```",
                    "",
                ]
    for name, text in meta.get("configs", {}).items():
        lines += [f"{name}:", "", "```", text.rstrip(), "```", ""]
    cpu_rows = _cpu_rows(results["records"])
    if cpu_rows:
        lines += [
            "## CPU use during the runs (% of one core, median over repeats)",
            "",
            "Shows which process limits a run: a process near 100 % is saturated (the machine has 2 cores).",
            "",
            "| workload | variant | system | loadgen | target | server | agent |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        lines += cpu_rows
        lines.append("")
    lines += efficiency.markdown(results["records"])
    if any(r["system"] == "floor" for r in results["records"]):
        lines += efficiency.markdown(results["records"], "ours", "floor")
    return "\n".join(lines)


def _compare(vals: dict, a: str, b: str, higher: bool) -> tuple[str, str]:
    """(a/b, which of the two is better) for one metric's values by system."""
    x, y = vals.get(a), vals.get(b)
    if x is None or y is None:
        return "-", "-"
    if y:
        r = x / y
        if 0.95 <= r <= 1.05:
            return f"{r:.2f}", "even"
        return f"{r:.2f}", a if (r > 1) == higher else b
    if x > 0:
        return "-", a if higher else b
    return "-", "-"


def _spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    """median / min / max of the values (times ``scale``), or "-"."""
    if not values:
        return "-"
    med, lo, hi = (v * scale for v in (statistics.median(values), min(values), max(values)))
    return f"{med:.{digits}f} / {lo:.{digits}f} / {hi:.{digits}f}"


def failover_details(records: list[dict], settings: dict) -> list[str]:
    """The failover rows with median / min / max over the repeats, the load and the errors seen."""
    runs: dict = defaultdict(list)
    for r in records:
        if r["workload"] == "failover" and r.get("metrics"):
            runs[(r["variant"], r["system"])].append(r)
    if not runs:
        return []
    order = {s: i for i, s in enumerate(SYSTEM_ORDER)}
    drained: dict[str, str] = {}
    late: list[str] = []
    lines = [
        "Each repeat signals one replica while `loadgen churn` opens new streams through haproxy",
        f"({settings.get('workers', '?')} workers, one stream after another with {settings.get('gap_ms', '?')} ms"
        " between, each a CONNECT and a 16-byte echo), watched for"
        f" {settings.get('window', '?')} s; haproxy checks /readyz every {settings.get('check_interval', '?')}."
        " median / min / max:",
        "",
        "| signal | system | runs | to the first new stream that worked (ms) | failed before it "
        "| failed after the signal (of them in flight) | slowest new stream (s) | ok in the window "
        "| streams/s | replica exited after (s) | successor held by every agent after (s) "
        "| load average 1 min |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for (variant, system), rs in sorted(runs.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 9))):

        def col(metric: str, rs=rs) -> list[float]:
            return [r["metrics"][metric] for r in rs if r["metrics"].get(metric) is not None]

        loads = [float(r["loadavg"].split()[0]) for r in rs if r.get("loadavg")]
        load = f"{min(loads, default=0):.2f}-{max(loads, default=0):.2f}"
        if variant.endswith("-late-successor"):
            late.append(
                f"| {system} | {len(rs)} | {_spread(col('rejoin_s'), digits=2)} "
                f"| {_spread(col('successor_slowest_s'), digits=2)} | {_spread(col('successor_failed'))} "
                f"| {_spread(col('successor_ok'))} | {load} |"
            )
            continue
        missing = sum(1 for r in rs if r["metrics"].get("failover_s") is None)
        first = _spread(col("failover_s"), 1000, 1) + (f" ({missing} runs: none)" if missing else "")
        lines.append(
            f"| {variant} | {system} | {len(rs)} | {first} | {_spread(col('failed_between'))} "
            f"| {_spread(col('failed_after'))} (in flight: {_spread(col('failed_in_flight'))}) "
            f"| {_spread(col('slowest_s'), digits=2)} "
            f"| {_spread(col('ok_after'))} | {_spread(col('streams_per_s'))} "
            f"| {_spread(col('exit_s'), digits=2)} | {_spread(col('rejoin_s'), digits=2)} | {load} |"
        )
        if variant == "sigterm":
            failed = sum(col("failed_after"))
            drained[system] = "0 failed" if failed == 0 else f"**{failed:.0f} failed** (expected 0)"
    if drained:
        lines += [
            "",
            "A drain (SIGTERM) must fail no stream: " + ", ".join(f"{k}: {v}" for k, v in drained.items()),
        ]
    if late:
        lines += [
            "",
            f"SIGKILL, the successor starting {settings.get('late_absence', '?')} s later, the client going on"
            " until every agent holds it (median / min / max):",
            "",
            "| system | runs | successor held by every agent after (s) | slowest new stream begun after "
            "it started (s) | failed | ok | load average 1 min |",
            "|---|---|---:|---:|---:|---:|---|",
            *late,
        ]
    errors = sorted(
        {
            (r["system"], r["variant"], e)
            for rs in runs.values()
            for r in rs
            for e in r.get("errors_after", [])
        }
    )
    if errors:
        lines += ["", "Errors the client saw after the signal:", ""]
        lines += [f"- {system} {variant}: `{e}`" for system, variant, e in errors]
    lines.append("")
    return lines


def gateway_details(summary: dict) -> list[str]:
    """ours/direct per variant: what the hub, the aggregator, the gateway and the tunnel add."""
    lines = []
    for variant, metrics in sorted(summary.items()):
        parts = []
        for metric in ("p50_ms", "p99_ms"):
            vals = metrics.get(metric, {})
            if vals.get("direct") and vals.get("ours") is not None:
                parts.append(
                    f"{metric[:3]} {vals['ours']:.1f} ms against {vals['direct']:.1f} "
                    f"(+{vals['ours'] - vals['direct']:.1f} ms, x{vals['ours'] / vals['direct']:.1f})"
                )
        if parts:
            lines.append(f"- {variant}: through the hub and the gateway {'; '.join(parts)}")
    return [*lines, ""] if lines else []


def _shell_word(arg: str) -> str:
    """The argument as typed in a shell (quoted when it has a space: a header flag's value)."""
    return f"'{arg}'" if " " in arg else arg


def _short(arg: str) -> str:
    """Shorten run-specific paths in a command line for the report."""
    for marker in ("/pki/", "/bin/"):
        if marker in arg:
            head, _, tail = arg.rpartition(marker)
            prefix = head.split("=", 1)[0] + "=" if "=" in head else ""
            return f"{prefix}…{marker}{tail}"
    return arg


def _cpu_rows(records: list[dict]) -> list[str]:
    acc: dict = defaultdict(lambda: defaultdict(list))
    for r in records:
        if "cpu" in r and r["workload"] in ("bulk", "connect", "rr"):
            for k, v in r["cpu"].items():
                acc[(r["workload"], r["variant"], r["system"])][k].append(v)
    rows = []
    order = {s: i for i, s in enumerate(SYSTEM_ORDER)}
    for (w, var, s), cols in sorted(
        acc.items(), key=lambda kv: (kv[0][0], _variant_key(kv[0][1]), order.get(kv[0][2], 9))
    ):

        def med(k: str, cols=cols) -> str:
            return f"{statistics.median(cols[k]):.0f}" if cols.get(k) else "-"

        rows.append(
            f"| {w} | {var} | {s} | {med('loadgen')} | {med('target')} | {med('server')} | {med('agent')} |"
        )
    return rows


def plots(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    colors = {
        "direct": "#7f7f7f",
        "ours": "#1f77b4",
        "upstream": "#ff7f0e",
        "ours-websocket": "#17becf",
        "ours-grpc": "#2ca02c",
        "upstream-grpc": "#d62728",
        "floor": "#9467bd",
    }
    made: list[Path] = []

    def bars(workload: str, metric: str, title: str, ylabel: str, fname: str, log: bool = False) -> None:
        if workload not in summary:
            return
        variants = sorted((v for v in summary[workload] if metric in summary[workload][v]), key=_variant_key)
        if not variants:
            return
        systems = [s for s in SYSTEM_ORDER if any(s in summary[workload][v][metric] for v in variants)]
        fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(variants) + 2), 3.6))
        width = 0.8 / max(len(systems), 1)
        for i, s in enumerate(systems):
            xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(variants))]
            ys = [summary[workload][v][metric].get(s, 0) or 0 for v in variants]
            ax.bar(xs, ys, width, label=s, color=colors.get(s))
        ax.set_xticks(range(len(variants)), variants)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)

    bars("bulk", "mbit_s", "Bulk throughput", "Mbit/s (log)", "bulk.png", log=True)
    bars("connect", "first_byte_p50_ms", "New stream to first byte, p50", "ms", "connect_p50.png")
    bars("connect", "first_byte_p99_ms", "New stream to first byte, p99", "ms", "connect_p99.png")
    bars("rr", "p50_ms", "1 KiB request/response latency p50", "ms (log)", "rr_p50.png", log=True)
    bars("rr", "p99_ms", "1 KiB request/response latency p99", "ms (log)", "rr_p99.png", log=True)
    bars("idle", "server_kib_per_stream", "Server RSS per idle stream", "KiB", "idle_server_rss.png")
    bars("idle", "agent_kib_per_stream", "Agent RSS per idle stream", "KiB", "idle_agent_rss.png")
    bars("fanin", "server_kib_per_tunnel", "Server RSS per agent tunnel", "KiB", "fanin_server_rss.png")
    bars("fanin", "reconnect_all_s", "All agents back after server restart", "s", "fanin_reconnect.png")
    bars("hol", "ratio", "Head-of-line: throughput with a stalled stream / alone", "ratio", "hol.png")
    bars("failover", "failover_s", "Signal to the first new stream through haproxy", "s", "failover.png")
    return made
