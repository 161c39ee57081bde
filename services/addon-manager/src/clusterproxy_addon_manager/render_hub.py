"""The hub side the manager renders, pure functions of its inputs (no I/O: unit-tested as is).

Hub (namespace ``spec.proxyServer.namespace``), each owned by the ManagedProxyConfiguration:

- ServiceAccounts ``cluster-proxy`` (proxy-server; no API access, no token mounted) and
  ``cluster-proxy-cert-signer`` with the Role/RoleBinding its Secrets store needs;
- Secret ``cluster-proxy-server-bootstrap``: the CA bundle and a bootstrap token for the servers;
- one Secret per hub client of ``--hub-client NAME=SECRET`` (the health-collector's, the gateway's):
  the CA bundle and a bootstrap token for a client certificate with CN ``NAME``;
- Deployment ``cluster-proxy`` (``cluster-proxy-server``), Services ``<inClusterServiceName>`` (client
  port, ClusterIP), ``<entrypoint service>`` (agent port; LoadBalancer or ClusterIP) and
  ``cluster-proxy-admin`` (headless: every replica's admin port, polled for agent tunnels);
- Deployment ``cluster-proxy-cert-signer`` (``cluster-proxy-cert-signer serve --store kubernetes:...``),
  Service ``cluster-proxy-cert-signer`` and, for a LoadBalancerService entrypoint, the agents' way
  to it ``cluster-proxy-cert-signer-entrypoint``;
- NetworkPolicies ``cluster-proxy`` and ``cluster-proxy-cert-signer``: each pod accepts its own ports
  only (:func:`.render_workloads.network_policy`);
- PodDisruptionBudget ``cluster-proxy``: the proxy-servers are evicted one at a time, and their
  replicas are spread over nodes (:func:`.render_workloads.spread_over_nodes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clusterproxy_castore.kubestore import RBAC_VERBS as SIGNER_STORE_VERBS

from .config import Endpoints, ProxyConfig
from .render import (
    ADMIN_SERVICE,
    CA_KEY,
    CREDENTIALS_DIR,
    SERVER_BOOTSTRAP_SECRET,
    SERVER_DEPLOYMENT,
    SERVER_SERVICE_ACCOUNT,
    SIGNER_DEPLOYMENT,
    SIGNER_ENTRYPOINT_SERVICE,
    SIGNER_SERVICE,
    SIGNER_SERVICE_ACCOUNT,
    TOKEN_KEY,
    HubClient,
    b64,
    labels,
    owner_references,
    server_tls_hosts,
    signer_tls_hosts,
    signer_url_in_hub,
)
from .render_workloads import (
    IN_CLUSTER,
    credential_volumes,
    deployment,
    health_probes,
    network_policy,
    placement,
    pod_disruption_budget,
    pod_security,
    restricted_container,
    seed_ca_container,
    service,
    spread_over_nodes,
    token_env,
)

__all__ = ["HubInputs", "hub_client_secret", "hub_objects"]


def hub_client_secret(
    cfg: ProxyConfig,
    client: HubClient,
    *,
    ca_bundle_pem: str,
    token: str,
    mpc_api_version: str = "proxy.open-cluster-management.io/v1alpha1",
) -> dict[str, Any]:
    """The Secret a hub client reads at start (keys ``bootstrap-token``, ``ca.crt``), owned by the
    ManagedProxyConfiguration like the proxy-servers' own."""
    namespace, name = client.where(cfg.namespace)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels(client.name),
            "ownerReferences": owner_references(
                mpc_api_version, "ManagedProxyConfiguration", cfg.name, cfg.uid
            ),
        },
        "type": "Opaque",
        "data": {CA_KEY: b64(ca_bundle_pem), TOKEN_KEY: b64(token)},
    }


@dataclass(frozen=True)
class HubInputs:
    cfg: ProxyConfig
    endpoints: Endpoints | None  # None while a LoadBalancer address is pending
    ca_bundle_pem: str
    server_token: str
    store_prefix: str
    signer_image: str
    mpc_api_version: str = "proxy.open-cluster-management.io/v1alpha1"


