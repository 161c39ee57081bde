"""The ``cma`` key: the ClusterManagementAddOn ``cluster-proxy`` that registers the addon with OCM
and points at the ManagedProxyConfiguration; and, once at the start, that configuration itself when
none exists (an empty spec: the CRD's defaults)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .compare import contains
from .kube import CLUSTER_MANAGEMENT_ADDON, MANAGED_PROXY_CONFIGURATION, Conflict
from .render import ADDON_NAME
from .render_registration import cluster_management_addon, default_configuration

if TYPE_CHECKING:
    from .controller import Controller

__all__ = ["create_default_configuration", "reconcile_cma"]


def reconcile_cma(ctl: Controller) -> None:
    desired = cluster_management_addon(ctl.options.mpc_name)
    current = ctl.fresh(ctl.cmas, CLUSTER_MANAGEMENT_ADDON, ADDON_NAME)
    if current is not None and contains(current, desired):
        return
    written = ctl.kube.apply(CLUSTER_MANAGEMENT_ADDON, desired)
    ctl.remember(CLUSTER_MANAGEMENT_ADDON, written)
    ctl.metrics.writes.labels("ClusterManagementAddOn", "apply").inc()
    ctl.log.info("object_applied", kind="ClusterManagementAddOn", name=ADDON_NAME, created=current is None)


def create_default_configuration(ctl: Controller) -> bool:
    """Create the MPC ``--mpc-name`` with an empty spec (the CRD's defaults fill it in) when the
    informers, having listed, hold none: once, at the start. Never overwrites: an MPC that exists
    is left as it is, and a 409 means another writer created it meanwhile. True when it created
    one. Blocking; the informers must be synced."""
    name = ctl.options.mpc_name
    if ctl.mpcs.get(name) is not None:
        return False
    try:
        created = ctl.kube.create(MANAGED_PROXY_CONFIGURATION, default_configuration(name))
    except Conflict:
        ctl.log.info("default_configuration_exists", name=name, reason="created by another writer")
        return False
    spec = created.get("spec") or {}
    ctl.log.info(
        "default_configuration_created",
        name=name,
        server_image=(spec.get("proxyServer") or {}).get("image"),
        agent_image=(spec.get("proxyAgent") or {}).get("image"),
    )
    return True
