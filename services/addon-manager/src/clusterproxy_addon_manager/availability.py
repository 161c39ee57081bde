"""Which clusters have an agent holding a tunnel now, from the proxy-servers' admin API.

Every ``--availability-poll`` the manager asks each proxy-server replica ``GET /api/v1/clusters``
(``{"cluster1": {"agents": 2}, ...}``) and sums the answers. The replicas are either the
``--admin-url`` list, or every address of the headless Service ``cluster-proxy-admin`` (one per
replica, from DNS). A cluster is

- ``True``: some replica holds at least one tunnel of it;
- ``False``: every replica answered and none holds one;
- ``Unknown``: no replica answered (or there is none), so nothing can be said.

Why the admin API and not a lease the agent renews: the tunnel *is* what users need; a lease says the
agent runs, not that it reaches the hub. A killed agent's tunnel ends when its TCP connection does
(at once for a process that dies; within the server's --keepalive-timeout, 20 s, for a peer that
vanishes), so False shows within that plus one poll period.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Availability", "ClusterAvailability", "admin_urls_from_dns", "poll_once"]


@dataclass(frozen=True)
class ClusterAvailability:
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


@dataclass(frozen=True)
class Availability:
    """One poll: tunnels per cluster over the replicas that answered."""

    agents: dict[str, int]
    answered: int
    asked: int
    errors: tuple[str, ...] = ()

    def of(self, cluster: str) -> ClusterAvailability:
        if self.asked == 0:
            return ClusterAvailability(
                "Unknown", "NoProxyServer", "no proxy-server replica to ask (none found)"
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
    return [f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}" for a in addresses]


def _fetch(url: str, timeout: float) -> dict[str, int]:
    with urllib.request.urlopen(url.rstrip("/") + "/api/v1/clusters", timeout=timeout) as response:
        answer = json.loads(response.read())
    if not isinstance(answer, dict):
        raise ValueError("the answer is not a JSON object")
    counts = {}
    for cluster, info in answer.items():
        agents = info.get("agents") if isinstance(info, dict) else None
        counts[str(cluster)] = agents if isinstance(agents, int) else 0
    return counts


def poll_once(
    urls: Sequence[str], *, timeout: float = 3.0, fetch: Callable[[str, float], dict[str, int]] = _fetch
) -> Availability:
    """Ask every URL (blocking; run in a thread) and sum what they say."""
    agents: dict[str, int] = {}
    answered = 0
    errors = []
    for url in urls:
        try:
            counts = fetch(url, timeout)
        except (OSError, ValueError, urllib.error.URLError) as exc:
            errors.append(f"{url}: {getattr(exc, 'reason', None) or exc}")
            continue
        answered += 1
        for cluster, count in counts.items():
            agents[cluster] = agents.get(cluster, 0) + count
    return Availability(agents, answered, len(urls), tuple(errors))