def hub_objects(inputs: HubInputs) -> list[dict[str, Any]]:
    """Every hub object, in apply order (identities and Secrets before the Deployments using them)."""
    cfg = inputs.cfg
    ns = cfg.namespace
    owner = owner_references(inputs.mpc_api_version, "ManagedProxyConfiguration", cfg.name, cfg.uid)

    def meta(name: str, component: str, **extra: Any) -> dict[str, Any]:
        return {"name": name, "namespace": ns, "labels": labels(component), "ownerReferences": owner, **extra}

    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": meta(SERVER_SERVICE_ACCOUNT, "proxy-server"),
            "automountServiceAccountToken": False,
        },
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": meta(SIGNER_SERVICE_ACCOUNT, "cert-signer"),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta(SIGNER_SERVICE_ACCOUNT, "cert-signer"),
            # The Secrets store (CA, tokens, issued records) in this namespace: exactly the verbs
            # the store uses, nothing else.
            "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": list(SIGNER_STORE_VERBS)}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta(SIGNER_SERVICE_ACCOUNT, "cert-signer"),
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": SIGNER_SERVICE_ACCOUNT,
            },
            "subjects": [{"kind": "ServiceAccount", "name": SIGNER_SERVICE_ACCOUNT, "namespace": ns}],
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": meta(SERVER_BOOTSTRAP_SECRET, "proxy-server"),
            "type": "Opaque",
            "data": {CA_KEY: b64(inputs.ca_bundle_pem), TOKEN_KEY: b64(inputs.server_token)},
        },
        # each policy before its pods: a pod never runs open
        _signer_network_policy(meta),
        _server_network_policy(meta),
        _signer_deployment(inputs, meta),
        service(
            meta(SIGNER_SERVICE, "cert-signer"),
            "ClusterIP",
            "cert-signer",
            [("https", cfg.signer_port, "https")],
        ),
        _server_deployment(inputs, meta),
        pod_disruption_budget(meta(SERVER_DEPLOYMENT, "proxy-server"), "proxy-server"),
        service(
            meta(cfg.in_cluster_service_name, "proxy-server"),
            "ClusterIP",
            "proxy-server",
            [("client", cfg.client_port, "client")],
        ),
        service(
            meta(
                cfg.entrypoint.service_name,
                "proxy-server",
                **({"annotations": dict(cfg.entrypoint.annotations)} if cfg.entrypoint.annotations else {}),
            ),
            "LoadBalancer" if cfg.entrypoint.type == "LoadBalancerService" else "ClusterIP",
            "proxy-server",
            [("agent", cfg.entrypoint.port, "agent")],
        ),
        service(
            meta(ADMIN_SERVICE, "proxy-server"),
            "ClusterIP",
            "proxy-server",
            [("admin", cfg.admin_port, "admin")],
            headless=True,
        ),
    ]
    if cfg.entrypoint.type == "LoadBalancerService":
        objects.append(
            service(
                meta(SIGNER_ENTRYPOINT_SERVICE, "cert-signer"),
                "LoadBalancer",
                "cert-signer",
                [("https", cfg.signer_port, "https")],
            )
        )
    return objects


def _server_network_policy(meta: Any) -> dict[str, Any]:
    return network_policy(
        meta(SERVER_DEPLOYMENT, "proxy-server"),
        "proxy-server",
        [
            # agents dial in from their own clusters, behind NATs and forward proxies
            ("agent", None),
            # hub clients: the gateway, the health-collector, users' pods; each one authenticated by
            # its client certificate (mutual TLS)
            ("client", IN_CLUSTER),
            # Prometheus (plain /metrics: totals only) and the inventory's readers (mutual TLS: the
            # health-collector, the manager's availability poll)
            ("admin", IN_CLUSTER),
        ],
    )


def _signer_network_policy(meta: Any) -> dict[str, Any]:
    # agents bootstrap and renew from their own clusters, users enrol from their machines; the hub's
    # parties too. Every request is authenticated (a bootstrap token or the current certificate).
    return network_policy(meta(SIGNER_DEPLOYMENT, "cert-signer"), "cert-signer", [("https", None)])


# On SIGTERM the server fails /readyz at once and keeps serving this long, while the Service's endpoints
# drop the pod (readiness period 5 s); then it drains for its --drain-timeout (default 30 s).
SERVER_SHUTDOWN_DELAY = 5
SERVER_DRAIN = 30

# The cert-signer's container: one Python process (cryptography, the Kubernetes client) that signs a
# certificate per request; not in the MPC (nothing in it grows with the fleet but its request rate).
SIGNER_RESOURCES: dict[str, Any] = {
    "requests": {"cpu": "50m", "memory": "96Mi"},
    "limits": {"cpu": "1", "memory": "256Mi"},
}


