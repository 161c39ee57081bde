"""A soak: ours' proxy-server and three agents for hours under a modest, checked mix, with the
hostile battery every ten minutes; does memory level off, and did any stream end without its digest?

    python -m bench.soak --duration 2h --out DIR
    python -m bench.soak --duration 3m --battery-every 1m --out /tmp/soak-dev   # a try-out

What runs (the processes as the tests start them, ``tests.support.procs.Hub``, whose command lines are
``local up``'s, ``clusterproxy_cli.commands``; the certificates of ``tests.support.pki``):

- a proxy-server (one worker, log level info) with an agent WebSocket port, at the battery's flags
  (``SERVER_OPTIONS`` of tests/support/bad_input_cases.py: 1 s frame, 5 s stall and handshake
  deadlines, 16 streams per client connection) so that every attack of the battery gets the answer
  it asserts;
- three agents: ``cluster1`` over TLS and ``cluster2`` over the WebSocket transport, which live for
  the whole run (their memory is what the verdict is about), and ``cluster3`` over TLS, SIGKILLed and
  restarted every ``--restart-every`` (the first half an interval in, so restarts fall between
  battery rounds);
- targets in this process: the sized and digest targets of tests.support, an echo, and the HTTP target
  of tests/support/konnget.py for the Go konnectivity client.

The mix, each flow bounded in rate (one start per interval on average, jittered +-50 %, so at most
twice duration/interval starts) and in concurrency, clusters taken in turn; every flow stops starting
at the end of ``--duration`` and the streams in flight finish (each within TRANSFER_TIMEOUT):

- ``connect``: HTTP/1.1 CONNECT churn, a new TLS connection each, 1 KiB-512 KiB each way;
- ``sdk``: clusterproxy_sdk tunnels (a new connection each) carrying 1-3 streams at once, 1 KiB-2 MiB
  each way, both ways at once with a half-close;
- ``sdk-long``: one long-lived SDK stream per cluster, a 1-16 KiB message echoed every 5 s, closed
  cleanly at the end (or when broken, by a restart say, reopened);
- ``konnectivity-get`` / ``-upload``: tests/go-konnectivity/konnget (gRPC, a single-use tunnel per
  request), one in turn every ``--konnectivity-every``; skipped, and the report says so, without Go.

Every transfer moves pseudo-random bytes checked by sha256 both ways, and ends ``ok``, ``no-digest``
(it ended cleanly but a digest is missing or wrong: the integrity failure) or ``error``; an error on
cluster3 while its agent was down is "broken by a restart" (bench/soak_report.py). The server's and
each agent's RSS, open descriptors and CPU are sampled every ``--sample-every`` into samples.jsonl;
at the end DIR holds report.json, report.md (also printed) and rss_fds.png. Exit status 1 when a
transfer ended without its digest, one failed outside a restart, or an attack got a wrong answer.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import random
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import trio

from bench import soak_report
from bench.procs import cpu_seconds, raise_nofile, rss_kib, with_descendants
from bench.report import results_folder
from bench.soak_report import Restart, Transfer
from clusterproxy_protocol import (
    WEBSOCKET_PATH,
    CertFiles,
    ConnectRefused,
    InvalidValue,
    parse_positive_duration,
)
from clusterproxy_sdk import TLSFiles, Tunnel, open_tunnel
from tests.support.agent_websocket import websocket_port
from tests.support.bad_input_cases import AGENT_OPTIONS, CASES, SERVER_OPTIONS
from tests.support.battery import HANG_GUARD, AttackContext
from tests.support.clients import client_context, h1_connect
from tests.support.gopeers import KONNECTIVITY_SOURCES, go_peer
from tests.support.konnget import answer_http, run_konnget
from tests.support.pki import make_pki
from tests.support.procs import Hub, Process
from tests.support.targets import CHUNK, Target, pattern_digest, serve, serve_digest, serve_echo
from tests.support.traffic import serve_sized

AGENT_ID = "agent-a"
# (cluster, transport, restarted): two agents that live for the whole run, one over each transport,
# and one that is SIGKILLed and restarted
AGENTS = (("cluster1", "tls", False), ("cluster2", "websocket", False), ("cluster3", "tls", True))
CLUSTERS = tuple(cluster for cluster, _, _ in AGENTS)
TRANSFER_TIMEOUT = 60.0  # one transfer, TLS handshake included; a loaded 2-core machine is slow, not stuck
LONG_EVERY = 5.0  # seconds between two messages of a long-lived stream
LONG_MESSAGE = (1 << 10, 16 << 10)
CONNECT_SIZES = (1 << 10, 512 << 10)  # each way, log-uniform
SDK_SIZES = (1 << 10, 2 << 20)
KONNECTIVITY_SIZES = (1 << 10, 1 << 20)
RESTART_DELAY = 1.0  # between an agent's death and its new process: a supervisor's pause
STATUS_EVERY = 60.0  # seconds between two progress lines


def log_uniform(rng: random.Random, bounds: tuple[int, int]) -> int:
    """A size between ``bounds``, small ones as likely as big ones per factor of two."""
    low, high = bounds
    return int(math.exp(rng.uniform(math.log(low), math.log(high))))


def error_kind(exc: BaseException) -> str:
    """``Type: message`` of the error that ended a transfer (the leaf of a one-error group)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    name = type(exc).__name__
    if isinstance(exc, ConnectRefused):
        name = f"{name} {exc.status}"
    return f"{name}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def process_figures(pid: int) -> dict[str, Any] | None:
    """RSS (KiB), open descriptors and CPU seconds of ``pid`` and its descendants; None when gone."""
    # the server's workers count as the server; this process's children are the others, not the load
    pids = [pid] if pid == os.getpid() else with_descendants(pid)
    try:
        fds = sum(len(os.listdir(f"/proc/{p}/fd")) for p in pids)
    except OSError:
        return None
    rss = sum(rss_kib(p) for p in pids)
    if not rss:
        return None
    return {"pid": pid, "rss_kib": rss, "fds": fds, "cpu_s": round(sum(cpu_seconds(p) for p in pids), 2)}


