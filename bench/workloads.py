"""The workloads. Each runs every selected system interleaved (direct, ours, upstream, repeat)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from bench import efficiency
from bench.failover import FailoverSettings, ReplicaFleet, loadavg
from bench.procs import Proc
from bench.systems import Env, System, Unavailable

WORKLOADS = ("bulk", "connect", "rr", "idle", "fanin", "hol", "failover", "gateway")
# variant -> (signal, the successor starts late: while the client goes on)
FAILOVER_VARIANTS = {
    "sigkill": (signal.SIGKILL, False),
    "sigterm": (signal.SIGTERM, False),
    "sigkill-late-successor": (signal.SIGKILL, True),
}
FAILOVER_DETAILS = ("errors_after", "loadavg", "victim", "exit_code")  # kept beside the metrics


@dataclass
class Settings:
    quick: bool
    repeats: int
    bulk_duration: float
    bulk_variants: list[tuple[str, int]]
    connect_count: int
    rr_rates: list[int]
    rr_duration: float
    rr_conns: int
    rr_repeats: int
    idle_levels: list[int]
    idle_hold: float
    fanin_levels: list[int]
    fanin_ours_max: int
    fanin_timeout: float
    fanin_idle_hold: float  # CPU of the server and agents while every tunnel idles (keepalives only)
    fanin_agent_processes: int  # ours' agents split over this many processes (upstream: one Go process)
    hol_duration: float
    hol_rounds: int
    hol_repeats: int
    idle_max_time: float
    failover_repeats: int
    failover: FailoverSettings
    gateway_requests: int  # per variant, path and repeat (bench/gateway.py)
    gateway_repeats: int
    gateway_time_limit: float

    @classmethod
    def make(cls, quick: bool) -> Settings:
        if quick:
            return cls(
                quick=True,
                repeats=1,
                bulk_duration=2.0,
                bulk_variants=[("up", 1), ("down", 1), ("up", 8), ("down", 8)],
                connect_count=100,
                rr_rates=[1000],
                rr_duration=2.0,
                rr_conns=16,
                rr_repeats=1,
                idle_levels=[1000],
                idle_hold=1.0,
                fanin_levels=[20, 100],
                fanin_ours_max=1000,
                fanin_timeout=60.0,
                fanin_idle_hold=3.0,
                fanin_agent_processes=1,
                hol_duration=1.5,
                hol_rounds=2,
                hol_repeats=1,
                idle_max_time=60.0,
                failover_repeats=2,
                failover=FailoverSettings(
                    replicas=3,
                    agents=2,
                    warmup=1.0,
                    window=3.0,
                    late_absence=6.0,
                    workers=4,
                    gap_ms=20,
                    check_interval="100ms",
                    drain_timeout=3.0,
                    converge_timeout=30.0,
                ),
                gateway_requests=50,
                gateway_repeats=1,
                gateway_time_limit=300.0,
            )
        return cls(
            quick=False,
            repeats=3,
            bulk_duration=4.0,
            bulk_variants=[("up", 1), ("down", 1), ("up", 8), ("down", 8)],
            connect_count=500,
            rr_rates=[500, 2000, 5000],
            rr_duration=4.0,
            rr_conns=16,
            rr_repeats=2,
            idle_levels=[1000, 5000, 10000],
            idle_hold=3.0,
            fanin_levels=[100, 500, 1000],
            fanin_ours_max=1000,
            fanin_timeout=120.0,
            fanin_idle_hold=20.0,
            fanin_agent_processes=1,
            hol_duration=2.0,
            hol_rounds=3,
            hol_repeats=1,
            idle_max_time=90.0,
            failover_repeats=5,
            failover=FailoverSettings(
                replicas=3,
                agents=2,
                warmup=1.5,
                window=5.0,
                late_absence=12.0,
                workers=4,
                gap_ms=20,
                check_interval="100ms",
                drain_timeout=3.0,
                converge_timeout=30.0,
            ),
            gateway_requests=200,
            gateway_repeats=3,
            gateway_time_limit=600.0,
        )


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Runner:
    env: Env
    systems: list[System]
    settings: Settings
    target: Proc
    records: list[dict] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    commands: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    configs: dict[str, str] = field(default_factory=dict)  # configuration files shown in the report

    # ------------------------------------------------------------------ plumbing

    def record(self, workload: str, variant: str, system: System, rep: int, metrics: dict, **extra) -> None:
        rec = {
            "workload": workload,
            "variant": variant,
            "system": system.name,
            "rep": rep,
            "metrics": metrics,
        }
        rec.update(extra)
        rec.setdefault("loadavg", loadavg())  # the machine is shared: each figure with its load
        self.records.append(rec)
        shown = ", ".join(f"{k}={v}" for k, v in metrics.items())
        log(f"{workload:8s} {variant:14s} {system.name:14s} rep {rep}: {shown}")

    def failed(self, workload: str, variant: str, system: System, rep: int, error: str) -> None:
        log(f"{workload:8s} {variant:14s} {system.name:14s} rep {rep}: FAILED: {error}")
        self.records.append(
            {
                "workload": workload,
                "variant": variant,
                "system": system.name,
                "rep": rep,
                "metrics": {},
                "error": error[-3000:],
            }
        )

    def measured_on(self, workload: str) -> list[System]:
        """The selected systems that the workload is measured on (System.workloads)."""
        return [s for s in self.systems if s.workloads is None or workload in s.workloads]

    @contextlib.contextmanager
    def started(self, workload: str, systems: list[System] | None = None) -> Iterator[list[System]]:
        """Start the systems for one workload (default: those measured on it, the workload being the
        name before any '-'); those that fail to start are left out (with a note)."""
        up: list[System] = []
        for s in systems if systems is not None else self.measured_on(workload.split("-")[0]):
            try:
                s.start()
                up.append(s)
                roles = {role: p.argv for role, p in s.procs().items()}
                # The client's side of every workload: loadgen MODE, these flags, the workload's own.
                roles["client (loadgen)"] = [str(self.env.loadgen), "MODE", *s.dial_args()]
                self.commands.setdefault(s.name, roles)
            except Exception as exc:
                s.stop()
                self.skipped[f"{workload}/{s.name}"] = f"failed to start: {exc}"
                log(f"{workload}: {s.name} failed to start: {exc}")
        try:
            yield up
        finally:
            for s in up:
                s.stop()

    def _cpu_snapshot(self, system: System) -> dict[str, float]:
        snap = {"target": self.target.cpu_seconds(), "wall": time.monotonic()}
        for role, p in system.procs().items():
            snap[role] = p.cpu_seconds()
        return snap

    @staticmethod
    def _cpu_percent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        wall = max(after["wall"] - before["wall"], 1e-9)
        return {
            k: round(100 * (after[k] - before[k]) / wall, 1) for k in before if k != "wall" and k in after
        }

    def loadgen(
        self, system: System, mode: str, args: list[str], timeout: float
    ) -> tuple[dict, dict[str, float], dict[str, float]]:
        """Run one loadgen client through `system`; returns (loadgen JSON, CPU % of the processes,
        CPU-seconds each used while the client ran)."""
        before = self._cpu_snapshot(system)
        argv = [str(self.env.loadgen), mode, *system.dial_args(), *args]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        after = self._cpu_snapshot(system)
        if out.returncode != 0:
            raise RuntimeError(f"loadgen {mode} exited {out.returncode}: {out.stderr[-2000:]}")
        res = json.loads(out.stdout)
        cpu = self._cpu_percent(before, after)
        cpu["loadgen"] = res["loadgen_cpu"]["cpu_percent"]
        cpu_s = efficiency.cpu_deltas(before, after)
        cpu_s["loadgen"] = res["loadgen_cpu"]["cpu_s"]
        return res, cpu, cpu_s

    def _check_alive(self, system: System) -> str | None:
        dead = [f"{role} (exit {p.popen.returncode})" for role, p in system.procs().items() if not p.alive()]
        return f"{system.name}: process died: {', '.join(dead)}" if dead else None

    def each(
        self, workload: str, variant: str, rep: int, systems: list[System], fn: Callable[[System], None]
    ) -> None:
        for s in systems:
            dead = self._check_alive(s)
            if dead:
                self.failed(workload, variant, s, rep, dead)
                continue
            try:
                fn(s)
            except Exception as exc:
                self.failed(workload, variant, s, rep, f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ workloads

    def bulk(self) -> None:
        st = self.settings
        with self.started("bulk") as systems:
            for rep in range(st.repeats):
                for direction, streams in st.bulk_variants:
                    variant = f"{direction}-{streams}stream" + ("s" if streams > 1 else "")

                    def one(
                        s: System, direction=direction, streams=streams, variant=variant, rep=rep
                    ) -> None:
                        res, cpu, cpu_s = self.loadgen(
                            s,
                            "bulk",
                            [
                                "--streams",
                                str(streams),
                                "--direction",
                                direction,
                                "--duration",
                                f"{st.bulk_duration}s",
                            ],
                            timeout=st.bulk_duration + 60,
                        )
                        r = res["result"]
                        m = {"mbit_s": r["mbit_s"], "errors": r["errors"]["count"]}
                        self.record("bulk", variant, s, rep, m, cpu=cpu, cpu_s=cpu_s, raw=r)

                    self.each("bulk", variant, rep, systems, one)

    def connect(self) -> None:
        st = self.settings
        with self.started("connect") as systems:
            for rep in range(st.repeats):

                def one(s: System, rep=rep) -> None:
                    res, cpu, cpu_s = self.loadgen(
                        s, "connect", ["--count", str(st.connect_count), "--max-time", "60s"], timeout=120
                    )
                    r = res["result"]
                    fb, c200 = r["first_byte"], r["connect_200"]
                    m = {
                        "first_byte_p50_ms": fb.get("p50_ms"),
                        "first_byte_p99_ms": fb.get("p99_ms"),
                        "connect_200_p50_ms": c200.get("p50_ms"),
                        "ok": r["ok"],
                        "errors": r["errors"]["count"],
                    }
                    self.record("connect", f"seq-{st.connect_count}", s, rep, m, cpu=cpu, cpu_s=cpu_s, raw=r)

                self.each("connect", f"seq-{st.connect_count}", rep, systems, one)

    def rr(self) -> None:
        st = self.settings
        with self.started("rr") as systems:
            for rep in range(st.rr_repeats):
                for rate in st.rr_rates:
                    variant = f"{rate}rps"

                    def one(s: System, rate=rate, variant=variant, rep=rep) -> None:
                        res, cpu, cpu_s = self.loadgen(
                            s,
                            "rr",
                            [
                                "--rate",
                                str(rate),
                                "--conns",
                                str(st.rr_conns),
                                "--size",
                                "1024",
                                "--duration",
                                f"{st.rr_duration}s",
                            ],
                            timeout=st.rr_duration + 60,
                        )
                        r = res["result"]
                        lat = r["latency"]
                        m = {
                            "p50_ms": lat.get("p50_ms"),
                            "p99_ms": lat.get("p99_ms"),
                            "achieved_rps": r["achieved_rps"],
                            "errors": r["errors"]["count"],
                        }
                        self.record("rr", variant, s, rep, m, cpu=cpu, cpu_s=cpu_s, raw=r)

                    self.each("rr", variant, rep, systems, one)

    def idle(self) -> None:
        st = self.settings
        for level in st.idle_levels:
            variant = f"{level}"
            for s in self.measured_on("idle"):
                with self.started(f"idle-{level}", [s]) as up:
                    if not up:
                        continue
                    self.each("idle", variant, 0, up, lambda s, level=level: self._idle_one(s, level))

    def _idle_one(self, s: System, level: int) -> None:
        st = self.settings
        time.sleep(0.5)
        procs = {"target": self.target, **s.procs()}
        base = {role: p.rss_kib() for role, p in procs.items()}
        argv = [
            str(self.env.loadgen),
            "idle",
            *s.dial_args(),
            "--count",
            str(level),
            "--parallel",
            "64",
            "--hold",
            f"{st.idle_hold + 1.5}s",
            "--max-time",
            f"{st.idle_max_time}s",
        ]
        before = self._cpu_snapshot(s)
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        opened: dict[str, float] = {}  # CPU snapshot when the last stream is open
        loaded: dict[str, int] = {}
        stderr_tail: list[str] = []
        assert p.stderr is not None and p.stdout is not None
        try:
            for line in p.stderr:
                stderr_tail = [*stderr_tail[-20:], line]
                if '"ready"' in line:
                    opened = self._cpu_snapshot(s)
                    time.sleep(1.0 + st.idle_hold / 2)
                    loaded = {role: pr.rss_kib() for role, pr in procs.items()}
            out = p.stdout.read()
            p.wait(timeout=st.idle_max_time + st.idle_hold + 120)
        except BaseException:
            p.kill()
            raise
        if p.returncode != 0:
            raise RuntimeError(f"loadgen idle exited {p.returncode}: {''.join(stderr_tail)}")
        r = json.loads(out)["result"]
        alive = r["alive"]
        per = {
            f"{role}_kib_per_stream": round((loaded.get(role, 0) - base[role]) / max(alive, 1), 2)
            for role in procs
            if role != "target"
        }
        m = {
            "alive": alive,
            "established": r["established"],
            **per,
            "open_per_s": r["open_per_s"],
        }
        cpu_s = efficiency.cpu_deltas(before, opened) if opened else {}
        self.record("idle", f"{level}", s, 0, m, cpu_s=cpu_s, rss_base_kib=base, rss_loaded_kib=loaded, raw=r)

    def fanin(self) -> None:
        st = self.settings
        for n in st.fanin_levels:
            variant = f"{n}"
            for s in self.measured_on("fanin"):
                if not s.proxied:
                    continue
                if s.name == "ours" and n > st.fanin_ours_max:
                    reason = (
                        f"more than --fanin-ours-max={st.fanin_ours_max} agents for ours; {n} agents skipped"
                    )
                    self.skipped[f"fanin-{n}/ours"] = reason
                    log(f"fanin    {variant:14s} ours      skipped: {reason}")
                    continue
                try:
                    s.check()
                except Unavailable as exc:
                    self.skipped[f"fanin-{n}/{s.name}"] = str(exc)
                    continue
                self.each("fanin", variant, 0, [s], lambda s, n=n: self._fanin_one(s, n))

    def _fanin_one(self, s: System, n: int) -> None:
        st = self.settings
        h = s.start_fanin(n, f"{n}", st.fanin_agent_processes)
        try:
            time.sleep(0.5)
            server_base = h.server.rss_kib()
            t0 = time.monotonic()
            h.start_agents()
            first = self.env.probe(s.probe_args(), h.probe_lines, st.fanin_timeout)
            connect_all = time.monotonic() - t0
            time.sleep(1.0)
            server_rss, agents_rss = h.server.rss_kib(), h.agents_rss_kib()
            idle_before = {
                "wall": time.monotonic(),
                "server": h.server.cpu_seconds(),
                "agents": h.agents_cpu_seconds(),
            }
            time.sleep(st.fanin_idle_hold)  # a fixed window of idleness is what is measured
            idle_after = {
                "wall": time.monotonic(),
                "server": h.server.cpu_seconds(),
                "agents": h.agents_cpu_seconds(),
            }
            idle_cpu_s = efficiency.cpu_deltas(idle_before, idle_after)
            idle_window = idle_after["wall"] - idle_before["wall"]
            h.restart_server()
            t_listen = time.monotonic()
            again = self.env.probe(s.probe_args(), h.probe_lines, st.fanin_timeout)
            reconnect_all = time.monotonic() - t_listen
            m = {
                "connected": first["ok"],
                "connect_all_s": round(connect_all, 2) if first["ok"] == n else None,
                "reconnected": again["ok"],
                "reconnect_all_s": round(reconnect_all, 2) if again["ok"] == n else None,
                "server_kib_per_tunnel": round((server_rss - server_base) / n, 1),
                "agent_kib_per_agent": round(agents_rss / n, 1),
                **efficiency.idle_tunnel_cost(idle_cpu_s, idle_window, n),
            }
            self.record(
                "fanin",
                f"{n}",
                s,
                0,
                m,
                server_rss_base_kib=server_base,
                server_rss_kib=server_rss,
                agents_rss_kib=agents_rss,
                agent_processes=len(h.agents),
                probe_first=first,
                probe_after_restart=again,
            )
        finally:
            h.stop()

    def hol(self) -> None:
        st = self.settings
        for direction in ("down", "up"):
            with self.started(f"hol-{direction}") as systems:
                for rep in range(st.hol_repeats):

                    def one(s: System, direction=direction, rep=rep) -> None:
                        res, cpu, cpu_s = self.loadgen(
                            s,
                            "hol",
                            [
                                "--streams",
                                "4",
                                "--direction",
                                direction,
                                "--duration",
                                f"{st.hol_duration}s",
                                "--rounds",
                                str(st.hol_rounds),
                            ],
                            timeout=st.hol_rounds * (2 * st.hol_duration + 60),
                        )
                        r = res["result"]
                        if "error" in r:
                            raise RuntimeError(r["error"])
                        m = {
                            "ratio": r["ratio"],
                            "alone_mbit_s": r["alone_mbit_s"],
                            "stalled_mbit_s": r["with_stalled_mbit_s"],
                            "new_stream_ok": 1 if r["new_stream_ok"] else 0,
                        }
                        self.record("hol", direction, s, rep, m, cpu=cpu, cpu_s=cpu_s, raw=r)

                    self.each("hol", direction, rep, systems, one)

    def failover(self) -> None:
        """Per proxied system: 3 replicas behind haproxy, agents holding each; per repeat, one replica
        SIGKILLed (a crash), one SIGTERMed (a drain) and one SIGKILLed with its successor starting
        late, while loadgen churns new streams through haproxy; the victim's successor is back in
        every agent before the next."""
        st = self.settings
        fleets: list[ReplicaFleet] = []
        try:
            for s in self.measured_on("failover"):
                if not s.proxied:
                    continue
                fleet = ReplicaFleet(s, self.env, st.failover)
                try:
                    s.check()
                    fleet.start()
                except Exception as exc:
                    fleet.stop()
                    self.skipped[f"failover/{s.name}"] = f"failed to start: {type(exc).__name__}: {exc}"
                    log(f"failover: {s.name} failed to start: {exc}")
                    continue
                fleets.append(fleet)
                self.commands[f"{s.name} failover"] = fleet.commands()
                if fleet.haproxy is not None:
                    self.configs[f"haproxy ({s.name} failover)"] = fleet.haproxy.config.read_text()
            for rep in range(st.failover_repeats):
                for n, (variant, (sig, late)) in enumerate(FAILOVER_VARIANTS.items()):
                    victim = (rep + n) % st.failover.replicas
                    for fleet in fleets:
                        try:
                            figures = fleet.failover_once(victim, sig, late)
                        except Exception as exc:
                            self.failed(
                                "failover", variant, fleet.system, rep, f"{type(exc).__name__}: {exc}"
                            )
                            continue
                        extra = {k: figures.pop(k) for k in FAILOVER_DETAILS if k in figures}
                        self.record("failover", variant, fleet.system, rep, figures, **extra)
        finally:
            for fleet in fleets:
                fleet.stop()

    def gateway(self) -> None:
        """seed 004's ``get --raw .../clustergateways/cluster1/proxy/healthz`` through the hub and the
        cluster-gateway (ours) against cluster1's kube-apiserver straight (direct), on real API servers
        (bench/gateway.py); the other systems do not take part."""
        from bench.gateway import run_gateway_workload

        st = self.settings
        names = {"direct": _Named("direct"), "ours": _Named("ours")}
        try:
            commands = run_gateway_workload(
                self.env.run_dir / "gateway",
                count=st.gateway_requests,
                repeats=st.gateway_repeats,
                time_limit=st.gateway_time_limit,
                record=lambda variant, system, rep, m: self.record("gateway", variant, names[system], rep, m),
                failed=lambda variant, system, rep, e: self.failed("gateway", variant, names[system], rep, e),
                log=log,
            )
            self.commands["ours (gateway)"] = commands
        except Exception as exc:
            self.skipped["gateway"] = f"failed to start: {type(exc).__name__}: {exc}"
            log(f"gateway: failed to start: {exc}")


@dataclass(frozen=True)
class _Named:
    """A row name of the report for a path that is not one of the System objects."""

    name: str
