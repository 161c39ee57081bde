"""A managed cluster's side the manager renders, a pure function of its inputs (no I/O: unit-tested
as is).

One ManifestWork ``addon-cluster-proxy-deploy`` in the cluster's namespace, owned by its
ManagedClusterAddOn, holding the agent Namespace, ServiceAccount, Secret
``cluster-proxy-agent-bootstrap`` (CA bundle, bootstrap token, proxy CA), the managed service accounts'
rights (:mod:`.render_serviceaccounts`), Deployment ``cluster-proxy-proxy-agent`` and NetworkPolicy
``cluster-proxy-proxy-agent`` (its admin port only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clusterproxy_protocol import format_authority

from .config import Endpoints, ProxyConfig, ProxySettings
from .render import (
    ADDON_NAME,
    ADDON_NAME_LABEL,
    AGENT_ADMIN_PORT,
    AGENT_BOOTSTRAP_SECRET,
    AGENT_DEPLOYMENT,
    AGENT_SERVICE_ACCOUNT,
    BOOTSTRAP_DIR,
    CA_KEY,
    CREDENTIALS_DIR,
    MANAGED_BY,
    MANIFEST_WORK_NAME,
    PART_OF,
    POD_SERVICEACCOUNT_DIR,
    PROXY_CA_KEY,
    SERVICEACCOUNT_NAMESPACE,
    TOKEN_KEY,
    b64,
    labels,
    owner_references,
)
from .render_serviceaccounts import service_proxy_rbac, serviceaccount_manifests
from .render_workloads import (
    IN_CLUSTER,
    credential_volumes,
    deployment,
    health_probes,
    network_policy,
    placement,
    pod_security,
    restricted_container,
    seed_ca_container,
    token_env,
)

__all__ = [
    "AgentInputs",
    "agent_deployment",
    "agent_manifest_work",
    "agent_manifests",
    "agent_network_policy",
]


@dataclass(frozen=True)
class AgentInputs:
    cfg: ProxyConfig
    cluster: str
    namespace: str  # where the agent runs in the managed cluster
    endpoints: Endpoints
    ca_bundle_pem: str
    token: str
    proxy: ProxySettings
    addon_uid: str
    addon_api_version: str = "addon.open-cluster-management.io/v1alpha1"


def _mirrored(image: str, registries: Sequence[tuple[str, str]]) -> str:
    """The image with the first matching registry source replaced by its mirror (OCM's rule)."""
    for source, mirror in registries:
        if source and image.startswith(source):
            return mirror + image[len(source) :]
        if not source:
            return f"{mirror.rstrip('/')}/{image.split('/', 1)[-1]}" if "/" in image else f"{mirror}/{image}"
    return image


def _agent_env(proxy: ProxySettings) -> list[dict[str, Any]]:
    """The bootstrap token, and the AddOnDeploymentConfig's proxy as the standard variables, which the
    agent reads with Go's rules (as upstream's agent does): HTTPS_PROXY for the hub and the signer
    (both TLS), NO_PROXY for exemptions; HTTP_PROXY is passed on too (the agent says at start that
    it does not use it: nothing it dials is plain HTTP)."""
    env = [token_env("CLUSTER_PROXY_AGENT_BOOTSTRAP_TOKEN", AGENT_BOOTSTRAP_SECRET)]
    for name, value in (
        ("HTTP_PROXY", proxy.http_proxy),
        ("HTTPS_PROXY", proxy.https_proxy),
        ("NO_PROXY", proxy.no_proxy),
    ):
        if value:
            env.append({"name": name, "value": value})
    return env


def agent_deployment(inputs: AgentInputs) -> dict[str, Any]:
    cfg = inputs.cfg
    image = _mirrored(cfg.agent_image, inputs.proxy.registries)
    args = [
        f"--cluster={inputs.cluster}",
        f"--server={format_authority(inputs.endpoints.server_host, inputs.endpoints.server_port)}",
        f"--signer=https://{format_authority(inputs.endpoints.signer_host, inputs.endpoints.signer_port)}",
        f"--ca={CREDENTIALS_DIR}/{CA_KEY}",
        f"--cert={CREDENTIALS_DIR}/tls.crt",
        f"--key={CREDENTIALS_DIR}/tls.key",
        f"--admin-listen=0.0.0.0:{AGENT_ADMIN_PORT}",
        "--log-format=json",
        f"--serviceaccount-namespace={SERVICEACCOUNT_NAMESPACE}",
        f"--kube-token-file={POD_SERVICEACCOUNT_DIR}/token",
        f"--kube-ca-file={POD_SERVICEACCOUNT_DIR}/ca.crt",
        *([f"--proxy-ca-file={BOOTSTRAP_DIR}/{PROXY_CA_KEY}"] if inputs.proxy.ca_bundle_pem else []),
        *cfg.agent_args,
    ]
    mounts: list[dict[str, Any]] = [{"name": "credentials", "mountPath": CREDENTIALS_DIR}]
    if inputs.proxy.ca_bundle_pem:
        mounts.append({"name": "bootstrap", "mountPath": BOOTSTRAP_DIR, "readOnly": True})
    pod_spec: dict[str, Any] = {
        "serviceAccountName": AGENT_SERVICE_ACCOUNT,
        # The agent calls the Kubernetes API as itself for the managed service accounts only (the Role
        # below: ServiceAccounts and their tokens in SERVICEACCOUNT_NAMESPACE).
        "automountServiceAccountToken": True,
        "terminationGracePeriodSeconds": 40,
        "securityContext": pod_security(),
        "initContainers": [seed_ca_container(image, cfg.agent_resources.as_dict())],
        "containers": [
            {
                "name": "proxy-agent",
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["cluster-proxy-agent"],
                "args": args,
                "env": _agent_env(inputs.proxy),
                "ports": [{"name": "admin", "containerPort": AGENT_ADMIN_PORT, "protocol": "TCP"}],
                **health_probes("/readyz", "/healthz", "admin"),
                "resources": cfg.agent_resources.as_dict(),
                "securityContext": restricted_container(),
                "volumeMounts": mounts,
            }
        ],
        "volumes": credential_volumes(AGENT_BOOTSTRAP_SECRET),
        **placement(inputs.proxy.node_selector, inputs.proxy.tolerations),
    }
    if cfg.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in cfg.image_pull_secrets]
    metadata = {"name": AGENT_DEPLOYMENT, "namespace": inputs.namespace, "labels": labels("proxy-agent")}
    return deployment(metadata, "proxy-agent", cfg.agent_replicas, pod_spec)


