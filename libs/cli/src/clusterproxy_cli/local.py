"""``cluster-proxy local up``: a hub and two simulated managed clusters as processes on loopback.

Started as subprocesses (logs in ``STATE/logs/<name>.log``):

- ``proxy-server``: client port, agent port, admin port;
- per cluster (``cluster1``, ``cluster2``): an echo service (the cluster's "in-cluster" target, also
  standing in for its kube-apiserver) and a ``proxy-agent`` dialing the server.

The cert-signer (the CA; its store in ``STATE/pki/store``) runs inside this process: its signing API
on a free loopback port, its log in ``STATE/logs/cert-signer.log``. Every party bootstraps from a
single-use token (:func:`prepare_signer_pki` creates tokens only for parties without a usable
certificate, so a restart needs none) and renews at 80% of its lifetime; the hub client's
certificate (``STATE/pki/local-admin.crt``, what curl and the SDK use) is bootstrapped and renewed by
this process. ``--no-cert-signer`` falls back to static certificates from a development CA
(:func:`issue_certificates`).

Once every agent is connected, ``STATE/local.json`` is written and ready-to-paste commands are
printed. Foreground: Ctrl-C or SIGTERM stops every child (SIGTERM, then SIGKILL after 10 s) and
removes ``local.json``; a child dying on its own (or the signer failing) stops the rest too and
exits 1.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import structlog
import trio
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from clusterproxy_certsigner.cli_commands import create_token
from clusterproxy_certsigner.filestore import FileStore
from clusterproxy_certsigner.models import Authorities, Binding
from clusterproxy_certsigner.rotation import ensure_ca
from clusterproxy_certsigner.service import SignerConfig, SignerService
from clusterproxy_certsigner.store import StoreError
from clusterproxy_protocol import certclient
from clusterproxy_protocol.certclient import CertFiles, SignerEndpoint, SignerRequestError
from clusterproxy_protocol.config import ConfigError, parse_duration
from clusterproxy_protocol.pki import DevCA
from clusterproxy_protocol.reloader import CertRenewer, RenewalPolicy
from clusterproxy_sdk import TLSFiles, open_tunnel

from . import _http
from .state import (
    LOCAL_JSON,
    ProxySettings,
    Target,
    build_local_json,
    curl_commands,
    curl_kube_apiserver,
    write_local_json,
)

CLUSTERS = ("cluster1", "cluster2")
CLIENT_NAME = "local-admin"
LOOPBACK = "127.0.0.1"
STOP_GRACE = 10.0
DRAIN_TIMEOUT = "3s"  # children drain on SIGTERM well within STOP_GRACE
POLL = 0.1
TAIL_LINES = 20


# --- certificates ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Certificates:
    """Where each party's certificate, key and trust bundle live."""

    ca: Path  # the hub client's trust bundle (curl --proxy-cacert, the SDK, local.json)
    server: CertFiles
    client: CertFiles
    agents: dict[str, CertFiles]  # cluster -> agent files


def agent_id(cluster: str) -> str:
    return f"{cluster}-agent-1"


def issue_certificates(pki_dir: Path, clusters: Sequence[str]) -> Certificates:
    """Static certificates from a development CA kept in ``pki_dir`` (``local up --no-cert-signer``):
    the CA is created once and reused; leaves are issued fresh on each start and never renewed."""
    ca = DevCA.create_or_load(pki_dir)

    def files(pair) -> CertFiles:  # type: ignore[no-untyped-def]
        return CertFiles(pair.cert, pair.key, ca.ca_path)

    return Certificates(
        ca=ca.ca_path,
        server=files(ca.issue_server("proxy-server", ["localhost", LOOPBACK], pki_dir)),
        client=files(ca.issue_client(CLIENT_NAME, pki_dir)),
        agents={cluster: files(ca.issue_agent(cluster, agent_id(cluster), pki_dir)) for cluster in clusters},
    )


# --- the cert-signer ---------------------------------------------------------------------------------

