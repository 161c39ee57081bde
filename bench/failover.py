"""The failover workload: proxy-server replicas behind a real haproxy, one of them stopped while a
client opens new streams through the balancer.

A :class:`ReplicaFleet` runs, for one system, ``replicas`` proxy-server replicas in fixed places behind
haproxy (bench/haproxy.py) and ``agents`` agents of cluster1 dialing haproxy's agent frontend, until
every agent holds a tunnel to every replica. :meth:`ReplicaFleet.failover_once` starts ``loadgen
churn`` (new streams through haproxy's client frontend, each a CONNECT and a 16-byte echo), lets it
run, signals one replica (SIGKILL: a crash; SIGTERM: a drain), watches for a fixed window, then starts
a successor in the victim's place and waits until every agent holds it again. :func:`analyse` turns
the client's attempts into the row's figures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.haproxy import Haproxy, Place, allocate_places
from bench.procs import Proc, free_port, wait_port
from bench.systems import Env, System

STREAM_LIMIT = 15.0  # seconds a new stream of the client may take (TLS, CONNECT, echo) before it fails


@dataclass(frozen=True)
class FailoverSettings:
    replicas: int
    agents: int
    warmup: float  # seconds of new streams before the signal
    window: float  # seconds watched after it
    workers: int  # loadgen churn goroutines
    gap_ms: int  # pause between one worker's streams
    late_absence: float  # the late variant: seconds from the signal to the successor's start
    check_interval: str  # haproxy's health-check interval
    drain_timeout: float  # the replicas' drain (ours) / graceful shutdown (upstream) timeout, s
    converge_timeout: float  # for every agent to hold every replica


def analyse(result: dict, event_unix_ns: int, window: float) -> dict:
    """Figures of one run of ``loadgen churn`` around an event (the signal) at ``event_unix_ns``.

    - failover_s: from the event to the end of the first new stream begun after it that succeeded
      (CONNECT answered and the echo back): the first new stream through the balancer that worked.
    - failed_between: streams that failed between the event and that first success.
    - failed_after: every stream that failed at or after the event, in flight at the event or begun
      in the window; failed_in_flight: those begun before the event.
    - ok_after: streams begun in the window that succeeded.
    - slowest_s: the longest stream begun in the window (ended by success or failure).
    """
    t0 = result["t0_unix_ns"]
    event = (event_unix_ns - t0) / 1e9
    limit = event + window
    rows = [(start / 1e6, end / 1e6, err) for start, end, err in result["attempts"]]
    begun = [(start, end, err) for start, end, err in rows if event <= start <= limit]
    ok_after = sorted(end for _, end, err in begun if err < 0)
    first_ok = ok_after[0] if ok_after else None
    # A failure counts when the stream was open at the event or begun in the window, however late
    # it failed (a stream may take up to STREAM_LIMIT).
    failed = [(start, end, err) for start, end, err in rows if err >= 0 and end >= event and start <= limit]
    messages = result["errors"]
    return {
        "failover_s": round(first_ok - event, 4) if first_ok is not None else None,
        "failed_between": sum(1 for _, end, _ in failed if first_ok is None or end <= first_ok),
        "failed_after": len(failed),
        "failed_in_flight": sum(1 for start, _, _ in failed if start < event),
        "ok_after": len(ok_after),
        "failed_before": sum(1 for _, end, err in rows if err >= 0 and end < event),
        "slowest_s": round(max((end - start for start, end, _ in begun), default=0.0), 3),
        "streams_per_s": round(len(rows) / max(result["elapsed_s"], 1e-9), 1),
        "errors_after": sorted({messages[err] for _, _, err in failed})[:10],
    }


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def http_text(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode(errors="replace")


class ReplicaFleet:
    """One system's replicas behind haproxy and its agents dialing haproxy."""

    def __init__(self, system: System, env: Env, settings: FailoverSettings) -> None:
        self.system = system
        self.env = env
        self.settings = settings
        self.tag = f"failover-{system.name}"
        self.places: list[Place] = []
        self.haproxy: Haproxy | None = None
        self.replicas: list[Proc | None] = []
        self.generation = 0
        self.agents: list[Proc] = []
        self.agent_metrics: list[int] = []
        self.broken = ""  # why the fleet can no longer be measured (a successor did not come up)

    # -- set-up --------------------------------------------------------------------------------------

    def start(self) -> None:
        st = self.settings
        self.places = allocate_places(st.replicas)
        self.haproxy = Haproxy(
            self.places, self.env.log_dir, self.tag, st.check_interval, self.system.agent_backend_check
        )
        self.replicas = [self._start_replica(i) for i in range(st.replicas)]
        for i in range(st.agents):
            port = free_port()
            argv = self.system.replica_agent_argv(i, self.haproxy.agent_port, port)
            self.agents.append(Proc(f"{self.system.name}-agent{i}", argv, self._log(f"agent{i}")))
            self.agent_metrics.append(port)
        self.wait_converged()

    def _log(self, what: str) -> Path:
        return self.env.log_dir / f"{self.tag}-{what}.log"

    def _start_replica(self, index: int) -> Proc:
        self.generation += 1
        place = self.places[index]
        server_id = f"{place.name}-g{self.generation}"  # a new process is a new replica
        argv = self.system.replica_argv(place, server_id, self.settings.replicas, self.settings.drain_timeout)
        proc = Proc(f"{self.system.name}-{server_id}", argv, self._log(server_id))
        wait_port("127.0.0.1", place.client, 30, proc)
        wait_port("127.0.0.1", place.agent, 30, proc)
        return proc

    def commands(self) -> dict[str, list[str]]:
        """The command lines of one replica, one agent and haproxy (for the report)."""
        live = [p for p in self.replicas if p is not None]
        out: dict[str, list[str]] = {}
        if live:
            out["replica"] = live[0].argv
        if self.agents:
            out["agent"] = self.agents[0].argv
        if self.haproxy is not None:
            out["haproxy"] = self.haproxy.proc.argv
        return out

    # -- state ---------------------------------------------------------------------------------------

    def held(self) -> list[int | None]:
        """What each agent's /metrics says it holds (None: unreadable)."""
        out: list[int | None] = []
        for port in self.agent_metrics:
            try:
                out.append(self.system.replicas_held(http_text(f"http://127.0.0.1:{port}/metrics")))
            except OSError:
                out.append(None)
        return out

    def wait_converged(self) -> float:
        """Wait until every agent holds every replica, haproxy sees every replica UP and every
        replica, asked directly, reaches the target in cluster1. Returns the seconds until the agents
        held them all (by polling their /metrics every 0.1 s)."""
        assert self.haproxy is not None
        st = self.settings
        began = time.monotonic()
        held: list[int | None] = []
        while True:
            dead = [p.name for p in [*self.agents, *self.replicas] if p is not None and not p.alive()]
            if dead:
                raise RuntimeError(f"{self.system.name}: process(es) exited: {dead}")
            held = self.held()
            if all(h == st.replicas for h in held):
                break
            if time.monotonic() - began > st.converge_timeout:
                raise RuntimeError(
                    f"{self.system.name}: agents hold {held} replicas, not {st.replicas} each, "
                    f"after {st.converge_timeout}s"
                )
            time.sleep(0.1)
        took = time.monotonic() - began
        for place in self.places:
            self.haproxy.wait_state(place.name, "UP", st.converge_timeout)
        for place in self.places:
            res = self.env.probe(self.env.proxy_args(place.client), [self.system.probe_line()], 20.0)
            if res["ok"] != 1:
                raise RuntimeError(f"{self.system.name}: {place.name} does not reach cluster1: {res}")
        return took

    # -- one measurement -----------------------------------------------------------------------------

    def failover_once(self, victim: int, sig: signal.Signals, late: bool = False) -> dict:
        """Signal replica ``victim`` while loadgen churns through haproxy, then bring a successor; the
        figures. ``late``: the client keeps going while the successor starts ``late_absence`` seconds
        after the signal, until every agent holds it (and a second more): how new streams that
        haproxy sends to a replica the agents have not found yet fare."""
        assert self.haproxy is not None
        st = self.settings
        if self.broken:
            raise RuntimeError(self.broken)
        window = st.late_absence if late else st.window
        argv = [
            str(self.env.loadgen),
            "churn",
            *self.system.dial_args(self.haproxy.client_port),
            "--workers",
            str(st.workers),
            "--gap",
            f"{st.gap_ms}ms",
            "--dial-timeout",
            f"{STREAM_LIMIT:g}s",
            "--max-time",
            f"{st.warmup + window + st.converge_timeout + 60:g}s",
        ]
        churn = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert churn.stderr is not None
        proc = self.replicas[victim]
        assert proc is not None
        signalled = restored = False
        try:
            ready = churn.stderr.readline()
            if '"ready"' not in ready:
                raise RuntimeError(f"loadgen churn did not start: {ready}{churn.stderr.read()[-2000:]}")
            time.sleep(st.warmup)  # a steady flow of new streams through every replica
            load = loadavg()
            exited_ns: list[int] = []
            event_ns = time.time_ns()
            os.kill(proc.pid, sig)
            signalled = True
            waiter = threading.Thread(
                target=lambda: (proc.popen.wait(), exited_ns.append(time.time_ns())), daemon=True
            )
            waiter.start()
            time.sleep(window)
            if late:
                successor_ns = time.time_ns()
                rejoined = self._restore(victim, proc)
                restored = True
                time.sleep(1.0)
            out, err = churn.communicate(timeout=60)  # closing its stdin tells it to stop
            if churn.returncode != 0:
                raise RuntimeError(f"loadgen churn exited {churn.returncode}: {err[-2000:]}")
            result = json.loads(out)["result"]
            figures = analyse(result, event_ns, window)
            if late:
                after = analyse(result, successor_ns, rejoined + 60)
                figures = {
                    "successor_failed": after["failed_after"],
                    "successor_slowest_s": after["slowest_s"],
                    "successor_ok": after["ok_after"],
                    "streams_per_s": after["streams_per_s"],
                    "errors_after": after["errors_after"],
                }
            figures["loadavg"] = load
            figures["victim"] = self.places[victim].name
            waiter.join(timeout=st.drain_timeout + 30)
            if exited_ns and not late:
                figures["exit_s"] = round((exited_ns[0] - event_ns) / 1e9, 3)
            figures["exit_code"] = proc.popen.poll()
        finally:
            if churn.poll() is None:
                churn.kill()
                churn.communicate()
            if signalled and not restored:
                rejoined = self._restore(victim, proc)
        figures["rejoin_s"] = round(rejoined, 3)
        return figures

    def _restore(self, victim: int, proc: Proc) -> float:
        """Start the victim's successor in its place (once it is gone) and wait until every agent holds
        it: the seconds from its ports listening to that."""
        if proc.alive():
            proc.kill()
            self.broken = f"{proc.name} still running {self.settings.drain_timeout + 30}s after the signal"
        proc.stop()  # closes its log
        self.replicas[victim] = None
        if self.broken:
            raise RuntimeError(self.broken)
        try:
            self.replicas[victim] = self._start_replica(victim)
            return self.wait_converged()
        except Exception as exc:
            self.broken = f"the successor of {proc.name} did not come back: {exc}"
            raise

    def stop(self) -> None:
        for p in self.agents:
            p.stop(grace=1.0)
        for p in self.replicas:
            if p is not None:
                p.stop(grace=1.0)
        if self.haproxy is not None:
            self.haproxy.stop()
