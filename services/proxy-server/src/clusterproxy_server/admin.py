"""The proxy-server's admin port: health, readiness and metrics for probes and Prometheus (plain
HTTP), and what it holds (clusters, agents) for authenticated hub clients only.

Plain HTTP (anyone who reaches the port: the kubelet, Prometheus, every pod of the hub):
``/healthz``, ``/readyz``, and ``/metrics`` with the labels that name clusters and agents summed away
(:data:`~clusterproxy_protocol.admin.INVENTORY_LABELS`). Over mutual TLS on the same port, to a
hub client certificate (:class:`~clusterproxy_protocol.admin.Authenticated`): ``/api/v1/agents``,
``/api/v1/clusters`` and ``/metrics`` with every label, each showing only the clusters the client
policy lets that client reach (a client may see what it may use, no more; without a policy, every
client reaches every cluster and sees every one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from cryptography import x509
from prometheus_client import CollectorRegistry

from clusterproxy_protocol import INVENTORY_LABELS, AdminRoute, Response, metrics_response
from clusterproxy_server.authz import ClientIdentity, PolicyFile
from clusterproxy_server.metrics import ServerMetrics
from clusterproxy_server.registry import Registry

#: what a client may see of the inventory: cluster name -> whether it is shown to this certificate;
#: None is a worker's parent on the pod's private admin channel (it sees all and filters itself)
Visibility = Callable[[x509.Certificate | None], Callable[[str], bool]]
#: an authenticated route here: None for the certificate is a worker's parent (above), which sees all
PrivateRoute = Callable[[x509.Certificate | None], Response]


def visibility(policy: PolicyFile | None) -> Visibility:
    """The clusters the client policy lets a certificate reach (every cluster without a policy)."""

    def of(cert: x509.Certificate | None) -> Callable[[str], bool]:
        if policy is None or cert is None:
            return lambda _cluster: True
        client = ClientIdentity.from_cert(cert)
        return lambda cluster: policy.decide(client, cluster).allowed

    return of


def metrics_routes(
    families: CollectorRegistry, visible: Visibility
) -> tuple[Callable[[], Response], PrivateRoute]:
    """``/metrics`` plain (inventory labels summed away) and authenticated (every label, the samples
    of the clusters this client may not see left out)."""

    def plain() -> Response:
        return metrics_response(families, without=INVENTORY_LABELS)

    def authenticated(cert: x509.Certificate | None) -> Response:
        shown = visible(cert)
        return metrics_response(
            families,
            keep=lambda labels: "cluster" not in labels or shown(labels["cluster"]),
        )

    return plain, authenticated


def admin_routes(
    registry: Registry,
    metrics: ServerMetrics,
    not_ready: Callable[[], str | None],
    server_id: str,
    visible: Visibility,
) -> tuple[Mapping[str, AdminRoute], Mapping[str, PrivateRoute]]:
    """The plain routes and the authenticated ones. ``not_ready()``: why this replica takes no new
    connections (starting, draining), None when it does. Every agent entry names this replica
    (``server_id``): behind a load balancer, the answer says which replica the agents listed are
    connected to."""

    def ready() -> Response:
        reason = not_ready()
        return Response.text("ready") if reason is None else Response.text(f"not ready: {reason}", 503)

    def agents(cert: x509.Certificate | None) -> Response:
        shown = visible(cert)
        return Response.json(
            [{**a, "server_id": server_id} for a in registry.describe() if shown(str(a["cluster"]))]
        )

    def clusters(cert: x509.Certificate | None) -> Response:
        shown = visible(cert)
        return Response.json(
            {
                name: {"agents": len(registry.tunnels(name))}
                for name in sorted(registry.known_clusters)
                if shown(name)
            }
        )

    plain_metrics, full_metrics = metrics_routes(metrics.registry, visible)
    return (
        {"/healthz": lambda: Response.text("ok"), "/readyz": ready, "/metrics": plain_metrics},
        {"/api/v1/agents": agents, "/api/v1/clusters": clusters, "/metrics": full_metrics},
    )
