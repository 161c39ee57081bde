"""What ``cluster-proxy local up`` runs: the clusters, the proxy-server replicas, the port plan, where
each party's certificate lives, and every child's command line (built with
:mod:`clusterproxy_cli.commands`)."""

from __future__ import annotations

import random
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from clusterproxy_protocol import CertFiles, InvalidValue, format_authority

from .commands import SignerFlags, agent_argv, repeat_flag, server_argv, signer_serve_argv
from .state import Target

CLUSTERS = ("cluster1", "cluster2")
CLIENT_NAME = "local-admin"
CLIENT_PARTY = "client"  # the hub client among the signer's parties (curl, the SDK, port-forward)
SERVER_NAME = "proxy-server"
SIGNER_NAME = "cert-signer"
LOOPBACK = "127.0.0.1"
SERVER_HOSTS = ("localhost", LOOPBACK)
DRAIN_TIMEOUT = "3s"  # children drain on SIGTERM well within the supervisor's stop grace
AGENT_BACKOFF_MAX = "2s"
SIGNER_STORE = "store"  # STATE/pki/store
SIGNER_STORE_POLL = "1s"  # how soon the signer sees `cluster-proxy certs rotate-ca` and new tokens
TOKEN_TTL = "10m"
MAX_SERVERS = 9
MAX_CLUSTERS = 7
BALANCER_NAME = "haproxy"
FORWARD_PROXY_NAME = "tinyproxy"


def agent_id(cluster: str) -> str:
    return f"{cluster}-agent-1"


def server_names(count: int) -> list[str]:
    """The proxy-server processes: one ``proxy-server``, or replicas ``proxy-server-1`` .. ``-N`` (each
    name is also the replica's ``--server-id`` and the folder of its certificate; every certificate is
    for CN ``proxy-server``)."""
    if count == 1:
        return [SERVER_NAME]
    return [f"{SERVER_NAME}-{i}" for i in range(1, count + 1)]


def loopback(port: int) -> str:
    return format_authority(LOOPBACK, port)


# --- ports -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerPorts:
    """One proxy-server process's own ports."""

    name: str
    client: int
    agent: int
    admin: int

    @property
    def admin_url(self) -> str:
        return f"http://{loopback(self.admin)}"

    @property
    def api_url(self) -> str:
        """The admin port over mutual TLS: its agents and clusters, to a hub client certificate."""
        return f"https://{loopback(self.admin)}"


@dataclass(frozen=True)
class Ports:
    """``client`` and ``agent`` are what clients and agents dial: the one proxy-server's ports, or
    haproxy's frontends in front of the replicas. ``admin`` is the one server's admin port, or haproxy's
    statistics page with replicas (each replica's admin port is in ``servers``)."""

    client: int
    agent: int
    admin: int
    agent_admin: dict[str, int]
    echo: dict[str, int]
    signer: int
    servers: tuple[ServerPorts, ...] = ()  # every proxy-server process (one, or the replicas)
    forward_proxy: int | None = None  # tinyproxy, when an agent reaches the hub through it

    @property
    def balanced(self) -> bool:
        """Whether replicas run behind haproxy (else one proxy-server listens on the hub's ports)."""
        return len(self.servers) > 1

    def all(self) -> list[int]:
        """Every planned port, once."""
        ports = [
            self.client,
            self.agent,
            self.admin,
            *self.agent_admin.values(),
            *self.echo.values(),
            self.signer,
            *(port for server in self.servers for port in (server.client, server.agent, server.admin)),
            *([self.forward_proxy] if self.forward_proxy is not None else []),
        ]
        return list(dict.fromkeys(ports))


# Free ports are picked here: below Linux's ephemeral range (32768-60999), where every outgoing
# connection on the machine takes its local port (a busy machine could take a planned port in the
# seconds before the service binds it), and below the benchmark's 20000-32000.
FREE_PORT_RANGE = range(10000, 20000)


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports free right now (all held open together, then released), at random in
    ``FREE_PORT_RANGE``; from the kernel's ephemeral range when that is too crowded."""
    sockets: list[socket.socket] = []
    rng = random.Random()
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            for _attempt in range(200):
                try:
                    s.bind((host, rng.choice(FREE_PORT_RANGE)))
                    break
                except OSError:
                    continue
            else:
                s.bind((host, 0))
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