SIGNER_STORE = "store"  # STATE/pki/store
SERVER_NAME = "proxy-server"
SERVER_HOSTS = ("localhost", LOOPBACK)
TOKEN_TTL = dt.timedelta(minutes=10)
SIGNER_POLL = 1.0  # seconds: how soon the signer sees `cluster-proxy certs rotate-ca` and new tokens


def signer_certificates(pki_dir: Path, clusters: Sequence[str]) -> Certificates:
    """The file layout with a signer: one folder per party (``tls.crt``, ``tls.key``, ``ca.crt``),
    each party its own trust bundle (a renewer must see its own bundle change to reload it); the hub
    client's files at the top, where curl and the SDK find them."""

    def party(name: str) -> CertFiles:
        folder = pki_dir / name
        return CertFiles(folder / "tls.crt", folder / "tls.key", folder / "ca.crt")

    client = CertFiles(pki_dir / f"{CLIENT_NAME}.crt", pki_dir / f"{CLIENT_NAME}.key", pki_dir / "ca.crt")
    return Certificates(
        ca=client.ca,
        server=party(SERVER_NAME),
        client=client,
        agents={cluster: party(f"{cluster}-agent") for cluster in clusters},
    )


def _issued_by_current_ca(cert: x509.Certificate, authorities: Authorities) -> bool:
    for record in authorities.bundle():
        try:
            cert.verify_directly_issued_by(record.cert)
            return True
        except (ValueError, TypeError, InvalidSignature):
            continue
    return False


@dataclass(frozen=True)
class SignerPlan:
    """What ``local up`` needs to run the signer and bootstrap the parties."""

    store: FileStore
    tokens: dict[str, str | None]  # "client", "proxy-server", cluster -> token (None: has a certificate)
    cert_ttl: str = "24h"
    trust_refresh: str = "30s"
    url: str = ""  # set once the signer listens

    def token(self, party: str) -> str | None:
        return self.tokens.get(party)


def prepare_signer_pki(
    pki_dir: Path,
    certs: Certificates,
    clusters: Sequence[str],
    *,
    now: dt.datetime | None = None,
) -> tuple[FileStore, dict[str, str | None]]:
    """Create the CA (once), give every party the current trust bundle, and a bootstrap token to
    each party without a usable certificate (missing, expired, or from a CA no longer trusted)."""
    now = now or dt.datetime.now(dt.UTC)
    store = FileStore(pki_dir / SIGNER_STORE)
    authorities = ensure_ca(store, now=now)
    bundle = authorities.bundle_pem()
    parties: dict[str, tuple[CertFiles, Binding]] = {
        "client": (certs.client, Binding(kind="client", name=CLIENT_NAME)),
        SERVER_NAME: (certs.server, Binding(kind="server", name=SERVER_NAME, hosts=SERVER_HOSTS)),
        **{
            cluster: (
                certs.agents[cluster],
                Binding(kind="agent", cluster=cluster, agent_id=agent_id(cluster)),
            )
            for cluster in clusters
        },
    }
    tokens: dict[str, str | None] = {}
    for name, (files, binding) in parties.items():
        files.cert.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        certclient.write_bundle(files.ca, bundle)
        cert = certclient.usable_credentials(files, now=now)
        if cert is not None and _issued_by_current_ca(cert, authorities):
            tokens[name] = None
            continue
        for stale in (files.cert, files.key):
            stale.unlink(missing_ok=True)
        tokens[name] = create_token(store, binding, TOKEN_TTL, description=f"local up: {name}", now=now).token
    return store, tokens


def _signer_flags(plan: SignerPlan | None, party: str) -> list[str]:
    if plan is None:
        return []
    flags = ["--signer", plan.url, "--trust-refresh", plan.trust_refresh]
    token = plan.token(party)
    return [*flags, "--bootstrap-token", token] if token else flags


# --- ports -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ports:
    client: int
    agent: int
    admin: int
    agent_admin: dict[str, int]
    echo: dict[str, int]

    def all(self) -> list[int]:
        return [self.client, self.agent, self.admin, *self.agent_admin.values(), *self.echo.values()]


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports free right now (all held open together, then released)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def busy_ports(ports: Sequence[int], host: str = LOOPBACK) -> list[int]:
    """Those of ``ports`` that cannot be bound on ``host`` right now."""
    busy = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the services bind
            try:
                s.bind((host, port))
            except OSError:
                busy.append(port)
    return busy


