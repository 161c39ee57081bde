"""The objects the manager writes, as pure functions of its inputs (no I/O: unit-tested as is).

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
  only (:func:`network_policy`).

Managed cluster: one ManifestWork ``addon-cluster-proxy-deploy`` in the cluster's namespace, owned by
its ManagedClusterAddOn, holding the agent Namespace, ServiceAccount, Secret
``cluster-proxy-agent-bootstrap`` (CA bundle, bootstrap token, proxy CA), Deployment
``cluster-proxy-proxy-agent`` and NetworkPolicy ``cluster-proxy-proxy-agent`` (its admin port only).

Parties that get certificates from the signer write them (and later renewals, and the trust bundle)
into a writable ``emptyDir``; an init container seeds it with the CA bundle from the Secret, since
the programs need a CA bundle to verify the signer before their first certificate.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clusterproxy_castore.kubestore import RBAC_VERBS as SIGNER_STORE_VERBS
from clusterproxy_protocol.wire import format_authority

from .config import Endpoints, ProxyConfig, ProxySettings

__all__ = [
    "ADDON_NAME",
    "ADMIN_SERVICE",
    "AGENT_BOOTSTRAP_SECRET",
    "AGENT_DEPLOYMENT",
    "COMPONENT_LABEL",
    "CREDENTIALS_DIR",
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
    "admin_server_name",
    "AgentInputs",
    "HubClient",
    "HubInputs",
    "agent_manifest_work",
    "agent_network_policy",
    "cluster_management_addon",
    "default_configuration",
    "hub_client_secret",
    "hub_objects",
    "network_policy",
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


def _b64(text: str) -> str:
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


def _owner(api_version: str, kind: str, name: str, uid: str) -> list[dict[str, Any]]:
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


def _restricted_container() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "fsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _seed_ca_container(image: str) -> dict[str, Any]:
    """Copies the CA bundle into the writable credentials volume on a pod's first start only: after a
    CA rotation the program's own copy is newer than the Secret's."""
    return {
        "name": "seed-ca-bundle",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "/bin/sh",
            "-c",
            f"test -s {CREDENTIALS_DIR}/{CA_KEY} || cp {BOOTSTRAP_DIR}/{CA_KEY} {CREDENTIALS_DIR}/{CA_KEY}",
        ],
        "securityContext": _restricted_container(),
        "volumeMounts": [
            {"name": "bootstrap", "mountPath": BOOTSTRAP_DIR, "readOnly": True},
            {"name": "credentials", "mountPath": CREDENTIALS_DIR},
        ],
    }


def _token_env(env_name: str, secret: str) -> dict[str, Any]:
    # The environment twin of --bootstrap-token, read from the Secret when the container starts: a
    # token the manager re-minted reaches the next start, and it stays off the command line.
    return {"name": env_name, "valueFrom": {"secretKeyRef": {"name": secret, "key": TOKEN_KEY}}}


def _credential_volumes(secret: str) -> list[dict[str, Any]]:
    return [
        {"name": "bootstrap", "secret": {"secretName": secret, "defaultMode": 0o440}},
        # Certificate, key and CA bundle the program keeps current; memory-backed: a private key.
        {"name": "credentials", "emptyDir": {"medium": "Memory"}},
    ]


def _placement(node_selector: Sequence[tuple[str, str]], tolerations: Sequence[Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        spec["tolerations"] = [dict(t) for t in tolerations]
    return spec


# --- hub -----------------------------------------------------------------------------------------------


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
            "ownerReferences": _owner(mpc_api_version, "ManagedProxyConfiguration", cfg.name, cfg.uid),
        },
        "type": "Opaque",
        "data": {CA_KEY: _b64(ca_bundle_pem), TOKEN_KEY: _b64(token)},
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
    owner = _owner(inputs.mpc_api_version, "ManagedProxyConfiguration", cfg.name, cfg.uid)

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
            "data": {CA_KEY: _b64(inputs.ca_bundle_pem), TOKEN_KEY: _b64(inputs.server_token)},
        },
        # each policy before its pods: a pod never runs open
        _signer_network_policy(meta),
        _server_network_policy(meta),
        _signer_deployment(inputs, meta),
        _service(
            meta(SIGNER_SERVICE, "cert-signer"),
            "ClusterIP",
            "cert-signer",
            [("https", cfg.signer_port, "https")],
        ),
        _server_deployment(inputs, meta),
        _service(
            meta(cfg.in_cluster_service_name, "proxy-server"),
            "ClusterIP",
            "proxy-server",
            [("client", cfg.client_port, "client")],
        ),
        _service(
            meta(
                cfg.entrypoint.service_name,
                "proxy-server",
                **({"annotations": dict(cfg.entrypoint.annotations)} if cfg.entrypoint.annotations else {}),
            ),
            "LoadBalancer" if cfg.entrypoint.type == "LoadBalancerService" else "ClusterIP",
            "proxy-server",
            [("agent", cfg.entrypoint.port, "agent")],
        ),
        _service(
            meta(ADMIN_SERVICE, "proxy-server"),
            "ClusterIP",
            "proxy-server",
            [("admin", cfg.admin_port, "admin")],
            headless=True,
        ),
    ]
    if cfg.entrypoint.type == "LoadBalancerService":
        objects.append(
            _service(
                meta(SIGNER_ENTRYPOINT_SERVICE, "cert-signer"),
                "LoadBalancer",
                "cert-signer",
                [("https", cfg.signer_port, "https")],
            )
        )
    return objects


def _service(
    metadata: dict[str, Any],
    service_type: str,
    component: str,
    ports: Sequence[tuple[str, int, str]],
    *,
    headless: bool = False,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "type": service_type,
        "selector": pod_selector(component),
        "ports": [
            {"name": name, "port": port, "targetPort": target, "protocol": "TCP"}
            for name, port, target in ports
        ],
    }
    if headless:
        spec["clusterIP"] = "None"
        spec["publishNotReadyAddresses"] = True  # a server not ready yet still answers who is connected
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": spec}


# --- NetworkPolicies --------------------------------------------------------------------------------------

#: Who may open a connection to a port, as a NetworkPolicy rule's ``from``: None is anyone (no ``from``:
#: other clusters, the internet, nodes); IN_CLUSTER every pod of every namespace. Whatever a policy
#: says, a node reaches its own pods (the kubelet's probes pass).
Sources = Sequence[Mapping[str, Any]] | None
IN_CLUSTER: Sources = ({"namespaceSelector": {}},)


def network_policy(
    metadata: dict[str, Any], component: str, ports: Sequence[tuple[str, Sources]]
) -> dict[str, Any]:
    """``component``'s pods accept connections on the named container ``ports`` only, each from its
    sources, and nothing else; egress is left alone (docs/kubernetes.md, "Network policies"). Named
    ports follow the Deployment's declarations, so a port number changed there needs nothing here."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {
            "podSelector": {"matchLabels": pod_selector(component)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    **({"from": [dict(s) for s in sources]} if sources is not None else {}),
                    "ports": [{"protocol": "TCP", "port": port}],
                }
                for port, sources in ports
            ],
        },
    }


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


