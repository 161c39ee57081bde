"""Issue 15, point 5: the Cluster Inventory API. A gateway as tests/kube/test_gateway.py runs it
(tests/support/gateway_rig.py: cluster1's and cluster2's API servers joined as ``cluster1-<tag>`` and
``cluster2-<tag>``) publishes a ClusterProfile (``multicluster.x-k8s.io/v1alpha1``) per cluster in the
hub namespace ``open-cluster-management``; its access provider ``cluster-proxy`` is all a consumer
needs besides its own hub credentials.

The CRD is the one the hub overlay ships (tests/kube/crds/inventory links it), installed here after the
gateway started: the gateway retries until the API is there.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.support.gateway_rig import (
    Gateway,
    _delete_managed_cluster,
    _kubectl,
    _managed_cluster,
    _names,
    _set_reader,
    running_gateway,
)
from tests.support.kubeapi import KubeClusters, install_crds
from tests.support.waiting import poll_until

pytestmark = pytest.mark.slow

INVENTORY_CRDS = Path(__file__).parent / "crds" / "inventory"
GROUP, VERSION, PLURAL = "multicluster.x-k8s.io", "v1alpha1", "clusterprofiles"
NAMESPACE = "open-cluster-management"
PROVIDER = "cluster-proxy"


@pytest.fixture(scope="module")
def gateway(kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """cluster1's and cluster2's API servers joined as ``cluster1-<tag>``, ``cluster2-<tag>``."""
    with running_gateway(kube_clusters, tmp_path_factory.mktemp("profiles")) as gw:
        yield gw


def _profile(gw: Gateway, name: str) -> dict[str, Any] | None:
    with gw.hub.api_client() as admin:
        try:
            return client.CustomObjectsApi(admin).get_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, PLURAL, name
            )
        except client.exceptions.ApiException as exc:
            if exc.status == 404:
                return None
            raise


def _provider(profile: dict[str, Any] | None) -> dict[str, Any] | None:
    providers = ((profile or {}).get("status") or {}).get("accessProviders") or []
    return next((p for p in providers if p["name"] == PROVIDER), None)


@pytest.fixture(scope="module")
def inventory(gateway: Gateway) -> Iterator[Gateway]:
    install_crds(gateway.hub, INVENTORY_CRDS)
    with gateway.hub.api_client() as admin, contextlib.suppress(client.exceptions.ApiException):
        client.CoreV1Api(admin).create_namespace({"metadata": {"name": NAMESPACE}})
    yield gateway


def test_cluster1s_profile_reaches_cluster1_from_a_plain_kubeconfig(inventory: Gateway) -> None:
    gw = inventory
    cluster1 = gw.clusters["cluster1"].name
    profile = poll_until(
        lambda: _provider(p := _profile(gw, cluster1)) and p,
        timeout=30,
        what=f"ClusterProfile {NAMESPACE}/{cluster1} with its {PROVIDER} access provider\n{gw.process.tail()}",
    )
    assert profile["spec"]["clusterManager"] == {"name": "open-cluster-management"}
    assert profile["metadata"]["labels"]["x-k8s.io/cluster-manager"] == "open-cluster-management"
    reach = _provider(profile)["cluster"]
    assert (
        reach["server"] == f"{gw.hub.url}/apis/cluster.core.oam.dev/v1alpha1/clustergateways/{cluster1}/proxy"
    )
    assert base64.b64decode(reach["certificate-authority-data"]) == gw.hub.ca_path.read_bytes()
    assert _provider(_profile(gw, gw.clusters["cluster2"].name)) is not None
    print(f"\nClusterProfile cluster1:\n{yaml.safe_dump(profile['status'])}")

    # a consumer: the provider's cluster as it is, a hub bearer token, nothing else
    config = gw.directory / "from-profile.kubeconfig"
    config.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "cluster1", "cluster": reach}],
                "users": [{"name": "hub-token", "user": {"token": gw.hub.admin_token}}],
                "contexts": [{"name": "cluster1", "context": {"cluster": "cluster1", "user": "hub-token"}}],
                "current-context": "cluster1",
            }
        )
    )
    _set_reader(gw.clusters["cluster1"].api, True)
    listed = poll_until(
        lambda: (done := _kubectl(config, "get", "ns", "-o", "name")).returncode == 0 and done,
        timeout=15,
        what="kubectl get ns with the profile's kubeconfig",
    )
    names = _names(listed.stdout)
    assert gw.clusters["cluster1"].only_here in names  # cluster1 answered
    assert gw.clusters["cluster2"].only_here not in names


def test_a_profile_comes_and_goes_with_its_cluster(inventory: Gateway) -> None:
    gw = inventory
    name = f"profiled-{gw.stack.tag}"
    _managed_cluster(gw, name)
    try:
        created = poll_until(
            lambda: _provider(p := _profile(gw, name)) and p, timeout=30, what=f"the profile of {name}"
        )
        assert (
            created["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "cluster-proxy-cluster-gateway"
        )
    finally:
        _delete_managed_cluster(gw, name)
    poll_until(lambda: _profile(gw, name) is None, timeout=30, what=f"the profile of {name} deleted")


def test_someone_elses_profile_gets_and_loses_only_our_entry(inventory: Gateway) -> None:
    """A profile made by another party for the same cluster (OCM's registration controller makes them
    too): the gateway adds its access provider beside the others, removes only it when the cluster
    goes, and leaves the profile."""
    gw = inventory
    name = f"shared-{gw.stack.tag}"
    theirs = {"name": "their-provider", "cluster": {"server": "https://elsewhere.example:6443"}}
    with gw.hub.api_client() as admin:
        custom = client.CustomObjectsApi(admin)
        custom.create_namespaced_custom_object(
            GROUP,
            VERSION,
            NAMESPACE,
            PLURAL,
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "ClusterProfile",
                "metadata": {"name": name},
                "spec": {"clusterManager": {"name": "open-cluster-management"}},
            },
        )
        made = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
        made["status"] = {"accessProviders": [theirs]}
        custom.replace_namespaced_custom_object_status(GROUP, VERSION, NAMESPACE, PLURAL, name, made)
    _managed_cluster(gw, name)
    try:
        both = poll_until(
            lambda: _provider(p := _profile(gw, name)) and p,
            timeout=30,
            what=f"our entry in {name}'s profile",
        )
        assert theirs in both["status"]["accessProviders"]
    finally:
        _delete_managed_cluster(gw, name)
    try:
        left = poll_until(
            lambda: (p := _profile(gw, name)) and _provider(p) is None and p,
            timeout=30,
            what=f"our entry removed from {name}'s profile",
        )
        assert left["status"]["accessProviders"] == [theirs]
    finally:
        with gw.hub.api_client() as admin, contextlib.suppress(client.exceptions.ApiException):
            client.CustomObjectsApi(admin).delete_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, PLURAL, name
            )