def plan_ports(base: int, clusters: Sequence[str]) -> Ports:
    """Fixed ports from ``base`` (client base, agent base+1, admin base+2, agents' admin base+3..,
    echo services base+10..), or free ephemeral ports when ``base`` is 0."""
    n = len(clusters)
    if n > 7:
        raise ValueError("at most 7 clusters fit the fixed port plan")
    if base == 0:
        ports = free_ports(3 + 2 * n)
        return Ports(
            ports[0],
            ports[1],
            ports[2],
            dict(zip(clusters, ports[3 : 3 + n], strict=True)),
            dict(zip(clusters, ports[3 + n :], strict=True)),
        )
    top = base + 10 + n - 1
    if base < 1 or top > 65535:
        raise ValueError(f"invalid base port {base}: the plan needs ports {base}..{top} (at most 65535)")
    return Ports(
        base,
        base + 1,
        base + 2,
        {c: base + 3 + i for i, c in enumerate(clusters)},
        {c: base + 10 + i for i, c in enumerate(clusters)},
    )


# --- command lines -----------------------------------------------------------------------------------


def executable(name: str) -> str:
    """A console script of this installation (next to the running Python), else from PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ConfigError(f"{name} not found next to {sys.executable} or on PATH: install cluster-proxy")
    return found


def server_argv(
    ports: Ports, certs: Certificates, clusters: Sequence[str], signer: SignerPlan | None = None
) -> list[str]:
    hosts = [arg for host in SERVER_HOSTS for arg in ("--tls-host", host)] if signer is not None else []
    return [
        executable("cluster-proxy-server"),
        "--agent-listen",
        f"{LOOPBACK}:{ports.agent}",
        "--client-listen",
        f"{LOOPBACK}:{ports.client}",
        "--admin-listen",
        f"{LOOPBACK}:{ports.admin}",
        "--ca",
        str(certs.server.ca),
        "--cert",
        str(certs.server.cert),
        "--key",
        str(certs.server.key),
        *_signer_flags(signer, SERVER_NAME),
        *hosts,
        "--known-clusters",
        ",".join(clusters),
        "--drain-timeout",
        DRAIN_TIMEOUT,
        "--log-format",
        "json",
    ]


def agent_argv(
    cluster: str, ports: Ports, certs: Certificates, signer: SignerPlan | None = None
) -> list[str]:
    echo = f"{LOOPBACK}:{ports.echo[cluster]}"
    return [
        executable("cluster-proxy-agent"),
        "--server",
        f"{LOOPBACK}:{ports.agent}",
        "--server-name",
        "localhost",
        "--cluster",
        cluster,
        "--agent-id",
        agent_id(cluster),
        "--ca",
        str(certs.agents[cluster].ca),
        "--cert",
        str(certs.agents[cluster].cert),
        "--key",
        str(certs.agents[cluster].key),
        *_signer_flags(signer, cluster),
        "--admin-listen",
        f"{LOOPBACK}:{ports.agent_admin[cluster]}",
        # Loopback is not in the default egress allow-list; allow this cluster's echo service.
        "--allow",
        echo,
        # No real kube-apiserver here: the bare-cluster-name route leads to the echo service.
        "--kube-apiserver",
        echo,
        "--drain-timeout",
        DRAIN_TIMEOUT,
        "--backoff-max",
        "2s",
        "--log-format",
        "json",
    ]


def echo_argv(cluster: str, ports: Ports) -> list[str]:
    return [
        sys.executable,
        "-m",
        "clusterproxy_cli.echo",
        "--listen",
        f"{LOOPBACK}:{ports.echo[cluster]}",
        "--name",
        f"{cluster}-echo",
        "--cluster",
        cluster,
    ]


# --- children ----------------------------------------------------------------------------------------


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    process: trio.Process | None = None
    expected_exit: bool = False

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode

    def tail(self, lines: int = TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


@dataclass
class Supervisor:
    log_dir: Path
    out: TextIO
    children: dict[str, Child] = field(default_factory=dict)
    failed: Child | None = None
    failure: str | None = None  # a failure of an in-process part (the cert-signer)
    stopping: bool = False
    died: trio.Event = field(default_factory=trio.Event)

    def fail(self, problem: str) -> None:
        """An in-process part failed: stop everything, like a child dying."""
        if not self.stopping and self.failed is None and self.failure is None:
            self.failure = problem
            self.died.set()

    async def start(self, nursery: trio.Nursery, name: str, argv: list[str]) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        child = Child(name, argv, self.log_dir / f"{name}.log")
        self.children[name] = child
        with child.log_path.open("ab") as log:
            log.write(f"--- {' '.join(argv)}\n".encode())
            log.flush()
            child.process = await trio.lowlevel.open_process(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                # Own session: a Ctrl-C in the terminal reaches only us; we stop the children in order.
                start_new_session=True,
            )
        nursery.start_soon(self._watch, child)
        return child

    async def _watch(self, child: Child) -> None:
        assert child.process is not None
        await child.process.wait()
        if not self.stopping and not child.expected_exit and self.failed is None:
            self.failed = child
            self.died.set()

    async def stop_all(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM every child still running, wait up to ``grace`` seconds, then SIGKILL."""
        self.stopping = True
        running = [c for c in self.children.values() if c.process is not None and c.returncode is None]
        for child in reversed(running):  # agents before the server, the server before targets
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        with trio.move_on_after(grace):
            for child in running:
                await child.process.wait()  # type: ignore[union-attr]
        for child in running:
            if child.returncode is None:
                print(f"{child.name} did not stop within {grace:g}s: killing it", file=self.out, flush=True)
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()  # type: ignore[union-attr]
        with trio.move_on_after(5):
            for child in running:
                await child.process.wait()  # type: ignore[union-attr]

    def report_failure(self, child: Child, problem: str | None = None) -> None:
        problem = problem or _describe_exit(child.returncode)
        print(f"error: {child.name} {problem}; last lines of {child.log_path}:", file=self.out, flush=True)
        for line in child.tail().splitlines():
            print(f"  | {line}", file=self.out)
        self.out.flush()


