"""``cluster-proxy local up``: a hub and two simulated managed clusters as processes on loopback.

Started as child processes, each with its log in ``STATE/logs/<name>.log``:

- per cluster (``cluster1``, ``cluster2``): an echo service (the cluster's "in-cluster" target, also
  standing in for its kube-apiserver);
- ``cert-signer`` (``cluster-proxy-cert-signer serve``): the CA, its store in ``STATE/pki/store``,
  its signing API on a free loopback port;
- with ``--proxied-cluster NAME``: ``tinyproxy``, a forward proxy on loopback (:mod:`.local_proxies`);
- ``proxy-server``: client port, agent port, admin port; with ``--servers N`` (N > 1) the replicas
  ``proxy-server-1`` .. ``-N`` (``--server-id`` their name, ``--server-count N``), each on its own
  ports, and ``haproxy`` in front of them on the hub's client and agent ports; its audit records in
  ``STATE/logs/audit.jsonl`` (a replica's in ``audit.<name>.jsonl``);
- per cluster a ``proxy-agent`` dialing the hub's agent port (the proxied cluster's through tinyproxy).

Before the signer starts, its own commands create the CA (once), write every party's trust bundle
and create a single-use bootstrap token for each party without a usable certificate, so a restart
needs none. Every party bootstraps and renews at 80% of its lifetime; the hub client's certificate
(``STATE/pki/local-admin.crt``, what curl and the SDK use) is bootstrapped and renewed by this
process over the signer's API. ``--no-cert-signer`` uses static certificates from a development CA.

Once every agent is connected, ``STATE/local.json`` is written and ready-to-paste commands are
printed. Foreground: Ctrl-C or SIGTERM (``cluster-proxy local down``) stops every child (SIGTERM,
then SIGKILL after 10 s) and removes ``local.json``. A replica dying on its own is restarted after 1 s
(haproxy sends new connections to the others meanwhile), an agent after ``--agent-restart-delay`` (5 s:
meanwhile its cluster is unreachable, as when a kubelet backs off a crashed pod), each with its
certificate from before; ``local.json`` gets the new pid. Any other child dying, or a replica or agent
crashing in a loop, stops the rest too and exits 1.

The jobs live in :mod:`.local_plan` (what runs where), :mod:`.local_pki` (certificates),
:mod:`.local_supervise` (children and readiness) and :mod:`.local_print` (the report); this module
wires them together.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import trio

from clusterproxy_protocol import (
    ALPN_HTTP1,
    CertRenewer,
    ConfigError,
    RenewalPolicy,
    RestartPolicy,
    SignerEndpoint,
    SignerRequestError,
    certclient,
    client_context,
    parse_duration,
)

from .commands import AGENT, SERVER, SIGNER, executable
from .local_pki import SignerCommandError, issue_certificates, prepare_signer_pki
from .local_plan import (
    BALANCER_NAME,
    CLIENT_NAME,
    CLIENT_PARTY,
    CLUSTERS,
    FORWARD_PROXY_NAME,
    LOOPBACK,
    SIGNER_NAME,
    SIGNER_STORE,
    Certificates,
    Ports,
    SignerPlan,
    agent_id,
    audit_log_path,
    busy_ports,
    echo_argv,
    echo_target,
    forward_proxy_url,
    free_ports,
    local_agent_argv,
    local_server_argv,
    local_signer_argv,
    loopback,
    plan_ports,
    server_names,
    signer_certificates,
    signer_parties,
    signer_url,
)
from .local_print import print_ready
from .local_proxies import (
    backend_states,
    down_replicas,
    find_program,
    haproxy_argv,
    haproxy_config,
    stats_url,
    tinyproxy_argv,
    tinyproxy_config,
)
from .local_supervise import (
    AGENT_RESTART_DELAY,
    REPLICA_RESTART,
    Child,
    Supervisor,
    connected_clusters,
    port_open,
    wait_agents,
    wait_signer,
)
from .state import LOCAL_JSON, ProxySettings, build_local_json, write_local_json

SIGNER_POLL_TIMEOUT = 2.0  # one /healthz attempt while the signer starts
HAPROXY_CONFIG = "haproxy.cfg"  # in the state folder
TINYPROXY_CONFIG = "tinyproxy.conf"


@dataclass(frozen=True)
class Programs:
    """The Debian programs this run needs, as found (None: not needed)."""

    haproxy: str | None = None
    tinyproxy: str | None = None


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
    servers: int = 1,
    proxied_cluster: str | None = None,
    haproxy: str = "haproxy",
    tinyproxy: str = "tinyproxy",
    agent_restart_delay: float = AGENT_RESTART_DELAY,
) -> int:
    """Run the local system until a signal (exit status 0) or a failure (exit status 1).

    With ``cert_signer`` (the default) certificates come from a cert-signer process (leaves live
    ``cert_ttl``, parties fetch the trust bundle every ``trust_refresh``); else from a static
    development CA. ``servers`` > 1 runs that many proxy-server replicas behind the program
    ``haproxy``; ``proxied_cluster``'s agent reaches the hub through the program ``tinyproxy``. An
    agent that dies is started again after ``agent_restart_delay`` seconds. A
    service or program that is not installed, or a bad setting, raises ConfigError naming what to do."""
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
    programs = _find_programs(clusters, servers, proxied_cluster, haproxy, tinyproxy)
    ports = plan_ports(base_port, clusters, servers, forward_proxy=proxied_cluster is not None)
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
    names = server_names(servers)
    if cert_signer:
        certs = signer_certificates(pki_dir, clusters, names)
        signer: SignerPlan | None = SignerPlan(
            pki_dir / SIGNER_STORE, signer_url(ports), cert_ttl=cert_ttl, trust_refresh=trust_refresh
        )
    else:
        certs = issue_certificates(pki_dir, clusters, names)
        signer = None
    proxy = ProxySettings(
        LOOPBACK,
        ports.client,
        certs.ca,
        certs.client.cert,
        certs.client.key,
        ports.servers[0].admin_url,
    )
    proxied = {proxied_cluster: forward_proxy_url(ports) or ""} if proxied_cluster is not None else {}
    supervisor = Supervisor(state_dir / "logs", out)
    published = False
    health_url = ""
    code = 0

    def publish() -> None:
        """Write ``local.json`` with every child's current pid."""
        pids = {"cluster-proxy": os.getpid(), **{n: c.pid for n, c in supervisor.children.items()}}
        doc = build_local_json(proxy, _cluster_info(clusters, ports), pids, state_dir)
        doc.update(_hub_info(ports, state_dir, proxied))
        for cluster in clusters:
            doc["clusters"][cluster]["agent_admin_url"] = f"http://{loopback(ports.agent_admin[cluster])}"
        for cluster, url in proxied.items():
            doc["clusters"][cluster]["proxy_url"] = url
        doc["proxy"]["admin_urls"] = [server.admin_url for server in ports.servers]
        doc["proxy"]["api_urls"] = [server.api_url for server in ports.servers]
        doc["proxy"]["agent_address"] = loopback(ports.agent)
        if signer is not None:
            doc["signer"] = {"url": signer.url, "store": str(signer.store)}
        if health_url:
            doc["health"] = {"url": health_url}  # `cluster-proxy health` with no flags reads it
        write_local_json(state_dir, doc)

    def on_restart(child: Child) -> None:
        if published:
            publish()

    supervisor.on_restart = on_restart

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
                agent_restart = replace(REPLICA_RESTART, delay=agent_restart_delay)
                hub = Hub(
                    nursery,
                    supervisor,
                    ports,
                    certs,
                    clusters,
                    state_dir,
                    programs,
                    signer,
                    proxied,
                    agent_restart,
                )
                await hub.start(ready_timeout, out)
                health_url = await _start_health_collector(nursery, supervisor, ports, proxy, ready_timeout)
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
                    publish()
                    published = True
                    await print_ready(proxy, clusters, ports, state_dir, out, signer, proxied)
                    if health_url:
                        print(
                            f"Health of every cluster: {health_url}/ (a page), `cluster-proxy health` (a table)",
                            file=out,
                            flush=True,
                        )
                    await trio.sleep_forever()

        with trio.CancelScope(shield=True):
            published = False
            if supervisor.failed is not None:
                supervisor.report_failure(supervisor.failed)
            (state_dir / LOCAL_JSON).unlink(missing_ok=True)
            await supervisor.stop_all()
    print("stopped" if code == 0 else "stopped after a failure", file=out, flush=True)
    return code


