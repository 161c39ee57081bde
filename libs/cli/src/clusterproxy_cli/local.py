"""``cluster-proxy local up``: a hub and two simulated managed clusters as processes on loopback.

Started as child processes, each with its log in ``STATE/logs/<name>.log``:

- per cluster (``cluster1``, ``cluster2``): an echo service (the cluster's "in-cluster" target, also
  standing in for its kube-apiserver);
- ``cert-signer`` (``cluster-proxy-cert-signer serve``): the CA, its store in ``STATE/pki/store``,
  its signing API on a free loopback port;
- ``proxy-server``: client port, agent port, admin port;
- per cluster a ``proxy-agent`` dialing the server.

Before the signer starts, its own commands create the CA (once), write every party's trust bundle
and create a single-use bootstrap token for each party without a usable certificate, so a restart
needs none. Every party bootstraps and renews at 80% of its lifetime; the hub client's certificate
(``STATE/pki/local-admin.crt``, what curl and the SDK use) is bootstrapped and renewed by this
process over the signer's API. ``--no-cert-signer`` uses static certificates from a development CA.

Once every agent is connected, ``STATE/local.json`` is written and ready-to-paste commands are
printed. Foreground: Ctrl-C or SIGTERM stops every child (SIGTERM, then SIGKILL after 10 s) and
removes ``local.json``; a child dying on its own stops the rest too and exits 1.

The jobs live in :mod:`.local_plan` (what runs where), :mod:`.local_pki` (certificates),
:mod:`.local_supervise` (children and readiness) and :mod:`.local_print` (the report); this module
wires them together.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import trio

from clusterproxy_protocol import certclient
from clusterproxy_protocol.certclient import SignerEndpoint, SignerRequestError
from clusterproxy_protocol.config import ConfigError, parse_duration
from clusterproxy_protocol.reloader import CertRenewer, RenewalPolicy

from .commands import AGENT, SERVER, SIGNER, executable
from .local_pki import SignerCommandError, issue_certificates, prepare_signer_pki
from .local_plan import (
    CLIENT_NAME,
    CLIENT_PARTY,
    CLUSTERS,
    LOOPBACK,
    SERVER_NAME,
    SIGNER_NAME,
    SIGNER_STORE,
    Certificates,
    Ports,
    SignerPlan,
    agent_id,
    busy_ports,
    echo_argv,
    echo_target,
    local_agent_argv,
    local_server_argv,
    local_signer_argv,
    plan_ports,
    signer_certificates,
    signer_parties,
    signer_url,
)
from .local_print import print_ready
from .local_supervise import Child, Supervisor, connected_clusters, port_open, wait_agents, wait_signer
from .state import LOCAL_JSON, ProxySettings, build_local_json, write_local_json

SIGNER_POLL_TIMEOUT = 2.0  # one /healthz attempt while the signer starts


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

    With ``cert_signer`` (the default) certificates come from a cert-signer process (leaves live
    ``cert_ttl``, parties fetch the trust bundle every ``trust_refresh``); else from a static
    development CA. A service that is not installed raises ConfigError naming its package."""
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
    for service in (SERVER, AGENT, *([SIGNER] if cert_signer else [])):
        executable(service)
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
    pki_dir = state_dir / "pki"
    if cert_signer:
        certs = signer_certificates(pki_dir, clusters)
        signer: SignerPlan | None = SignerPlan(
            pki_dir / SIGNER_STORE, signer_url(ports), cert_ttl=cert_ttl, trust_refresh=trust_refresh
        )
    else:
        certs = issue_certificates(pki_dir, clusters)
        signer = None
    proxy = ProxySettings(
        LOOPBACK,
        ports.client,
        certs.ca,
        certs.client.cert,
        certs.client.key,
        f"http://{LOOPBACK}:{ports.admin}",
    )
    supervisor = Supervisor(state_dir / "logs", out)
    code = 0

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                async for signum in signals:
                    print(f"\n{signal.Signals(signum).name}: stopping", file=out, flush=True)
                    nursery.cancel_scope.cancel()
                    return

            async def on_death() -> None:
                nonlocal code
                await supervisor.died.wait()
                code = 1
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_signal)
            nursery.start_soon(on_death)
            try:
                print(f"starting cluster-proxy local (logs in {supervisor.log_dir})", file=out, flush=True)
                for cluster in clusters:
                    await supervisor.start(nursery, f"{cluster}-echo", echo_argv(cluster, ports))
                if signer is not None:
                    signer = await _start_signer(
                        nursery, supervisor, signer, ports, certs, clusters, ready_timeout
                    )
                await _start_hub(nursery, supervisor, ports, certs, clusters, ready_timeout, out, signer)
            except (
                TimeoutError,
                trio.TooSlowError,
                ConfigError,
                SignerRequestError,
                SignerCommandError,
            ) as exc:
                print(f"error: {exc}", file=out, flush=True)
                code = 1
                nursery.cancel_scope.cancel()
            except OSError as exc:
                print(f"error: cannot start a child process: {exc}", file=out, flush=True)
                code = 1
                nursery.cancel_scope.cancel()
            else:
                if not nursery.cancel_scope.cancel_called:
                    pids = {
                        "cluster-proxy": os.getpid(),
                        **{n: c.pid for n, c in supervisor.children.items()},
                    }
                    doc = build_local_json(proxy, _cluster_info(clusters, ports), pids, state_dir)
                    if signer is not None:
                        doc["signer"] = {"url": signer.url, "store": str(signer.store)}
                    write_local_json(state_dir, doc)
                    await print_ready(proxy, clusters, ports, state_dir, out, signer)
                    await trio.sleep_forever()

        with trio.CancelScope(shield=True):
            if supervisor.failed is not None:
                supervisor.report_failure(supervisor.failed)
            (state_dir / LOCAL_JSON).unlink(missing_ok=True)
            await supervisor.stop_all()
    print("stopped" if code == 0 else "stopped after a failure", file=out, flush=True)
    return code