# --- readiness ---------------------------------------------------------------------------------------


def _file_logger(file: TextIO, name: str) -> Any:
    """A structlog logger writing JSON lines to ``file`` (the in-process signer's own log)."""
    return structlog.wrap_logger(
        structlog.WriteLogger(file),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    ).bind(logger=name)


async def start_signer(
    nursery: trio.Nursery, plan: SignerPlan, ca: Path, log: TextIO, on_failure: Callable[[str], None]
) -> SignerEndpoint:
    """Run the cert-signer in this process (its log in ``log``) on a free loopback port and check
    that it answers over TLS, verified with ``ca``. A later failure calls ``on_failure``."""
    config = SignerConfig(
        store=plan.store,
        tls_dir=plan.store.root / "signer",
        listen=(LOOPBACK, 0),
        tls_hosts=SERVER_HOSTS,
        cert_ttl=dt.timedelta(seconds=parse_duration(plan.cert_ttl)),
        store_poll=SIGNER_POLL,
    )
    service = SignerService(config)
    service.log = _file_logger(log, "cert-signer")

    async def run(*, task_status: trio.TaskStatus[tuple[str, int]]) -> None:
        started = False
        try:
            async with trio.open_nursery() as inner:
                task_status.started(await inner.start(service.run))
                started = True
        except Exception as exc:
            if not started:
                raise
            service.log.exception("signer_failed")
            leaf: BaseException = exc
            while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:
                leaf = leaf.exceptions[0]
            on_failure(f"cert-signer failed: {type(leaf).__name__}: {leaf}")

    _, port = await nursery.start(run)
    endpoint = SignerEndpoint(LOOPBACK, port, ca, "localhost", timeout=10.0)
    await certclient.request_json(endpoint, "GET", "/healthz")
    return endpoint


async def _port_open(host: str, port: int) -> bool:
    try:
        with trio.fail_after(1):
            stream = await trio.open_tcp_stream(host, port)
    except (OSError, trio.TooSlowError):
        return False
    await stream.aclose()
    return True


