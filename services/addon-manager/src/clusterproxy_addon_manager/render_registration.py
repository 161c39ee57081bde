"""The addon's registration objects the manager renders, pure functions (no I/O): the
ClusterManagementAddOn that registers the addon with OCM and points at the ManagedProxyConfiguration,
and the ManagedProxyConfiguration it creates when none exists at its start.
"""

from __future__ import annotations

from typing import Any

from .render import ADDON_NAME, MANAGED_BY, PART_OF

__all__ = ["cluster_management_addon", "default_configuration"]


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
