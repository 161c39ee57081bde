"""Seed 004 against real API servers: the cluster-gateway behind the hub kube-apiserver's aggregator.

The addon's stack runs as in test_through_tunnel (addon-manager, cert-signer and proxy-server from the
Deployments it wrote, agents from the ManifestWorks in cluster1 and cluster2). The ManagedClusters are
named ``cluster1`` and ``cluster2``, as a user sees them. The gateway runs as a process with a hub client
certificate of the signer, behind an ``APIService`` for ``v1alpha1.cluster.core.oam.dev`` whose Service
is an ``ExternalName`` to localhost (tests.support.kubeapi: the only route the aggregator takes here).
It reads the aggregator's requestheader CA and allowed names from the hub's ConfigMap
``kube-system/extension-apiserver-authentication``, as it does in a cluster.

Each managed cluster has a ServiceAccount ``cluster-gateway`` in ``open-cluster-management-managed-
serviceaccount`` (the seed's), and its TokenRequest token and CA are in the hub Secret
``<cluster>/cluster-gateway`` (what point 2's ManagedServiceAccount will write). Whether that
ServiceAccount may list namespaces in cluster1 is switched by the tests that care.

Every answer is checked for where it came from: a namespace that exists only in cluster1 (or cluster2).
"""

from __future__ import annotations