def plan_ports(base: int, clusters: Sequence[str], servers: int = 1, forward_proxy: bool = False) -> Ports:
    """Fixed ports from ``base``, or free ephemeral ports when ``base`` is 0. The fixed plan: the hub's
    client port base, agent port base+1, admin base+2 (with replicas: haproxy's statistics page);
    agents' admin base+3..; echo services base+10..; tinyproxy base+17; replica i (from 0) client
    base+20+3i, agent +1, admin +2. The cert-signer always gets a free ephemeral port: only the services
    get its URL, from their command line. Raises InvalidValue (a ValueError) for a plan that does not
    fit."""
    n = len(clusters)
    if n > MAX_CLUSTERS:
        raise InvalidValue(f"at most {MAX_CLUSTERS} clusters fit the fixed port plan")
    if not 1 <= servers <= MAX_SERVERS:
        raise InvalidValue(f"invalid number of proxy-servers {servers}: 1 to {MAX_SERVERS}")
    names = server_names(servers)
    if base == 0:
        count = 4 + 2 * n + (3 * servers if servers > 1 else 0) + (1 if forward_proxy else 0)
        free = iter(free_ports(count))
        client, agent, admin = next(free), next(free), next(free)
        agent_admin = {c: next(free) for c in clusters}
        echo = {c: next(free) for c in clusters}
        signer = next(free)
        replicas = [ServerPorts(name, next(free), next(free), next(free)) for name in names if servers > 1]
        tinyproxy = next(free) if forward_proxy else None
    else:
        top = base + 10 + n - 1
        if servers > 1:
            top = base + 20 + 3 * servers - 1
        elif forward_proxy:
            top = max(top, base + 17)
        if base < 1 or top > 65535:
            raise InvalidValue(
                f"invalid base port {base}: the plan needs ports {base}..{top} (at most 65535)"
            )
        fixed = range(base, top + 1)
        client, agent, admin = base, base + 1, base + 2
        agent_admin = {c: base + 3 + i for i, c in enumerate(clusters)}
        echo = {c: base + 10 + i for i, c in enumerate(clusters)}
        # one more free port than the fixed plan has: at least one lies outside it
        signer = next(p for p in free_ports(len(fixed) + 1) if p not in fixed)
        replicas = (
            [
                ServerPorts(name, base + 20 + 3 * i, base + 21 + 3 * i, base + 22 + 3 * i)
                for i, name in enumerate(names)
            ]
            if servers > 1
            else []
        )
        tinyproxy = base + 17 if forward_proxy else None
    return Ports(
        client,
        agent,
        admin,
        agent_admin,
        echo,
        signer,
        tuple(replicas) or (ServerPorts(names[0], client, agent, admin),),
        tinyproxy,
    )


def echo_target(cluster: str, ports: Ports) -> Target:
    """The cluster's echo service: its in-cluster target, and its kube-apiserver stand-in."""
    return Target("echo", LOOPBACK, ports.echo[cluster])


# --- certificates ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Certificates:
    """Where each party's certificate, key and trust bundle live."""

    ca: Path  # the hub client's trust bundle (curl --proxy-cacert, the SDK, local.json)
    servers: dict[str, CertFiles]  # proxy-server process name -> its files (each renews its own)
    client: CertFiles
    agents: dict[str, CertFiles]  # cluster -> agent files

    @property
    def server(self) -> CertFiles:
        """The first proxy-server's files."""
        return next(iter(self.servers.values()))


def signer_certificates(
    pki_dir: Path, clusters: Sequence[str], servers: Sequence[str] = (SERVER_NAME,)
) -> Certificates:
    """The file layout with a signer: one folder per party (``tls.crt``, ``tls.key``, ``ca.crt``),
    each party its own trust bundle (a renewer must see its own bundle change to reload it); the hub
    client's files at the top, where curl and the SDK find them. Every proxy-server replica is a party
    of its own: replicas sharing files would race to bootstrap and renew them."""

    def party(name: str) -> CertFiles:
        folder = pki_dir / name
        return CertFiles(folder / "tls.crt", folder / "tls.key", folder / "ca.crt")

    client = CertFiles(pki_dir / f"{CLIENT_NAME}.crt", pki_dir / f"{CLIENT_NAME}.key", pki_dir / "ca.crt")
    return Certificates(
        ca=client.ca,
        servers={name: party(name) for name in servers},
        client=client,
        agents={cluster: party(f"{cluster}-agent") for cluster in clusters},
    )


@dataclass(frozen=True)
class Party:
    """A holder of a certificate from the signer: its files and the binding of a token for it
    (``token create`` flags)."""

    name: str
    files: CertFiles
    binding: tuple[str, ...]


