"""10,000 clusters on one proxy-server (issue 36, point 5): a fleet of simulated agents, each of its own
cluster, against one server with ``--workers 1`` and ``--workers 2``.

    python -m bench.fleet_scale --agents 10000 --workers 1,2 --agent-processes 10 --out DIR

For each worker count: the server starts, the agents start (``bench.fleet``, full
``clusterproxy_agent.Service`` instances, ``--agent-processes`` processes), and the tool measures

- all connected: seconds until every agent holds a tunnel to every worker (what each fleet process
  reports of its agents every second: the server is not asked, so the numbers are not its scrapes');
- the server's memory (RSS and PSS summed over the parent and its workers), per tunnel above the
  server's own before any agent, and the fleet's memory per agent;
- a probe through every cluster: ``loadgen probe``, a CONNECT to a small target through each cluster
  with a one-byte echo, until each has answered once;
- idle CPU of the server (and of the fleet) over ``--idle-window`` seconds, nothing else asking;
- the return after a crash: every process of the server SIGKILLed at once (a pod's crash), the server
  started again on the same ports with a new ``--server-id``, seconds until every agent holds every new
  worker again (from the SIGKILL and from the new server's listening), and the reconnect storm:
  connections the server accepted per second (its registrations and refusals over the storm; per
  sample, its established connections on the agent port as ``ss`` lists them), tunnels registered
  per second (the agents' view), the server's CPU and the kernel's listen-queue overflows (counted
  machine-wide); then the probe again.

Every tunnel shape figure is today's: an agent holds one tunnel per worker of every replica.

The tool stops by itself at ``--deadline`` (whatever is measured by then is written), and kills every
process it started (the server's workers included) when it ends, on Ctrl-C or SIGTERM; the children
also get SIGKILL from the kernel if the tool itself is killed (PR_SET_PDEATHSIG). The certificates
and fleet specs live in a scratch folder removed at the end; DIR keeps results.json, results.md and
logs/.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import math
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from bench.procs import cpu_seconds, free_port, rss_kib, start_logged, wait_port, with_descendants
from bench.report import results_folder, write_results
from bench.systems import Ours, tool_env

REPO = Path(__file__).resolve().parent.parent
AGENTS_PER_PROCESS = 1000  # --agent-processes 0: this many agents per fleet process (see the docs)
ADMIN_BASE = "127.3.0.0"  # the agents' admin listeners: one loopback address each, one port for all
CLUSTER_HEADER = "cluster-proxy-cluster"
GOALS = {"agents": 10000, "rss_mib": 2048, "idle_pct": 30.0, "restart_s": 60.0}
FD_MARGIN = 256  # descriptors a process needs besides its connections (files, pipes, listeners)
PR_SET_PDEATHSIG = 1


class DeadlineExceeded(Exception):
    """The tool's --deadline has passed."""


class PhaseTimeout(Exception):
    """A phase did not finish within its own bound; what it saw is in ``seen``."""

    def __init__(self, message: str, seen: dict) -> None:
        super().__init__(message)
        self.seen = seen


# ------------------------------------------------------------------ arithmetic and parsing (tested)


def parse_workers(text: str) -> list[int]:
    """``1,2`` -> [1, 2]: the worker counts measured, each once, in the order given."""
    counts: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"--workers takes counts >= 1 like 1,2, not {text!r}")
        if int(part) not in counts:
            counts.append(int(part))
    if not counts:
        raise ValueError(f"--workers takes counts >= 1 like 1,2, not {text!r}")
    return counts


def agent_processes(agents: int, asked: int, per_process: int = AGENTS_PER_PROCESS) -> int:
    """Fleet processes: ``asked``, or (0) one per ``per_process`` agents; never more than agents."""
    count = asked or math.ceil(agents / per_process)
    return max(1, min(count, agents))


def loopback_ip(i: int, base: str = ADMIN_BASE) -> str:
    """The i-th address of a 127.x block, 250 per /24 (x.y.z.1 .. x.y.z.250), as bench.systems.fanin_ip."""
    a, b, c, _ = (int(p) for p in base.split("."))
    return f"{a}.{b + i // 62500}.{c + (i // 250) % 250}.{i % 250 + 1}"


def descriptors_needed(agents: int, processes: int, workers: int, probe_parallel: int) -> dict[str, int]:
    """Open files each process needs: a server worker holds one socket per agent and per probe
    connection; a fleet process, per agent, its admin listener, a tunnel per worker and one dial in
    flight (a redial, a target)."""
    per_fleet = math.ceil(agents / processes)
    return {
        "server_process": agents + 2 * probe_parallel + FD_MARGIN,
        "fleet_process": per_fleet * (2 + workers) + FD_MARGIN,
    }


def parse_port_range(text: str) -> tuple[int, int]:
    """/proc/sys/net/ipv4/ip_local_port_range -> (low, high)."""
    low, high = (int(v) for v in text.split())
    return low, high


def ports_needed(agents: int, workers: int) -> int:
    """Local ports the agents' tunnels take: all dial one address (127.0.0.1:agent port), so each
    tunnel needs a port of the ephemeral range of its own."""
    return agents * workers


def parse_proc_net(text: str, section: str) -> dict[str, int]:
    """One section of /proc/net/snmp or /proc/net/netstat (a line of names, then a line of values)."""
    rows = [line.split() for line in text.splitlines() if line.startswith(f"{section}:")]
    for names, values in zip(rows[::2], rows[1::2], strict=False):
        return {n: int(v) for n, v in zip(names[1:], values[1:], strict=True)}
    return {}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? (\S+)$")