async def connected_clusters(admin_port: int) -> set[str] | None:
    """Clusters with at least one agent on the server's admin API, or None if it does not answer."""
    try:
        response = await _http.get(LOOPBACK, admin_port, "/api/v1/agents", timeout=2)
    except Exception:  # not up yet: refused, reset, timeout, garbage
        return None
    if response.status != 200:
        return None
    try:
        agents = json.loads(response.body)
    except ValueError:
        return None
    if isinstance(agents, dict):  # tolerate {"agents": [...]}
        agents = agents.get("agents", [])
    return {a["cluster"] for a in agents if isinstance(a, dict) and isinstance(a.get("cluster"), str)}


async def wait_ready(ports: Ports, clusters: Sequence[str], supervisor: Supervisor, out: TextIO) -> None:
    """Wait until the echo services listen and every cluster has an agent on the server.

    Raises TimeoutError naming what is missing; returns early (without error) if a child died, which
    the caller sees in ``supervisor.failed``.
    """
    for cluster in clusters:
        while not await _port_open(LOOPBACK, ports.echo[cluster]):
            await trio.sleep(POLL)
    shown = -1
    while True:
        connected = await connected_clusters(ports.admin) or set()
        ready = [c for c in clusters if c in connected]
        if len(ready) != shown:
            shown = len(ready)
            print(f"waiting for agents: {shown}/{len(clusters)}", file=out, flush=True)
        if shown == len(clusters):
            return
        await trio.sleep(POLL)


async def self_test(proxy: ProxySettings, cluster: str, target: Target) -> str:
    """GET / on ``target`` through the proxy with the SDK; returns the echo's message."""
    tls = TLSFiles(proxy.ca, proxy.cert, proxy.key)
    async with open_tunnel((proxy.host, proxy.port), tls, server_hostname="localhost") as tunnel:
        stream = await tunnel.connect(cluster, target.host, target.port)
        async with stream:
            response = await _http.request(stream, "GET", "/self-test", target.address)
            with trio.move_on_after(2):  # let the echo's close come through: a clean end both ways
                while await stream.receive_some():
                    pass
    if response.status != 200:
        raise RuntimeError(f"echo answered {response.status}")
    return json.loads(response.body).get("message", "")


# --- the command -------------------------------------------------------------------------------------


def _running_pids(state_dir: Path) -> dict[str, int]:
    try:
        doc = json.loads((state_dir / LOCAL_JSON).read_text())
        pids = {k: int(v) for k, v in doc.get("pids", {}).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}
    alive = {}
    for name, pid in pids.items():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        alive[name] = pid
    return alive