HEALTH_COLLECTOR = "cluster-proxy-health-collector"
HEALTH_INTERVAL = "2s"


async def _start_health_collector(
    nursery: trio.Nursery, supervisor: Supervisor, ports: Ports, proxy: ProxySettings, ready_timeout: float
) -> str:
    """The health-collector over every proxy-server, probing each cluster's kube-apiserver stand-in (its
    echo service, plain HTTP) by the bare cluster name; its URL once it answers, "" when the package is
    not installed (local mode runs without it)."""
    try:
        program = executable(HEALTH_COLLECTOR)
    except ConfigError:
        return ""
    port = free_ports(1)[0]
    argv = [
        program,
        f"--listen={loopback(port)}",
        *(f"--admin-url={server.api_url}" for server in ports.servers),
        f"--proxy={loopback(ports.client)}",
        f"--ca={proxy.ca}",
        f"--cert={proxy.cert}",
        f"--key={proxy.key}",
        "--server-name=localhost",
        "--probe-url=http://{cluster}:443/healthz",
        f"--interval={HEALTH_INTERVAL}",
        "--log-format=json",
    ]
    await supervisor.start(nursery, "health-collector", argv)
    url = f"http://{loopback(port)}"
    with trio.fail_after(ready_timeout):
        while not await port_open(LOOPBACK, port):
            await trio.sleep(0.05)
    return url


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


