"""Uninstalling the cluster-gateway never leaves a ManagedServiceAccount held by its finalizer
(docs/kubernetes.md, "Uninstalling"), against a real hub API server: the hub's ``kubectl delete -k
overlays/hub`` deletes the ManagedServiceAccount CRD, which waits until every MSA is gone.

- The addon disabled with the gateway running: its agent goes with the ManifestWork, so the gateway
  cannot delete the ServiceAccount through the tunnel any more; it lets the finalizer go once the
  addon is gone (the agent will not come back).
- The gateway removed first (its APIService and its process gone, as ``kubectl delete -k
  overlays/hub-gateway`` removes them), the addon disabled afterwards: the addon-manager, which owns
  these MSAs, takes the gateway's finalizer off itself.

The clusters here have no agent anywhere (a ManagedCluster and its addon only), which is what a
disabled addon leaves the gateway: no tunnel.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.support.gateway_rig import APISERVICE, Gateway, _managed_cluster, running_gateway
from tests.support.kubeapi import KubeClusters, install_crds
from tests.support.waiting import poll_until

pytestmark = [pytest.mark.slow]

GROUP, VERSION, PLURAL = "authentication.open-cluster-management.io", "v1beta1", "managedserviceaccounts"
CRDS = Path(__file__).parent / "crds" / "authentication"
FINALIZER = "authentication.open-cluster-management.io/managed-serviceaccount"
GATEWAY_MSAS = ("cluster-gateway", "cluster-proxy-service-proxy")


def _msas(gw: Gateway, cluster: str) -> list[dict[str, Any]]:
    with gw.hub.api_client() as admin:
        listed = client.CustomObjectsApi(admin).list_namespaced_custom_object(GROUP, VERSION, cluster, PLURAL)
    return list(listed["items"])


def _held(gw: Gateway, cluster: str) -> bool:
    """Both of the manager's MSAs exist, each with the gateway's finalizer."""
    found = {m["metadata"]["name"]: m["metadata"].get("finalizers") or [] for m in _msas(gw, cluster)}
    return set(GATEWAY_MSAS) <= set(found) and all(FINALIZER in found[n] for n in GATEWAY_MSAS)


def _disable(gw: Gateway, cluster: str) -> None:
    with gw.hub.api_client() as admin:
        client.CustomObjectsApi(admin).delete_namespaced_custom_object(
            "addon.open-cluster-management.io", "v1alpha1", cluster, "managedclusteraddons", "cluster-proxy"
        )


def _forget(gw: Gateway, cluster: str) -> None:
    with gw.hub.api_client() as admin:
        custom = client.CustomObjectsApi(admin)
        with contextlib.suppress(client.exceptions.ApiException):
            custom.delete_cluster_custom_object(
                "cluster.open-cluster-management.io", "v1", "managedclusters", cluster
            )
        with contextlib.suppress(client.exceptions.ApiException):
            client.CoreV1Api(admin).delete_namespace(cluster)


def test_disabling_the_addon_never_leaves_an_msa_held_in_either_order(
    kube_clusters: KubeClusters, tmp_path: Path
) -> None:
    install_crds(kube_clusters["hub"], CRDS)
    with running_gateway(kube_clusters, tmp_path, (), managed_serviceaccounts=True) as gw:
        first, second = f"gone-a-{gw.stack.tag}", f"gone-b-{gw.stack.tag}"
        try:
            for cluster in (first, second):
                _managed_cluster(gw, cluster)
            for cluster in (first, second):
                poll_until(
                    lambda c=cluster: _held(gw, c),
                    timeout=30,
                    what=f"{cluster}: the manager's MSAs held by the gateway's finalizer",
                )

            # the gateway running: the addon disabled, no agent to delete the ServiceAccounts through
            _disable(gw, first)
            poll_until(lambda: not _msas(gw, first), timeout=30, what=f"{first}: the MSAs gone")
            released = [r for r in gw.process.events() if r.get("event") == "managedserviceaccount_released"]
            assert {r["name"] for r in released if r.get("cluster") == first} == set(GATEWAY_MSAS), released

            # the gateway removed first (kubectl delete -k overlays/hub-gateway), the addon disabled after
            with gw.hub.api_client() as admin:
                client.ApiregistrationV1Api(admin).delete_api_service(APISERVICE)
            gw.process.stop()
            assert _held(gw, second)
            _disable(gw, second)
            poll_until(lambda: not _msas(gw, second), timeout=30, what=f"{second}: the MSAs gone")
            released = [
                r
                for r in gw.stack.manager.events()
                if r.get("event") == "gateway_serviceaccount_released" and r.get("cluster") == second
            ]
            assert {r["name"] for r in released} == set(GATEWAY_MSAS), released
        finally:
            for cluster in (first, second):
                _forget(gw, cluster)
