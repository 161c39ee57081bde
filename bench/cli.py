"""python -m bench: run the benchmark workloads through direct, ours and upstream (and their
variants: ours-websocket, ours-grpc, upstream-grpc)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from bench import image_runtime, report
from bench.pki import BenchPKI
from bench.procs import Proc, free_port, raise_nofile, wait_port
from bench.systems import (
    REPO,
    Direct,
    Env,
    Floor,
    Ours,
    System,
    Unavailable,
    Upstream,
    build_loadgen,
    find_anp,
)
from bench.workloads import WORKLOADS, Runner, Settings, log

DEFAULT_ANP_VERSION = "v0.36.0"
SYSTEMS: dict[str, Callable[[Env], System]] = {
    "direct": Direct,
    "ours": Ours,
    "upstream": Upstream,
    # ours with its agents in a WebSocket (ws:// to --agent-websocket-listen, no ingress)
    "ours-websocket": lambda env: Ours(env, transport="websocket"),
    # konnectivity gRPC clients (CreateSingleUseGrpcTunnel per stream): our client port, and
    # upstream's proxy-server in its default --mode=grpc
    "ours-grpc": lambda env: Ours(env, frontend="konnectivity"),
    # the server with --workers 2 (ours runs --workers 1): what a second core buys (issue 17)
    "ours-w2": lambda env: Ours(env, workers=2),
    "upstream-grpc": lambda env: Upstream(env, mode="grpc"),
    # bench/floor: the same stack (trio, ssl, h11, h2, ours' windows) with nothing of ours (issue 36)
    "floor": Floor,
}
# ours on the images' runtime (deploy/images/base.env's release), made before the run: main() names
# its programs (bench/image_runtime.py)
IMAGE_SYSTEM = image_runtime.system_name()


def _image_runtime_not_prepared(env: Env) -> System:
    raise Unavailable(f"{IMAGE_SYSTEM}: not prepared")


SYSTEMS[IMAGE_SYSTEM] = _image_runtime_not_prepared


def known_systems(ours_builds: list[str]) -> dict[str, Callable[[Env], System]]:
    """:data:`SYSTEMS` and an ``ours-NAME`` for each ``--ours-build NAME=DIR``; ValueError for a bad one."""
    known = dict(SYSTEMS)
    for given in ours_builds:
        name, _, folder = given.partition("=")
        if not name or not folder or not Path(folder).is_dir():
            raise ValueError(f"--ours-build {given!r}: expected NAME=DIR with DIR an existing folder")
        if f"ours-{name}" in known:
            raise ValueError(f"--ours-build {given!r}: ours-{name} is a system already")
        known[f"ours-{name}"] = partial(Ours, build=(name, Path(folder)))
    return known


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure the same workloads directly, through ours and through upstream ANP.",
    )
    p.add_argument(
        "--quick", action="store_true", help="short durations and small levels (smoke run, ~5 min)"
    )
    p.add_argument(
        "--only",
        default="",
        help=f"comma-separated workloads to run (default: all of {','.join(WORKLOADS)})",
    )
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated, of {','.join(SYSTEMS)} (default: all; each variant runs only the "
        "workloads it is measured on)",
    )
    p.add_argument(
        "--ours-build",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also measure ours from another build as system ours-NAME (list it in --systems): the "
        "cluster-proxy-server and cluster-proxy-agent programs in DIR, e.g. another python3's "
        "virtualenv or the wrappers of `bash bench/python_root.sh` (repeat)",
    )
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="results folder")
    p.add_argument("--anp-version", default=os.environ.get("ANP_VERSION", DEFAULT_ANP_VERSION))
    p.add_argument(
        "--no-build", action="store_true", help="do not run the build scripts; use what is in the cache"
    )
    p.add_argument("--repeats", type=int, default=0, help="override the number of interleaved repeats")
    p.add_argument(
        "--fanin-ours-max", type=int, default=0, help="largest fan-in level run for ours (process per agent)"
    )
    p.add_argument(
        "--fanin-levels", default="", help="comma-separated agent counts for fan-in (default: 100,500,1000)"
    )
    p.add_argument(
        "--fanin-idle-hold",
        type=float,
        default=0.0,
        help="seconds of idle tunnels over which fan-in measures CPU (default: 20; --quick: 3)",
    )
    p.add_argument(
        "--fanin-agent-processes",
        type=int,
        default=0,
        help="processes ours' fan-in agents are split over (default: 1; upstream's run in one Go process, "
        "which uses every core)",
    )
    return p.parse_args(argv)


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem = f"{kb / 1024 / 1024:.0f} GiB RAM"
    except (OSError, IndexError, ValueError):
        pass
    go = ""
    if shutil.which("go"):
        go = subprocess.run(["go", "version"], capture_output=True, text=True).stdout.strip()
    return f"{os.cpu_count()} CPUs ({model}), {mem}, Linux {platform.release()}, Python {platform.python_version()}, {go}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    started = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    settings = Settings.make(args.quick)
    if args.repeats:
        settings.repeats = args.repeats
        settings.hol_repeats = args.repeats
        settings.rr_repeats = args.repeats
        settings.failover_repeats = args.repeats
    if args.fanin_ours_max:
        settings.fanin_ours_max = args.fanin_ours_max
    if args.fanin_levels:
        try:
            settings.fanin_levels = [int(n) for n in args.fanin_levels.split(",") if n.strip()]
        except ValueError:
            print(
                f"--fanin-levels takes agent counts like 100,1000, not {args.fanin_levels!r}", file=sys.stderr
            )
            return 2
    if args.fanin_idle_hold:
        settings.fanin_idle_hold = args.fanin_idle_hold
    if args.fanin_agent_processes < 0:
        print(
            f"--fanin-agent-processes takes a count >= 1, not {args.fanin_agent_processes}", file=sys.stderr
        )
        return 2
    if args.fanin_agent_processes:
        settings.fanin_agent_processes = args.fanin_agent_processes
    workloads = [w.strip() for w in args.only.split(",") if w.strip()] or list(WORKLOADS)
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        print(f"unknown workload(s) {bad}; known: {', '.join(WORKLOADS)}", file=sys.stderr)
        return 2
    try:
        known = known_systems(args.ours_build)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in wanted if s not in known]
    if bad:
        print(f"unknown system(s) {bad}; known: {', '.join(known)}", file=sys.stderr)
        return 2

    load_before = Path("/proc/loadavg").read_text().split()[:3]
    nofile = raise_nofile()
    log(f"open-files limit {nofile[0]}")
    need = max(settings.idle_levels) + 1000 if "idle" in workloads else 0
    if need > nofile[0]:
        log(f"warning: the idle workload needs ~{need} open files per process; the limit is {nofile[0]}")

    loadgen = build_loadgen()
    image_why = ""
    if IMAGE_SYSTEM in wanted:
        log(f"making {IMAGE_SYSTEM}: this commit in {image_runtime.root_dir()} (bench/python_root.sh)")
        image_bin, image_why = image_runtime.prepare(build=not args.no_build)
        if image_bin is not None:
            known[IMAGE_SYSTEM] = partial(Ours, build=(image_runtime.image_suite(), image_bin))
    anp_bin, anp_why = (None, "not selected")
    if any(name.startswith("upstream") for name in wanted):
        log(f"building/locating apiserver-network-proxy {args.anp_version}")
        anp_bin, anp_why = find_anp(args.anp_version, build=not args.no_build)
    anp_versions = ""
    if anp_bin is not None and (anp_bin.parent / "versions.txt").exists():
        anp_versions = (anp_bin.parent / "versions.txt").read_text().strip().replace("\n", "; ")

    tmp = args.out / "tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    run_dir = tmp / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True)
    pki = BenchPKI(run_dir / "pki")
    server_cert, client_cert = pki.server(), pki.client()

    target_port = free_port()
    fanin_ips = max(settings.fanin_levels) if "fanin" in workloads and "upstream" in wanted else 0
    target = Proc(
        "target",
        [str(loadgen), "target", "--listen", f"127.0.0.1:{target_port}", "--fanin-ips", str(fanin_ips)],
        run_dir / "logs" / "target.log",
    )
    env = Env(
        loadgen=loadgen,
        run_dir=run_dir,
        pki=pki,
        server_cert=server_cert,
        client_cert=client_cert,
        target_port=target_port,
        anp_bin=anp_bin,
        anp_version=args.anp_version,
    )
    skipped: dict[str, str] = {}
    systems: list[System] = []
    for name in wanted:
        try:
            if name.startswith("upstream") and anp_bin is None:
                raise Unavailable(f"{name}: apiserver-network-proxy unavailable: {anp_why}")
            if name == IMAGE_SYSTEM and image_why:
                raise Unavailable(f"{name}: {image_why}")
            s = known[name](env)
            s.check()
            systems.append(s)
        except Unavailable as exc:
            skipped[name] = str(exc)
            log(f"SKIPPING {name}: {exc}")
    runner = Runner(env=env, systems=systems, settings=settings, target=target)
    runner.skipped.update(skipped)
    try:
        wait_port("127.0.0.1", target_port, 10, target)
        for w in workloads:
            log(f"=== workload {w} ===")
            getattr(runner, w)()
    except KeyboardInterrupt:
        log("interrupted: writing what was measured so far")
    finally:
        for s in systems:
            s.stop()
        target.stop()
        if IMAGE_SYSTEM in wanted:
            image_runtime.release()

    results = {
        "meta": {
            "started": started,
            "elapsed_s": round(time.monotonic() - t_start, 1),
            "quick": args.quick,
            "command": "python -m bench " + shlex.join(sys.argv[1:] if argv is None else argv),
            "machine": machine(),
            "anp_version": args.anp_version,
            "anp_modules": anp_versions,
            "systems": [s.name for s in systems],
            "workloads": workloads,
            "open_files_limit": nofile[0],
            "loadavg_before": " ".join(load_before),
            "loadavg_after": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
            "commands": runner.commands,
            "configs": runner.configs,
        },
        "settings": dataclasses.asdict(settings),
        "skipped": runner.skipped,
        "summary": report.summarize(runner.records),
        "records": runner.records,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")
    (args.out / "results.md").write_text(report.markdown(results) + "\n")
    try:
        made = report.plots(results, args.out)
        log(f"plots: {', '.join(p.name for p in made)}")
    except ImportError as exc:
        log(f"no plots (matplotlib missing: {exc})")
    log(f"wrote {args.out / 'results.md'} and results.json in {results['meta']['elapsed_s']} s")
    return 0
