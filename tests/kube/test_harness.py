"""The real-API-server harness itself: RBAC on, admin access through the Python client and kubectl,
clusters isolated by etcd prefix, the OCM CRDs served on the hub, TokenRequest, restart in place."""

from __future__ import annotations

import base64
import json
import ssl
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.support.kubeapi import KubeCluster, KubeClusters

pytestmark = pytest.mark.slow

OCM_KINDS = {
    "managedclusters.cluster.open-cluster-management.io",
    "clustermanagementaddons.addon.open-cluster-management.io",
    "managedclusteraddons.addon.open-cluster-management.io",
    "addondeploymentconfigs.addon.open-cluster-management.io",
    "manifestworks.work.open-cluster-management.io",
}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def request(
    cluster: KubeCluster,
    path: str,
    *,
    context: ssl.SSLContext | None = None,
    token: str | None = None,
    body: dict[str, Any] | None = None,
) -> tuple[int, dict[str, Any]]:
    """One HTTPS request to the API server; (status, JSON body) whatever the status."""
    if context is None:
        context = ssl.create_default_context(cafile=str(cluster.ca_path))
    headers = {"Accept": "application/json", "Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    sent = urllib.request.Request(cluster.url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(sent, context=context, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def namespace(kube_clusters: KubeClusters) -> Iterator[str]:
    """A fresh namespace name (created by the test where it needs one; deleted everywhere after)."""
    name = unique("harness")
    yield name
    for cluster in kube_clusters:
        cluster.kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=false")


def test_rbac_refuses_anonymous_bad_token_and_unprivileged_users(kube_clusters: KubeClusters) -> None:
    hub = kube_clusters["hub"]
    status, body = request(hub, "/api/v1/namespaces")
    assert (status, body["reason"]) == (403, "Forbidden"), body
    assert "system:anonymous" in body["message"]

    status, body = request(hub, "/api/v1/namespaces", token="not-a-token")
    assert (status, body["reason"]) == (401, "Unauthorized"), body

    nobody = kube_clusters.ca.issue(unique("nobody"), "nobody", organizations=["some-team"])
    context = ssl.create_default_context(cafile=str(hub.ca_path))
    context.load_cert_chain(str(nobody.cert), str(nobody.key))
    status, body = request(hub, "/api/v1/namespaces", context=context)
    assert (status, body["reason"]) == (403, "Forbidden"), body
    assert 'User "nobody"' in body["message"]

    status, body = request(hub, "/api/v1/namespaces", token=hub.admin_token)
    assert status == 200, body


def test_admin_kubeconfig_works_with_python_client_and_kubectl(kube_clusters: KubeClusters) -> None:
    for cluster in kube_clusters:
        with cluster.api_client() as api:
            names = {ns.metadata.name for ns in client.CoreV1Api(api).list_namespace().items}
            version = client.VersionApi(api).get_code()
        assert {"default", "kube-system", "kube-public"} <= names, (cluster.name, names)
        assert version.git_version == "v1.32.13", version

        listed = cluster.kubectl("get", "ns", "-o", "name")
        assert listed.returncode == 0, listed.stderr
        assert "namespace/default" in listed.stdout.split()

        whoami = cluster.kubectl("auth", "whoami", "-o", "json")
        assert whoami.returncode == 0, whoami.stderr
        user = json.loads(whoami.stdout)["status"]["userInfo"]
        assert "system:masters" in user["groups"], user


def etcd_keys(kube_clusters: KubeClusters, prefix: str) -> list[str]:
    """Keys under ``prefix`` in the shared etcd, read through its v3 JSON gateway."""
    key = base64.b64encode(prefix.encode()).decode()
    range_end = base64.b64encode(prefix[:-1].encode() + bytes([ord(prefix[-1]) + 1])).decode()
    body = json.dumps({"key": key, "range_end": range_end, "keys_only": True}).encode()
    sent = urllib.request.Request(f"{kube_clusters.etcd.url}/v3/kv/range", data=body)
    with urllib.request.urlopen(sent, timeout=10) as response:
        found = json.loads(response.read())
    return [base64.b64decode(kv["key"]).decode() for kv in found.get("kvs", [])]


def test_each_cluster_stores_under_its_own_etcd_prefix(kube_clusters: KubeClusters, namespace: str) -> None:
    hub, cluster1, cluster2 = (kube_clusters[n] for n in ("hub", "cluster1", "cluster2"))
    created = hub.kubectl("create", "namespace", namespace)
    assert created.returncode == 0, created.stderr

    assert etcd_keys(kube_clusters, f"/hub/namespaces/{namespace}") == [f"/hub/namespaces/{namespace}"]
    assert etcd_keys(kube_clusters, f"/cluster1/namespaces/{namespace}") == []
    for other in (cluster1, cluster2):
        missing = other.kubectl("get", "namespace", namespace)
        assert missing.returncode != 0
        assert "NotFound" in missing.stderr, missing.stderr


def test_ocm_crds_established_on_the_hub_only(kube_clusters: KubeClusters) -> None:
    hub, cluster1 = kube_clusters["hub"], kube_clusters["cluster1"]
    with hub.api_client() as api:
        crds = client.ApiextensionsV1Api(api).list_custom_resource_definition().items
    established = {
        crd.metadata.name
        for crd in crds
        if any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])
    }
    assert established >= OCM_KINDS, established

    name = unique("managed")
    managed_cluster = {
        "apiVersion": "cluster.open-cluster-management.io/v1",
        "kind": "ManagedCluster",
        "metadata": {"name": name},
        "spec": {"hubAcceptsClient": True},
    }
    with hub.api_client() as api:
        objects = client.CustomObjectsApi(api)
        objects.create_cluster_custom_object(
            "cluster.open-cluster-management.io", "v1", "managedclusters", managed_cluster
        )
        try:
            read = objects.get_cluster_custom_object(
                "cluster.open-cluster-management.io", "v1", "managedclusters", name
            )
            assert read["spec"]["hubAcceptsClient"] is True
            # The structural schema is enforced: an unknown type for a known field is refused.
            bad = {
                **managed_cluster,
                "metadata": {"name": unique("bad")},
                "spec": {"hubAcceptsClient": "yes"},
            }
            with pytest.raises(ApiException) as refused:
                objects.create_cluster_custom_object(
                    "cluster.open-cluster-management.io", "v1", "managedclusters", bad
                )
            assert refused.value.status == 422, refused.value.body
        finally:
            objects.delete_cluster_custom_object(
                "cluster.open-cluster-management.io", "v1", "managedclusters", name
            )

    absent = cluster1.kubectl("get", "managedclusters")
    assert absent.returncode != 0
    assert "the server doesn't have a resource type" in absent.stderr, absent.stderr