def _find_programs(
    clusters: Sequence[str], servers: int, proxied_cluster: str | None, haproxy: str, tinyproxy: str
) -> Programs:
    """The Debian programs the settings need; ConfigError for a bad setting or a missing program."""
    if proxied_cluster is not None and proxied_cluster not in clusters:
        raise ConfigError(
            f"--proxied-cluster {proxied_cluster}: not one of the clusters ({', '.join(clusters)})"
        )
    return Programs(
        haproxy=find_program(
            haproxy,
            "haproxy",
            f"--servers {servers} runs the proxy-server replicas behind haproxy (or use --servers 1)",
            "--haproxy",
        )
        if servers > 1
        else None,
        tinyproxy=find_program(
            tinyproxy,
            "tinyproxy",
            f"--proxied-cluster {proxied_cluster} sends that cluster's agent through tinyproxy",
            "--tinyproxy",
        )
        if proxied_cluster is not None
        else None,
    )


@dataclass
class Hub:
    """The hub side and the agents: tinyproxy, the proxy-server(s), haproxy, the agents."""

    nursery: trio.Nursery
    supervisor: Supervisor
    ports: Ports
    certs: Certificates
    clusters: Sequence[str]
    state_dir: Path
    programs: Programs
    signer: SignerPlan | None
    proxied: dict[str, str]  # cluster -> the forward proxy's URL its agent dials through
    agent_restart: RestartPolicy

    def api_tls(self) -> ssl.SSLContext:
        """The hub client certificate as it is now (renewals followed), for the proxy-servers' agents
        and clusters: their admin ports serve those over mutual TLS only."""
        files = self.certs.client
        return client_context(files.cert, files.key, files.ca, alpn=[ALPN_HTTP1])

    async def start(self, ready_timeout: float, out: TextIO) -> None:
        """Start everything; wait until tinyproxy listens, every agent holds a tunnel to every
        proxy-server, and haproxy has every replica in rotation."""
        ports, supervisor, nursery = self.ports, self.supervisor, self.nursery
        try:
            with trio.fail_after(ready_timeout):
                if self.programs.tinyproxy is not None and ports.forward_proxy is not None:
                    config = self.state_dir / TINYPROXY_CONFIG
                    config.write_text(tinyproxy_config(ports.forward_proxy, [ports.agent, ports.signer]))
                    await supervisor.start(
                        nursery, FORWARD_PROXY_NAME, tinyproxy_argv(self.programs.tinyproxy, config)
                    )
                    while not await port_open(LOOPBACK, ports.forward_proxy):
                        await trio.sleep(0.05)
                for server in ports.servers:
                    audit = audit_log_path(self.state_dir / "logs", ports, server)
                    argv = local_server_argv(ports, self.certs, self.clusters, self.signer, server, audit)
                    await supervisor.start(
                        nursery, server.name, argv, REPLICA_RESTART if ports.balanced else None
                    )
                if self.programs.haproxy is not None:
                    config = self.state_dir / HAPROXY_CONFIG
                    config.write_text(haproxy_config(ports.servers, ports.client, ports.agent, ports.admin))
                    await supervisor.start(
                        nursery, BALANCER_NAME, haproxy_argv(self.programs.haproxy, config)
                    )
                for cluster in self.clusters:
                    argv = local_agent_argv(
                        cluster, ports, self.certs, self.signer, proxy_url=self.proxied.get(cluster)
                    )
                    await supervisor.start(nursery, f"{cluster}-agent", argv, self.agent_restart)
                admin_ports = [server.admin for server in ports.servers]
                await wait_agents(LOOPBACK, ports.echo, admin_ports, self.clusters, out, self.api_tls)
                if ports.balanced:
                    while down_replicas(await backend_states(ports.admin), ports.servers):
                        await trio.sleep(0.05)
        except trio.TooSlowError:
            problems = await self._not_ready()
            for child, problem in problems:
                supervisor.report_failure(child, problem)
            what = "; ".join(f"{child.name} {problem}" for child, problem in problems) or "unknown"
            raise TimeoutError(f"not ready within {ready_timeout:g}s: {what}") from None

    async def _not_ready(self) -> list[tuple[Child, str]]:
        """Which children are not ready, and why."""
        ports, children = self.ports, self.supervisor.children
        problems: list[tuple[Child, str]] = []
        for cluster in self.clusters:
            if not await port_open(LOOPBACK, ports.echo[cluster]):
                problems.append(
                    (children[f"{cluster}-echo"], f"does not listen on port {ports.echo[cluster]}")
                )
        if (
            ports.forward_proxy is not None
            and FORWARD_PROXY_NAME in children
            and not await port_open(LOOPBACK, ports.forward_proxy)
        ):
            problems.append((children[FORWARD_PROXY_NAME], f"does not listen on port {ports.forward_proxy}"))
        for server in ports.servers:
            if server.name not in children:
                continue
            connected = await connected_clusters(LOOPBACK, server.admin, self.api_tls)
            if connected is None:
                problems.append((children[server.name], f"does not answer on its admin port {server.admin}"))
                continue
            for cluster in self.clusters:
                agent = f"{cluster}-agent"
                if cluster not in connected and agent in children:
                    via = f" through {FORWARD_PROXY_NAME}" if cluster in self.proxied else ""
                    problems.append((children[agent], f"has not connected{via} to {server.name}"))
        if ports.balanced and BALANCER_NAME in children:
            states = await backend_states(ports.admin)
            if states is None:
                problems.append(
                    (children[BALANCER_NAME], f"does not answer on its statistics port {ports.admin}")
                )
            elif down := down_replicas(states, ports.servers):
                problems.append((children[BALANCER_NAME], f"has not taken {', '.join(down)} into rotation"))
        return problems


