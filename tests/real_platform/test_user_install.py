"""The addon installed as a user installs it, on the real clusters with real OCM: the project's images
(the compose layer's) imported into each node's containerd, ``kubectl apply -k`` of the hub overlays,
the addon enabled for cluster1 as ``clusteradm addon enable`` does, OCM's own work agent applying
our ManifestWork, our agent on cluster1's node holding its tunnel to the proxy-server on the hub's
node, the addon Available (written by our addon-manager, ``healthCheck.mode: Customized``), the
health-collector's probe of cluster1's real kube-apiserver through the tunnel; then disabled and
uninstalled, leaving nothing of ours.

The hub's load balancer is played as k3s's ServiceLB plays it: the LoadBalancer Services' ingress
address is the hub node's own (kube-proxy forwards the ports there; the managed nodes may reach
them: ``realclusters.HUB_LB_PORTS``).

Needs the project's images: ``bash scripts/compose.sh images``. Runs after ``test_real_ocm`` in a
session (the clusters are joined once: :func:`realocm.join_all`).
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support import nodeimages, realocm
from tests.support.realclusters import DIRECT, HUB, PROXIED, RealClusters
from tests.support.realnode import RealCluster

pytestmark = [pytest.mark.platform, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = REPO / "deploy" / "kustomize" / "overlays"
ADDON_NAMESPACE = "open-cluster-management-addon"
AGENT_NAMESPACE = "open-cluster-management-cluster-proxy"  # the manager's default (config.py)
LB_SERVICES = ("proxy-agent-entrypoint", "cluster-proxy-cert-signer-entrypoint")
PART_OF = "app.kubernetes.io/part-of=cluster-proxy"


def _wait(what: str, check: object, timeout: float, cluster: RealCluster | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            detail = ""
            if cluster is not None:
                detail = cluster.kubectl("get", "pods", "-A", "-o", "wide").stdout
            raise AssertionError(f"{what}: not after {timeout:g}s\n{detail}")
        time.sleep(0.5)


def _rollout(cluster: RealCluster, namespace: str, deployment: str, timeout: float = 120) -> None:
    done = cluster.kubectl(
        "-n",
        namespace,
        "rollout",
        "status",
        f"deployment/{deployment}",
        f"--timeout={timeout:g}s",
        timeout=timeout + 10,
    )
    if done.returncode != 0:
        pods = cluster.kubectl("-n", namespace, "get", "pods", "-o", "wide").stdout
        described = cluster.kubectl("-n", namespace, "describe", "pods").stdout[-6000:]
        logs = cluster.kubectl(
            "-n", namespace, "logs", f"deployment/{deployment}", "--all-containers", "--tail=40"
        )
        raise AssertionError(
            f"{cluster.name}: {deployment} not rolled out:\n{done.stderr}\n{pods}\n{described}\n"
            f"{logs.stdout}{logs.stderr}"
        )


def _play_load_balancer(hub: RealCluster) -> None:
    """What a load-balancer provider does for the manager's LoadBalancer Services: an ingress
    address (the hub node's, as k3s's ServiceLB gives)."""
    status = json.dumps({"status": {"loadBalancer": {"ingress": [{"ip": hub.network.node_ip}]}}})
    for name in LB_SERVICES:
        _wait(
            f"Service {name}",
            lambda n=name: hub.kubectl("-n", ADDON_NAMESPACE, "get", "svc", n).returncode == 0,
            60,
            hub,
        )
        hub.kubectl_ok(
            "-n", ADDON_NAMESPACE, "patch", "svc", name, "--subresource=status", "--type=merge", "-p", status
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _collector(hub: RealCluster) -> dict[str, object]:
    """The health-collector's document, through ``kubectl port-forward`` as docs/kubernetes.md shows."""
    port = _free_port()
    forward = subprocess.Popen(
        [
            str(hub.kubectl_binary),
            f"--kubeconfig={hub.kubeconfig}",
            "-n",
            ADDON_NAMESPACE,
            "port-forward",
            "svc/cluster-proxy-health-collector",
            f"{port}:8080",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/clusters", timeout=5) as page:
                    return json.loads(page.read())
            except OSError:
                assert forward.poll() is None, f"port-forward exited: {forward.stderr.read()}"  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "the health-collector did not answer"
                time.sleep(0.5)
    finally:
        forward.terminate()
        forward.wait(10)


def _ours(cluster: RealCluster, *kinds: str) -> str:
    """Every object of ours (the project's label) of ``kinds`` left on ``cluster``."""
    done = cluster.kubectl("get", ",".join(kinds), "-A", "-l", PART_OF, "-o", "name")
    return done.stdout.strip()


def _enable(hub: RealCluster, cluster: str, https_proxy: str = "") -> None:
    """The ManagedClusterAddOn (docs/kubernetes.md), with an AddOnDeploymentConfig naming the
    forward proxy when the cluster needs one."""
    addon: dict[str, object] = {
        "apiVersion": "addon.open-cluster-management.io/v1alpha1",
        "kind": "ManagedClusterAddOn",
        "metadata": {"name": "cluster-proxy", "namespace": cluster},
        "spec": {},
    }
    documents: list[dict[str, object]] = [addon]
    if https_proxy:
        documents.insert(
            0,
            {
                "apiVersion": "addon.open-cluster-management.io/v1alpha1",
                "kind": "AddOnDeploymentConfig",
                "metadata": {"name": "cluster-proxy", "namespace": cluster},
                "spec": {"proxyConfig": {"httpsProxy": https_proxy}},
            },
        )
        addon["spec"] = {
            "configs": [
                {
                    "group": "addon.open-cluster-management.io",
                    "resource": "addondeploymentconfigs",
                    "name": "cluster-proxy",
                    "namespace": cluster,
                }
            ]
        }
    hub.apply(documents)


def _agent_running(managed: RealCluster) -> None:
    _wait(
        f"the agent's Deployment on {managed.name}",
        lambda: (
            managed.kubectl("-n", AGENT_NAMESPACE, "get", "deployment", "-o", "name").stdout.strip() != ""
        ),
        120,
        managed,
    )
    name = managed.kubectl_ok("-n", AGENT_NAMESPACE, "get", "deployment", "-o", "name").split()[0]
    _rollout(managed, AGENT_NAMESPACE, name.split("/", 1)[1])


def _available(hub: RealCluster, cluster: str) -> dict[str, Any]:
    done = hub.kubectl(
        "-n",
        cluster,
        "wait",
        "--for=condition=Available",
        "managedclusteraddon/cluster-proxy",
        "--timeout=120s",
        timeout=130,
    )
    addon = json.loads(
        hub.kubectl_ok("-n", cluster, "get", "managedclusteraddon", "cluster-proxy", "-o", "json")
    )
    assert done.returncode == 0, (
        f"{cluster}: the addon not Available: {json.dumps(addon.get('status'), indent=1)}"
    )
    return addon


def _probed_healthy(hub: RealCluster, cluster: str) -> bool:
    rows = _collector(hub).get("clusters") or []
    row = next((r for r in rows if r.get("name") == cluster), None)  # type: ignore[union-attr]
    return bool(row and row.get("probed") and row.get("state") == "healthy")


def test_the_addon_installed_enabled_and_removed_as_a_user_does(
    real_clusters: RealClusters, tmp_path: Path
) -> None:
    hub, managed = real_clusters[HUB], real_clusters[DIRECT]
    times: dict[str, float] = {}
    started = time.monotonic()
    realocm.join_all(real_clusters, tmp_path)
    times["joined"] = time.monotonic() - started

    # the project's images in each node's containerd (docker save, cached by image ID)
    with ThreadPoolExecutor(3) as pool:
        hub_archive = pool.submit(nodeimages.project_images_archive, nodeimages.HUB_IMAGES)
        agent_archive = pool.submit(nodeimages.project_images_archive, nodeimages.AGENT_IMAGES)
        jobs = [pool.submit(hub.import_images, [hub_archive.result()])]
        jobs += [
            pool.submit(real_clusters[name].import_images, [agent_archive.result()])
            for name in (DIRECT, PROXIED)
        ]
        for job in jobs:
            job.result()
    times["images"] = time.monotonic() - started

    # the install: docs/kubernetes.md, "Installing the hub"
    hub.kubectl_ok("apply", "-k", str(OVERLAYS / "hub"), timeout=120)
    _rollout(hub, ADDON_NAMESPACE, "cluster-proxy-addon-manager")
    hub.kubectl_ok("apply", "-k", str(OVERLAYS / "hub-configuration"), timeout=120)
    _play_load_balancer(hub)
    for deployment in ("cluster-proxy-cert-signer", "cluster-proxy", "cluster-proxy-health-collector"):
        _rollout(hub, ADDON_NAMESPACE, deployment)
    times["hub installed"] = time.monotonic() - started

    # enable for cluster1, as `clusteradm addon enable --names cluster-proxy --clusters cluster1`
    _enable(hub, DIRECT)
    _agent_running(managed)
    addon = _available(hub, DIRECT)
    assert addon["status"]["healthCheck"]["mode"] == "Customized", addon["status"]
    times["cluster1 available"] = time.monotonic() - started
    # cluster1's real kube-apiserver probed through the tunnel by its bare name (the health-collector)
    _wait("cluster1 probed healthy through its tunnel", lambda: _probed_healthy(hub, DIRECT), 90, hub)
    times["cluster1 probed"] = time.monotonic() - started

    # cluster2: its agent reaches the hub only through the forward proxy (AddOnDeploymentConfig)
    _enable(hub, PROXIED, https_proxy=real_clusters.proxy_url)
    _agent_running(real_clusters[PROXIED])
    _available(hub, PROXIED)
    _wait("cluster2 probed healthy through its tunnel", lambda: _probed_healthy(hub, PROXIED), 90, hub)
    assert real_clusters.proxy is not None
    assert f"CONNECT {hub.network.node_ip}:8091" in real_clusters.proxy.log_path.read_text()
    times["cluster2 probed"] = time.monotonic() - started

    # disable: nothing of ours left on cluster1
    hub.kubectl_ok(
        "-n", DIRECT, "delete", "managedclusteraddon", "cluster-proxy", "--timeout=120s", timeout=130
    )
    _wait(
        "nothing of ours on cluster1",
        lambda: (
            managed.kubectl("get", "namespace", AGENT_NAMESPACE).returncode != 0
            and not _ours(managed, "deployments", "serviceaccounts", "clusterroles", "clusterrolebindings")
        ),
        120,
        managed,
    )
    times["disabled"] = time.monotonic() - started

    # uninstall: docs/kubernetes.md's order (configuration, then the hub overlay)
    hub.kubectl_ok("delete", "-k", str(OVERLAYS / "hub-configuration"), "--timeout=120s", timeout=130)
    hub.kubectl_ok("delete", "-k", str(OVERLAYS / "hub"), "--timeout=180s", timeout=190)
    _wait(
        "nothing of ours on the hub",
        lambda: (
            hub.kubectl("get", "namespace", ADDON_NAMESPACE).returncode != 0
            and not _ours(hub, "clusterroles", "clusterrolebindings", "crds")
        ),
        120,
        hub,
    )
    times["uninstalled"] = time.monotonic() - started
    print("times (s from the test's start): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