def metric_sums(text: str) -> dict[str, float]:
    """Prometheus text -> every metric's samples summed over their labels."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            sums[m.group(1)] = sums.get(m.group(1), 0.0) + float(m.group(4))
    return sums


def metric_by_label(text: str, name: str, label: str, **where: str) -> dict[str, float]:
    """Samples of ``name`` (those whose labels match ``where``) summed per value of ``label``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if any(labels.get(k) != v for k, v in where.items()):
            continue
        key = labels.get(label, "")
        out[key] = out.get(key, 0.0) + float(m.group(4))
    return out


def fleet_total(statuses: Iterable[dict | None], server: str) -> dict[str, int]:
    """The fleet processes' status files summed: agents reporting, routable through ``server`` (they
    hold every worker of it), tunnels registered with it, live tunnels (registered or not), RSS;
    ``silent``: processes with no status yet."""
    total = {
        "agents": 0,
        "routable": 0,
        "registered": 0,
        "tunnels": 0,
        "rss_kib": 0,
        "base_rss_kib": 0,
        "silent": 0,
    }
    for s in statuses:
        if s is None:
            total["silent"] += 1
            continue
        total["agents"] += s["agents"]
        total["routable"] += s["routable"].get(server, 0)
        total["registered"] += s["registered"].get(server, 0)
        total["tunnels"] += s["tunnels"]
        total["rss_kib"] += s["rss_kib"]
        total["base_rss_kib"] += s["base_rss_kib"]
    return total


def pct_of_core(cpu_s: float, wall_s: float) -> float:
    return round(100.0 * cpu_s / wall_s, 1) if wall_s > 0 else 0.0


def rates(samples: list[dict], key: str, window: float = 1.0) -> dict[str, float]:
    """Per second of a growing counter ``key`` in samples ``{"t": seconds, key: value}``: the mean
    over the samples and the peak over consecutive windows of at least ``window`` seconds that cover
    them all (a shorter tail joins the last window, so the peak is never below the mean). Samples
    without the value (None: not read) are left out."""
    samples = [s for s in samples if s.get(key) is not None]
    if len(samples) < 2 or samples[-1]["t"] <= samples[0]["t"]:
        return {"mean_per_s": 0.0, "peak_per_s": 0.0}
    bounds = [0]
    for i in range(1, len(samples)):
        if samples[i]["t"] - samples[bounds[-1]]["t"] >= window:
            bounds.append(i)
    last = len(samples) - 1
    if bounds[-1] != last:
        if len(bounds) > 1:
            bounds[-1] = last
        else:
            bounds.append(last)

    def per_s(a: dict, b: dict) -> float:
        return (b[key] - a[key]) / (b["t"] - a["t"])

    peak = max(per_s(samples[a], samples[b]) for a, b in itertools.pairwise(bounds))
    mean = per_s(samples[0], samples[-1])
    return {"mean_per_s": round(mean, 1), "peak_per_s": round(peak, 1)}


def peak_cpu_pct(samples: list[dict], key: str = "server_cpu_s", window: float = 1.0) -> float:
    return rates(samples, key, window)["peak_per_s"] * 100.0


def extrapolate(base_kib: float, per_unit_kib: float, units: int) -> float:
    """MiB of ``base`` plus ``units`` times ``per_unit`` (KiB each)."""
    return round((base_kib + per_unit_kib * units) / 1024.0, 1)


def goal_check(agents: int, rss_mib: float | None, idle_pct: float | None, restart_s: float | None) -> dict:
    """Each goal of issue 36 point 5 met (True), missed (False) or not measured (None); the goals
    are for 10,000 agents: at fewer, ``at_goal_scale`` is False and the checks say little."""

    def at_most(value: float | None, bound: float) -> bool | None:
        return None if value is None else value <= bound

    return {
        "at_goal_scale": agents >= GOALS["agents"],
        "rss": at_most(rss_mib, GOALS["rss_mib"]),
        "idle_cpu": at_most(idle_pct, GOALS["idle_pct"]),
        "restart": at_most(restart_s, GOALS["restart_s"]),
    }


# ------------------------------------------------------------------ processes


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the tool dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"  # a zombie holds no socket and no memory


def pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Child:
    """A process the tool started, in a session of its own, with its log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log = name, argv, log
        self.popen, self._logf = start_logged(argv, log, env, _die_with_parent)  # _logf closed in kill()
        self.seen: set[int] = {self.popen.pid}  # every descendant seen: the server's workers

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def pids(self) -> list[int]:
        found = with_descendants(self.pid) if self.alive() else []
        self.seen.update(found)
        return found

    def rss_kib(self) -> dict[int, int]:
        return {pid: rss_kib(pid) for pid in self.pids()}

    def pss_kib(self) -> dict[int, int]:
        return {pid: pss_kib(pid) for pid in self.pids()}

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(pid) for pid in self.pids())

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL this process and every descendant at once (the server's workers are in sessions of
        their own: a process group would miss them), and wait until each is gone."""
        targets = [pid for pid in set(self.pids()) | self.seen if not _gone(pid) and _ours(pid, self)]
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout)
        end = time.monotonic() + timeout
        while time.monotonic() < end and not all(_gone(pid) for pid in targets):
            time.sleep(0.02)
        if not self._logf.closed:
            self._logf.close()

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def runs_with(cmdline: bytes, argv: list[str]) -> bool:
    """Whether a /proc/PID/cmdline ends with ``argv``'s arguments: the server's workers run
    ``python -m clusterproxy_server.main`` with exactly the parent's arguments (its unique ports and
    --server-id), which no other process on the machine has."""
    args = [a.encode() for a in argv[1:]]
    parts = cmdline.split(b"\0")
    if parts and parts[-1] == b"":
        parts.pop()
    return bool(args) and parts[-len(args) :] == args