def _cluster_info(clusters: Sequence[str], ports: Ports) -> dict[str, dict[str, Any]]:
    info = {}
    for cluster in clusters:
        echo = echo_target(cluster, ports)
        info[cluster] = {"targets": [echo], "agent_id": agent_id(cluster), "kube_apiserver": echo}
    return info


def _hub_info(ports: Ports, state_dir: Path, proxied: dict[str, str]) -> dict[str, Any]:
    """``local.json``'s description of the proxy-servers, haproxy and tinyproxy."""
    info: dict[str, Any] = {
        "servers": [
            {
                "name": server.name,
                "client": loopback(server.client),
                "agent": loopback(server.agent),
                "admin_url": server.admin_url,
                "api_url": server.api_url,
                "audit_log": str(audit_log_path(state_dir / "logs", ports, server)),
                **({"server_id": server.name} if ports.balanced else {}),
            }
            for server in ports.servers
        ]
    }
    if ports.balanced:
        info["balancer"] = {
            "kind": BALANCER_NAME,
            "client": loopback(ports.client),
            "agent": loopback(ports.agent),
            "stats_url": stats_url(ports.admin),
            "config": str(state_dir / HAPROXY_CONFIG),
        }
    if proxied and ports.forward_proxy is not None:
        info["forward_proxy"] = {
            "kind": FORWARD_PROXY_NAME,
            "url": forward_proxy_url(ports),
            "clusters": sorted(proxied),
            "config": str(state_dir / TINYPROXY_CONFIG),
            "log": str(state_dir / "logs" / f"{FORWARD_PROXY_NAME}.log"),
        }
    return info