async def local_up(
    state_dir: Path,
    base_port: int = 0,
    *,
    ready_timeout: float = 30.0,
    out: TextIO | None = None,
    clusters: Sequence[str] = CLUSTERS,
    cert_signer: bool = True,
    cert_ttl: str = "24h",
    trust_refresh: str = "30s",
) -> int:
    """Run the local system until a signal (exit status 0) or a failure (exit status 1).

    With ``cert_signer`` (the default) certificates come from an in-process cert-signer (leaves live
    ``cert_ttl``, parties fetch the trust bundle every ``trust_refresh``); else from a static
    development CA."""
    out = out or sys.stdout
    state_dir = state_dir.resolve()
    running = _running_pids(state_dir)
    if running.get("cluster-proxy") and running["cluster-proxy"] != os.getpid():
        print(
            f"error: cluster-proxy local is already running from {state_dir} (pid {running['cluster-proxy']}); "
            "stop it first or use another --state-dir",
            file=out,
            flush=True,
        )
        return 1
    ports = plan_ports(base_port, clusters)
    busy = busy_ports(ports.all()) if base_port else []
    if busy:
        print(
            f"error: port(s) {', '.join(map(str, busy))} on {LOOPBACK} already in use; choose another "
            f"--base-port (the plan uses {base_port}..{max(ports.all())}) or 0 for free ports",
            file=out,
            flush=True,
        )
        return 1
    plan: SignerPlan | None = None
    if cert_signer:
        certs = signer_certificates(state_dir / "pki", clusters)
        store, tokens = prepare_signer_pki(state_dir / "pki", certs, clusters)
        plan = SignerPlan(store, tokens, cert_ttl=cert_ttl, trust_refresh=trust_refresh)
    else:
        certs = issue_certificates(state_dir / "pki", clusters)
    proxy = ProxySettings(
        LOOPBACK,
        ports.client,
        certs.ca,
        certs.client.cert,
        certs.client.key,
        f"http://{LOOPBACK}:{ports.admin}",
    )
    supervisor = Supervisor(state_dir / "logs", out)
    local_json = state_dir / LOCAL_JSON
    outcome = {"code": 0}
    signer_log: TextIO | None = None
    if plan is not None:
        supervisor.log_dir.mkdir(parents=True, exist_ok=True)
        signer_log = (supervisor.log_dir / "cert-signer.log").open("a", buffering=1)

    with contextlib.ExitStack() as files, trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        if signer_log is not None:
            files.enter_context(signer_log)
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                async for signum in signals:
                    print(f"\n{signal.Signals(signum).name}: stopping", file=out, flush=True)
                    nursery.cancel_scope.cancel()
                    return

            async def on_death() -> None:
                await supervisor.died.wait()
                outcome["code"] = 1
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_signal)
            nursery.start_soon(on_death)
            try:
                plan = await _bring_up(
                    nursery, supervisor, ports, certs, proxy, clusters, ready_timeout, out, plan, signer_log
                )
            except (TimeoutError, trio.TooSlowError, ConfigError, SignerRequestError, StoreError) as exc:
                print(f"error: {exc}", file=out, flush=True)
                outcome["code"] = 1
                nursery.cancel_scope.cancel()
            except OSError as exc:
                print(f"error: cannot start a child process: {exc}", file=out, flush=True)
                outcome["code"] = 1
                nursery.cancel_scope.cancel()
            else:
                if not nursery.cancel_scope.cancel_called:
                    pids = {
                        "cluster-proxy": os.getpid(),
                        **{n: c.pid for n, c in supervisor.children.items()},
                    }
                    doc = build_local_json(proxy, _cluster_info(clusters, ports), pids, state_dir)
                    if plan is not None:
                        doc["signer"] = {"url": plan.url, "store": str(plan.store.root.resolve())}
                    write_local_json(state_dir, doc)
                    await _print_ready(proxy, clusters, ports, state_dir, out, plan)
                    await trio.sleep_forever()

        with trio.CancelScope(shield=True):
            if supervisor.failed is not None:
                supervisor.report_failure(supervisor.failed)
            elif supervisor.failure is not None:
                print(f"error: {supervisor.failure}", file=out, flush=True)
            local_json.unlink(missing_ok=True)
            await supervisor.stop_all()
    print("stopped" if outcome["code"] == 0 else "stopped after a failure", file=out, flush=True)
    return outcome["code"]


