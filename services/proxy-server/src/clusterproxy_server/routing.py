"""Which cluster and which target a hub client asked for (pure functions, no I/O).

A client names the cluster in one of three ways, tried in this order:

1. the header ``cluster-proxy-cluster: NAME`` (HTTP/2 SDK, ``curl --proxy-header``);
2. the proxy URL's user name, ``https://NAME@hub:8090``, which clients send as
   ``Proxy-Authorization: Basic base64("NAME:")`` (curl ``-x``, kubectl ``proxy-url``);
3. the upstream cluster-proxy convention: ``CONNECT NAME:PORT`` where NAME is a known cluster
   reaches that cluster's kube-apiserver (the agent maps its own cluster name to the apiserver).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from clusterproxy_protocol import (
    CLUSTER_HEADER,
    CLUSTER_NAME,
    MalformedAddress,
    MalformedTarget,
    cluster_from_proxy_authorization,
    parse_authority,
)


@dataclass(frozen=True)
class Route:
    cluster: str
    authority: str  # host:port as the agent should see it
    named_by: str  # "header", "proxy-user" or "bare-cluster-name"


def resolve(authority: str, headers: dict[str, str], known_clusters: set[str]) -> Route:
    """Decide the route of a CONNECT; raises MalformedTarget (400) when no cluster is named."""
    try:
        host, _ = parse_authority(authority)
    except MalformedAddress as exc:
        raise MalformedTarget(f"malformed target {authority!r}: {exc}") from None
    cluster = headers.get(CLUSTER_HEADER, "").strip()
    named_by = "header"
    if not cluster:
        cluster = cluster_from_proxy_authorization(headers.get("proxy-authorization")) or ""
        named_by = "proxy-user"
    if not cluster and host.lower() in known_clusters:
        return Route(host.lower(), authority, "bare-cluster-name")
    if not cluster:
        raise MalformedTarget(
            f"no cluster named for {authority!r}: send header '{CLUSTER_HEADER}: NAME', use the proxy URL "
            "https://NAME@HUB:PORT, or CONNECT NAME:PORT to reach the cluster's kube-apiserver"
        )
    if not CLUSTER_NAME.match(cluster):
        raise MalformedTarget(
            f"invalid cluster name {cluster!r}: expected a DNS-1123 name (lower case, digits, - and .)"
        )
    return Route(cluster, authority, named_by)


def may_name_unknown_cluster(authority: str, headers: dict[str, str]) -> bool:
    """Whether a request that named no cluster could be the upstream form (``CONNECT NAME:PORT``) for a
    cluster not known yet: no cluster header, no proxy user, and a host that is a cluster name."""
    if headers.get(CLUSTER_HEADER, "").strip() or headers.get("proxy-authorization"):
        return False
    try:
        host, _ = parse_authority(authority)
    except MalformedAddress:
        return False
    try:
        ipaddress.ip_address(host)
        return False
    except ValueError:
        return bool(CLUSTER_NAME.match(host.lower()))
