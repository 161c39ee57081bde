"""What the collector knows, without any I/O: the proxy-servers' views, the addons, the probe results,
and the JSON document ``/api/v1/clusters`` serves (built here, read back by ``cluster-proxy health``).

A cluster's three answers, each True, False or None (unknown: nothing could be asked):

- ``installed``: Kubernetes mode, its ManagedClusterAddOn exists; otherwise, a proxy-server that
  answered knows the cluster (``--known-clusters``, or an agent of it connected once);
- ``available``: Kubernetes mode, the addon's ``Available`` condition; otherwise, some replica that
  answered holds a tunnel of it now;
- ``probed``: the last probe through the tunnel succeeded.

A cluster is healthy when all three are True.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DOCUMENT_VERSION",
    "AddonStatus",
    "AddonsView",
    "AgentTunnel",
    "ClusterRecord",
    "ProbeResult",
    "ServerView",
    "State",
    "iso_time",
    "parse_agents",
    "parse_clusters",
]

DOCUMENT_VERSION = 1


def iso_time(seconds: float | None) -> str | None:
    """``2026-11-24T10:00:00.123Z`` (UTC, milliseconds), None for None."""
    if seconds is None:
        return None
    whole = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    return f"{whole}.{int((seconds % 1) * 1000):03d}Z"


@dataclass(frozen=True)
class AgentTunnel:
    """One agent tunnel as a proxy-server replica describes it (``/api/v1/agents``)."""

    cluster: str
    agent_id: str
    server_id: str
    open_streams: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    last_rtt: float | None = None
    connected_since: str | None = None
    draining: bool = False


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def parse_agents(answer: Any, server: str) -> list[AgentTunnel]:
    """``/api/v1/agents`` of one replica (a list of objects); entries without a cluster or agent id are
    skipped. ``server`` names the replica when its entries do not (``server_id``). ValueError when the
    answer is not a list."""
    if not isinstance(answer, list):
        raise ValueError("/api/v1/agents did not answer a JSON list")
    tunnels = []
    for entry in answer:
        if not isinstance(entry, dict):
            continue
        cluster, agent_id = entry.get("cluster"), entry.get("agent_id")
        if not isinstance(cluster, str) or not isinstance(agent_id, str) or not cluster or not agent_id:
            continue
        rtt = entry.get("last_rtt")
        tunnels.append(
            AgentTunnel(
                cluster=cluster,
                agent_id=agent_id,
                server_id=str(entry.get("server_id") or server),
                open_streams=_int(entry.get("open_streams")),
                bytes_in=_int(entry.get("bytes_in")),
                bytes_out=_int(entry.get("bytes_out")),
                last_rtt=float(rtt) if isinstance(rtt, int | float) and math.isfinite(rtt) else None,
                connected_since=str(entry["connected_since"]) if entry.get("connected_since") else None,
                draining=entry.get("draining") is True,
            )
        )
    return tunnels


def parse_clusters(answer: Any) -> dict[str, int]:
    """``/api/v1/clusters`` of one replica: every cluster it knows -> tunnels it holds. ValueError when
    the answer is not an object."""
    if not isinstance(answer, dict):
        raise ValueError("/api/v1/clusters did not answer a JSON object")
    return {
        str(name): _int(info.get("agents")) if isinstance(info, dict) else 0 for name, info in answer.items()
    }


@dataclass
class ServerView:
    """One proxy-server replica as the last round saw it: reachable with what it holds, or the error."""

    url: str
    checked_at: float
    error: str | None = None
    known: dict[str, int] = field(default_factory=dict)  # cluster -> tunnels
    tunnels: list[AgentTunnel] = field(default_factory=list)

    @property
    def reachable(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        ids = sorted({t.server_id for t in self.tunnels})
        return {
            "url": self.url,
            "reachable": self.reachable,
            "error": self.error,
            "checked_at": iso_time(self.checked_at),
            "server_ids": ids,
            "clusters": len(self.known),
            "tunnels": len(self.tunnels),
        }


@dataclass(frozen=True)
class AddonStatus:
    """A cluster's ManagedClusterAddOn: whether it exists and its ``Available`` condition."""

    available: bool | None
    reason: str = ""
    message: str = ""


