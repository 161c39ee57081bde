"""Real OCM on the real clusters: cluster1 and cluster2 join the hub as a user makes them join (a
bootstrap kubeconfig, the CSR approved, the cluster accepted), cluster2 through its forward proxy;
then OCM's own work agent applies a ManifestWork to cluster1's node.

Run: ``.venv/bin/pytest -m platform tests/real_platform`` (as root; the first run builds OCM too).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support import nodeimages, realocm
from tests.support.realclusters import DIRECT, HUB, RealClusters

pytestmark = [pytest.mark.platform, pytest.mark.slow, pytest.mark.timeout(600)]


def _work(cluster: str, namespace: str) -> dict[str, object]:
    labels = {"app": "sleeper"}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "sleeper", "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "securityContext": {"runAsNonRoot": True},
                    "containers": [
                        {
                            "name": "sleeper",
                            "image": nodeimages.BUSYBOX_IMAGE,
                            "imagePullPolicy": "Never",
                            "command": ["/bin/sh", "-c", "echo applied by OCM; exec sleep 3600"],
                            "securityContext": {
                                "readOnlyRootFilesystem": True,
                                "allowPrivilegeEscalation": False,
                            },
                        }
                    ],
                },
            },
        },
    }
    return {
        "apiVersion": "work.open-cluster-management.io/v1",
        "kind": "ManifestWork",
        "metadata": {"name": "sleeper", "namespace": cluster},
        "spec": {
            "workload": {
                "manifests": [
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
                    {
                        "apiVersion": "v1",
                        "kind": "ConfigMap",
                        "metadata": {"name": "settings", "namespace": namespace},
                        "data": {"from": "the hub"},
                    },
                    deployment,
                ]
            }
        },
    }


def test_clusters_join_and_a_manifest_work_runs_on_a_real_node(
    real_clusters: RealClusters, tmp_path: Path
) -> None:
    hub = real_clusters[HUB]
    started = time.monotonic()
    # the join as a user does it (realocm.join_all: the bootstrap kubeconfig, the CSR approved, the
    # cluster accepted), here or by whichever test of the session came first: the clusters join once
    realocm.join_all(real_clusters, tmp_path)
    joined = time.monotonic() - started
    # cluster2's agent reached the hub through its forward proxy (its node has no other way there)
    assert real_clusters.proxy is not None
    assert f"CONNECT {hub.network.host_ip}:6443" in real_clusters.proxy.log_path.read_text()

    namespace = "ocm-applied"
    hub.apply([_work(DIRECT, namespace)])
    hub.kubectl_ok(
        "-n", DIRECT, "wait", "--for=condition=Applied", "manifestwork/sleeper", "--timeout=60s", timeout=70
    )
    managed = real_clusters[DIRECT]
    managed.kubectl_ok(
        "-n", namespace, "rollout", "status", "deployment/sleeper", "--timeout=90s", timeout=100
    )
    assert managed.kubectl_ok(
        "-n", namespace, "get", "configmap", "settings", "-o", "jsonpath={.data.from}"
    ) == ("the hub")
    assert "applied by OCM" in managed.kubectl_ok("-n", namespace, "logs", "deployment/sleeper")
    hub.kubectl_ok(
        "-n", DIRECT, "wait", "--for=condition=Available", "manifestwork/sleeper", "--timeout=60s", timeout=70
    )
    applied = time.monotonic() - started - joined

    # deleting the work removes what it applied from the managed cluster
    hub.kubectl_ok("-n", DIRECT, "delete", "manifestwork", "sleeper", "--timeout=90s", timeout=100)
    deadline = time.monotonic() + 60
    while managed.kubectl("get", "namespace", namespace).returncode == 0:
        assert time.monotonic() < deadline, f"{namespace} still on {DIRECT} 60 s after its work was deleted"
        time.sleep(0.5)
    print(f"joined in {joined:.1f}s, work applied and running in {applied:.1f}s")
