"""The ``hub`` key: the ManagedProxyConfiguration -> the hub objects (render_hub.hub_objects) in its
namespace, the CA and the proxy-servers' bootstrap token, the hub clients' bootstrap Secrets
(``--hub-client``, ``--hub-server``), the deletion of what the manager made and no longer wants (all
of it without a configuration, the old namespace's after a move), and the MPC's status conditions.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

from .compare import contains
from .conditions import Condition
from .config import Endpoints, ProxyConfig
from .hub_informers import HubInformers
from .identity import client_binding, server_binding
from .kube import (
    CLUSTER_MANAGEMENT_ADDON,
    DEPLOYMENT,
    MANIFEST_WORK,
    NETWORK_POLICY,
    ROLE,
    ROLE_BINDING,
    SECRET,
    SERVICE,
    SERVICE_ACCOUNT,
    KubeError,
    Resource,
)
from .render import (
    MANAGED_BY,
    SERVER_BOOTSTRAP_SECRET,
    SERVER_CERT_NAME,
    SERVER_DEPLOYMENT,
    SERVER_SERVICE_ACCOUNT,
    SIGNER_DEPLOYMENT,
    SIGNER_SERVICE_ACCOUNT,
    HubClient,
    server_tls_hosts,
    token_from_secret,
)
from .render_hub import HubInputs, hub_client_secret, hub_objects
from .status import deployment_condition, server_certificate, set_mpc_status
from .tokens import trust_bundle

if TYPE_CHECKING:
    from .controller import Controller

__all__ = ["reconcile_hub"]

#: the proxy-servers' disruption budget (a built-in kind the other modules do not use)
POD_DISRUPTION_BUDGET = Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True)

RESOURCES_BY_KIND: dict[str, Resource] = {
    r.kind: r
    for r in (
        SERVICE_ACCOUNT,
        ROLE,
        ROLE_BINDING,
        SECRET,
        DEPLOYMENT,
        SERVICE,
        NETWORK_POLICY,
        POD_DISRUPTION_BUDGET,
    )
}


def reconcile_hub(ctl: Controller) -> None:
    cfg = ctl.config()
    if cfg is None:
        # No configuration: nothing of the hub side should exist (a real cluster's garbage
        # collector does the same through the owner references; tests have none).
        hub = ctl.hub_informers(ctl.hub.namespace if ctl.hub else ctl.options.namespace)
        _delete_hub_objects(ctl, hub)
        return
    hub = ctl.hub_informers(cfg.namespace)
    retired = ctl.retired_hub
    if retired is not None and retired.namespace != cfg.namespace:
        # spec.proxyServer.namespace changed: the old namespace's servers and signer go (their
        # CA store stays there; see docs/addon-manager.md on moving namespaces)
        _delete_hub_objects(ctl, retired)
    ctl.retired_hub = None
    endpoints = ctl.endpoints(cfg, hub)
    ready_endpoints = endpoints if isinstance(endpoints, Endpoints) else None
    conditions: list[Condition] = []
    bundle, ca_problem = trust_bundle(ctl, cfg)
    if ca_problem is not None:
        conditions.append(ca_problem)
        set_mpc_status(ctl, cfg, conditions)
        return
    hosts = server_tls_hosts(cfg, ready_endpoints)
    current_token = token_from_secret(ctl.fresh(hub.secrets, SECRET, SERVER_BOOTSTRAP_SECRET, cfg.namespace))
    token = ctl.credentials.ensure_token(
        cfg.namespace, "proxy-server", server_binding(SERVER_CERT_NAME, hosts), current_token
    )
    if token.minted:
        ctl.metrics.tokens_minted.labels("proxy-server").inc()
        ctl.log.info("token_minted", group="proxy-server", reason=token.reason)
    objects = hub_objects(
        HubInputs(
            cfg=cfg,
            endpoints=ready_endpoints,
            ca_bundle_pem=bundle,
            server_token=token.token,
            store_prefix=ctl.options.store_prefix,
            signer_image=ctl.options.signer_image,
        )
    )
    for obj in objects:
        _ensure(ctl, obj, hub)
    client_secrets = _reconcile_hub_clients(ctl, cfg, hub, bundle)
    keep = {(o["kind"], o["metadata"]["name"]) for o in objects}
    keep |= {("Secret", name) for namespace, name in client_secrets if namespace == cfg.namespace}
    _delete_hub_objects(ctl, hub, keep=keep)

    conditions.append(deployment_condition(ctl, hub, cfg, "ProxyServerDeployed", SERVER_DEPLOYMENT))
    conditions.append(deployment_condition(ctl, hub, cfg, "CertSignerDeployed", SIGNER_DEPLOYMENT))
    if isinstance(endpoints, Endpoints):
        conditions.append(
            Condition(
                "EntrypointReady",
                "True",
                "AddressKnown",
                f"agents dial the proxy-servers at {endpoints.server_host}:{endpoints.server_port} and the "
                f"cert-signer at {endpoints.signer_host}:{endpoints.signer_port} ({cfg.entrypoint.type})",
            )
        )
    else:
        conditions.append(Condition("EntrypointReady", "False", endpoints.reason, endpoints.message))
    signed = server_certificate(ctl, hub)
    if signed is not None:
        conditions.append(
            Condition(
                "ProxyServerSecretsSigned",
                "True",
                "CertificateIssued",
                f"the cert-signer issued the proxy-server certificate {signed.serial[:16]} (CA {signed.ca_id}, "
                f"valid until {signed.not_after:%Y-%m-%dT%H:%M:%SZ}); servers renew it themselves",
            )
        )
    else:
        conditions.append(
            Condition(
                "ProxyServerSecretsSigned",
                "False",
                "WaitingForProxyServer",
                f"the CA is ready and Secret {cfg.namespace}/{SERVER_BOOTSTRAP_SECRET} holds a "
                "bootstrap token; no proxy-server has traded it for a certificate yet",
            )
        )
    set_mpc_status(ctl, cfg, conditions)


def _ensure(ctl: Controller, obj: dict[str, Any], hub: HubInformers | None = None) -> bool:
    """Apply ``obj`` unless the server already holds it; True when written."""
    resource = (
        RESOURCES_BY_KIND.get(obj["kind"])
        or {
            "ManifestWork": MANIFEST_WORK,
            "ClusterManagementAddOn": CLUSTER_MANAGEMENT_ADDON,
        }[obj["kind"]]
    )
    metadata = obj["metadata"]
    name, namespace = metadata["name"], metadata.get("namespace", "")
    informer = hub.cached(obj["kind"]) if hub is not None else None
    if informer is not None:
        current = ctl.fresh(informer, resource, name, namespace)
    else:
        current = ctl.kube.get_or_none(resource, name, namespace or None)
    if current is not None and contains(current, obj):
        return False
    written = ctl.kube.apply(resource, obj)
    ctl.remember(resource, written)
    ctl.metrics.writes.labels(resource.kind, "apply").inc()
    ctl.log.info(
        "object_applied",
        kind=obj["kind"],
        name=name,
        namespace=namespace or None,
        created=current is None,
    )
    return True


def _delete_hub_objects(
    ctl: Controller,
    hub: HubInformers,
    keep: AbstractSet[tuple[str, str]] = frozenset(),
) -> int:
    """Delete the hub objects this manager made that are not in ``keep`` ((kind, name))."""
    deleted = 0
    for informer, resource in (
        (hub.deployments, DEPLOYMENT),
        (hub.services, SERVICE),
        (hub.secrets, SECRET),
    ):
        for obj in informer.items():
            name = obj["metadata"]["name"]
            if (resource.kind, name) in keep:
                continue
            if ctl.kube.delete(resource, name, hub.namespace):
                ctl.metrics.writes.labels(resource.kind, "delete").inc()
                ctl.log.info("object_deleted", kind=resource.kind, name=name, namespace=hub.namespace)
                deleted += 1
    if not keep:
        for resource, name in (
            (POD_DISRUPTION_BUDGET, SERVER_DEPLOYMENT),
            (NETWORK_POLICY, SERVER_DEPLOYMENT),
            (NETWORK_POLICY, SIGNER_DEPLOYMENT),
            (ROLE_BINDING, SIGNER_SERVICE_ACCOUNT),
            (ROLE, SIGNER_SERVICE_ACCOUNT),
            (SERVICE_ACCOUNT, SIGNER_SERVICE_ACCOUNT),
            (SERVICE_ACCOUNT, SERVER_SERVICE_ACCOUNT),
        ):
            current = ctl.kube.get_or_none(resource, name, hub.namespace)
            labels = ((current or {}).get("metadata") or {}).get("labels") or {}
            if labels.get("app.kubernetes.io/managed-by") == MANAGED_BY:
                ctl.kube.delete(resource, name, hub.namespace)
                ctl.metrics.writes.labels(resource.kind, "delete").inc()
                ctl.log.info("object_deleted", kind=resource.kind, name=name, namespace=hub.namespace)
                deleted += 1
    return deleted


def _reconcile_hub_clients(
    ctl: Controller, cfg: ProxyConfig, hub: HubInformers, bundle: str
) -> list[tuple[str, str]]:
    """One usable token per hub client in its Secret, with the CA bundle (docs/addon-manager.md,
    "Identities"): replaced when used, expiring or bound otherwise, as the proxy-servers' one.
    Returns the (namespace, name) of every Secret kept. A Secret in another namespace that cannot
    be written (no such namespace, no Role there) is logged with what to do, and does not stop the
    rest of the hub's reconcile; the resync tries it again."""
    kept = []
    for hub_client in ctl.options.hub_clients:
        namespace, name = hub_client.where(cfg.namespace)
        try:
            _reconcile_hub_client(ctl, cfg, hub, bundle, hub_client)
        except KubeError as exc:
            if namespace == cfg.namespace:
                raise
            ctl.log.warning(
                "hub_client_secret_failed",
                client=hub_client.name,
                secret=f"{namespace}/{name}",
                error=str(exc),
                fix=f"create namespace {namespace} and bind the manager's Role there "
                "(deploy/kustomize/base/addon-manager/rbac.yaml), or drop the namespace from --hub-client",
            )
            continue
        kept.append((namespace, name))
    return kept


def _reconcile_hub_client(
    ctl: Controller, cfg: ProxyConfig, hub: HubInformers, bundle: str, hub_client: HubClient
) -> None:
    namespace, name = hub_client.where(cfg.namespace)
    current = ctl.read_hub_client_secret(hub, namespace, name)
    token = ctl.credentials.ensure_token(
        cfg.namespace,
        hub_client.group,
        server_binding(hub_client.name, list(hub_client.hosts))
        if hub_client.hosts
        else client_binding(hub_client.name),
        token_from_secret(current),
    )
    if token.minted:
        ctl.metrics.tokens_minted.labels("hub-client").inc()
        ctl.log.info(
            "token_minted", group=hub_client.group, secret=f"{namespace}/{name}", reason=token.reason
        )
    desired = hub_client_secret(cfg, hub_client, ca_bundle_pem=bundle, token=token.token)
    if current is None or not contains(current, desired):
        written = ctl.kube.apply(SECRET, desired)
        ctl.remember(SECRET, written)
        ctl.metrics.writes.labels("Secret", "apply").inc()
        ctl.log.info("object_applied", kind="Secret", name=name, namespace=namespace, created=current is None)