async def _bring_up(
    nursery: trio.Nursery,
    supervisor: Supervisor,
    ports: Ports,
    certs: Certificates,
    proxy: ProxySettings,
    clusters: Sequence[str],
    ready_timeout: float,
    out: TextIO,
    plan: SignerPlan | None = None,
    signer_log: TextIO | None = None,
) -> SignerPlan | None:
    print(f"starting cluster-proxy local (logs in {supervisor.log_dir})", file=out, flush=True)
    for cluster in clusters:
        await supervisor.start(nursery, f"{cluster}-echo", echo_argv(cluster, ports))
    if plan is not None:
        assert signer_log is not None
        endpoint = await start_signer(nursery, plan, certs.client.ca, signer_log, supervisor.fail)
        plan = replace(plan, url=endpoint.url)
        # The hub client (curl, the SDK, this process's self-test) is a party too: bootstrapped and
        # renewed here, reporting its trust like the others.
        await certclient.ensure_bootstrapped(
            endpoint,
            certs.client,
            plan.token("client"),
            lambda key: certclient.client_csr(key, CLIENT_NAME),
        )
        renewer = CertRenewer(
            endpoint, certs.client, [], RenewalPolicy(trust_refresh=parse_duration(plan.trust_refresh))
        )
        await nursery.start(renewer.run)
    await supervisor.start(nursery, "proxy-server", server_argv(ports, certs, clusters, plan))
    for cluster in clusters:
        await supervisor.start(nursery, f"{cluster}-agent", agent_argv(cluster, ports, certs, plan))
    try:
        with trio.fail_after(ready_timeout):
            await wait_ready(ports, clusters, supervisor, out)
    except trio.TooSlowError:
        problems: list[tuple[Child, str]] = []
        for cluster in clusters:
            if not await _port_open(LOOPBACK, ports.echo[cluster]):
                problems.append(
                    (supervisor.children[f"{cluster}-echo"], f"does not listen on port {ports.echo[cluster]}")
                )
        connected = await connected_clusters(ports.admin)
        if connected is None:
            problems.append(
                (supervisor.children["proxy-server"], f"does not answer on its admin port {ports.admin}")
            )
        else:
            for cluster in clusters:
                if cluster not in connected:
                    problems.append(
                        (supervisor.children[f"{cluster}-agent"], "has not connected to the proxy-server")
                    )
        for child, problem in problems:
            supervisor.report_failure(child, problem)
        what = "; ".join(f"{child.name} {problem}" for child, problem in problems) or "unknown"
        raise TimeoutError(f"not ready within {ready_timeout:g}s: {what}") from None
    return plan


def _cluster_info(clusters: Sequence[str], ports: Ports) -> dict[str, dict]:  # type: ignore[type-arg]
    info = {}
    for cluster in clusters:
        echo = Target("echo", LOOPBACK, ports.echo[cluster])
        info[cluster] = {"targets": [echo], "agent_id": agent_id(cluster), "kube_apiserver": echo}
    return info


async def _print_ready(
    proxy: ProxySettings,
    clusters: Sequence[str],
    ports: Ports,
    state_dir: Path,
    out: TextIO,
    plan: SignerPlan | None = None,
) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("")
    p(f"cluster-proxy local is up ({state_dir / LOCAL_JSON})")
    if plan is not None:
        p(
            f"  cert-signer   {plan.url}  (CA store {plan.store.root}; leaves live {plan.cert_ttl}, renewed at 80%)"
        )
    p(f"  proxy-server  client port {proxy.client_url}  (mTLS; HTTP/2 and HTTP/1.1 CONNECT)")
    p(f"                admin       {proxy.admin_url}/api/v1/agents")
    for cluster in clusters:
        echo = Target("echo", LOOPBACK, ports.echo[cluster])
        try:
            with trio.fail_after(10):
                message = await self_test(proxy, cluster, echo)
            check = f"self-test through the proxy OK: {message!r}"
        except Exception as exc:
            check = f"self-test through the proxy FAILED: {type(exc).__name__}: {exc}"
        p(f"  {cluster:<12}  agent {agent_id(cluster)}, echo service {echo.address}; {check}")
    p("")
    p("Reach a cluster's echo service with curl (the proxy URL's user name names the cluster):")
    for cluster in clusters:
        echo = Target("echo", LOOPBACK, ports.echo[cluster])
        p(f"  {curl_commands(proxy, cluster, echo)['proxy-user']}")
    p("or name the cluster in a header:")
    first = clusters[0]
    p(f"  {curl_commands(proxy, first, Target('echo', LOOPBACK, ports.echo[first]))['header']}")
    p(
        "The bare cluster name reaches the cluster's kube-apiserver (locally: its echo service, no real apiserver):"
    )
    p(f"  {curl_kube_apiserver(proxy, first)}")
    p("Forward a local port into a cluster:")
    p(
        f"  cluster-proxy port-forward {first} {LOOPBACK}:{ports.echo[first]} --listen 127.0.0.1:0 --state-dir {state_dir}"
    )
    if plan is not None:
        p("Certificates (every party, its CA, what it trusts; CA rotation with overlap):")
        p(f"  cluster-proxy certs status --store {plan.store.root}")
        p(f"  cluster-proxy certs rotate-ca --store {plan.store.root}   # start, then activate, then retire")
    p("")
    p("Press Ctrl-C to stop.")
    out.flush()