def signer_parties(certs: Certificates, clusters: Sequence[str]) -> list[Party]:
    """The hub client, every proxy-server and every agent, each bound to the identity it asks for."""
    return [
        Party(CLIENT_PARTY, certs.client, ("--client", CLIENT_NAME)),
        *(
            # every replica asks for the server's name (CN=proxy-server), each with a key of its own
            Party(name, files, ("--server", SERVER_NAME, *repeat_flag("--host", SERVER_HOSTS)))
            for name, files in certs.servers.items()
        ),
        *(
            Party(cluster, certs.agents[cluster], ("--cluster", cluster, "--agent-id", agent_id(cluster)))
            for cluster in clusters
        ),
    ]


# --- command lines -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SignerPlan:
    """The cert-signer of local mode: its store, its URL, the lifetime of the leaves it issues, how
    often the parties fetch the trust bundle, and the bootstrap token of each party without a usable
    certificate."""

    store: Path
    url: str
    cert_ttl: str = "24h"
    trust_refresh: str = "30s"
    tokens: dict[str, str] = field(default_factory=dict)  # party name -> token

    def flags(self, party: str) -> SignerFlags:
        return SignerFlags(self.url, self.trust_refresh, self.tokens.get(party))


def signer_url(ports: Ports) -> str:
    return f"https://{loopback(ports.signer)}"


def local_signer_argv(store: Path, ports: Ports, cert_ttl: str) -> list[str]:
    return signer_serve_argv(
        store,
        listen=loopback(ports.signer),
        tls_hosts=SERVER_HOSTS,
        cert_ttl=cert_ttl,
        store_poll=SIGNER_STORE_POLL,
    )


def audit_log_path(logs: Path, ports: Ports, server: ServerPorts) -> Path:
    """Where ``server`` writes its audit records: ``logs/audit.jsonl``, or with replicas one file each
    (``logs/audit.proxy-server-1.jsonl``): two processes rotating one file would lose records."""
    return logs / (f"audit.{server.name}.jsonl" if ports.balanced else "audit.jsonl")


def local_server_argv(
    ports: Ports,
    certs: Certificates,
    clusters: Sequence[str],
    signer: SignerPlan | None = None,
    server: ServerPorts | None = None,
    audit_log: Path | None = None,
) -> list[str]:
    """The command line of ``server`` (default: the first proxy-server). A replica is told its id (its
    name) and the replica count, which the agents learn from it; ``audit_log``: its audit records' file
    (:func:`audit_log_path`)."""
    server = server or ports.servers[0]
    replica = ["--server-id", server.name, "--server-count", str(len(ports.servers))]
    audit = ["--audit-log", str(audit_log)] if audit_log is not None else []
    return server_argv(
        certs.servers[server.name],
        agent_listen=loopback(server.agent),
        client_listen=loopback(server.client),
        admin_listen=loopback(server.admin),
        signer=signer.flags(server.name) if signer is not None else None,
        tls_hosts=SERVER_HOSTS if signer is not None else (),
        known_clusters=clusters,
        drain_timeout=DRAIN_TIMEOUT,
        options=[*(replica if ports.balanced else ()), *audit],
    )


def forward_proxy_url(ports: Ports) -> str | None:
    """The URL of local mode's forward proxy (tinyproxy, plain HTTP), if one runs."""
    return None if ports.forward_proxy is None else f"http://{loopback(ports.forward_proxy)}"


def local_agent_argv(
    cluster: str,
    ports: Ports,
    certs: Certificates,
    signer: SignerPlan | None = None,
    proxy_url: str | None = None,
) -> list[str]:
    """The agent of ``cluster``: it dials the hub's agent port (haproxy's with replicas), through the
    forward proxy ``proxy_url`` if given (its calls to the cert-signer too)."""
    echo = loopback(ports.echo[cluster])
    return agent_argv(
        certs.agents[cluster],
        cluster=cluster,
        agent_id=agent_id(cluster),
        server=loopback(ports.agent),
        admin_listen=loopback(ports.agent_admin[cluster]),
        signer=signer.flags(cluster) if signer is not None else None,
        # Loopback is not in the default egress allow-list; allow this cluster's echo service.
        allow=[echo],
        # No real kube-apiserver here: the bare-cluster-name route leads to the echo service.
        kube_apiserver=echo,
        backoff_max=AGENT_BACKOFF_MAX,
        drain_timeout=DRAIN_TIMEOUT,
        options=["--proxy-url", proxy_url] if proxy_url is not None else (),
    )


def echo_argv(cluster: str, ports: Ports) -> list[str]:
    return [
        sys.executable,
        "-m",
        "clusterproxy_cli.echo",
        "--listen",
        loopback(ports.echo[cluster]),
        "--name",
        f"{cluster}-echo",
        "--cluster",
        cluster,
    ]