def _ours(pid: int, child: Child) -> bool:
    """A pid is still this child's (not reused by another process since it was seen)."""
    if pid == child.pid:
        return child.alive()  # not reaped yet: the pid cannot have been reused
    try:
        return runs_with(Path(f"/proc/{pid}/cmdline").read_bytes(), child.argv)
    except OSError:
        return False


class Children:
    """Every process the tool started; ``kill_all`` leaves none behind."""

    def __init__(self) -> None:
        self.all: list[Child] = []

    def start(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, log, env)
        self.all.append(child)
        return child

    def kill(self, child: Child) -> None:
        child.kill()
        with contextlib.suppress(ValueError):
            self.all.remove(child)

    def kill_all_but(self, keep: Child) -> None:
        for child in list(self.all):
            if child is not keep:
                self.kill(child)

    def kill_all(self) -> None:
        for child in reversed(self.all):
            with contextlib.suppress(Exception):
                child.kill()
        self.all.clear()


def raise_descriptor_limit(wanted: int) -> tuple[int, int]:
    """Lift this process's RLIMIT_NOFILE (inherited by every child) to ``wanted`` or the hard limit;
    as root the hard limit itself is lifted up to the kernel's nr_open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        nr_open = hard
    target = max(soft, min(wanted, nr_open))
    for new in ((max(target, hard), max(target, hard)), (min(target, hard), hard)):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, new)
            break
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def read_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


# ------------------------------------------------------------------ the run


def log(msg: str) -> None:
    print(f"[fleet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Deadline:
    at: float  # time.monotonic()

    def left(self) -> float:
        return self.at - time.monotonic()

    def bound(self, seconds: float) -> float:
        left = self.left()
        if left <= 0:
            raise DeadlineExceeded("the tool's --deadline has passed")
        return min(seconds, left)


@dataclass
class Options:
    agents: int
    workers: list[int]
    processes: int
    out: Path
    deadline: float
    connect_timeout: float
    restart_timeout: float
    probe_timeout: float
    probe_parallel: int
    idle_window: float
    settle: float
    progress: float
    server_flags: list[str] = field(default_factory=list)


Fleets = list[tuple[Child, Path]]  # the fleet's processes and their status files


class FleetRun:
    """The server, the fleet and the target of one tool run (the certificates issued once)."""

    def __init__(self, opts: Options, scratch: Path, children: Children, deadline: Deadline) -> None:
        self.opts, self.scratch, self.children, self.deadline = opts, scratch, children, deadline
        self.logs = opts.out / "logs"
        log("building the loadgen (cached when its sources did not change) and the server's certificates")
        self.env = tool_env(scratch)
        self.env.log_dir = self.logs
        self.logs.mkdir(parents=True, exist_ok=True)
        self.target = children.start(
            "target",
            [str(self.env.loadgen), "target", "--listen", f"127.0.0.1:{self.env.target_port}"],
            self.logs / "target.log",
        )
        wait_port("127.0.0.1", self.env.target_port, 30)
        self.admin_port = free_port()  # one port for every agent's admin listener, below the ephemeral range
        self.agents = self._issue_agents()

    def _issue_agents(self) -> list[dict]:
        started, agents = time.monotonic(), []
        last = started
        for i in range(self.opts.agents):
            cluster = f"fleet-{i}"
            cert = self.env.pki.agent(cluster, "a")
            agents.append(
                {
                    "cluster": cluster,
                    "agent_id": "a",
                    "cert": str(cert.cert),
                    "key": str(cert.key),
                    "admin": f"{loopback_ip(i)}:{self.admin_port}",
                }
            )
            if time.monotonic() - last >= self.opts.progress:
                last = time.monotonic()
                log(f"certificates: {i + 1}/{self.opts.agents}")
            self.deadline.bound(1)
        log(f"{self.opts.agents} agent certificates in {time.monotonic() - started:.1f} s")
        return agents

    # -- server

    def server_argv(self, ours: Ours, server_id: str) -> list[str]:
        return [*ours._server_argv(), "--server-id", server_id, *self.opts.server_flags]

    def start_server(self, ours: Ours, server_id: str, tag: str, ready: bool = True) -> tuple[Child, float]:
        """Start the server and wait until its ports listen (and, with ``ready``, until it is ready:
        every worker started); returns (child, seconds until it listened)."""
        argv = self.server_argv(ours, server_id)
        t0 = time.monotonic()
        child = self.children.start(f"server-{tag}", argv, self.logs / f"server-w{ours.workers}.log")
        # The admin port opens after the agent and client ports (app.py, workers.py): connecting to
        # it, not to them, tells that they listen without a refused TLS connection in the counters.
        # (a Child has what wait_port reads of a Proc: popen, name, log)
        wait_port("127.0.0.1", ours.admin_port, self.deadline.bound(60), child)  # type: ignore[arg-type]
        listening = time.monotonic() - t0
        if not ready:
            return child, listening
        end = time.monotonic() + self.deadline.bound(60)
        while not _ready(ours.admin_port):  # with workers: the parent answers once every worker has
            if not child.alive():
                raise RuntimeError(f"the server exited: {child.tail()}")
            if time.monotonic() > end:
                raise RuntimeError(f"the server is not ready after 60 s: {child.tail()}")
            time.sleep(0.1)
        return child, listening

    # -- fleet

    def start_fleet(self, ours: Ours, workers: int) -> Fleets:
        processes = agent_processes(self.opts.agents, self.opts.processes)
        fleets = []
        for part in range(processes):
            status = self.scratch / f"status-w{workers}-{part}.json"
            status.unlink(missing_ok=True)
            spec = self.scratch / f"fleet-w{workers}-{part}.json"
            common = {
                "server_host": "127.0.0.1",
                "server_port": ours.agent_port,
                "server_name": "localhost",
                "ca": str(self.env.pki.ca),
                "status_file": str(status),
                "status_interval": 1.0,
                "expect_replicas": workers,
            }
            spec.write_text(json.dumps({"common": common, "agents": self.agents[part::processes]}))
            child = self.children.start(
                f"fleet-{part}",
                fleet_argv(self.env.venv_bin, spec),
                self.logs / f"fleet-w{workers}-{part}.log",
                env={"PYTHONPATH": str(REPO)},
            )
            fleets.append((child, status))
        return fleets

    # -- waiting for the fleet

    def wait_routable(
        self,
        phase: str,
        server: Child,
        fleets: Fleets,
        server_base: str,
        timeout: float,
        workers: int,
        agent_port: int,
    ) -> tuple[float, list[dict]]:
        """Poll the fleet's status files (and the server's CPU, its established connections, the
        kernel's listen-queue counters) until every agent holds every worker of ``server_base``;
        returns (time.monotonic() then, samples). The server's own readings come first in a sample:
        they are what moves fastest in a storm."""
        n = self.opts.agents
        t0 = time.monotonic()
        bound = self.deadline.bound(timeout)
        samples: list[dict] = []
        last_print = 0.0
        while True:
            now = time.monotonic() - t0
            sample = {
                "t": round(now, 3),
                "established": established(agent_port),
                "server_cpu_s": server.cpu_seconds(),
                "server_rss_kib": sum(server.rss_kib().values()),
            }
            ext = parse_proc_net(read_text("/proc/net/netstat"), "TcpExt")
            total = fleet_total((read_status(path) for _c, path in fleets), server_base)
            sample.update(
                {
                    "routable": total["routable"],
                    "registered": total["registered"],
                    "tunnels": total["tunnels"],
                    "listen_overflows": ext.get("ListenOverflows", 0),
                    "listen_drops": ext.get("ListenDrops", 0),
                }
            )
            samples.append(sample)
            for child, _path in fleets:
                if not child.alive():
                    raise RuntimeError(f"{child.name} exited: {child.tail()}")
            if not server.alive():
                raise RuntimeError(f"the server exited: {server.tail()}")
            if total["routable"] >= n:
                log(
                    f"w{workers} {phase}: all {n} agents routable ({now:.2f} s into this wait), {total['tunnels']} tunnels"
                )
                return time.monotonic(), samples
            if now - last_print >= self.opts.progress:
                last_print = now
                recent = [s for s in samples if s["t"] >= now - self.opts.progress]
                cpu = pct_of_core(
                    recent[-1]["server_cpu_s"] - recent[0]["server_cpu_s"], recent[-1]["t"] - recent[0]["t"]
                )
                log(
                    f"w{workers} {phase}: {total['routable']}/{n} routable, {total['tunnels']} tunnels, "
                    f"server {sample['server_rss_kib'] / 1024:.0f} MiB, CPU {cpu:.0f} % of a core, "
                    f"{now:.0f} s"
                )
            if now > bound:
                raise PhaseTimeout(
                    f"{phase}: {total['routable']} of {n} agents routable after {bound:g} s",
                    {"routable": total["routable"], "tunnels": total["tunnels"], "samples": samples},
                )
            time.sleep(0.5)

    def probe(self, ours: Ours) -> dict:
        lines = [f"127.0.0.1:{self.env.target_port}\t{CLUSTER_HEADER}: {a['cluster']}" for a in self.agents]
        t0 = time.monotonic()
        res = self.env.probe(
            self.env.proxy_args(ours.client_port),
            lines,
            self.deadline.bound(self.opts.probe_timeout),
            self.opts.probe_parallel,
        )
        errors = res.get("failed_dial") or {}
        return {
            "targets": res["targets"],
            "ok": res["ok"],
            "all_s": res["time_all_s"] if res["ok"] == res["targets"] else None,
            "wall_s": round(time.monotonic() - t0, 2),
            "ok_times": res.get("ok_times"),
            "failed_attempts": errors if isinstance(errors, dict) else {"errors": errors},
        }

    # -- one worker count

    def measure(self, workers: int, result: dict) -> None:
        """Everything for one worker count, into ``result`` as it is measured (a timeout or the
        deadline keeps what came before)."""
        opts, n = self.opts, self.opts.agents
        ours = Ours(self.env, workers=workers)
        ours.client_port, ours.agent_port, ours.admin_port = free_port(), free_port(), free_port()
        first_id, second_id = f"fleet-w{workers}-start", f"fleet-w{workers}-restart"
        spec = self.scratch / "fleet-SPEC.json"
        result["commands"] = {
            "server": shlex.join(self.server_argv(ours, first_id)),
            "server_after_restart": f"the same with --server-id {second_id}",
            "fleet": f"PYTHONPATH={REPO} {shlex.join(fleet_argv(self.env.venv_bin, spec))}",
            "probe": shlex.join(
                [
                    str(self.env.loadgen),
                    "probe",
                    "--targets",
                    "FILE",
                    "--parallel",
                    str(opts.probe_parallel),
                    "--dial-timeout",
                    "5s",
                    *self.env.proxy_args(ours.client_port),
                ]
            ),
        }
        log(f"w{workers}: starting the server")
        server, listen_s = self.start_server(ours, first_id, "start")
        time.sleep(1.0)
        base = server.rss_kib()
        result["server_start_listen_s"] = round(listen_s, 2)
        result["server_base"] = {"rss_kib": sum(base.values()), "processes": len(base)}
        t_fleet = time.monotonic()
        fleets = self.start_fleet(ours, workers)
        result["agent_processes"] = len(fleets)
        log(f"w{workers}: {n} agents in {len(fleets)} processes started")
        try:
            done_at, samples = self.wait_routable(
                "connect", server, fleets, first_id, opts.connect_timeout, workers, ours.agent_port
            )
        except PhaseTimeout as exc:
            result["connect"] = {"timed_out": str(exc), "routable": exc.seen["routable"]}
            return
        connect_s = done_at - t_fleet
        result["connect"] = {
            "all_routable_s": round(connect_s, 2),
            "established_per_s": rates(samples, "established"),
            "registered_per_s": rates(samples, "registered"),
            "server_cpu_pct": pct_of_core(
                samples[-1]["server_cpu_s"] - samples[0]["server_cpu_s"], connect_s
            ),
        }
        time.sleep(opts.settle)  # the last registrations' garbage and the first keepalives pass
        result["memory"] = self.memory(server, fleets, base, workers)
        log(
            f"w{workers}: server RSS {result['memory']['server_rss_mib']} MiB, "
            f"{result['memory']['server_kib_per_tunnel']} KiB per tunnel; "
            f"fleet {result['memory']['fleet_kib_per_agent']} KiB per agent"
        )
        log(f"w{workers}: probing every cluster ({opts.probe_parallel} at once)")
        result["probe"] = self.probe(ours)
        log(f"w{workers}: probe {result['probe']['ok']}/{n} answered in {result['probe']['wall_s']} s")
        result["idle"] = self.idle(server, fleets, workers)
        result["server_metrics_before_kill"] = scrape(ours.admin_port)
        result["restart"] = self.restart(ours, server, fleets, workers, second_id)

    def memory(self, server: Child, fleets: Fleets, base: dict[int, int], workers: int) -> dict:
        n = self.opts.agents
        rss, pss = server.rss_kib(), server.pss_kib()
        statuses = [read_status(path) for _c, path in fleets]
        fleet = fleet_total(statuses, "")
        tunnels = n * workers
        per_tunnel = (sum(rss.values()) - sum(base.values())) / tunnels
        per_agent = (fleet["rss_kib"] - fleet["base_rss_kib"]) / n
        goal = GOALS["agents"]
        return {
            "tunnels_per_agent": workers,
            "tunnels_seen_per_agent": round(fleet["tunnels"] / n, 2),
            "server_rss_kib": rss,
            "server_pss_kib": pss,
            "server_rss_mib": round(sum(rss.values()) / 1024, 1),
            "server_pss_mib": round(sum(pss.values()) / 1024, 1),
            "server_kib_per_tunnel": round(per_tunnel, 1),
            "server_kib_per_agent": round(per_tunnel * workers, 1),
            "server_rss_mib_at_goal": extrapolate(sum(base.values()), per_tunnel * workers, goal),
            "fleet_rss_mib": round(fleet["rss_kib"] / 1024, 1),
            "fleet_base_rss_mib": round(fleet["base_rss_kib"] / 1024, 1),
            "fleet_kib_per_agent": round(per_agent, 1),
            "fleet_rss_mib_at_goal": extrapolate(
                fleet["base_rss_kib"] / len(fleets) * agent_processes(goal, 0), per_agent, goal
            ),
        }

    def idle(self, server: Child, fleets: Fleets, workers: int) -> dict:
        """CPU over a fixed window in which nothing but the tunnels' keepalives happens."""
        log(f"w{workers}: idle window of {self.opts.idle_window:g} s (nothing asks the server)")
        time.sleep(self.opts.settle)  # the probe's connections close
        fleet_cpu = lambda: sum(c.cpu_seconds() for c, _p in fleets)  # noqa: E731
        t0, s0, f0 = time.monotonic(), server.cpu_seconds(), fleet_cpu()
        time.sleep(self.deadline.bound(self.opts.idle_window))
        wall = time.monotonic() - t0
        out = {
            "window_s": round(wall, 1),
            "server_cpu_pct": pct_of_core(server.cpu_seconds() - s0, wall),
            "fleet_cpu_pct": pct_of_core(fleet_cpu() - f0, wall),
            "loadavg": read_text("/proc/loadavg").split()[:3],
        }
        log(
            f"w{workers}: idle CPU: server {out['server_cpu_pct']} %, fleet {out['fleet_cpu_pct']} % of a core"
        )
        return out

    def restart(self, ours: Ours, server: Child, fleets: Fleets, workers: int, second_id: str) -> dict:
        n = self.opts.agents
        log(f"w{workers}: SIGKILL of every server process")
        t_kill = time.monotonic()
        self.children.kill(server)
        t_spawn = time.monotonic()
        # the storm is sampled from the moment the new server listens: agents' connections queue
        # from then on, while the server (its workers) still start
        server, listen_s = self.start_server(ours, second_id, "restart", ready=False)
        t_listen = t_spawn + listen_s
        out: dict = {
            "kill_to_gone_s": round(t_spawn - t_kill, 2),
            "restarted_listening_after_kill_s": round(t_listen - t_kill, 2),
        }
        try:
            done_at, samples = self.wait_routable(
                "restart",
                server,
                fleets,
                second_id,
                self.opts.restart_timeout,
                workers,
                ours.agent_port,
            )
        except PhaseTimeout as exc:
            out["timed_out"] = str(exc)
            out["routable"] = exc.seen["routable"]
            return out
        storm_wall = max(samples[-1]["t"] - samples[0]["t"], 1e-9)
        metrics = scrape(ours.admin_port)
        out.update(
            {
                "all_routable_after_kill_s": round(done_at - t_kill, 2),
                "all_routable_after_listening_s": round(done_at - t_listen, 2),
                "accepted_per_s": accepted_per_s(metrics, storm_wall),
                "established_per_s": rates(samples, "established"),
                "registered_per_s": rates(samples, "registered"),
                "server_cpu_pct": pct_of_core(
                    samples[-1]["server_cpu_s"] - samples[0]["server_cpu_s"], storm_wall
                ),
                "server_cpu_peak_pct": round(peak_cpu_pct(samples), 1),
                "listen_overflows": samples[-1]["listen_overflows"] - samples[0]["listen_overflows"],
                "listen_drops": samples[-1]["listen_drops"] - samples[0]["listen_drops"],
                "registrations": metrics.get("registrations"),
                "registrations_per_tunnel": (
                    round(metrics["registrations"] / (n * workers), 2)
                    if metrics.get("registrations")
                    else None
                ),
                "rejected": metrics.get("rejected"),
                "samples": samples,
            }
        )
        out["storm"] = f"{len(samples)} samples every 0.5 s"
        log(f"w{workers}: probing every cluster again")
        out["probe"] = self.probe(ours)
        log(f"w{workers}: probe {out['probe']['ok']}/{n} answered in {out['probe']['wall_s']} s")
        return out