def _deployment(
    metadata: dict[str, Any],
    component: str,
    replicas: int,
    pod_spec: dict[str, Any],
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": pod_selector(component)},
            "template": {
                "metadata": {"labels": {**pod_selector(component), **labels(component)}},
                "spec": pod_spec,
            },
        },
    }


# On SIGTERM the server fails /readyz at once and keeps serving this long, while the Service's endpoints
# drop the pod (readiness period 5 s); then it drains for its --drain-timeout (default 30 s).
SERVER_SHUTDOWN_DELAY = 5
SERVER_DRAIN = 30


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
        "securityContext": _pod_security(),
        "initContainers": [_seed_ca_container(cfg.server_image)],
        "containers": [
            {
                "name": "proxy-server",
                "image": cfg.server_image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["cluster-proxy-server"],
                "args": args,
                "env": [_token_env("CLUSTER_PROXY_SERVER_BOOTSTRAP_TOKEN", SERVER_BOOTSTRAP_SECRET)],
                "ports": [
                    {"name": "client", "containerPort": cfg.client_port, "protocol": "TCP"},
                    {"name": "agent", "containerPort": cfg.agent_port, "protocol": "TCP"},
                    {"name": "admin", "containerPort": cfg.admin_port, "protocol": "TCP"},
                ],
                "readinessProbe": {"httpGet": {"path": "/readyz", "port": "admin"}, "periodSeconds": 5},
                "livenessProbe": {
                    "httpGet": {"path": "/healthz", "port": "admin"},
                    "initialDelaySeconds": 10,
                    "periodSeconds": 10,
                },
                "securityContext": _restricted_container(),
                "volumeMounts": [{"name": "credentials", "mountPath": CREDENTIALS_DIR}],
            }
        ],
        "volumes": _credential_volumes(SERVER_BOOTSTRAP_SECRET),
        **_placement(cfg.node_selector, cfg.tolerations),
    }
    return _deployment(meta(SERVER_DEPLOYMENT, "proxy-server"), "proxy-server", cfg.server_replicas, pod_spec)


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
        "securityContext": _pod_security(),
        "containers": [
            {
                "name": "cert-signer",
                "image": inputs.signer_image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["cluster-proxy-cert-signer"],
                "args": args,
                "ports": [{"name": "https", "containerPort": cfg.signer_port, "protocol": "TCP"}],
                "readinessProbe": {
                    "httpGet": {"path": "/healthz", "port": "https", "scheme": "HTTPS"},
                    "periodSeconds": 5,
                },
                "securityContext": _restricted_container(),
                "volumeMounts": [{"name": "signer-tls", "mountPath": "/var/run/cluster-proxy-signer"}],
            }
        ],
        # its own serving certificate, issued at each start from the store's CA
        "volumes": [{"name": "signer-tls", "emptyDir": {"medium": "Memory"}}],
        **_placement(cfg.node_selector, cfg.tolerations),
    }
    return _deployment(meta(SIGNER_DEPLOYMENT, "cert-signer"), "cert-signer", 1, pod_spec)


