"""The ``cluster/<name>`` key: ManagedCluster ``<name>`` + ManagedClusterAddOn ``cluster-proxy`` in
namespace ``<name>`` -> one ManifestWork ``addon-cluster-proxy-deploy`` there (or none: deleted when
the addon or the cluster is gone, with the agent's token), the cluster-gateway's ManagedServiceAccounts
beside it, and the addon's conditions ``ManifestApplied`` and ``Available``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .compare import contains
from .conditions import Condition
from .config import EntrypointWaiting, ProxySettings, agent_namespace, deploy_config_ref, parse_deploy_config
from .identity import agent_binding
from .kube import MANAGED_CLUSTER_ADDON, MANIFEST_WORK, KubeError, Resource
from .metadata import generation_of, is_deleting
from .render import ADDON_NAME, GATEWAY_SERVICEACCOUNTS, MANIFEST_WORK_NAME, token_from_manifest_work
from .render_agent import AgentInputs, agent_manifest_work
from .render_serviceaccounts import gateway_managed_serviceaccount
from .status import available, manifest_applied, set_addon_status
from .tokens import trust_bundle

if TYPE_CHECKING:
    from .controller import Controller

__all__ = ["MANAGED_SERVICE_ACCOUNT", "reconcile_cluster"]

# the cluster-gateway's ManagedServiceAccounts (docs/managed-serviceaccount.md)
MANAGED_SERVICE_ACCOUNT = Resource(
    "authentication.open-cluster-management.io",
    "v1beta1",
    "managedserviceaccounts",
    "ManagedServiceAccount",
    True,
    "deploy/kustomize/base/crds",
)

# the cluster-gateway's finalizer on them, and the APIService that says the gateway is installed
GATEWAY_FINALIZER = "authentication.open-cluster-management.io/managed-serviceaccount"
GATEWAY_APISERVICE = Resource("apiregistration.k8s.io", "v1", "apiservices", "APIService", False)
GATEWAY_APISERVICE_NAME = "v1alpha1.cluster.core.oam.dev"


def reconcile_cluster(ctl: Controller, name: str) -> None:
    cluster = ctl.clusters.get(name)
    addon = ctl.fresh(ctl.addons, MANAGED_CLUSTER_ADDON, ADDON_NAME, name)
    work = ctl.fresh(ctl.works, MANIFEST_WORK, MANIFEST_WORK_NAME, name)
    cfg = ctl.config()
    if cluster is None or is_deleting(cluster) or addon is None or is_deleting(addon):
        if work is not None:
            ctl.kube.delete(MANIFEST_WORK, MANIFEST_WORK_NAME, name)
            ctl.forget(MANIFEST_WORK, work)
            ctl.metrics.writes.labels("ManifestWork", "delete").inc()
            why = "cluster" if cluster is None or is_deleting(cluster) else "addon"
            ctl.log.info("work_deleted", cluster=name, reason=f"the {why} is gone")
            _delete_gateway_serviceaccounts(ctl, name)
            if cfg is not None and ctl.credentials.forget_token(
                cfg.namespace, token_from_manifest_work(work)
            ):
                ctl.log.info("token_deleted", group=f"cluster {name}", reason="the addon is gone")
        return
    if cfg is None:
        set_addon_status(
            ctl,
            addon,
            [
                Condition(
                    "ManifestApplied",
                    "False",
                    "ConfigurationMissing",
                    f"ManagedProxyConfiguration {ctl.options.mpc_name!r} does not exist: the agent cannot be "
                    "configured (the existing ManifestWork, if any, is kept)",
                )
            ],
            None,
        )
        return
    hub = ctl.hub_informers(cfg.namespace)
    endpoints = ctl.endpoints(cfg, hub)
    if isinstance(endpoints, EntrypointWaiting):
        set_addon_status(
            ctl, addon, [Condition("ManifestApplied", "False", endpoints.reason, endpoints.message)], None
        )
        return
    settings = ProxySettings()
    ref = deploy_config_ref(addon, ctl.cmas.get(ADDON_NAME))
    if ref is not None:
        deploy_config = ctl.deploy_configs.get(ref[1], ref[0])
        if deploy_config is None:
            set_addon_status(
                ctl,
                addon,
                [
                    Condition(
                        "ManifestApplied",
                        "False",
                        "DeployConfigMissing",
                        f"AddOnDeploymentConfig {ref[0]}/{ref[1]} (referenced by the addon or the "
                        "ClusterManagementAddOn) does not exist",
                    )
                ],
                None,
            )
            return
        settings = parse_deploy_config(deploy_config)
        for problem in settings.problems:
            ctl.log.warning(
                "deploy_config_problem", cluster=name, config=f"{ref[0]}/{ref[1]}", problem=problem
            )
    agent_ns = agent_namespace(addon, settings)
    bundle, ca_problem = trust_bundle(ctl, cfg)
    if ca_problem is not None:
        set_addon_status(
            ctl, addon, [Condition("ManifestApplied", "False", ca_problem.reason, ca_problem.message)], None
        )
        return
    token = ctl.credentials.ensure_token(
        cfg.namespace, f"cluster {name}", agent_binding(name), token_from_manifest_work(work)
    )
    if token.minted:
        ctl.metrics.tokens_minted.labels("agent").inc()
        ctl.log.info("token_minted", group=f"cluster {name}", reason=token.reason)
    desired = agent_manifest_work(
        AgentInputs(
            cfg=cfg,
            cluster=name,
            namespace=agent_ns,
            endpoints=endpoints,
            ca_bundle_pem=bundle,
            token=token.token,
            proxy=settings,
            addon_uid=str(addon["metadata"].get("uid") or ""),
        )
    )
    if work is None or not contains(work, desired):
        written = ctl.kube.apply(MANIFEST_WORK, desired)
        ctl.remember(MANIFEST_WORK, written)
        ctl.metrics.writes.labels("ManifestWork", "apply").inc()
        ctl.log.info(
            "work_applied",
            cluster=name,
            work=f"{name}/{MANIFEST_WORK_NAME}",
            created=work is None,
            generation=generation_of(written),
        )
        work = written
    _ensure_gateway_serviceaccounts(ctl, name, str(addon["metadata"].get("uid") or ""))
    set_addon_status(ctl, addon, [manifest_applied(work), available(ctl, name)], agent_ns)


def _ensure_gateway_serviceaccounts(ctl: Controller, cluster: str, addon_uid: str) -> None:
    """The cluster-gateway's ManagedServiceAccounts (its own and its service proxy's) in the cluster's
    namespace, created when missing. A hub without their CRD (no gateway) or a refused write is
    logged, never the addon's failure."""
    for name in GATEWAY_SERVICEACCOUNTS:
        try:
            if ctl.kube.get_or_none(MANAGED_SERVICE_ACCOUNT, name, cluster) is None:
                ctl.kube.create(
                    MANAGED_SERVICE_ACCOUNT,
                    gateway_managed_serviceaccount(cluster, addon_uid, name),
                )
                ctl.log.info("gateway_serviceaccount_created", cluster=cluster, name=name)
        except KubeError as exc:
            if exc.status != 409:
                ctl.log.warning("gateway_serviceaccount_failed", cluster=cluster, name=name, error=str(exc))


