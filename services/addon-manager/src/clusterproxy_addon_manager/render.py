"""The names of what the manager writes, shared by every renderer and reader: object names, labels
and owners, the hub services' DNS names, the hub parties it keeps a bootstrap Secret for
(:class:`HubClient`), and a Secret's data (a token written, a token read back). Pure, no I/O.

The objects themselves are pure functions of their inputs too (no I/O: unit-tested as is), one module
per what they render:

- :mod:`.render_hub`: the hub side, owned by the ManagedProxyConfiguration (the proxy-servers, the
  cert-signer, their identities, Services and NetworkPolicies, the hub clients' Secrets);
- :mod:`.render_agent`: a managed cluster's ManifestWork ``addon-cluster-proxy-deploy`` (the agent);
- :mod:`.render_serviceaccounts`: the managed service accounts' rights in a managed cluster and the
  cluster-gateway's ManagedServiceAccounts on the hub;
- :mod:`.render_registration`: the ClusterManagementAddOn and the default ManagedProxyConfiguration;
- :mod:`.render_workloads`: what every workload shares (Deployments, Services, NetworkPolicies, pod
  security, the credentials volume).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .config import Endpoints, ProxyConfig

__all__ = [
    "ADDON_NAME",
    "ADMIN_SERVICE",
    "AGENT_BOOTSTRAP_SECRET",
    "AGENT_DEPLOYMENT",
    "COMPONENT_LABEL",
    "CREDENTIALS_DIR",
    "GATEWAY_SERVICEACCOUNT",
    "GATEWAY_SERVICEACCOUNTS",
    "MANAGED_BY",
    "MANIFEST_WORK_NAME",
    "PART_OF",
    "SERVER_BOOTSTRAP_SECRET",
    "SERVER_CERT_NAME",
    "SERVER_DEPLOYMENT",
    "SIGNER_DEPLOYMENT",
    "SIGNER_ENTRYPOINT_SERVICE",
    "SIGNER_SERVICE",
    "TOKEN_KEY",
    "HubClient",
    "admin_server_name",
    "b64",
    "labels",
    "owner_references",
    "pod_selector",
    "server_tls_hosts",
    "signer_tls_hosts",
    "signer_url_in_hub",
    "token_from_manifest_work",
    "token_from_secret",
]

ADDON_NAME = "cluster-proxy"
MANIFEST_WORK_NAME = "addon-cluster-proxy-deploy"
MANAGED_BY = "cluster-proxy-addon-manager"
PART_OF = "cluster-proxy"
COMPONENT_LABEL = "proxy.open-cluster-management.io/component-name"
ADDON_LABEL = "open-cluster-management.io/addon"
ADDON_NAME_LABEL = "open-cluster-management.io/addon-name"  # OCM's label on an addon's ManifestWorks

SERVER_DEPLOYMENT = "cluster-proxy"
SERVER_SERVICE_ACCOUNT = "cluster-proxy"
SERVER_BOOTSTRAP_SECRET = "cluster-proxy-server-bootstrap"
SERVER_CERT_NAME = "proxy-server"  # the proxy-server's CN (its main.SERVER_CERT_NAME)
ADMIN_SERVICE = "cluster-proxy-admin"
SIGNER_DEPLOYMENT = "cluster-proxy-cert-signer"
SIGNER_SERVICE = "cluster-proxy-cert-signer"
SIGNER_ENTRYPOINT_SERVICE = "cluster-proxy-cert-signer-entrypoint"
SIGNER_SERVICE_ACCOUNT = "cluster-proxy-cert-signer"
AGENT_DEPLOYMENT = "cluster-proxy-proxy-agent"
AGENT_SERVICE_ACCOUNT = "cluster-proxy"
AGENT_BOOTSTRAP_SECRET = "cluster-proxy-agent-bootstrap"
AGENT_ADMIN_PORT = 8093
# The managed service accounts (docs/managed-serviceaccount.md): their ServiceAccounts live in this
# namespace of the managed cluster (upstream's), where the agent may manage them and nothing else.
SERVICEACCOUNT_NAMESPACE = "open-cluster-management-managed-serviceaccount"
SERVICEACCOUNT_ROLE = "cluster-proxy-agent-serviceaccounts"
# The cluster-gateway's service proxy (docs/cluster-gateway.md, "The HTTPS endpoint"): its ServiceAccount
# there (a ManagedServiceAccount of the hub) and the ClusterRole that lets it review tokens and access and
# impersonate, nothing else.
SERVICE_PROXY_SERVICEACCOUNT = "cluster-proxy-service-proxy"
SERVICE_PROXY_ROLE = "cluster-proxy-service-proxy"
POD_SERVICEACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

TOKEN_KEY = "bootstrap-token"
CA_KEY = "ca.crt"
PROXY_CA_KEY = "proxy-ca.crt"
BOOTSTRAP_DIR = "/etc/cluster-proxy/bootstrap"
CREDENTIALS_DIR = "/var/lib/cluster-proxy"
CLUSTER_DOMAIN = "cluster.local"

# The cluster-gateway's own ManagedServiceAccounts per cluster: their token Secrets are the gateway's
# --token-secret and --service-proxy-credential-secret (docs/managed-serviceaccount.md).
GATEWAY_SERVICEACCOUNT = "cluster-gateway"
GATEWAY_SERVICEACCOUNTS = (GATEWAY_SERVICEACCOUNT, SERVICE_PROXY_SERVICEACCOUNT)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def labels(component: str, **extra: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/name": component,
        "app.kubernetes.io/component": component,
        **extra,
    }


def pod_selector(component: str) -> dict[str, str]:
    return {ADDON_LABEL: ADDON_NAME, COMPONENT_LABEL: component}


def owner_references(api_version: str, kind: str, name: str, uid: str) -> list[dict[str, Any]]:
    return [{"apiVersion": api_version, "kind": kind, "name": name, "uid": uid, "controller": True}]


def _service_names(name: str, namespace: str) -> list[str]:
    return [
        name,
        f"{name}.{namespace}",
        f"{name}.{namespace}.svc",
        f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}",
    ]


def _unique(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(v for v in values if v))


def server_tls_hosts(cfg: ProxyConfig, endpoints: Endpoints | None) -> list[str]:
    """Names in the proxy-server certificate: its in-cluster Services, the address agents dial, the
    MPC's additional SANs. Sorted, so that the token binding does not change with their order."""
    hosts = [
        *_service_names(cfg.in_cluster_service_name, cfg.namespace),
        *_service_names(cfg.entrypoint.service_name, cfg.namespace),
        *cfg.additional_sans,
    ]
    if endpoints is not None:
        hosts.append(endpoints.server_host)
    return sorted(_unique(h.lower() for h in hosts))


