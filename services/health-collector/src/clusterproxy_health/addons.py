"""Kubernetes mode: each cluster's ManagedClusterAddOn (installed, and its ``Available`` condition).

Two list calls a round, across every namespace (a cluster's addon lives in the namespace named after
it): the ManagedClusterAddOns named ``--addon-name`` and the ManagedClusters (a cluster without the
addon is a row that says "not installed"). Blocking (the ``kubernetes`` client): run in a thread.
The collector's RBAC: ``list`` on ``managedclusteraddons.addon.open-cluster-management.io`` and
``managedclusters.cluster.open-cluster-management.io``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from clusterproxy_protocol import load_configuration

from .state import AddonStatus, AddonsView

__all__ = ["AddonReader", "addon_status", "hub_configuration"]

ADDON_GROUP, ADDON_VERSION, ADDON_PLURAL = (
    "addon.open-cluster-management.io",
    "v1alpha1",
    "managedclusteraddons",
)
CLUSTER_GROUP, CLUSTER_VERSION, CLUSTER_PLURAL = "cluster.open-cluster-management.io", "v1", "managedclusters"


def hub_configuration(kubeconfig: Path | None) -> Any:
    """The hub API server's ``kubernetes.client.Configuration`` (:mod:`clusterproxy_protocol.kubeconfig`)."""
    return load_configuration(kubeconfig, flag_env="CLUSTER_PROXY_HEALTH_KUBECONFIG").configuration


def addon_status(addon: dict[str, Any]) -> AddonStatus:
    """The addon's ``Available`` condition: True, False, or None (absent or Unknown)."""
    for condition in (addon.get("status") or {}).get("conditions") or []:
        if isinstance(condition, dict) and condition.get("type") == "Available":
            value = {"True": True, "False": False}.get(str(condition.get("status")))
            return AddonStatus(value, str(condition.get("reason") or ""), str(condition.get("message") or ""))
    return AddonStatus(None, "NoCondition", "the addon has no Available condition yet")


class AddonReader:
    def __init__(self, configuration: Any, addon_name: str, *, timeout: float) -> None:
        from kubernetes import client

        self.addon_name = addon_name
        self.timeout = timeout
        self.api = client.CustomObjectsApi(client.ApiClient(configuration))

    def _list(self, group: str, version: str, plural: str, **query: Any) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        token = None
        while True:
            answer = cast(  # kubernetes declares custom objects `object`: they are JSON
                "dict[str, Any]",
                self.api.list_cluster_custom_object(
                    group, version, plural, limit=500, _continue=token, _request_timeout=self.timeout, **query
                ),
            )
            items += answer.get("items") or []
            token = (answer.get("metadata") or {}).get("continue")
            if not token:
                return items

    def read(self, now: float) -> AddonsView:
        """Blocking. A failure is the view's ``error`` (what to do included), never an exception."""
        from kubernetes.client.exceptions import ApiException

        try:
            addons = self._list(
                ADDON_GROUP, ADDON_VERSION, ADDON_PLURAL, field_selector=f"metadata.name={self.addon_name}"
            )
            clusters = self._list(CLUSTER_GROUP, CLUSTER_VERSION, CLUSTER_PLURAL)
        except ApiException as exc:
            detail = f"HTTP {exc.status} {exc.reason}"
            if exc.status == 403:
                detail += (
                    "; grant the collector's ServiceAccount 'list' on managedclusteraddons and "
                    "managedclusters (addon.open-cluster-management.io, cluster.open-cluster-management.io)"
                )
            elif exc.status == 404:
                detail += "; are Open Cluster Management's CRDs installed on this API server?"
            return AddonsView(now, error=detail)
        except Exception as exc:  # urllib3's connection errors and the like: the API server is not there
            return AddonsView(now, error=f"the hub's API server did not answer: {exc}")
        by_cluster = {
            str((a.get("metadata") or {}).get("namespace")): addon_status(a)
            for a in addons
            if (a.get("metadata") or {}).get("namespace")
        }
        names = {
            str((c.get("metadata") or {}).get("name"))
            for c in clusters
            if (c.get("metadata") or {}).get("name")
        }
        return AddonsView(now, addons=by_cluster, clusters=names)
