"""Live agent tunnels by cluster, and the choice of a tunnel for a new stream (ejected tunnels last)."""

from __future__ import annotations

import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import trio

from clusterproxy_protocol import Mux, NoAgentConnected, UnknownCluster
from clusterproxy_server.ejection import Ejection, EjectionPolicy, OutlierEjection, TunnelHealth


@dataclass(eq=False)
class AgentTunnel:
    cluster: str
    agent_id: str
    mux: Mux
    peer: str
    connected_since: float = field(default_factory=time.time)
    health: TunnelHealth = field(default_factory=TunnelHealth)

    @property
    def usable(self) -> bool:
        return self.mux.accepts_streams and not self.mux.peer_draining

    def describe(self) -> dict[str, object]:
        return {
            "cluster": self.cluster,
            "agent_id": self.agent_id,
            "peer": self.peer,
            "connected_since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.connected_since)),
            "open_streams": self.mux.open_streams,
            "bytes_in": self.mux.bytes_in,
            "bytes_out": self.mux.bytes_out,
            "last_rtt": self.mux.last_rtt,
            "draining": self.mux.peer_draining,
            "ejections": self.health.ejections,
        }


class Registry:
    def __init__(
        self, known_clusters: set[str] | None = None, ejection: OutlierEjection | None = None
    ) -> None:
        self.known_clusters: set[str] = set(known_clusters or ())
        self._tunnels: dict[str, list[AgentTunnel]] = {}
        self.ejection = ejection or OutlierEjection(EjectionPolicy())
        self._added = trio.Event()
        self._empty = trio.Event()
        self._empty.set()
        # When the last usable tunnel of a cluster was a draining agent's: its successor is on its way
        # (a drained node, an evicted or deleted pod: the agent drains as its replacement starts).
        self._drained_at: dict[str, float] = {}

    def add(self, tunnel: AgentTunnel) -> None:
        self._drained_at.pop(tunnel.cluster, None)
        self.known_clusters.add(tunnel.cluster)
        self._tunnels.setdefault(tunnel.cluster, []).append(tunnel)
        self._added.set()
        self._added = trio.Event()
        if self._empty.is_set():
            self._empty = trio.Event()

    async def wait_added(self) -> None:
        """Until the next tunnel registers."""
        await self._added.wait()

    def remove(self, tunnel: AgentTunnel) -> None:
        tunnels = self._tunnels.get(tunnel.cluster, [])
        if tunnel in tunnels:
            tunnels.remove(tunnel)
        if tunnel.mux.peer_draining and not any(t.usable for t in tunnels):
            self._drained_at.setdefault(tunnel.cluster, trio.current_time())
        if not tunnels:
            self._tunnels.pop(tunnel.cluster, None)
        if not self._tunnels:
            self._empty.set()

    def replacement_since(self, cluster: str) -> float | None:
        """Since when (trio clock) every agent of ``cluster`` has been draining or gone after a drain,
        with none usable: its successor is starting. None when it has a usable tunnel, or when its
        agents went without draining (a crash, a network cut: nothing says one is coming)."""
        tunnels = self._tunnels.get(cluster, [])
        if any(t.usable for t in tunnels):
            return None
        if tunnels and all(t.mux.peer_draining for t in tunnels):
            return self._drained_at.setdefault(cluster, trio.current_time())
        return self._drained_at.get(cluster)

    async def wait_empty(self) -> None:
        """Until no tunnel is registered."""
        await self._empty.wait()

    def find(self, cluster: str, agent_id: str) -> AgentTunnel | None:
        """The live tunnel of that agent identity, if one is registered."""
        for tunnel in self._tunnels.get(cluster, ()):
            if tunnel.agent_id == agent_id:
                return tunnel
        return None

    def tunnels(self, cluster: str | None = None) -> list[AgentTunnel]:
        if cluster is not None:
            return list(self._tunnels.get(cluster, ()))
        return [t for group in self._tunnels.values() for t in group]

    def describe(self) -> list[dict[str, object]]:
        """Every live tunnel for the admin API, with whether it is out of routing now."""
        return [{**t.describe(), "ejected": self.ejection.is_ejected(t.health)} for t in self.tunnels()]

    def pick(
        self,
        cluster: str,
        exclude: AbstractSet[AgentTunnel] = frozenset(),
        *,
        fall_back_to_ejected: bool = True,
    ) -> AgentTunnel:
        """The usable tunnel of ``cluster`` with the fewest open streams, among those not ejected when
        there are any: an ejected tunnel still serves rather than leave the cluster unreachable (unless
        ``fall_back_to_ejected`` is false: then NoAgentConnected)."""
        if cluster not in self.known_clusters:
            raise UnknownCluster(f"unknown cluster {cluster!r}")
        candidates = [t for t in self._tunnels.get(cluster, ()) if t.usable and t not in exclude]
        if not candidates:
            if self._tunnels.get(cluster):
                raise NoAgentConnected(
                    f"every agent of cluster {cluster!r} is draining or at its stream limit"
                )
            raise NoAgentConnected(f"no agent of cluster {cluster!r} is connected to this server")
        in_routing = [t for t in candidates if not self.ejection.is_ejected(t.health)]
        if not in_routing and not fall_back_to_ejected:
            raise NoAgentConnected(f"every other agent of cluster {cluster!r} is ejected")
        return min(in_routing or candidates, key=lambda t: t.mux.open_streams)

    def record_dial(self, tunnel: AgentTunnel, failed: bool) -> Ejection | None:
        """One agent-level dial outcome of ``tunnel``; an :class:`Ejection` when it leaves routing now."""
        others = [t.health for t in self._tunnels.get(tunnel.cluster, ()) if t is not tunnel and t.usable]
        return self.ejection.record(tunnel.health, failed, others)
