"""Who may reach an agent's control endpoint (the reserved target of clusterproxy_protocol.agent_control).

The control endpoint hands out ServiceAccount tokens of the managed cluster, so it is not for every
hub client: only client certificates whose common name is in the allow-list (``--control-client``,
default ``cluster-gateway``, the name the gateway's certificate is issued for) get through. A client
certificate carries the client role (the client port accepts no other), and the cert-signer issues a
name only against a token an admin minted for it (``token create --client NAME``), so the name is the
identity. Anyone else asking for the reserved target gets 403 naming the allow-list. An allowed stream
reaches the agent marked with the client's name (:data:`CONTROL_CLIENT_HEADER`): the agent answers the
reserved target only on a stream so marked.
"""

from __future__ import annotations

from dataclasses import dataclass

from clusterproxy_protocol import (
    CONTROL_CLIENT_HEADER,
    CONTROL_HOST,
    Forbidden,
    MalformedAddress,
    parse_authority,
)
from clusterproxy_server.authz import ClientIdentity

__all__ = ["DEFAULT_CONTROL_CLIENTS", "ControlAccess"]

DEFAULT_CONTROL_CLIENTS = ("cluster-gateway",)


def is_control_target(authority: str) -> bool:
    try:
        host, _ = parse_authority(authority)
    except MalformedAddress:
        return False
    return host.rstrip(".").lower() == CONTROL_HOST


@dataclass(frozen=True)
class ControlAccess:
    clients: tuple[str, ...] = DEFAULT_CONTROL_CLIENTS  # common names; empty: nobody

    def headers_for(self, client: ClientIdentity, authority: str, cluster: str) -> list[tuple[str, str]]:
        """The headers of the stream to the agent: none for an ordinary target, the control mark for
        an allowed client; Forbidden (403) for anyone else asking for the control target."""
        if not is_control_target(authority):
            return []
        name = str(client.peer.get("common_name") or "")
        if name and name in self.clients:
            return [(CONTROL_CLIENT_HEADER, name)]
        allowed = ", ".join(self.clients) or "none"
        raise Forbidden(
            f"client {client.describe()!r} may not reach the control endpoint of cluster {cluster!r}: only "
            f"the hub clients named by the proxy-server's --control-client may ({allowed})"
        )