def established(port: int) -> int | None:
    """The server's established TCP connections on ``port`` (``ss``: the kernel filters them, which
    reading /proc/net/tcp's tens of thousands of lines twice a second would not)."""
    try:
        out = subprocess.run(
            ["ss", "-Htn", "state", "established", f"( sport = :{port} )"],
            capture_output=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.count(b"\n")


def accepted_per_s(metrics: dict, wall: float) -> float | None:
    """Agent connections the server took per second: each was registered or refused."""
    if not isinstance(metrics.get("registrations"), float) or wall <= 0:
        return None
    return round((metrics["registrations"] + sum((metrics.get("rejected") or {}).values())) / wall, 1)


def fleet_argv(venv_bin: Path, spec: Path) -> list[str]:
    return [str(venv_bin / "python"), "-m", "bench.fleet", str(spec)]


def read_status(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _ready(admin_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/readyz", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def scrape(admin_port: int) -> dict:
    """The server's own counters, read once (a scrape of 10,000 clusters costs the server CPU: never
    during a measured window)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError as exc:
        return {"error": str(exc)}
    sums = metric_sums(text)
    return {
        "tunnels": sums.get("cluster_proxy_server_agent_tunnels"),
        "registrations": sums.get("cluster_proxy_server_agent_connects_total"),
        "rejected": metric_by_label(
            text, "cluster_proxy_server_rejected_connections_total", "reason", port="agent"
        ),
        "client_refusals": metric_by_label(text, "cluster_proxy_server_client_refusals_total", "bound"),
    }


# ------------------------------------------------------------------ report


def flag_notes(opts: Options, limits: dict) -> list[str]:
    """Which of the server's limits bear on 10,000 agents, and what this run sets (written down)."""
    return [
        "Per-identity quotas (--client-max-connections 1,024, --client-max-concurrent-streams, "
        "--client-stream-rate/--client-stream-burst, the buffer budgets) are the client port's: "
        "agents are not counted by them, whatever their identities. The probe is one client identity "
        f"with at most {opts.probe_parallel} connections at once; a 429 from its stream rate "
        "(500/s by default) is retried by the probe and counted under client_refusals.",
        "The agent port has no count limit; what bears on a storm is --handshake-timeout (10 s: the "
        "TLS handshake and the registration must fit, or the agent redials), the server's handshake "
        "gate (256 agent handshakes at once per worker, the rest wait their turn) and the kernel's "
        f"listen queue (the server asks for 65,535, capped by net.core.somaxconn = {limits['somaxconn']}).",
        "--keepalive-interval 30s (default since issue 36; 10 s before): every tunnel is PINGed every "
        "30 s, so 10,000 agents x workers tunnels mean 333 x workers PINGs a second; that is what the "
        "idle CPU pays.",
        "The server does not raise its own RLIMIT_NOFILE: it runs with what it inherits. A worker holds "
        "a socket per agent, so a 10,000-cluster hub needs a limit above 10,000 plus its clients "
        "(containers usually get 1,048,576; a systemd unit's default soft limit of 1,024 is too low). "
        f"This run: soft {limits['nofile'][0]}, hard {limits['nofile'][1]}, inherited by every process.",
        f"Agent tunnels dial one address, so agents x workers must fit the ephemeral port range "
        f"{limits['port_range'][0]}-{limits['port_range'][1]} ({limits['ports_needed']} needed); the "
        "agents' admin listeners take one port below it on an address each (127.3.x.y).",
        "Server flags set: --workers, --server-id (new at the restart, as a new pod's); everything else "
        "at its default, plus --server-flag: " + (shlex.join(opts.server_flags) or "none") + ".",
    ]


def markdown(results: dict) -> str:
    runs = results["runs"]
    lines = [
        f"# 10,000 clusters: {results['agents']} agents on one proxy-server",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Started {results['started']}, {results['machine']['cpus']} CPUs, kernel "
        f"{results['machine']['kernel']}, load average before {results['loadavg_before']}, after "
        f"{results.get('loadavg_after', '?')}. {results['agent_processes']} fleet processes "
        f"({results['agents_per_process']} agents each at most).",
        "",
    ]
    if results.get("stopped"):
        lines += [f"**Stopped early:** {results['stopped']}", ""]
    rows: list[tuple[str, Callable[[dict], object]]] = [
        ("tunnels per agent (pods x workers)", lambda r: _get(r, "memory", "tunnels_per_agent")),
        ("all routable after the agents start, s", lambda r: _get(r, "connect", "all_routable_s")),
        (
            "while connecting: tunnels registered per s, mean / peak",
            lambda r: _pair(_get(r, "connect", "registered_per_s")),
        ),
        ("while connecting: server CPU, % of a core", lambda r: _get(r, "connect", "server_cpu_pct")),
        ("server RSS, MiB (parent + workers)", lambda r: _get(r, "memory", "server_rss_mib")),
        ("server PSS, MiB", lambda r: _get(r, "memory", "server_pss_mib")),
        ("server RSS per tunnel, KiB", lambda r: _get(r, "memory", "server_kib_per_tunnel")),
        ("server RSS per agent, KiB", lambda r: _get(r, "memory", "server_kib_per_agent")),
        (
            "server RSS at 10,000 agents (extrapolated), MiB",
            lambda r: _get(r, "memory", "server_rss_mib_at_goal"),
        ),
        ("probe: clusters answering", lambda r: _probe(r.get("probe"))),
        ("idle CPU of the server, % of a core", lambda r: _get(r, "idle", "server_cpu_pct")),
        ("idle CPU of the fleet, % of a core", lambda r: _get(r, "idle", "fleet_cpu_pct")),
        (
            "restart: new server listening after SIGKILL, s",
            lambda r: _get(r, "restart", "restarted_listening_after_kill_s"),
        ),
        ("restart: all routable after SIGKILL, s", lambda r: _get(r, "restart", "all_routable_after_kill_s")),
        (
            "restart: all routable after listening, s",
            lambda r: _get(r, "restart", "all_routable_after_listening_s"),
        ),
        (
            "storm: agent connections accepted per s (server's counters), mean",
            lambda r: _get(r, "restart", "accepted_per_s"),
        ),
        (
            "storm: agent-port connections established per s (ss), mean / peak",
            lambda r: _pair(_get(r, "restart", "established_per_s")),
        ),
        (
            "storm: tunnels registered per s (agents' view), mean / peak",
            lambda r: _pair(_get(r, "restart", "registered_per_s")),
        ),
        ("storm: server CPU, % of a core, mean / peak", lambda r: _cpu(r.get("restart"))),
        ("storm: registrations per tunnel", lambda r: _get(r, "restart", "registrations_per_tunnel")),
        ("storm: agent connections refused, by reason", lambda r: _get(r, "restart", "rejected")),
        ("storm: listen queue overflows / drops (machine-wide)", lambda r: _overflows(r.get("restart"))),
        ("probe after the restart", lambda r: _probe(_get(r, "restart", "probe"))),
        ("fleet RSS per agent, KiB", lambda r: _get(r, "memory", "fleet_kib_per_agent")),
        (
            "fleet RSS at 10,000 agents (extrapolated), MiB",
            lambda r: _get(r, "memory", "fleet_rss_mib_at_goal"),
        ),
    ]
    lines.append("| | " + " | ".join(f"--workers {r['workers']}" for r in runs) + " |")
    lines.append("|---|" + "---|" * len(runs))
    for label, get in rows:
        lines.append(f"| {label} | " + " | ".join(_cell(get(r)) for r in runs) + " |")
    lines += ["", "Goals (issue 36, point 5; for 10,000 agents on this machine):", ""]
    for r in runs:
        g = r.get("goals", {})
        scale = "" if g.get("at_goal_scale") else f" (at {results['agents']} agents: not the goal's scale)"
        lines.append(
            f"- --workers {r['workers']}{scale}: RSS <= 2 GiB {_met(g.get('rss'))}, idle CPU <= 30 % "
            f"{_met(g.get('idle_cpu'))}, all routable <= 60 s after restart {_met(g.get('restart'))}"
        )
    lines += ["", "## Limits and flags", ""]
    lines += [f"- {note}" for note in results["flag_notes"]]
    lines += ["", "## Command lines", ""]
    for r in runs:
        for name, command in r.get("commands", {}).items():
            lines.append(f"- --workers {r['workers']}, {name}: `{command}`")
    for r in runs:
        if r.get("error"):
            lines += ["", f"--workers {r['workers']} failed: {r['error']}"]
    return "\n".join(lines) + "\n"


def _get(r: dict | None, *keys: str) -> object:
    for k in keys:
        if not isinstance(r, dict):
            return None
        r = r.get(k)
    return r


def _probe(p: object) -> str | None:
    if not isinstance(p, dict):
        return None
    return f"{p['ok']}/{p['targets']} in {p['wall_s']} s"


def _pair(v: object) -> str | None:
    return f"{v['mean_per_s']} / {v['peak_per_s']}" if isinstance(v, dict) else None


def _cpu(r: object) -> str | None:
    if not isinstance(r, dict) or "server_cpu_pct" not in r:
        return None
    return f"{r['server_cpu_pct']} / {r['server_cpu_peak_pct']}"


def _overflows(r: object) -> str | None:
    if not isinstance(r, dict) or "listen_overflows" not in r:
        return None
    return f"{r['listen_overflows']} / {r['listen_drops']}"


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, dict):
        return (
            ", ".join(f"{k or '?'} {int(x) if isinstance(x, float) else x}" for k, x in v.items()) or "none"
        )
    return str(v)


def _met(v: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "not measured"}[v]


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> Options:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=10000, help="agents, each of its own cluster")
    p.add_argument("--workers", default="1,2", help="the server's --workers values measured, e.g. 1,2")
    p.add_argument(
        "--agent-processes",
        type=int,
        default=0,
        help=f"fleet processes the agents are spread over (0: one per {AGENTS_PER_PROCESS} agents)",
    )
    p.add_argument("--out", type=Path, required=True, help="folder for results.json, results.md and logs/")
    p.add_argument("--deadline", type=float, default=3600.0, help="seconds the whole run may take")
    p.add_argument("--connect-timeout", type=float, default=600.0, help="seconds for every agent to connect")
    p.add_argument(
        "--restart-timeout", type=float, default=300.0, help="seconds to be back after the restart"
    )
    p.add_argument("--probe-timeout", type=float, default=600.0, help="seconds the probe may take")
    p.add_argument("--probe-parallel", type=int, default=32, help="probe connections at once")
    p.add_argument("--idle-window", type=float, default=30.0, help="seconds of idle CPU measured")
    p.add_argument("--settle", type=float, default=3.0, help="seconds waited before memory and idle CPU")
    p.add_argument("--progress", type=float, default=3.0, help="seconds between two progress lines")
    p.add_argument(
        "--server-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="an extra proxy-server argument (repeat; e.g. --server-flag=--keepalive-interval=30s)",
    )
    a = p.parse_args(argv)
    try:
        workers = parse_workers(a.workers)
    except ValueError as exc:
        p.error(str(exc))
    if a.agents < 1 or a.agent_processes < 0 or a.probe_parallel < 1 or a.deadline <= 0:
        p.error("--agents, --probe-parallel and --deadline take positive numbers, --agent-processes >= 0")
    return Options(
        agents=a.agents,
        workers=workers,
        processes=a.agent_processes,
        out=a.out,
        deadline=a.deadline,
        connect_timeout=a.connect_timeout,
        restart_timeout=a.restart_timeout,
        probe_timeout=a.probe_timeout,
        probe_parallel=a.probe_parallel,
        idle_window=a.idle_window,
        settle=a.settle,
        progress=a.progress,
        server_flags=a.server_flag,
    )


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def _alarm(_signum: int, _frame: object) -> None:
    raise DeadlineExceeded("the tool's --deadline has passed (a step was still running)")


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    results_folder(opts.out)
    processes = agent_processes(opts.agents, opts.processes)
    need = descriptors_needed(opts.agents, processes, max(opts.workers), opts.probe_parallel)
    nofile = raise_descriptor_limit(max(need.values()) + FD_MARGIN)
    port_range = parse_port_range(read_text("/proc/sys/net/ipv4/ip_local_port_range") or "32768 60999")
    limits = {
        "nofile": nofile,
        "descriptors_needed": need,
        "port_range": port_range,
        "ports_needed": ports_needed(opts.agents, max(opts.workers)),
        "somaxconn": read_text("/proc/sys/net/core/somaxconn").strip() or "?",
    }
    problems = []
    if nofile[0] < max(need.values()):
        problems.append(f"RLIMIT_NOFILE {nofile[0]} is below the {max(need.values())} a process needs")
    if limits["ports_needed"] > port_range[1] - port_range[0] - 1000:
        problems.append(f"{limits['ports_needed']} tunnels do not fit the ephemeral port range {port_range}")
    if problems:
        print("bench.fleet_scale: " + "; ".join(problems), file=sys.stderr)
        return 2
    results: dict = {
        "command": "python -m bench.fleet_scale " + shlex.join(sys.argv[1:] if argv is None else argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "agents": opts.agents,
        "workers": opts.workers,
        "agent_processes": processes,
        "agents_per_process": math.ceil(opts.agents / processes),
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
        },
        "loadavg_before": " ".join(read_text("/proc/loadavg").split()[:3]),
        "limits": limits,
        "flag_notes": flag_notes(opts, limits),
        "runs": [],
    }
    deadline = Deadline(time.monotonic() + opts.deadline)
    children = Children()
    scratch = Path(tempfile.mkdtemp(prefix="fleet-scale-"))
    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(opts.deadline) + 60)  # the backstop: a step that ignores the deadline is cut
    log(f"{opts.agents} agents, workers {opts.workers}, {processes} fleet processes; results in {opts.out}")
    try:
        run = FleetRun(opts, scratch, children, deadline)
        for workers in opts.workers:
            result: dict = {"workers": workers}
            results["runs"].append(result)
            try:
                run.measure(workers, result)
            except (
                RuntimeError,
                TimeoutError,
                subprocess.SubprocessError,
                OSError,
                ValueError,
                KeyError,
            ) as exc:
                result["error"] = str(exc)
                log(f"w{workers}: failed: {exc}")
            finally:
                children.kill_all_but(run.target)
                result["goals"] = goal_check(
                    opts.agents,
                    _get(result, "memory", "server_rss_mib_at_goal"),
                    _get(result, "idle", "server_cpu_pct"),
                    _get(result, "restart", "all_routable_after_kill_s"),
                )
                _write(opts.out, results)
    except (KeyboardInterrupt, DeadlineExceeded) as exc:
        results["stopped"] = f"{type(exc).__name__}: {exc}"
        log(f"stopping: {results['stopped']}")
    finally:
        signal.alarm(0)
        children.kill_all()
        shutil.rmtree(scratch, ignore_errors=True)
        for s, handler in old.items():
            signal.signal(s, handler)
        results["loadavg_after"] = " ".join(read_text("/proc/loadavg").split()[:3])
        _write(opts.out, results)
        log(f"wrote {opts.out / 'results.json'} and {opts.out / 'results.md'}")
    return 0 if not results.get("stopped") and not any(r.get("error") for r in results["runs"]) else 1


def _write(out: Path, results: dict) -> None:
    write_results(out, results, markdown(results))


if __name__ == "__main__":
    raise SystemExit(main())