def admin_server_name(cfg: ProxyConfig) -> str:
    """The name a reader of the proxy-servers' admin port checks on their certificate (one of
    :func:`server_tls_hosts`): the headless Service answers pod IPs, which no certificate names."""
    return f"{cfg.in_cluster_service_name}.{cfg.namespace}.svc"


def signer_tls_hosts(cfg: ProxyConfig, endpoints: Endpoints | None) -> list[str]:
    hosts = _service_names(SIGNER_SERVICE, cfg.namespace)
    if endpoints is not None:
        hosts.append(endpoints.signer_host)
    return sorted(_unique(h.lower() for h in hosts))


def signer_url_in_hub(cfg: ProxyConfig) -> str:
    return f"https://{SIGNER_SERVICE}.{cfg.namespace}.svc:{cfg.signer_port}"


@dataclass(frozen=True)
class HubClient:
    """A hub client whose bootstrap Secret the manager keeps (``--hub-client NAME=[NAMESPACE/]SECRET``):
    ``name`` is its certificate's CN (the token's ``--client``); ``namespace`` "" is the proxy-server
    namespace, where the cert-signer the client dials runs."""

    name: str
    secret: str
    namespace: str = ""
    # a server of the hub (``--hub-server NAME=[NAMESPACE/]SECRET=HOST,...``: the cluster-gateway's HTTPS
    # endpoint): its token is a server token for CN ``name`` and these names, not a client's
    hosts: tuple[str, ...] = ()

    def where(self, default_namespace: str) -> tuple[str, str]:
        return self.namespace or default_namespace, self.secret

    @property
    def group(self) -> str:
        """The token group (the description of the tokens minted for it: ``addon-manager <group>``)."""
        return f"hub-server {self.name}" if self.hosts else f"hub-client {self.name}"


# --- reading back what was written ---------------------------------------------------------------------


def token_from_secret(secret: Mapping[str, Any] | None) -> str | None:
    """The bootstrap token held in a rendered Secret (None when absent or unreadable)."""
    raw = ((secret or {}).get("data") or {}).get(TOKEN_KEY)
    if not isinstance(raw, str):
        return None
    try:
        return base64.b64decode(raw, validate=True).decode().strip() or None
    except (ValueError, UnicodeDecodeError):
        return None


def token_from_manifest_work(work: Mapping[str, Any] | None) -> str | None:
    for manifest in ((work or {}).get("spec") or {}).get("workload", {}).get("manifests") or []:
        if (
            isinstance(manifest, Mapping)
            and manifest.get("kind") == "Secret"
            and (manifest.get("metadata") or {}).get("name") == AGENT_BOOTSTRAP_SECRET
        ):
            return token_from_secret(manifest)
    return None
