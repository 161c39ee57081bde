"""What ``cluster-proxy local up`` runs: the clusters, the port plan, where each party's certificate
lives, and every child's command line (built with :mod:`clusterproxy_cli.commands`)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from clusterproxy_protocol.certclient import CertFiles
from clusterproxy_protocol.wire import format_authority

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


def agent_id(cluster: str) -> str:
    return f"{cluster}-agent-1"


def loopback(port: int) -> str:
    return format_authority(LOOPBACK, port)


# --- ports -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ports:
    client: int
    agent: int
    admin: int
    agent_admin: dict[str, int]
    echo: dict[str, int]
    signer: int

    def all(self) -> list[int]:
        return [
            self.client,
            self.agent,
            self.admin,
            *self.agent_admin.values(),
            *self.echo.values(),
            self.signer,
        ]


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
    echo services base+10..), or free ephemeral ports when ``base`` is 0. The cert-signer always gets
    a free ephemeral port: only the services get its URL, from their command line."""
    n = len(clusters)
    if n > 7:
        raise ValueError("at most 7 clusters fit the fixed port plan")
    if base == 0:
        *ports, signer = free_ports(4 + 2 * n)
        return Ports(
            ports[0],
            ports[1],
            ports[2],
            dict(zip(clusters, ports[3 : 3 + n], strict=True)),
            dict(zip(clusters, ports[3 + n :], strict=True)),
            signer,
        )
    top = base + 10 + n - 1
    if base < 1 or top > 65535:
        raise ValueError(f"invalid base port {base}: the plan needs ports {base}..{top} (at most 65535)")
    fixed = range(base, top + 1)
    # one more free port than the fixed plan has: at least one lies outside it
    signer = next(p for p in free_ports(len(fixed) + 1) if p not in fixed)
    return Ports(
        base,
        base + 1,
        base + 2,
        {c: base + 3 + i for i, c in enumerate(clusters)},
        {c: base + 10 + i for i, c in enumerate(clusters)},
        signer,
    )


def echo_target(cluster: str, ports: Ports) -> Target:
    """The cluster's echo service: its in-cluster target, and its kube-apiserver stand-in."""
    return Target("echo", LOOPBACK, ports.echo[cluster])


# --- certificates ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Certificates:
    """Where each party's certificate, key and trust bundle live."""

    ca: Path  # the hub client's trust bundle (curl --proxy-cacert, the SDK, local.json)
    server: CertFiles
    client: CertFiles
    agents: dict[str, CertFiles]  # cluster -> agent files


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


@dataclass(frozen=True)
class Party:
    """A holder of a certificate from the signer: its files and the binding of a token for it
    (``token create`` flags)."""

    name: str
    files: CertFiles
    binding: tuple[str, ...]


def signer_parties(certs: Certificates, clusters: Sequence[str]) -> list[Party]:
    """The hub client, the proxy-server and every agent, each bound to the identity it asks for."""
    return [
        Party(CLIENT_PARTY, certs.client, ("--client", CLIENT_NAME)),
        Party(SERVER_NAME, certs.server, ("--server", SERVER_NAME, *repeat_flag("--host", SERVER_HOSTS))),
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


def local_server_argv(
    ports: Ports, certs: Certificates, clusters: Sequence[str], signer: SignerPlan | None = None
) -> list[str]:
    return server_argv(
        certs.server,
        agent_listen=loopback(ports.agent),
        client_listen=loopback(ports.client),
        admin_listen=loopback(ports.admin),
        signer=signer.flags(SERVER_NAME) if signer is not None else None,
        tls_hosts=SERVER_HOSTS if signer is not None else (),
        known_clusters=clusters,
        drain_timeout=DRAIN_TIMEOUT,
    )


def local_agent_argv(
    cluster: str, ports: Ports, certs: Certificates, signer: SignerPlan | None = None
) -> list[str]:
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