def default_configuration(name: str) -> dict[str, Any]:
    """The ManagedProxyConfiguration the manager creates when none named ``name`` exists at its start:
    an empty spec, so that every field takes the CRD's default (the images included)."""
    return {
        "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
        "kind": "ManagedProxyConfiguration",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/managed-by": MANAGED_BY},
        },
        "spec": {},
    }


def cluster_management_addon(mpc_name: str) -> dict[str, Any]:
    """The ClusterManagementAddOn that registers the addon with OCM and points at the MPC."""
    return {
        "apiVersion": "addon.open-cluster-management.io/v1alpha1",
        "kind": "ClusterManagementAddOn",
        "metadata": {
            "name": ADDON_NAME,
            "labels": {"app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/managed-by": MANAGED_BY},
            "annotations": {"addon.open-cluster-management.io/lifecycle": "self"},
        },
        "spec": {
            "addOnMeta": {
                "displayName": "cluster-proxy",
                "description": "Reverse tunnels from every managed cluster to the hub (proxy-agents to proxy-servers)",
            },
            "addOnConfiguration": {
                "crdName": "managedproxyconfigurations.proxy.open-cluster-management.io",
                "crName": mpc_name,
            },
            "supportedConfigs": [
                {
                    "group": "proxy.open-cluster-management.io",
                    "resource": "managedproxyconfigurations",
                    "defaultConfig": {"name": mpc_name},
                },
                {"group": "addon.open-cluster-management.io", "resource": "addondeploymentconfigs"},
            ],
        },
    }


# --- managed cluster -----------------------------------------------------------------------------------


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
    env = [_token_env("CLUSTER_PROXY_AGENT_BOOTSTRAP_TOKEN", AGENT_BOOTSTRAP_SECRET)]
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
    mounts = [{"name": "credentials", "mountPath": CREDENTIALS_DIR}]
    if inputs.proxy.ca_bundle_pem:
        mounts.append({"name": "bootstrap", "mountPath": BOOTSTRAP_DIR, "readOnly": True})
    pod_spec: dict[str, Any] = {
        "serviceAccountName": AGENT_SERVICE_ACCOUNT,
        # The agent calls the Kubernetes API as itself for the managed service accounts only (the Role
        # below: ServiceAccounts and their tokens in SERVICEACCOUNT_NAMESPACE).
        "automountServiceAccountToken": True,
        "terminationGracePeriodSeconds": 40,
        "securityContext": _pod_security(),
        "initContainers": [_seed_ca_container(image)],
        "containers": [
            {
                "name": "proxy-agent",
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["cluster-proxy-agent"],
                "args": args,
                "env": _agent_env(inputs.proxy),
                "ports": [{"name": "admin", "containerPort": AGENT_ADMIN_PORT, "protocol": "TCP"}],
                "readinessProbe": {"httpGet": {"path": "/readyz", "port": "admin"}, "periodSeconds": 5},
                "livenessProbe": {
                    "httpGet": {"path": "/healthz", "port": "admin"},
                    "initialDelaySeconds": 10,
                    "periodSeconds": 10,
                },
                "securityContext": _restricted_container(),
                "volumeMounts": mounts,
            }
        ],
        "volumes": _credential_volumes(AGENT_BOOTSTRAP_SECRET),
        **_placement(inputs.proxy.node_selector, inputs.proxy.tolerations),
    }
    if cfg.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in cfg.image_pull_secrets]
    metadata = {"name": AGENT_DEPLOYMENT, "namespace": inputs.namespace, "labels": labels("proxy-agent")}
    return _deployment(metadata, "proxy-agent", cfg.agent_replicas, pod_spec)


