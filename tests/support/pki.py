"""Certificates for tests: one CA for the system, a second CA for "wrong CA" clients."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from clusterproxy_protocol.pki import DevCA, PemPair
from clusterproxy_sdk import TLSFiles


@dataclass(frozen=True)
class PkiFiles:
    ca: Path
    server: PemPair
    client: PemPair
    agents: dict[str, PemPair]  # "cluster1/agent-a" -> agent certificate
    foreign_client: PemPair  # valid client certificate from another CA

    def agent(self, cluster: str, agent_id: str) -> PemPair:
        return self.agents[f"{cluster}/{agent_id}"]

    def sdk_files(self, pair: PemPair | None = None) -> TLSFiles:
        """What the SDK needs to reach the client port as ``pair`` (the hub client unless given)."""
        pair = pair or self.client
        return TLSFiles(self.ca, pair.cert, pair.key)


def make_pki(directory: Path) -> PkiFiles:
    ca = DevCA.create_or_load(directory / "ca")
    other = DevCA.create_or_load(directory / "other-ca", name="some-other-ca")
    leaves = directory / "leaves"
    agents = {
        f"{cluster}/{agent_id}": ca.issue_agent(cluster, agent_id, leaves)
        for cluster, agent_id in [
            ("cluster1", "agent-a"),
            ("cluster1", "agent-b"),
            ("cluster2", "agent-a"),
            ("cluster3", "agent-a"),
        ]
    }
    return PkiFiles(
        ca=ca.ca_path,
        server=ca.issue_server("proxy-server", ["localhost", "127.0.0.1", "::1"], leaves),
        client=ca.issue_client("test-admin", leaves),
        agents=agents,
        foreign_client=other.issue_client("intruder", directory / "other-leaves"),
    )