def test_token_request_issues_a_service_account_token_the_server_accepts(
    kube_clusters: KubeClusters, namespace: str
) -> None:
    cluster1 = kube_clusters["cluster1"]
    with cluster1.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
        core.create_namespaced_service_account(
            namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="agent"))
        )
        issued = core.create_namespaced_service_account_token(
            "agent",
            namespace,
            client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600)
            ),
        )
    token = issued.status.token
    assert token.count(".") == 2, "not a JWT"

    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    status, body = request(
        cluster1, "/apis/authentication.k8s.io/v1/selfsubjectreviews", token=token, body=review
    )
    assert status == 201, body
    assert body["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:agent"

    # The token is cluster1's: the hub (another signing key) does not accept it.
    status, body = request(
        kube_clusters["hub"], "/apis/authentication.k8s.io/v1/selfsubjectreviews", token=token, body=review
    )
    assert status == 401, body


def test_restart_keeps_data_and_the_other_clusters_keep_serving(
    kube_clusters: KubeClusters, namespace: str
) -> None:
    hub, cluster1 = kube_clusters["hub"], kube_clusters["cluster1"]
    created = hub.kubectl("create", "namespace", namespace)
    assert created.returncode == 0, created.stderr
    port, pid = hub.port, hub.process.pid

    hub.stop()
    assert not hub.process.running
    assert hub.readyz()[0] is False
    listed = cluster1.kubectl("get", "ns", "-o", "name")
    assert listed.returncode == 0 and "namespace/default" in listed.stdout, listed.stderr

    started = time.monotonic()
    hub.start()
    print(f"hub API server ready {time.monotonic() - started:.1f}s after start")
    assert (hub.port, hub.url) == (port, f"https://127.0.0.1:{port}")
    assert hub.process.pid != pid
    kept = hub.kubectl("get", "namespace", namespace, "-o", "jsonpath={.metadata.name}")
    assert (kept.returncode, kept.stdout) == (0, namespace), kept.stderr
    crds = hub.kubectl("get", "crd", "managedclusters.cluster.open-cluster-management.io")
    assert crds.returncode == 0, crds.stderr

    hub.restart()
    again = hub.kubectl("get", "namespace", namespace, "-o", "name")
    assert again.returncode == 0, again.stderr
