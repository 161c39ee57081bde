"""Scaling on paper (issue 17, point 4): what one proxy-server pod carries at N cores, and how many
pods a fleet needs, from per-core costs measured by the bench.

    python -m bench.scaling EFFICIENCY.json FANIN.json [IDLE.json]

The first file is a bulk/connect/rr run with CPU-seconds (bench/efficiency.py), the second a fan-in
run (RSS and idle CPU per tunnel), the third (optional, default: the fan-in file) an idle run (RSS
per idle stream). Prints the markdown that docs/benchmarks.md quotes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from bench import efficiency, report

GBIT_PER_GIB = (1 << 30) * 8 / 1e9
MIB = 1024  # KiB


@dataclass(frozen=True)
class Costs:
    """Per-core costs of one server worker (a Python process: one core at most)."""

    cpu_s_per_gib_down: float
    cpu_s_per_gib_up: float
    cpu_s_per_1k_connects: float
    cpu_s_per_1k_requests: float
    kib_per_tunnel: float  # server RSS per agent tunnel, per worker
    kib_per_stream: float  # server RSS per idle stream (a stream lives in one worker)
    base_kib_per_worker: float  # a worker's RSS with nothing connected
    pct_per_1k_idle_tunnels: float  # % of a core that 1,000 idle tunnels keep busy (keepalives)


@dataclass(frozen=True)
class Pod:
    cores: int
    gbit_s_down: float
    gbit_s_up: float
    connects_per_s: float
    requests_per_s: float
    streams_per_gib: float


def pod(costs: Costs, cores: int, usable: float) -> Pod:
    """What a pod of ``cores`` cores (one worker per core) does with ``usable`` of each core, each
    figure as if the pod did nothing else; a mix takes its fractions of each."""
    core_s = cores * usable
    return Pod(
        cores=cores,
        gbit_s_down=core_s / costs.cpu_s_per_gib_down * GBIT_PER_GIB,
        gbit_s_up=core_s / costs.cpu_s_per_gib_up * GBIT_PER_GIB,
        connects_per_s=core_s / costs.cpu_s_per_1k_connects * 1000,
        requests_per_s=core_s / costs.cpu_s_per_1k_requests * 1000,
        streams_per_gib=(1 << 20) / costs.kib_per_stream,
    )


@dataclass(frozen=True)
class Profile:
    """Average traffic of one managed cluster through the hub (an assumption to replace with yours)."""

    connects_per_s: float
    requests_per_s: float
    mbit_s: float  # bulk, the costlier direction (upload)
    streams: float  # held open (watches, exec, port-forwards)


def fleet_pods(
    costs: Costs, cores: int, usable: float, clusters: int, profile: Profile, min_pods: int = 2
) -> dict[str, float]:
    """Pods needed for ``clusters`` clusters of ``profile`` (``min_pods`` at least, for availability):
    the CPU the traffic takes plus what the idle tunnels take (every agent holds a tunnel to every
    worker of every pod, so each worker carries one tunnel per cluster, however many pods there
    are), and the memory that costs per pod."""
    tunnels_per_worker = clusters
    idle_share = tunnels_per_worker / 1000 * costs.pct_per_1k_idle_tunnels / 100  # of each core
    left = usable - idle_share
    traffic_core_s = clusters * (
        profile.connects_per_s / 1000 * costs.cpu_s_per_1k_connects
        + profile.requests_per_s / 1000 * costs.cpu_s_per_1k_requests
        + profile.mbit_s / 1000 / GBIT_PER_GIB * costs.cpu_s_per_gib_up
    )
    pods = max(min_pods, math.ceil(traffic_core_s / (cores * left))) if left > 0 else math.inf
    tunnel_kib = cores * (costs.base_kib_per_worker + tunnels_per_worker * costs.kib_per_tunnel)
    return {
        "pods": pods,
        "traffic_cores": traffic_core_s,
        "idle_share": idle_share,
        "tunnel_gib_per_pod": tunnel_kib / (1 << 20),
        "stream_gib_per_pod": clusters * profile.streams / pods * costs.kib_per_stream / (1 << 20),
        "tunnels_per_agent": pods * cores,
    }


def _median_metric(results: dict, workload: str, metric: str, system: str) -> float:
    values = [
        r["metrics"][metric]
        for r in results["records"]
        if r["workload"] == workload
        and r["system"] == system
        and r.get("metrics", {}).get(metric) is not None
        and not r.get("error")
    ]
    if not values:
        raise SystemExit(f"no {workload} {metric} for {system} in the results: run that workload first")
    return statistics.median(values)


def held_rate(run: dict, system: str) -> str:
    """The rr variant with the highest rate that ``system`` held (95 % achieved): a saturated row's
    cost per request includes the queueing, not only the work."""
    held = [
        (int(variant.removesuffix("rps")), variant)
        for variant, metrics in report.summarize(run["records"]).get("rr", {}).items()
        if metrics.get("achieved_rps", {}).get(system, 0) >= 0.95 * int(variant.removesuffix("rps"))
    ]
    if not held:
        raise SystemExit(f"{system} held no request/response rate in the run")
    return max(held)[1]


def costs_from(run: dict, fanin: dict, idle: dict, system: str = "ours") -> Costs:
    """The server's costs for ``system`` from three results.json files (largest fan-in level)."""
    eff = efficiency.summarize(run["records"])

    def server(workload: str, variant: str) -> float:
        try:
            return eff[(workload, variant)][system]["server"]
        except KeyError:
            raise SystemExit(
                f"no CPU-seconds for {system} {workload} {variant}: a run since cpu_s is recorded"
            ) from None

    top = max(int(r["variant"]) for r in fanin["records"] if r["workload"] == "fanin")
    at_top = [
        r
        for r in fanin["records"]
        if r["workload"] == "fanin" and r["variant"] == str(top) and r["system"] == system
    ]
    return Costs(
        cpu_s_per_gib_down=server("bulk", "down-8streams"),
        cpu_s_per_gib_up=server("bulk", "up-8streams"),
        cpu_s_per_1k_connects=server("connect", next(v for w, v in eff if w == "connect")),
        cpu_s_per_1k_requests=server("rr", held_rate(run, system)),
        kib_per_tunnel=statistics.median(r["metrics"]["server_kib_per_tunnel"] for r in at_top),
        kib_per_stream=_median_metric(idle, "idle", "server_kib_per_stream", system),
        base_kib_per_worker=statistics.median(r["server_rss_base_kib"] for r in at_top),
        pct_per_1k_idle_tunnels=statistics.median(
            r["metrics"]["server_pct_per_1k_idle_tunnels"] for r in at_top
        ),
    )