class Refused(Exception):
    """The proxy answered a CONNECT with an error status."""


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.rng = random.Random(args.seed)
        self.stop = trio.Event()
        self.t0 = 0.0
        self.transfers: list[Transfer] = []
        self.restarts: list[Restart] = []
        self.battery_rounds: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.skipped: list[str] = []
        self.konnget: Path | None = None
        self.tokens = 0
        self.konnectivity_runs = 0
        self.argv: dict[str, list[str]] = {}  # agent process name -> its command line (for restarts)
        self.log_dir = self.out / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.pki = make_pki(self.out / "pki")
        self.hub = Hub(self.pki, self.log_dir)
        self.h1 = client_context(self.pki, alpn=["http/1.1"])
        self.sdk_tls = TLSFiles(self.pki.ca, self.pki.client.cert, self.pki.client.key)
        self.journal: dict[str, TextIO] = {}

    # -- time and records -------------------------------------------------------------------------------

    def now(self) -> float:
        return trio.current_time() - self.t0

    def token(self, flow: str) -> str:
        self.tokens += 1
        return f"{flow}-{self.tokens}"

    def note(self, kind: str, record: dict[str, Any]) -> None:
        """Append ``record`` to ``DIR/<kind>.jsonl`` at once: a run cut short keeps what it saw."""
        if kind not in self.journal:
            self.journal[kind] = (self.out / f"{kind}.jsonl").open("a")
        self.journal[kind].write(json.dumps(record) + "\n")
        self.journal[kind].flush()

    def say(self, line: str) -> None:
        print(f"[{self.now():7.0f} s] {line}", flush=True)

    async def measure(
        self,
        flow: str,
        cluster: str,
        body: Callable[[], Awaitable[tuple[str, str, int]]],
        timeout: float | None = TRANSFER_TIMEOUT,
    ) -> None:
        """Run one transfer and record how it ended; every failure is recorded, never raised."""
        started = self.now()
        try:
            with trio.fail_after(timeout if timeout is not None else math.inf):
                outcome, detail, moved = await body()
        except Exception as exc:
            outcome, detail, moved = "error", error_kind(exc), 0
        self.record(Transfer(flow, cluster, round(started, 2), round(self.now(), 2), outcome, detail, moved))

    def record(self, transfer: Transfer) -> None:
        self.transfers.append(transfer)
        self.note("transfers", transfer.__dict__)

    # -- the processes ----------------------------------------------------------------------------------

    async def start_processes(self) -> None:
        p = self.pki
        server = self.hub.server_argv(
            CertFiles(p.server.cert, p.server.key, p.ca),
            log_level="info",  # the battery reads info records (refusals) from the server's log
            options=(*SERVER_OPTIONS, "--agent-websocket-listen", "127.0.0.1:0"),
        )
        await self.hub.launch_server(server)
        ws_port = websocket_port(self.hub)
        for cluster, transport, _ in AGENTS:
            pair = p.agent(cluster, AGENT_ID)
            dial = {"server": f"ws://127.0.0.1:{ws_port}{WEBSOCKET_PATH}"} if transport == "websocket" else {}
            name = f"agent-{cluster}"
            self.argv[name] = self.hub.agent_argv(
                CertFiles(pair.cert, pair.key, p.ca),
                cluster,
                AGENT_ID,
                log_level="info",
                options=AGENT_OPTIONS,
                **dial,
            )
            self.hub.launch_agent(name, self.argv[name])
        for cluster in CLUSTERS:
            await self.hub.wait_agent(cluster, AGENT_ID, timeout=60)

    def watched(self) -> dict[str, Process | None]:
        """The processes sampled, by their name in the report (None: this process, the load)."""
        assert self.hub.server is not None
        names = {c: f"agent-{c} ({t}{', restarted' if r else ''})" for c, t, r in AGENTS}
        return {
            "proxy-server": self.hub.server,
            **{names[c]: self.hub.agents[f"agent-{c}"] for c in CLUSTERS},
            "load (this process)": None,
        }

    def sample(self) -> None:
        processes = {}
        for name, process in self.watched().items():
            if process is not None and process.popen.poll() is not None:
                continue  # a restarted agent between its death and its new process
            figures = process_figures(os.getpid() if process is None else process.pid)
            if figures is not None:
                processes[name] = figures
        record = {"t": round(self.now(), 2), "processes": processes}
        self.samples.append(record)
        self.note("samples", record)

    async def sampler(self, load_done: trio.Event) -> None:
        """Sample every ``--sample-every`` until the load is over, then once more."""
        tick = 0
        while not load_done.is_set():
            self.sample()
            tick += 1
            with trio.move_on_at(self.t0 + tick * self.args.sample_every):
                await load_done.wait()
        self.sample()

    async def restarter(self) -> None:
        """SIGKILL the restarted agent every ``--restart-every`` (first at half of it) and start it
        again with the same command line and certificate; its window ends when the server lists it."""
        (cluster,) = [c for c, _, restarted in AGENTS if restarted]
        name = f"agent-{cluster}"
        k = 0
        while (at := (k + 0.5) * self.args.restart_every) < self.args.duration:
            k += 1
            with trio.move_on_at(self.t0 + at):
                await self.stop.wait()
            if self.stop.is_set():
                return
            old = self.hub.agents[name]
            killed = self.now()
            old.kill(signal.SIGKILL)
            await old.wait_exit()
            old.stop()  # closes its log (the new process appends to the same file)
            try:
                await self.hub.wait_agent(cluster, AGENT_ID, timeout=15, present=False)
            except AssertionError:
                self.say(f"{name}: the server still lists it 15 s after its SIGKILL")
            await trio.sleep(RESTART_DELAY)
            self.hub.launch_agent(name, self.argv[name])
            try:
                await self.hub.wait_agent(cluster, AGENT_ID, timeout=60)
            except AssertionError:
                self.say(f"{name}: not back 60 s after its restart")
            restart = Restart(cluster, round(killed, 2), round(self.now(), 2))
            self.restarts.append(restart)
            self.note("restarts", restart.__dict__)
            self.say(f"{name} SIGKILLed and back in {restart.back - restart.killed:.1f} s")

    # -- the battery ------------------------------------------------------------------------------------

    async def battery(self) -> None:
        k = 1
        while (at := k * self.args.battery_every) < self.args.duration:
            k += 1
            with trio.move_on_at(self.t0 + at):
                await self.stop.wait()
            if self.stop.is_set():
                return
            await self.battery_round()

    async def battery_round(self) -> None:
        """Every attack of the bad-input battery once, against the soak's server, its answer recorded.
        Each round has an echo target of its own: an attack counts the dials it caused there."""
        hub = self.hub
        assert hub.server is not None
        started = self.now()
        before = rss_kib(hub.server.pid)
        results = []
        async with trio.open_nursery() as targets:
            echo = await serve_echo(targets)
            for case in CASES:
                port = hub.client_port if case.port == "client" else hub.agent_port
                context = AttackContext(hub, self.pki, port, echo)
                begun = trio.current_time()
                try:
                    with trio.fail_after(case.bound + HANG_GUARD):
                        answer, ok = await case.attack(context), True
                except Exception as exc:  # a wrong answer (AssertionError) or none: recorded
                    answer, ok = error_kind(exc), False
                seconds = trio.current_time() - begun
                results.append(
                    {
                        "name": case.name,
                        "ok": ok,
                        "answer": answer,
                        "seconds": round(seconds, 3),
                        "bound": case.bound,
                    }
                )
            targets.cancel_scope.cancel()
        record = {
            "t": round(started, 2),
            "server_rss_kib_before": before,
            "server_rss_kib_after": rss_kib(hub.server.pid),
            "results": results,
        }
        self.battery_rounds.append(record)
        self.note("battery", record)
        right = sum(r["ok"] for r in results)
        self.say(
            f"battery: {right} of {len(results)} answered right in {self.now() - started:.0f} s; server RSS "
            f"{before >> 10} -> {record['server_rss_kib_after'] >> 10} MiB"
        )
        for r in results:
            if not r["ok"]:
                self.say(f"  {r['name']}: {r['answer']}")

    # -- the load ---------------------------------------------------------------------------------------

    async def every(self, interval: float, concurrency: int, start: Callable[[str], Awaitable[None]]) -> None:
        """``start(cluster)`` once per ``interval`` on average (clusters in turn), at most
        ``concurrency`` at once, until the stop; returns when those in flight have ended."""
        slots = trio.Semaphore(concurrency)

        async def one(cluster: str) -> None:
            try:
                await start(cluster)
            finally:
                slots.release()

        async with trio.open_nursery() as flight:
            n = 0
            while not self.stop.is_set():
                await slots.acquire()
                if self.stop.is_set():
                    slots.release()
                    break
                flight.start_soon(one, CLUSTERS[n % len(CLUSTERS)])
                n += 1
                with trio.move_on_after(interval * self.rng.uniform(0.5, 1.5)):
                    await self.stop.wait()

    async def connect(self, cluster: str, *, sized: Target) -> None:
        await self.measure("connect", cluster, lambda: self.connect_transfer(cluster, sized))

    async def connect_transfer(self, cluster: str, sized: Target) -> tuple[str, str, int]:
        """HTTP/1.1 CONNECT on a new TLS connection to the sized target (tests.support.traffic): the
        upload's digest recorded by the target, the download checked here."""
        token = self.token("connect")
        up, down = log_uniform(self.rng, CONNECT_SIZES), log_uniform(self.rng, CONNECT_SIZES)
        upload = random.Random(token).randbytes(up)
        reply = await h1_connect(
            self.hub.client_port, self.h1, sized.address, {"cluster-proxy-cluster": cluster}
        )
        if reply.status != 200 or reply.stream is None:
            raise Refused(f"{reply.status} {reply.body[:100]!r}")
        async with reply.stream:
            got, count = await exchange(reply.stream, f"{token} {up} {down}\n".encode() + upload, eof=False)
        return judge(token, sized, upload, got, count, down)

    async def sdk_session(self, cluster: str, *, target: Target) -> None:
        """One SDK connection carrying 1-3 streams at once to the digest target. The streams are
        recorded one by one; an error that escapes them (the connection failed) is recorded as one
        ``sdk-connection`` transfer more."""
        started = self.now()
        try:
            with trio.fail_after(TRANSFER_TIMEOUT + 10):
                async with (
                    open_tunnel(
                        f"127.0.0.1:{self.hub.client_port}", self.sdk_tls, server_hostname="localhost"
                    ) as tunnel,
                    trio.open_nursery() as each,
                ):
                    for _ in range(self.rng.randint(1, 3)):
                        each.start_soon(
                            self.measure, "sdk", cluster, lambda: self.sdk_stream(tunnel, cluster, target)
                        )
        except Exception as exc:
            ended = round(self.now(), 2)
            self.record(
                Transfer("sdk-connection", cluster, round(started, 2), ended, "error", error_kind(exc))
            )

    async def sdk_stream(self, tunnel: Tunnel, cluster: str, target: Target) -> tuple[str, str, int]:
        token = self.token("sdk")
        up, down = log_uniform(self.rng, SDK_SIZES), log_uniform(self.rng, SDK_SIZES)
        upload = random.Random(token).randbytes(up)
        stream = await tunnel.connect(cluster, target.host, target.port)
        async with stream:
            got, count = await exchange(stream, f"{token} {down}\n".encode() + upload, eof=True)
        return judge(token, target, upload, got, count, down)

    async def long_lived(self, cluster: str, echo: Target) -> None:
        """One long-lived stream at a time on ``cluster`` for the whole run; a broken one is reopened."""
        while not self.stop.is_set():
            await self.measure("sdk-long", cluster, lambda: self.long_stream(cluster, echo), timeout=None)
            with trio.move_on_after(1.0):
                await self.stop.wait()

    async def long_stream(self, cluster: str, echo: Target) -> tuple[str, str, int]:
        """Messages echoed every LONG_EVERY until the stop, then a half-close: ``ok`` when the echo of
        everything sent came back and then a clean end."""
        rng = random.Random(self.token("long"))
        sent, got = hashlib.sha256(), hashlib.sha256()
        n_sent = n_got = exchanges = 0
        async with open_tunnel(
            f"127.0.0.1:{self.hub.client_port}", self.sdk_tls, server_hostname="localhost"
        ) as tunnel:
            stream = await tunnel.connect(cluster, echo.host, echo.port)
            async with stream:
                while not self.stop.is_set():
                    message = rng.randbytes(rng.randint(*LONG_MESSAGE))
                    with trio.fail_after(TRANSFER_TIMEOUT):
                        await stream.send_all(message)
                        sent.update(message)
                        n_sent += len(message)
                        while n_got < n_sent:
                            chunk = await stream.receive_some(CHUNK)
                            if not chunk:
                                return "no-digest", f"ended cleanly after {n_got} of {n_sent} bytes echoed", 0
                            got.update(chunk)
                            n_got += len(chunk)
                    exchanges += 1
                    with trio.move_on_after(LONG_EVERY):
                        await self.stop.wait()
                with trio.fail_after(TRANSFER_TIMEOUT):
                    await stream.send_eof()
                    while chunk := await stream.receive_some(CHUNK):
                        got.update(chunk)
                        n_got += len(chunk)
        if n_got != n_sent or got.digest() != sent.digest():
            return "no-digest", f"{n_got} bytes echoed of {n_sent} sent, digests differ", 0
        return "ok", f"{exchanges} exchanges", 2 * n_sent

    async def konnectivity(self, cluster: str, *, http: Target) -> None:
        """konnget, a GET and an upload in turn (each its own single-use gRPC tunnel)."""
        assert self.konnget is not None
        binary, size = self.konnget, log_uniform(self.rng, KONNECTIVITY_SIZES)
        self.konnectivity_runs += 1
        if self.konnectivity_runs % 2:
            path = f"/bytes/{size}"

            async def get() -> tuple[str, str, int]:
                result = await run_konnget(
                    binary, self.hub, "-mode", "get", "-url", f"http://{http.address}{path}", "-cluster", cluster,
                    timeout=TRANSFER_TIMEOUT - 5,
                )  # fmt: skip
                if result["failed"]:
                    raise Refused(f"konnget: {result.get('errors')}")
                if result["bytes"] != size or result["sha256"] != pattern_digest(path, size):
                    return (
                        "no-digest",
                        f"{result['bytes']} of {size} bytes, sha256 {result['sha256'][:12]}",
                        0,
                    )
                return "ok", "", size

            await self.measure("konnectivity-get", cluster, get)
        else:

            async def upload() -> tuple[str, str, int]:
                result = await run_konnget(
                    binary, self.hub, "-mode", "upload", "-url", f"http://{http.address}/sha256", "-size", str(size), "-cluster", cluster,
                    timeout=TRANSFER_TIMEOUT - 5,
                )  # fmt: skip
                if result["body"] != result["sha256"]:
                    return (
                        "no-digest",
                        f"the target's sha256 {result['body'][:12]} is not the sent {result['sha256'][:12]}",
                        0,
                    )
                return "ok", "", size

            await self.measure("konnectivity-upload", cluster, upload)

    def find_konnget(self) -> None:
        """Build (or find) konnget; without Go, or when the build fails, the flow is skipped."""
        if shutil.which("go") is None:
            self.skipped.append("konnectivity gRPC: no Go toolchain (go) on PATH, konnget cannot be built")
            return
        try:
            self.konnget = go_peer("konnget", KONNECTIVITY_SOURCES)
        except AssertionError as exc:
            self.skipped.append(f"konnectivity gRPC: building konnget failed: {str(exc)[:300]}")

    # -- the run ----------------------------------------------------------------------------------------

    def status(self) -> str:
        verdicts = soak_report.transfer_summary(self.transfers, self.restarts)["total"]
        last = self.samples[-1]["processes"] if self.samples else {}
        rss = ", ".join(f"{name.split(' ')[0]} {p['rss_kib'] >> 10}" for name, p in last.items())
        return f"transfers {verdicts}; RSS MiB: {rss}"

    async def progress(self, load_done: trio.Event) -> None:
        while True:
            with trio.move_on_after(STATUS_EVERY):
                await load_done.wait()
                return
            if not self.stop.is_set():  # the end of the load prints its own
                self.say(self.status())

    async def run(self) -> int:
        started_utc = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        self.find_konnget()
        for skipped in self.skipped:
            print(f"bench.soak: skipped {skipped}", file=sys.stderr)
        try:
            await self.start_processes()
            await self.load_and_watch()
        finally:
            self.hub.stop()
            for journal in self.journal.values():
                journal.close()
        return self.finish(started_utc)

    async def load_and_watch(self) -> None:
        a = self.args
        load_done = trio.Event()
        async with trio.open_nursery() as services:
            sized, digest = await serve_sized(services), await serve_digest(services)
            echo, http = await serve_echo(services), await serve(services, answer_http)
            self.t0 = trio.current_time()
            async with trio.open_nursery() as watch:
                watch.start_soon(self.sampler, load_done)
                watch.start_soon(self.progress, load_done)
                async with trio.open_nursery() as load:
                    load.start_soon(self.every, a.connect_every, 4, partial(self.connect, sized=sized))
                    load.start_soon(self.every, a.sdk_every, 2, partial(self.sdk_session, target=digest))
                    for cluster in CLUSTERS:
                        load.start_soon(self.long_lived, cluster, echo)
                    if self.konnget is not None:
                        load.start_soon(
                            self.every, a.konnectivity_every, 2, partial(self.konnectivity, http=http)
                        )
                    load.start_soon(self.restarter)
                    load.start_soon(self.battery)
                    await trio.sleep_until(self.t0 + a.duration)
                    self.say("duration reached: no new transfers; those in flight finish")
                    self.stop.set()
                self.say(self.status())
                load_done.set()  # the sampler takes its last sample and returns
            services.cancel_scope.cancel()

    def finish(self, started_utc: str) -> int:
        a = self.args
        duration = self.samples[-1]["t"] if self.samples else 0.0
        mix = (
            f"HTTP/1.1 CONNECT every {a.connect_every:g} s, an SDK connection (1-3 streams) every "
            f"{a.sdk_every:g} s, a long-lived SDK stream per cluster"
            + (f", konnectivity gRPC every {a.konnectivity_every:g} s" if self.konnget else "")
        )
        run = {
            "started_utc": started_utc,
            "duration_s": duration,
            "mix": mix,
            "battery_every_s": a.battery_every,
            "restart_every_s": a.restart_every,
            "sample_every_s": a.sample_every,
            "restarted": next(f"agent-{c}" for c, _, r in AGENTS if r),
            "skipped": self.skipped,
            "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "seed": a.seed,
        }
        report = soak_report.build(
            run=run,
            samples=self.samples,
            transfers=self.transfers,
            restarts=self.restarts,
            battery_rounds=self.battery_rounds,
        )
        notes = soak_report.write(self.out, report, self.samples)
        print(soak_report.markdown(report))
        for note in notes:
            print(f"bench.soak: {note}", file=sys.stderr)
        print(f"bench.soak: report.md, report.json, rss_fds.png, samples.jsonl and logs/ in {self.out}")
        total = report["transfers"]["total"]
        wrong = len(report["battery"]["wrong"])
        return 1 if total["without digest"] or total["failed"] or wrong else 0