async def _start_signer(
    nursery: trio.Nursery,
    supervisor: Supervisor,
    plan: SignerPlan,
    ports: Ports,
    certs: Certificates,
    clusters: Sequence[str],
    ready_timeout: float,
) -> SignerPlan:
    """Prepare the parties' certificates with the signer's commands, start the signer, wait until it
    answers, and bootstrap and renew the hub client (a party like the others, reporting its trust)."""
    plan = replace(plan, tokens=await prepare_signer_pki(plan.store, signer_parties(certs, clusters)))
    child = await supervisor.start(nursery, SIGNER_NAME, local_signer_argv(plan.store, ports, plan.cert_ttl))
    endpoint = SignerEndpoint(LOOPBACK, ports.signer, certs.client.ca, "localhost", timeout=10.0)
    try:
        with trio.fail_after(ready_timeout):
            await wait_signer(replace(endpoint, timeout=SIGNER_POLL_TIMEOUT))
    except trio.TooSlowError:
        problem = f"does not answer on {plan.url}"
        supervisor.report_failure(child, problem)
        raise TimeoutError(f"not ready within {ready_timeout:g}s: {child.name} {problem}") from None
    await certclient.ensure_bootstrapped(
        endpoint,
        certs.client,
        plan.tokens.get(CLIENT_PARTY),
        lambda key: certclient.client_csr(key, CLIENT_NAME),
    )
    renewer = CertRenewer(
        endpoint, certs.client, [], RenewalPolicy(trust_refresh=parse_duration(plan.trust_refresh))
    )
    await nursery.start(renewer.run)
    return plan


async def _start_hub(
    nursery: trio.Nursery,
    supervisor: Supervisor,
    ports: Ports,
    certs: Certificates,
    clusters: Sequence[str],
    ready_timeout: float,
    out: TextIO,
    signer: SignerPlan | None,
) -> None:
    """Start the proxy-server and the agents; wait until every agent is connected."""
    await supervisor.start(nursery, SERVER_NAME, local_server_argv(ports, certs, clusters, signer))
    for cluster in clusters:
        await supervisor.start(nursery, f"{cluster}-agent", local_agent_argv(cluster, ports, certs, signer))
    try:
        with trio.fail_after(ready_timeout):
            await wait_agents(LOOPBACK, ports.echo, ports.admin, clusters, out)
    except trio.TooSlowError:
        problems = await _not_ready(supervisor, ports, clusters)
        for child, problem in problems:
            supervisor.report_failure(child, problem)
        what = "; ".join(f"{child.name} {problem}" for child, problem in problems) or "unknown"
        raise TimeoutError(f"not ready within {ready_timeout:g}s: {what}") from None


async def _not_ready(
    supervisor: Supervisor, ports: Ports, clusters: Sequence[str]
) -> list[tuple[Child, str]]:
    """Which children are not ready, and why."""
    problems: list[tuple[Child, str]] = []
    for cluster in clusters:
        if not await port_open(LOOPBACK, ports.echo[cluster]):
            problems.append(
                (supervisor.children[f"{cluster}-echo"], f"does not listen on port {ports.echo[cluster]}")
            )
    connected = await connected_clusters(LOOPBACK, ports.admin)
    if connected is None:
        problems.append(
            (supervisor.children[SERVER_NAME], f"does not answer on its admin port {ports.admin}")
        )
    else:
        for cluster in clusters:
            if cluster not in connected:
                problems.append(
                    (supervisor.children[f"{cluster}-agent"], "has not connected to the proxy-server")
                )
    return problems


def _cluster_info(clusters: Sequence[str], ports: Ports) -> dict[str, dict[str, Any]]:
    info = {}
    for cluster in clusters:
        echo = echo_target(cluster, ports)
        info[cluster] = {"targets": [echo], "agent_id": agent_id(cluster), "kube_apiserver": echo}
    return info