def markdown(costs: Costs, usable: float, profile: Profile, clusters: int) -> list[str]:
    lines = [
        f"| cores (= workers) | down Gbit/s | up Gbit/s | new streams/s | 1 KiB requests/s "
        f"| idle streams per GiB | tunnel RSS at {clusters:,} agents (GiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cores in (4, 8, 16):
        p = pod(costs, cores, usable)
        tunnel_gib = cores * (costs.base_kib_per_worker + clusters * costs.kib_per_tunnel) / (1 << 20)
        lines.append(
            f"| {cores} | {p.gbit_s_down:.1f} | {p.gbit_s_up:.1f} | {p.connects_per_s:,.0f} "
            f"| {p.requests_per_s:,.0f} | {p.streams_per_gib:,.0f} | {tunnel_gib:.1f} |"
        )
    lines.append("")
    lines += fleet_lines(costs, usable, profile, clusters)
    return lines


def fleet_lines(costs: Costs, usable: float, profile: Profile, clusters: int) -> list[str]:
    lines = [
        "| pod cores | pods | traffic (cores) | idle tunnels (share of each core) "
        "| tunnel RSS per pod (GiB) | stream RSS per pod (GiB) | tunnels per agent |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cores in (4, 8, 16):
        f = fleet_pods(costs, cores, usable, clusters, profile)
        fits = not math.isinf(f["pods"])
        lines.append(
            f"| {cores} | {f['pods'] if fits else 'none fits'} | {f['traffic_cores']:.1f} | {f['idle_share']:.1%} "
            f"| {f['tunnel_gib_per_pod']:.1f} | {f['stream_gib_per_pod']:.2f} "
            f"| {f['tunnels_per_agent'] if fits else '-'} |"
        )
    return lines


def per_unit_by_process(run: dict, system: str) -> dict[tuple[str, str], dict[str, float]]:
    """Median CPU-seconds per unit of work of every process of the run (server, agent, loadgen,
    target: they share the machine's cores), by (workload, variant)."""
    acc: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in run["records"]:
        if r["system"] != system or r.get("error") or "cpu_s" not in r:
            continue
        units = efficiency.work_units(r["workload"], r.get("raw", {}))
        if units is None:
            continue
        row = acc.setdefault((r["workload"], r["variant"]), {})
        for role, seconds in r["cpu_s"].items():
            row.setdefault(role, []).append(seconds / units)
    return {key: {role: statistics.median(v) for role, v in roles.items()} for key, roles in acc.items()}


def two_core_prediction(
    per_unit: dict[str, float], streams: int, workers: int, cores: int = 2
) -> dict[str, float]:
    """Units of work per second that ``workers`` server workers can do on a machine of ``cores`` cores
    shared with one agent, the loadgen and the target, from each process's CPU-seconds per unit:

    - pod model: the server alone, one core per worker (what the pod table assumes);
    - machine: every process's CPU shares the cores;
    - agent: one process, one core at most;
    - streams: a stream is served by one worker, so no more workers than streams help.
    """
    limits = {
        "pod model": workers / per_unit["server"],
        "machine": cores
        / sum(per_unit[role] for role in ("server", "agent", "loadgen", "target") if role in per_unit),
        "agent": 1 / per_unit["agent"],
        "streams": min(workers, streams) / per_unit["server"],
    }
    limits["predicted"] = min(limits["machine"], limits["agent"], limits["streams"])
    return limits


def check_lines(run: dict, system: str = "ours") -> list[str]:
    """The model against 1 and 2 workers on this machine (bulk in Mbit/s, rr in requests/s)."""
    lines = [
        "| row | measured, 1 worker | predicted, 1 worker | pod model, 2 workers | predicted, 2 workers "
        "| measured, 2 workers | predicted 2/1 | measured 2/1 | limit with 2 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    measured = report.summarize(run["records"])
    for (workload, variant), per_unit in sorted(per_unit_by_process(run, system).items()):
        if workload == "bulk":
            streams = int(variant.split("-")[1].rstrip("s").removesuffix("stream"))
            scale, by_system = GBIT_PER_GIB * 1000, measured["bulk"][variant]["mbit_s"]
        elif workload == "rr" and variant == max(measured["rr"], key=lambda v: int(v.removesuffix("rps"))):
            # the highest offered rate only: below saturation the achieved rate is the offered one
            streams, scale = 16, 1000.0
            by_system = measured["rr"][variant]["achieved_rps"]
        else:
            continue  # connect runs one stream after another: its rate is its latency, not a CPU limit
        one = two_core_prediction(per_unit, streams, workers=1)
        two = two_core_prediction(per_unit, streams, workers=2)
        limit = min(("machine", "agent", "streams"), key=lambda k: two[k])
        got, got_two = by_system.get(system), by_system.get(f"{system}-w2")
        lines.append(
            f"| {workload} {variant} | {got:,.0f} | {one['predicted'] * scale:,.0f} | {two['pod model'] * scale:,.0f} "
            f"| {two['predicted'] * scale:,.0f} | {f'{got_two:,.0f}' if got_two else '-'} "
            f"| {two['predicted'] / one['predicted']:.2f} | {f'{got_two / got:.2f}' if got_two else '-'} | {limit} |"
        )
    return lines


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    run, fanin = (json.loads(Path(a).read_text()) for a in argv[:2])
    idle = json.loads(Path(argv[2]).read_text()) if len(argv) == 3 else fanin
    costs = costs_from(run, fanin, idle)
    print(costs)
    profile = Profile(connects_per_s=0.1, requests_per_s=5.0, mbit_s=0.1, streams=10)
    print("\n".join(markdown(costs, usable=0.7, profile=profile, clusters=10_000)))
    rarer = dataclasses.replace(costs, pct_per_1k_idle_tunnels=costs.pct_per_1k_idle_tunnels / 3)
    print("\nThe same with the idle tunnels' CPU a third (keepalives every 30 s, not 10):\n")
    print("\n".join(fleet_lines(rarer, usable=0.7, profile=profile, clusters=10_000)))
    print()
    print("\n".join(check_lines(run)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
