"""Which clusters have an agent holding a tunnel now, from the proxy-servers' admin API.

Every ``--availability-poll`` the manager asks each proxy-server replica ``GET /api/v1/clusters``
(``{"cluster1": {"agents": 2}, ...}``) and sums the answers. The replicas are either the
``--admin-url`` list, or every address of the headless Service ``cluster-proxy-admin`` (one per
replica, from DNS). A cluster is

- ``True``: some replica holds at least one tunnel of it;
- ``False``: every replica answered and none holds one;
- ``Unknown``: no replica answered (or there is none), or the manager holds no certificate to ask
  with, so nothing can be said.

The inventory lists clusters and agents, so the admin port serves it over mutual TLS only, to a hub
client certificate (docs/architecture.md, "The admin port"): the manager presents its own
(:mod:`.hubclient`) and checks the replica's, the client port's certificate, against the name the
manager gave it (:func:`.render.admin_server_name`; a headless Service answers pod IPs, which no
certificate names), or the URL's host for an ``--admin-url``.

Why the admin API and not a lease the agent renews: the tunnel *is* what users need; a lease says the
agent runs, not that it reaches the hub. A killed agent's tunnel ends when its TCP connection does
(at once for a process that dies; within the server's --keepalive-interval plus --keepalive-timeout,
30 + 20 s, for a peer that vanishes), so False shows within that plus one poll period.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from clusterproxy_protocol import describe_exception, format_authority

__all__ = [
    "AdminTLS",
    "AdminTarget",
    "Availability",
    "ClusterAvailability",
    "admin_urls_from_dns",
    "poll_once",
]

MAX_ANSWER = 16 << 20  # /api/v1/clusters of 10,000 clusters is well under 1 MiB


@dataclass(frozen=True)
class ClusterAvailability:
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


@dataclass(frozen=True)
class AdminTarget:
    """The proxy-servers the manager polls: their namespace (the headless Service's, and the store and
    cert-signer the manager's own certificate comes from), their admin port, the name their certificate
    carries, and that namespace's cert-signer."""

    namespace: str
    port: int
    server_name: str
    signer_url: str


@dataclass(frozen=True)
class AdminTLS:
    """The manager's side of the admin ports' mutual TLS: its hub client certificate and the trust
    bundle (``context``), and the name the replicas' certificate must carry (None: the URL's host)."""

    context: ssl.SSLContext
    server_name: str | None = None


@dataclass(frozen=True)
class Availability:
    """One poll: tunnels per cluster over the replicas that answered. ``uncertified``: why the poll
    asked nobody (no client certificate to ask with yet)."""

    agents: dict[str, int]
    answered: int
    asked: int
    errors: tuple[str, ...] = ()
    uncertified: str | None = None

    def of(self, cluster: str) -> ClusterAvailability:
        if self.asked == 0:
            return ClusterAvailability(
                "Unknown", "NoProxyServer", "no proxy-server replica to ask (none found)"
            )
        if self.uncertified is not None:
            return ClusterAvailability(
                "Unknown",
                "NoClientCertificate",
                "the proxy-servers list their clusters to a hub client certificate only (mutual TLS) and "
                f"the addon-manager holds none yet: {self.uncertified}",
            )
        if self.answered == 0:
            detail = "; ".join(self.errors[:3])
            return ClusterAvailability(
                "Unknown",
                "ProxyServerUnreachable",
                f"none of the {self.asked} proxy-server replica(s) answered on its admin port: {detail}",
            )
        tunnels = self.agents.get(cluster, 0)
        if tunnels > 0:
            return ClusterAvailability(
                "True",
                "ProxyAgentConnected",
                f"{tunnels} agent tunnel(s) to {self.answered} proxy-server replica(s)",
            )
        partial = f" ({self.asked - self.answered} did not answer)" if self.answered < self.asked else ""
        return ClusterAvailability(
            "False",
            "ProxyAgentNotConnected",
            f"no agent of cluster {cluster} holds a tunnel to the {self.answered} proxy-server replica(s) "
            f"that answered{partial}",
        )


def admin_urls_from_dns(host: str, port: int) -> list[str]:
    """One admin URL per address of ``host`` (a headless Service: one address per replica)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    addresses = sorted({str(info[4][0]) for info in infos})
    return [f"https://{format_authority(address, port)}" for address in addresses]


class _AdminConnection(http.client.HTTPConnection):
    """HTTPS to an admin port that checks the replica's certificate for ``tls.server_name`` rather
    than for the host dialed (``http.client.HTTPSConnection`` checks the host: a pod IP here)."""

    def __init__(self, host: str, port: int, tls: AdminTLS, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.tls = tls

    def connect(self) -> None:
        super().connect()
        self.sock = self.tls.context.wrap_socket(self.sock, server_hostname=self.tls.server_name or self.host)


def _fetch(url: str, timeout: float, tls: AdminTLS) -> dict[str, int]:
    parts = urlsplit(url)
    connection = _AdminConnection(parts.hostname or "", parts.port or 443, tls, timeout)
    try:
        connection.request("GET", "/api/v1/clusters", headers={"accept": "application/json"})
        response = connection.getresponse()
        body = response.read(MAX_ANSWER + 1)
    finally:
        connection.close()
    if response.status != 200:
        reason = body[:300].decode(errors="replace").strip().splitlines()[:1]
        raise ValueError(f"HTTP {response.status}{': ' + reason[0] if reason else ''}")
    if len(body) > MAX_ANSWER:
        raise ValueError(f"the answer is larger than {MAX_ANSWER >> 20} MiB")
    answer = json.loads(body)
    if not isinstance(answer, dict):
        raise ValueError("the answer is not a JSON object")
    counts = {}
    for cluster, info in answer.items():
        agents = info.get("agents") if isinstance(info, dict) else None
        counts[str(cluster)] = agents if isinstance(agents, int) else 0
    return counts


def poll_once(
    urls: Sequence[str],
    tls: AdminTLS | str,
    *,
    timeout: float = 3.0,
    fetch: Callable[[str, float, AdminTLS], dict[str, int]] = _fetch,
) -> Availability:
    """Ask every URL (blocking; run in a thread) and sum what they say. ``tls`` a string: why the
    manager holds no client certificate (nobody is asked: a plain request would be refused)."""
    if isinstance(tls, str):
        return Availability({}, 0, len(urls), uncertified=tls)
    agents: dict[str, int] = {}
    answered = 0
    errors = []
    for url in urls:
        try:
            counts = fetch(url, timeout, tls)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            errors.append(f"{url}: {describe_exception(exc)}")
            continue
        answered += 1
        for cluster, count in counts.items():
            agents[cluster] = agents.get(cluster, 0) + count
    return Availability(agents, answered, len(urls), tuple(errors))