def _server_deployment(inputs: HubInputs, meta: Any) -> dict[str, Any]:
    cfg = inputs.cfg
    args = [
        f"--agent-listen=0.0.0.0:{cfg.agent_port}",
        f"--client-listen=0.0.0.0:{cfg.client_port}",
        f"--admin-listen=0.0.0.0:{cfg.admin_port}",
        f"--ca={CREDENTIALS_DIR}/{CA_KEY}",
        f"--cert={CREDENTIALS_DIR}/tls.crt",
        f"--key={CREDENTIALS_DIR}/tls.key",
        f"--signer={signer_url_in_hub(cfg)}",
        *(f"--tls-host={host}" for host in server_tls_hosts(cfg, inputs.endpoints)),
        f"--server-count={max(cfg.server_replicas, 1)}",
        f"--shutdown-delay={SERVER_SHUTDOWN_DELAY}s",
        "--log-format=json",
        *cfg.server_args,
    ]
    pod_spec: dict[str, Any] = {
        "serviceAccountName": SERVER_SERVICE_ACCOUNT,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": SERVER_SHUTDOWN_DELAY + SERVER_DRAIN + 10,  # then 10 s to exit
        "securityContext": pod_security(),
        "initContainers": [seed_ca_container(cfg.server_image, cfg.server_resources.as_dict())],
        "containers": [
            {
                "name": "proxy-server",
                "image": cfg.server_image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["cluster-proxy-server"],
                "args": args,
                "env": [token_env("CLUSTER_PROXY_SERVER_BOOTSTRAP_TOKEN", SERVER_BOOTSTRAP_SECRET)],
                "ports": [
                    {"name": "client", "containerPort": cfg.client_port, "protocol": "TCP"},
                    {"name": "agent", "containerPort": cfg.agent_port, "protocol": "TCP"},
                    {"name": "admin", "containerPort": cfg.admin_port, "protocol": "TCP"},
                ],
                **health_probes("/readyz", "/healthz", "admin"),
                # Its CPU limit is also its number of workers: --workers defaults to the cgroup's
                # CPU quota rounded up (clusterproxy_server.workers.default_workers).
                "resources": cfg.server_resources.as_dict(),
                "securityContext": restricted_container(),
                "volumeMounts": [{"name": "credentials", "mountPath": CREDENTIALS_DIR}],
            }
        ],
        "volumes": credential_volumes(SERVER_BOOTSTRAP_SECRET),
        "topologySpreadConstraints": spread_over_nodes("proxy-server"),
        **placement(cfg.node_selector, cfg.tolerations),
    }
    return deployment(meta(SERVER_DEPLOYMENT, "proxy-server"), "proxy-server", cfg.server_replicas, pod_spec)


def _signer_deployment(inputs: HubInputs, meta: Any) -> dict[str, Any]:
    cfg = inputs.cfg
    args = [
        "serve",
        f"--store=kubernetes:{cfg.namespace}/{inputs.store_prefix}",
        f"--listen=0.0.0.0:{cfg.signer_port}",
        *(f"--tls-host={host}" for host in signer_tls_hosts(cfg, inputs.endpoints)),
        "--tls-dir=/var/run/cluster-proxy-signer",
        "--log-format=json",
    ]
    pod_spec: dict[str, Any] = {
        "serviceAccountName": SIGNER_SERVICE_ACCOUNT,
        "securityContext": pod_security(),
        "containers": [
            {
                "name": "cert-signer",
                "image": inputs.signer_image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["cluster-proxy-cert-signer"],
                "args": args,
                "ports": [{"name": "https", "containerPort": cfg.signer_port, "protocol": "TCP"}],
                **health_probes("/healthz", "/healthz", "https", scheme="HTTPS"),
                "resources": {half: dict(values) for half, values in SIGNER_RESOURCES.items()},
                "securityContext": restricted_container(),
                "volumeMounts": [
                    {"name": "signer-tls", "mountPath": "/var/run/cluster-proxy-signer"},
                    {"name": "tmp", "mountPath": "/tmp"},
                ],
            }
        ],
        "volumes": [
            # its own serving certificate, issued at each start from the store's CA
            {"name": "signer-tls", "emptyDir": {"medium": "Memory"}},
            # `serve` makes a private scratch folder (tempfile) even with --tls-dir, and the root
            # filesystem is read-only
            {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
        ],
        **placement(cfg.node_selector, cfg.tolerations),
    }
    return deployment(meta(SIGNER_DEPLOYMENT, "cert-signer"), "cert-signer", 1, pod_spec)