def agent_manifests(inputs: AgentInputs) -> list[dict[str, Any]]:
    ns = inputs.namespace
    data = {CA_KEY: _b64(inputs.ca_bundle_pem), TOKEN_KEY: _b64(inputs.token)}
    if inputs.proxy.ca_bundle_pem:
        data[PROXY_CA_KEY] = _b64(inputs.proxy.ca_bundle_pem)
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


def serviceaccount_manifests(agent_namespace: str) -> list[dict[str, Any]]:
    """The namespace of the managed service accounts and the agent's rights there: exactly what its control
    endpoint does (read, make and delete a ServiceAccount, ask TokenRequest for its token), nothing else."""
    meta = {
        "name": SERVICEACCOUNT_ROLE,
        "namespace": SERVICEACCOUNT_NAMESPACE,
        "labels": labels("proxy-agent"),
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": SERVICEACCOUNT_NAMESPACE, "labels": labels("proxy-agent")},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [
                {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["get", "create", "delete"]},
                {"apiGroups": [""], "resources": ["serviceaccounts/token"], "verbs": ["create"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": SERVICEACCOUNT_ROLE},
            "subjects": [
                {"kind": "ServiceAccount", "name": AGENT_SERVICE_ACCOUNT, "namespace": agent_namespace}
            ],
        },
    ]


def service_proxy_rbac() -> list[dict[str, Any]]:
    """What the service proxy's ServiceAccount may do in the managed cluster: ``create`` TokenReviews (is
    a caller's token this cluster's?) and SubjectAccessReviews (may a hub caller impersonate whom it asks
    for?), and ``impersonate`` users, groups and ServiceAccounts (a hub caller's identity, or the one it
    was allowed to ask for). No ``uids`` or ``userextras``: the service proxy carries neither. It can
    read or change nothing by itself: every request it makes for a caller is authorized as that caller."""
    meta = {"name": SERVICE_PROXY_ROLE, "labels": labels("proxy-agent")}
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": meta,
            "rules": [
                {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
                {
                    "apiGroups": ["authorization.k8s.io"],
                    "resources": ["subjectaccessreviews"],
                    "verbs": ["create"],
                },
                {
                    "apiGroups": [""],
                    "resources": ["users", "groups", "serviceaccounts"],
                    "verbs": ["impersonate"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": meta,
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": SERVICE_PROXY_ROLE,
            },
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": SERVICE_PROXY_SERVICEACCOUNT,
                    "namespace": SERVICEACCOUNT_NAMESPACE,
                }
            ],
        },
    ]


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
            "ownerReferences": _owner(
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


# The cluster-gateway's own ManagedServiceAccounts per cluster: their token Secrets are the gateway's
# --token-secret and --service-proxy-credential-secret (docs/managed-serviceaccount.md).
GATEWAY_SERVICEACCOUNT = "cluster-gateway"
GATEWAY_SERVICEACCOUNTS = (GATEWAY_SERVICEACCOUNT, SERVICE_PROXY_SERVICEACCOUNT)


def gateway_managed_serviceaccount(
    cluster: str, addon_uid: str, name: str = GATEWAY_SERVICEACCOUNT
) -> dict[str, Any]:
    """Created once with the addon (never overwritten: an admin may change its rotation), owned by the
    ManagedClusterAddOn so that a hub's garbage collector removes it with the addon."""
    return {
        "apiVersion": "authentication.open-cluster-management.io/v1beta1",
        "kind": "ManagedServiceAccount",
        "metadata": {
            "name": name,
            "namespace": cluster,
            "labels": {"app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/managed-by": MANAGED_BY},
            "ownerReferences": [
                {
                    "apiVersion": "addon.open-cluster-management.io/v1alpha1",
                    "kind": "ManagedClusterAddOn",
                    "name": ADDON_NAME,
                    "uid": addon_uid,
                }
            ],
        },
        "spec": {"rotation": {"enabled": True}},
    }


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