@dataclass
class AddonsView:
    """The last read of the ManagedClusterAddOns (Kubernetes mode): cluster -> its addon, or the error."""

    checked_at: float
    addons: dict[str, AddonStatus] = field(default_factory=dict)
    clusters: set[str] = field(default_factory=set)  # ManagedClusters, with or without the addon
    error: str | None = None


@dataclass(frozen=True)
class ProbeResult:
    """One probe: when it started, its latency in seconds when it succeeded, else the error in words."""

    at: float
    latency: float | None
    error: str | None = None
    reason: str = ""  # a short machine word for metrics: refused_503, timeout, tls, http_500, ...

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class ClusterRecord:
    name: str
    last_seen: float
    history: deque[tuple[float, float | None]]
    installed: bool | None = None
    available: bool | None = None
    addon: AddonStatus | None = None
    tunnels: list[AgentTunnel] = field(default_factory=list)
    last_probe: ProbeResult | None = None
    last_error: ProbeResult | None = None
    last_success: float | None = None

    @property
    def probed(self) -> bool | None:
        return None if self.last_probe is None else self.last_probe.ok

    @property
    def healthy(self) -> bool:
        return self.installed is True and self.available is True and self.probed is True

    @property
    def state(self) -> str:
        """``healthy``; ``unhealthy`` when any answer is False; ``unknown`` when some are unknown."""
        if self.healthy:
            return "healthy"
        if False in (self.installed, self.available, self.probed):
            return "unhealthy"
        return "unknown"

    def record_probe(self, result: ProbeResult) -> None:
        self.last_probe = result
        self.history.append((result.at, result.latency))
        if result.ok:
            self.last_success = result.at
        else:
            self.last_error = result

    def agents(self) -> list[dict[str, Any]]:
        """One entry per agent id: the replicas it holds a tunnel to and their sums."""
        by_agent: dict[str, list[AgentTunnel]] = {}
        for tunnel in self.tunnels:
            by_agent.setdefault(tunnel.agent_id, []).append(tunnel)
        agents = []
        for agent_id, tunnels in sorted(by_agent.items()):
            rtts = [t.last_rtt for t in tunnels if t.last_rtt is not None]
            since = [t.connected_since for t in tunnels if t.connected_since]
            agents.append(
                {
                    "agent_id": agent_id,
                    "replicas": sorted({t.server_id for t in tunnels}),
                    "tunnels": len(tunnels),
                    "open_streams": sum(t.open_streams for t in tunnels),
                    "bytes_in": sum(t.bytes_in for t in tunnels),
                    "bytes_out": sum(t.bytes_out for t in tunnels),
                    "last_rtt_ms": round(min(rtts) * 1000, 3) if rtts else None,
                    "connected_since": min(since) if since else None,
                    "draining": all(t.draining for t in tunnels),
                }
            )
        return agents

    def to_json(self) -> dict[str, Any]:
        probe = self.last_probe
        error = self.last_error
        return {
            "name": self.name,
            "state": self.state,
            "healthy": self.healthy,
            "installed": self.installed,
            "available": self.available,
            "probed": self.probed,
            "latency_ms": _ms(probe.latency) if probe is not None else None,
            "last_probe_at": iso_time(probe.at) if probe is not None else None,
            "last_success_at": iso_time(self.last_success),
            "last_error": None
            if error is None
            else {"message": error.error, "reason": error.reason, "at": iso_time(error.at)},
            "addon": None
            if self.addon is None
            else {
                "available": self.addon.available,
                "reason": self.addon.reason,
                "message": self.addon.message,
            },
            "agents": self.agents(),
            "open_streams": sum(t.open_streams for t in self.tunnels),
            "bytes_in": sum(t.bytes_in for t in self.tunnels),
            "bytes_out": sum(t.bytes_out for t in self.tunnels),
            "history": [[round(at, 3), _ms(latency)] for at, latency in self.history],
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


class State:
    """Every cluster the collector knows of, the servers' and the addons' last views, and the
    collector's own problems. Clusters no source mentions any more are forgotten after
    ``forget_after`` seconds (until then their row says why they are unhealthy)."""

    def __init__(self, *, history: int = 60, forget_after: float = 3600.0, kubernetes: bool = False) -> None:
        self.history = history
        self.forget_after = forget_after
        self.kubernetes = kubernetes
        self.clusters: dict[str, ClusterRecord] = {}
        self.servers: list[ServerView] = []
        self.addons: AddonsView | None = None
        self.last_round_at: float | None = None
        self.last_round_seconds: float | None = None
        self.rounds = 0
        self.probing: str | None = None  # why probes are off, None when they run
        self.problems: list[str] = []  # the collector's own failures of the last round, in words

    def _record(self, name: str, now: float) -> ClusterRecord:
        record = self.clusters.get(name)
        if record is None:
            record = self.clusters[name] = ClusterRecord(name, now, deque(maxlen=self.history))
        record.last_seen = now
        return record

    def update_sources(
        self, servers: Sequence[ServerView], addons: AddonsView | None, now: float
    ) -> list[str]:
        """Merge one round's views; returns the clusters forgotten now."""
        self.servers = list(servers)
        self.addons = addons
        answered = [s for s in servers if s.reachable]
        tunnels: dict[str, list[AgentTunnel]] = {}
        known: set[str] = set()
        for server in answered:
            known.update(server.known)
            for tunnel in server.tunnels:
                tunnels.setdefault(tunnel.cluster, []).append(tunnel)
        mentioned = known | set(tunnels)
        if addons is not None and addons.error is None:
            mentioned |= set(addons.addons) | addons.clusters
        for name in mentioned:
            self._record(name, now)
        forgotten = [
            name
            for name, record in self.clusters.items()
            if name not in mentioned and now - record.last_seen > self.forget_after
        ]
        for name in forgotten:
            del self.clusters[name]
        for name, record in self.clusters.items():
            record.tunnels = tunnels.get(name, [])
            if self.kubernetes:
                if addons is None or addons.error is not None:
                    record.installed = record.available = None
                    record.addon = None
                else:
                    record.addon = addons.addons.get(name)
                    record.installed = record.addon is not None
                    record.available = record.addon.available if record.addon is not None else False
            elif not answered:
                record.installed = record.available = None
            else:
                record.installed = name in known or bool(record.tunnels)
                record.available = bool(record.tunnels)
        return forgotten

    def names(self) -> list[str]:
        return sorted(self.clusters)

    def document(self, *, interval: float, probe: Mapping[str, Any], now: float) -> dict[str, Any]:
        """The ``/api/v1/clusters`` answer."""
        clusters = [self.clusters[name].to_json() for name in self.names()]
        problems = list(self.problems)
        for server in self.servers:
            if not server.reachable:
                problems.append(f"proxy-server {server.url} did not answer: {server.error}")
        if self.addons is not None and self.addons.error is not None:
            problems.append(f"cannot read the ManagedClusterAddOns: {self.addons.error}")
        if self.probing is not None:
            problems.append(self.probing)
        return {
            "version": DOCUMENT_VERSION,
            "generated_at": iso_time(now),
            "mode": "kubernetes" if self.kubernetes else "proxy-servers",
            "interval_seconds": interval,
            "rounds": self.rounds,
            "last_round_at": iso_time(self.last_round_at),
            "last_round_seconds": None
            if self.last_round_seconds is None
            else round(self.last_round_seconds, 3),
            "probe": dict(probe),
            "proxy_servers": [s.to_json() for s in self.servers],
            "addons": None
            if self.addons is None
            else {"checked_at": iso_time(self.addons.checked_at), "error": self.addons.error},
            "problems": problems,
            "summary": summarize(clusters),
            "clusters": clusters,
        }


def summarize(clusters: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    counts = {"clusters": 0, "healthy": 0, "unhealthy": 0, "unknown": 0}
    for cluster in clusters:
        counts["clusters"] += 1
        state = cluster.get("state")
        counts[state if state in ("healthy", "unhealthy") else "unknown"] += 1
    return counts