async def exchange(stream: trio.abc.Stream, data: bytes, *, eof: bool) -> tuple[str, int]:
    """Send ``data`` (then a half-close when ``eof``) while reading until the end: the sha256 and
    the number of bytes read."""
    digest, count = hashlib.sha256(), 0

    async def send() -> None:
        for i in range(0, len(data), CHUNK):
            await stream.send_all(data[i : i + CHUNK])
        if eof:
            await stream.send_eof()  # type: ignore[attr-defined]

    async with trio.open_nursery() as both:
        both.start_soon(send)
        while chunk := await stream.receive_some(CHUNK):
            digest.update(chunk)
            count += len(chunk)
    return digest.hexdigest(), count


def judge(token: str, target: Target, upload: bytes, got: str, count: int, down: int) -> tuple[str, str, int]:
    """A transfer that ended cleanly: ``ok`` when the download has the pattern's sha256 and the
    target recorded the upload's, else ``no-digest`` saying which."""
    if count != down or got != pattern_digest(token, down):
        return "no-digest", f"download: {count} of {down} bytes, sha256 differs", 0
    # popped, not read: the targets' records would otherwise grow with the run in the load's memory
    if target.received.pop(token, None) != hashlib.sha256(upload).hexdigest():
        return "no-digest", f"upload of {len(upload)} bytes: the target recorded no or another sha256", 0
    return "ok", "", len(upload) + down


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])

    def duration(text: str) -> float:
        try:
            return parse_positive_duration(text)
        except InvalidValue as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parser.add_argument(
        "--duration", type=duration, default=duration("2h"), help="how long the load runs (2h)"
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the samples, logs and report")
    parser.add_argument("--battery-every", type=duration, default=600.0, help="the hostile battery (10m)")
    parser.add_argument("--sample-every", type=duration, default=10.0, help="RSS and fds samples (10s)")
    parser.add_argument(
        "--restart-every", type=duration, default=300.0, help="SIGKILL + restart of cluster3's agent (5m)"
    )
    parser.add_argument("--connect-every", type=duration, default=1.0, help="HTTP/1.1 CONNECT churn (1s)")
    parser.add_argument("--sdk-every", type=duration, default=3.0, help="SDK connections of 1-3 streams (3s)")
    parser.add_argument("--konnectivity-every", type=duration, default=15.0, help="konnget runs (15s)")
    parser.add_argument("--seed", type=int, default=32, help="the random sizes' seed")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refused = results_folder(args.out, fresh=True)
    if refused:
        print(f"bench.soak: {refused}", file=sys.stderr)
        return 2
    raise_nofile()
    return trio.run(Soak(args).run)


if __name__ == "__main__":
    raise SystemExit(main())