def agent_manifests(inputs: AgentInputs) -> list[dict[str, Any]]:
    ns = inputs.namespace
    data = {CA_KEY: b64(inputs.ca_bundle_pem), TOKEN_KEY: b64(inputs.token)}
    if inputs.proxy.ca_bundle_pem:
        data[PROXY_CA_KEY] = b64(inputs.proxy.ca_bundle_pem)
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": labels("proxy-agent")}},
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": AGENT_SERVICE_ACCOUNT, "namespace": ns, "labels": labels("proxy-agent")},
            "automountServiceAccountToken": False,
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": AGENT_BOOTSTRAP_SECRET, "namespace": ns, "labels": labels("proxy-agent")},
            "type": "Opaque",
            "data": data,
        },
        *serviceaccount_manifests(ns),
        *service_proxy_rbac(),
        agent_network_policy(ns),
        agent_deployment(inputs),
    ]


def agent_network_policy(namespace: str) -> dict[str, Any]:
    """The agent's one port is its admin port (probes, Prometheus): it serves nothing else, since its
    tunnels are connections it dials out."""
    metadata = {"name": AGENT_DEPLOYMENT, "namespace": namespace, "labels": labels("proxy-agent")}
    return network_policy(metadata, "proxy-agent", [("admin", IN_CLUSTER)])


def agent_manifest_work(inputs: AgentInputs) -> dict[str, Any]:
    return {
        "apiVersion": "work.open-cluster-management.io/v1",
        "kind": "ManifestWork",
        "metadata": {
            "name": MANIFEST_WORK_NAME,
            "namespace": inputs.cluster,
            "labels": {
                "app.kubernetes.io/part-of": PART_OF,
                "app.kubernetes.io/managed-by": MANAGED_BY,
                ADDON_NAME_LABEL: ADDON_NAME,
            },
            "ownerReferences": owner_references(
                inputs.addon_api_version, "ManagedClusterAddOn", ADDON_NAME, inputs.addon_uid
            ),
        },
        "spec": {
            "workload": {"manifests": agent_manifests(inputs)},
            # The managed service accounts' namespace outlives the addon: its ServiceAccounts belong to
            # the hub's ManagedServiceAccounts (their finalizer deletes them), not to this work.
            "deleteOption": {
                "propagationPolicy": "SelectivelyOrphan",
                "selectivelyOrphans": {
                    "orphaningRules": [
                        {"group": "", "resource": "namespaces", "name": SERVICEACCOUNT_NAMESPACE}
                    ]
                },
            },
        },
    }