def _delete_gateway_serviceaccounts(ctl: Controller, cluster: str) -> None:
    """Delete them with the addon. Their finalizer is the cluster-gateway's (it deletes the
    ServiceAccount in the cluster, or lets go once the addon is gone); with no gateway installed
    (its APIService gone: removed before the addon was disabled) nobody would ever take it off and
    the hub's uninstall would wait on the CRD for good, so the manager takes it off itself."""
    for name in GATEWAY_SERVICEACCOUNTS:
        try:
            if not ctl.kube.delete(MANAGED_SERVICE_ACCOUNT, name, cluster):
                continue
            left = ctl.kube.get_or_none(MANAGED_SERVICE_ACCOUNT, name, cluster)
            if left is None:
                continue
            finalizers = list((left.get("metadata") or {}).get("finalizers") or [])
            if GATEWAY_FINALIZER not in finalizers or _gateway_installed(ctl):
                continue
            ctl.kube.request(
                "PATCH",
                MANAGED_SERVICE_ACCOUNT,
                namespace=cluster,
                name=name,
                body={
                    "metadata": {
                        "finalizers": [f for f in finalizers if f != GATEWAY_FINALIZER],
                        "resourceVersion": left["metadata"].get("resourceVersion"),
                    }
                },
                content_type="application/merge-patch+json",
            )
            ctl.log.info(
                "gateway_serviceaccount_released",
                cluster=cluster,
                name=name,
                reason="no cluster-gateway installed to finalize it",
            )
        except KubeError as exc:
            ctl.log.warning("gateway_serviceaccount_failed", cluster=cluster, name=name, error=str(exc))


def _gateway_installed(ctl: Controller) -> bool:
    """The gateway's APIService exists (a refused read counts as installed: never drop a finalizer
    that someone may still be about to honour)."""
    try:
        return ctl.kube.get_or_none(GATEWAY_APISERVICE, GATEWAY_APISERVICE_NAME) is not None
    except KubeError:
        return True