import base64
import json
import secrets
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from tests.support import require
from tests.support.gateway_rig import (
    APISERVICE,
    GROUP_PATH,
    SA_USER,
    TOKEN_SECRET,
    Gateway,
    _cluster_kubeconfig,
    _delete_managed_cluster,
    _hub_user,
    _kubectl,
    _managed_cluster,
    _names,
    _set_reader,
    running_gateway,
)
from tests.support.kubeapi import KubeClusters
from tests.support.waiting import poll_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway(kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(
        kube_clusters,
        tmp_path_factory.mktemp("gateway"),
        tagged=False,
        extra_args=["--serving-name=127.0.0.1"],  # for the direct call of test_errors_say_what_is_wrong
    ) as gateway:
        _set_reader(kube_clusters["cluster2"], True)
        yield gateway


def _raw(gateway: Gateway, path: str, kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
    return _kubectl(kubeconfig or gateway.hub.kubeconfig, "get", "--raw", path)


# --- the objects ------------------------------------------------------------------------------------------


def test_kubectl_get_clustergateway_lists_both_clusters_with_the_seed_columns(gateway: Gateway) -> None:
    done = gateway.hub.kubectl("get", "clustergateway")
    assert done.returncode == 0, f"{done.stderr}\n--- gateway\n{gateway.process.tail()}"
    rows = [line.split() for line in done.stdout.splitlines()]
    assert rows[0] == ["NAME", "PROVIDER", "CREDENTIAL-TYPE", "ENDPOINT-TYPE"], done.stdout
    assert ["cluster1", "cluster-proxy", "ServiceAccountToken", "ClusterProxy"] in rows[1:]
    assert ["cluster2", "cluster-proxy", "ServiceAccountToken", "ClusterProxy"] in rows[1:]
    print(f"\nkubectl get clustergateway:\n{done.stdout}")

    one = gateway.hub.kubectl("get", "clustergateway", "cluster1", "-o", "json")
    assert one.returncode == 0, one.stderr
    document = json.loads(one.stdout)
    assert document["kind"] == "ClusterGateway" and document["metadata"]["name"] == "cluster1"
    assert document["spec"]["access"] == {
        "endpoint": {"type": "ClusterProxy"},
        "credential": {"type": "ServiceAccountToken"},
    }
    assert "token" not in one.stdout.lower().replace("serviceaccounttoken", "")  # never the credential


def test_watch_of_clustergateways_sees_a_cluster_that_gets_the_addon(gateway: Gateway) -> None:
    kubectl = shutil.which("kubectl")
    require(kubectl is not None, "kubectl (apt-get install kubernetes-client)")
    assert kubectl is not None
    name = f"late-{gateway.stack.tag}"
    log = gateway.directory / "watch.out"
    with log.open("w") as out:
        watch = subprocess.Popen(
            [kubectl, f"--kubeconfig={gateway.hub.kubeconfig}", "get", "clustergateway", "-w", "-o", "name"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        poll_until(
            lambda: "clustergateway" in log.read_text() and "cluster2" in log.read_text(),
            timeout=30,
            what="the listed gateways",
        )
        _managed_cluster(gateway, name)
        poll_until(lambda: f"/{name}" in log.read_text(), timeout=30, what=f"{name} in the watch")
    finally:
        watch.terminate()
        watch.wait(10)
        _delete_managed_cluster(gateway, name)


# --- the proxy subresource --------------------------------------------------------------------------------


def test_healthz_through_the_gateway_answers_from_each_cluster(gateway: Gateway) -> None:
    for name in ("cluster1", "cluster2"):
        done = _raw(gateway, gateway.proxy_path(name, "/healthz"))
        assert done.returncode == 0, f"{done.stderr}\n--- gateway\n{gateway.process.tail()}"
        assert done.stdout.strip() == "ok"
    # which server answered: cluster2's gateway ServiceAccount may read namespaces; each sees its own
    _set_reader(gateway.clusters["cluster1"].api, True)
    for name, other in (("cluster1", "cluster2"), ("cluster2", "cluster1")):
        here = gateway.clusters[name].only_here
        found = poll_until(
            lambda n=name, h=here: (
                (done := _raw(gateway, gateway.proxy_path(n, f"/api/v1/namespaces/{h}"))).returncode == 0
                and done
            ),
            timeout=15,
            what=f"namespace {here} through the gateway",
        )
        assert found.returncode == 0, found.stderr
        assert json.loads(found.stdout)["metadata"]["name"] == here
        missing = _raw(
            gateway, gateway.proxy_path(name, f"/api/v1/namespaces/{gateway.clusters[other].only_here}")
        )
        assert missing.returncode != 0 and "NotFound" in missing.stderr, missing.stderr


def test_hub_rbac_on_the_proxy_subresource_decides_who_passes(gateway: Gateway) -> None:
    alice = _hub_user(gateway, f"alice-{gateway.stack.tag}")
    bob_name = f"bob-{gateway.stack.tag}"
    bob = _hub_user(gateway, bob_name)
    role = f"gateway-proxy-{gateway.stack.tag}"
    with gateway.hub.api_client() as admin:
        rbac = client.RbacAuthorizationV1Api(admin)
        rbac.create_cluster_role(
            {
                "metadata": {"name": role},
                "rules": [
                    {
                        "apiGroups": ["cluster.core.oam.dev"],
                        "resources": ["clustergateways/proxy"],
                        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
                    }
                ],
            }
        )
        rbac.create_cluster_role_binding(
            {
                "metadata": {"name": role},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                "subjects": [{"kind": "User", "name": bob_name, "apiGroup": "rbac.authorization.k8s.io"}],
            }
        )
    try:
        path = gateway.proxy_path("cluster1", "/healthz")
        refused = _raw(gateway, path, alice)
        assert refused.returncode != 0
        assert "Forbidden" in refused.stderr and "clustergateways/proxy" in refused.stderr, refused.stderr
        assert "alice" in refused.stderr
        print(f"\nhub user without RBAC: {refused.stderr.strip()}")
        passed = poll_until(
            lambda: (done := _raw(gateway, path, bob)).returncode == 0 and done,
            timeout=15,
            what="bob through the gateway once the binding is seen",
        )
        assert passed.stdout.strip() == "ok"
        # the gateway saw bob, named by the aggregator's requestheader identity
        poll_until(
            lambda: [
                r
                for r in gateway.process.events()
                if r.get("event") == "request" and r.get("user") == bob_name
            ],
            timeout=10,
            what="the gateway's request record naming bob",
        )
    finally:
        with gateway.hub.api_client() as admin:
            rbac = client.RbacAuthorizationV1Api(admin)
            rbac.delete_cluster_role_binding(role)
            rbac.delete_cluster_role(role)


# --- kubectl with the generated kubeconfig ----------------------------------------------------------------


def test_kubeconfig_from_the_cli_points_at_the_proxy_subresource(gateway: Gateway) -> None:
    config = yaml.safe_load(_cluster_kubeconfig(gateway, "cluster1").read_text())
    server = config["clusters"][0]["cluster"]["server"]
    assert server == f"{gateway.hub.url}{GROUP_PATH}/clustergateways/cluster1/proxy"
    # the hub user's own credentials, nothing of cluster1
    assert config["users"][0]["user"]["client-certificate"] == str(gateway.hub.admin.cert)
    assert config["clusters"][0]["cluster"]["certificate-authority"] == str(gateway.hub.ca_path)


def test_forbidden_in_cluster1_names_the_service_account_until_granted(gateway: Gateway) -> None:
    config = _cluster_kubeconfig(gateway, "cluster1")
    cluster1 = gateway.clusters["cluster1"].api
    _set_reader(cluster1, False)
    refused = poll_until(
        lambda: (done := _kubectl(config, "get", "ns", "-o", "name")).returncode != 0 and done,
        timeout=15,
        what="Forbidden once the binding is gone",
    )
    assert (
        "Forbidden" in refused.stderr
        and f'User "{SA_USER}" cannot list resource "namespaces"' in refused.stderr
    )
    print(f"\nbefore RBAC in cluster1: {refused.stderr.strip()}")
    _set_reader(cluster1, True)
    allowed = poll_until(
        lambda: (done := _kubectl(config, "get", "ns", "-o", "name")).returncode == 0 and done,
        timeout=15,
        what="namespaces once granted",
    )
    names = _names(allowed.stdout)
    assert gateway.clusters["cluster1"].only_here in names
    assert gateway.clusters["cluster2"].only_here not in names


def test_kubectl_through_the_gateway_gets_creates_applies_deletes_and_watches(gateway: Gateway) -> None:
    config = _cluster_kubeconfig(gateway, "cluster1")
    _set_reader(gateway.clusters["cluster1"].api, True)
    namespace = gateway.clusters["cluster1"].only_here
    listed = poll_until(
        lambda: (done := _kubectl(config, "get", "ns", "-o", "name")).returncode == 0 and done,
        timeout=15,
        what="get ns through the gateway",
    )
    assert namespace in _names(listed.stdout)

    created = _kubectl(config, "-n", namespace, "create", "configmap", "gw", "--from-literal=a=1")
    assert created.returncode == 0, created.stderr
    manifest = yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "gw", "namespace": namespace},
            "data": {"a": "2"},
        }
    )
    applied = subprocess.run(
        [shutil.which("kubectl") or "kubectl", f"--kubeconfig={config}", "apply", "-f", "-"],
        input=manifest,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert applied.returncode == 0, applied.stderr
    with gateway.clusters["cluster1"].api.api_client() as admin:
        stored = client.CoreV1Api(admin).read_namespaced_config_map("gw", namespace)
    assert stored.data == {"a": "2"}  # in cluster1's own API server
    deleted = _kubectl(config, "-n", namespace, "delete", "configmap", "gw")
    assert deleted.returncode == 0, deleted.stderr
    with (
        gateway.clusters["cluster1"].api.api_client() as admin,
        pytest.raises(client.exceptions.ApiException) as gone,
    ):
        client.CoreV1Api(admin).read_namespaced_config_map("gw", namespace)
    assert gone.value.status == 404

    # a watch streams through the aggregator, the gateway and the tunnel: an event after it started
    kubectl = shutil.which("kubectl")
    assert kubectl is not None
    log = gateway.directory / "ns-watch.out"
    late = f"late-ns-{secrets.token_hex(3)}"
    with log.open("w") as out:
        watch = subprocess.Popen(
            [kubectl, f"--kubeconfig={config}", "get", "ns", "-w", "-o", "name"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        poll_until(lambda: namespace in log.read_text(), timeout=30, what="the watch's initial list")
        started = time.monotonic()
        with gateway.clusters["cluster1"].api.api_client() as admin:
            client.CoreV1Api(admin).create_namespace({"metadata": {"name": late}})
        poll_until(lambda: late in log.read_text(), timeout=30, what=f"{late} in the watch")
        print(
            f"\nnamespace created in cluster1 seen by kubectl get ns -w through the gateway after {(time.monotonic() - started) * 1000:.0f} ms"
        )
        assert watch.poll() is None, log.read_text()  # still streaming
    finally:
        watch.terminate()
        watch.wait(10)


# --- errors in words ---------------------------------------------------------------------------------------


def test_errors_say_what_is_wrong(gateway: Gateway) -> None:
    unknown = _raw(gateway, gateway.proxy_path("nowhere", "/healthz"))
    assert unknown.returncode != 0
    assert (
        "(NotFound)" in unknown.stderr
        and 'clustergateways.cluster.core.oam.dev "nowhere" not found' in unknown.stderr
    )
    got = gateway.hub.kubectl("get", "clustergateway", "nowhere")
    assert got.returncode != 0 and "NotFound" in got.stderr, got.stderr

    lonely = f"lonely-{gateway.stack.tag}"
    _managed_cluster(gateway, lonely)
    try:
        not_projected = poll_until(
            lambda: (
                "ServiceUnavailable" in (done := _raw(gateway, gateway.proxy_path(lonely, "/healthz"))).stderr
                and done
            ),
            timeout=15,
            what=f"503 for {lonely}",
        )
        assert f"Secret {lonely}/{TOKEN_SECRET} on the hub does not exist" in not_projected.stderr
        assert "not projected yet" in not_projected.stderr
        print(f"\ntoken not projected: {not_projected.stderr.strip()}")
        with gateway.hub.api_client() as admin:
            client.CoreV1Api(admin).create_namespaced_secret(
                lonely,
                {
                    "metadata": {"name": TOKEN_SECRET},
                    "stringData": {"token": "x", "ca.crt": gateway.hub.ca_path.read_text()},
                },
            )
        no_tunnel = poll_until(
            lambda: (
                "no tunnel" in (done := _raw(gateway, gateway.proxy_path(lonely, "/healthz"))).stderr and done
            ),
            timeout=15,
            what=f"no tunnel for {lonely}",
        )
        assert (
            "ServiceUnavailable" in no_tunnel.stderr
            and "no proxy-agent of it is connected" in no_tunnel.stderr
        )
        print(f"no tunnel: {no_tunnel.stderr.strip()}")
    finally:
        _delete_managed_cluster(gateway, lonely)

    # a CA that did not sign cluster2's serving certificate in its Secret: TLS fails, said in words
    with gateway.hub.api_client() as admin:
        core = client.CoreV1Api(admin)
        right = core.read_namespaced_secret(TOKEN_SECRET, "cluster2").data["ca.crt"]
        wrong = base64.b64encode(gateway.kube_clusters.front_proxy_ca.path.read_bytes()).decode()
        core.patch_namespaced_secret(TOKEN_SECRET, "cluster2", {"data": {"ca.crt": wrong}})
        try:
            refused = poll_until(
                lambda: (
                    "BadGateway" in (done := _raw(gateway, gateway.proxy_path("cluster2", "/healthz"))).stderr
                    and done
                ),
                timeout=15,
                what="502 for a wrong CA",
            )
            assert "TLS with the kube-apiserver of cluster 'cluster2' failed" in refused.stderr
            assert "certificate verify failed" in refused.stderr and "ca.crt" in refused.stderr
            print(f"wrong CA: {refused.stderr.strip()}")
        finally:
            core.patch_namespaced_secret(TOKEN_SECRET, "cluster2", {"data": {"ca.crt": right}})
    poll_until(
        lambda: _raw(gateway, gateway.proxy_path("cluster2", "/healthz")).returncode == 0,
        timeout=15,
        what="cluster2 back with its CA",
    )

    # nobody but the aggregator: a direct call without its front-proxy certificate
    # the gateway's own serving CA, which it wrote into the APIService
    registered = gateway.hub.kubectl("get", "apiservice", APISERVICE, "-o", "jsonpath={.spec.caBundle}")
    assert registered.returncode == 0, registered.stderr
    context = ssl.create_default_context(cadata=base64.b64decode(registered.stdout).decode())
    request = urllib.request.Request(
        f"https://127.0.0.1:{gateway.port}{gateway.proxy_path('cluster1', '/healthz')}",
        headers={"X-Remote-User": "mallory"},
    )
    with pytest.raises(urllib.error.HTTPError) as direct:
        urllib.request.urlopen(request, context=context, timeout=10)
    assert direct.value.code == 401
    assert "only the hub kube-apiserver's aggregator" in direct.value.read().decode()


# --- a number for the closing note (printed, never asserted) -----------------------------------------------


def _latencies(url: str, context: ssl.SSLContext, count: int) -> list[float]:
    """Milliseconds of ``count`` sequential GETs of ``url``, each on a new connection (as kubectl's
    first request), every answer checked."""
    measured = []
    for _ in range(count):
        started = time.perf_counter()
        with urllib.request.urlopen(url, context=context, timeout=30) as answer:
            assert answer.status == 200 and answer.read().strip() == b"ok"
        measured.append((time.perf_counter() - started) * 1000)
    return sorted(measured)


def test_healthz_latency_through_the_gateway_and_straight(gateway: Gateway) -> None:
    hub, cluster1 = gateway.hub, gateway.clusters["cluster1"].api
    count = 50
    through = _latencies(
        f"{hub.url}{gateway.proxy_path('cluster1', '/healthz')}", hub.admin_ssl_context(), count
    )
    straight = _latencies(f"{cluster1.url}/healthz", cluster1.admin_ssl_context(), count)

    def summary(values: list[float]) -> str:
        return f"p50 {values[len(values) // 2]:.1f} ms, p99 {values[int(len(values) * 0.99) - 1]:.1f} ms"

    print(
        f"\nGET /healthz x{count}: through the hub and the gateway {summary(through)}; straight {summary(straight)}"
    )
