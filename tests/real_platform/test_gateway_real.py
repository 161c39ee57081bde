"""The cluster-gateway on the real clusters: the hub's aggregated API (``overlays/hub-gateway``,
docs/kubernetes.md "The cluster gateway") in front of cluster1's real kube-apiserver and kubelet. The
real kubectl of the nodes, with the kubeconfig ``cluster-proxy kubeconfig cluster1`` writes from the
hub's (docs/cluster-gateway.md), lists cluster1's pods through the hub and runs ``kubectl exec`` into
a real pod there: kubectl offers ``v5.channel.k8s.io`` (WebSocket) to the hub, the gateway carries it
through the tunnel, cluster1's API server turns it into SPDY toward its kubelet. Then the addon is
disabled and everything uninstalled in docs/kubernetes.md's order ("Uninstalling"), leaving nothing of
ours: the gateway's finalizers on the ManagedServiceAccounts do not hold the CRD.

Needs the project's images: ``bash scripts/compose.sh images``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.support import nodeimages, realocm
from tests.support.realclusters import DIRECT, HUB, RealClusters
from tests.support.realinstall import (
    ADDON_NAMESPACE,
    AGENT_NAMESPACE,
    OVERLAYS,
    REPO,
    agent_running,
    disable,
    enable,
    import_images,
    install_hub,
    rollout,
    uninstall,
    wait_available,
    wait_for,
)
from tests.support.realnode import RealCluster

pytestmark = [pytest.mark.platform, pytest.mark.slow, pytest.mark.timeout(900)]

APISERVICE = "v1alpha1.cluster.core.oam.dev"
MSA_CRD = "managedserviceaccounts.authentication.open-cluster-management.io"
MSA_NAMESPACE = "open-cluster-management-managed-serviceaccount"  # where cluster1's agent makes them
GRANT = "hub-users-through-the-gateway"


def user_kubectl(
    cluster: RealCluster, kubeconfig: Path, *args: str, input: bytes | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[bytes]:
    """The node's real kubectl with a user's kubeconfig (not the admin's of ``cluster``)."""
    return subprocess.run(
        [str(cluster.kubectl_binary), f"--kubeconfig={kubeconfig}", *args],
        input=input,
        capture_output=True,
        timeout=timeout,
    )


def apiservice_available(hub: RealCluster) -> bool:
    done = hub.kubectl("get", "apiservice", APISERVICE, "-o", "json")
    if done.returncode != 0:
        return False
    conditions = json.loads(done.stdout).get("status", {}).get("conditions") or []
    return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)


def test_kubectl_get_and_exec_on_cluster1_through_the_hub_gateway(
    real_clusters: RealClusters, tmp_path: Path
) -> None:
    hub, managed = real_clusters[HUB], real_clusters[DIRECT]
    times: dict[str, float] = {}
    started = time.monotonic()
    realocm.join_all(real_clusters, tmp_path)
    import_images(real_clusters)
    times["images"] = time.monotonic() - started
    # docs/kubernetes.md: the hub overlay, its configuration, then the gateway
    install_hub(hub)
    hub.kubectl_ok("apply", "-k", str(OVERLAYS / "hub-gateway"), timeout=120)
    rollout(hub, ADDON_NAMESPACE, "cluster-proxy-cluster-gateway")
    wait_for("the APIService Available", lambda: apiservice_available(hub), 90, hub)
    times["gateway installed"] = time.monotonic() - started

    enable(hub, DIRECT)
    agent_running(managed)
    wait_available(hub, DIRECT)
    times["cluster1 available"] = time.monotonic() - started

    # the user's kubeconfig for cluster1 through the hub (docs/cluster-gateway.md)
    kubeconfig = tmp_path / "cluster1-gateway.kubeconfig"
    written = subprocess.run(
        [
            str(REPO / ".venv" / "bin" / "cluster-proxy"),
            "kubeconfig",
            DIRECT,
            f"--kubeconfig={hub.kubeconfig}",
            "-o",
            str(kubeconfig),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert written.returncode == 0, written.stdout + written.stderr
    assert "/clustergateways/cluster1/proxy" in kubeconfig.read_text()

    # cluster1's admin grants the gateway's ServiceAccount what hub users may do there
    # (docs/managed-serviceaccount.md, "The gateway's own"): read pods, exec into them
    managed.apply(
        [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": GRANT},
                "rules": [
                    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
                    {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["get", "create"]},
                ],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": GRANT},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": GRANT},
                "subjects": [
                    {"kind": "ServiceAccount", "name": "cluster-gateway", "namespace": MSA_NAMESPACE}
                ],
            },
        ]
    )
    # a pod on cluster1 to exec into (the node's own busybox image)
    managed.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "gateway-exec", "namespace": "default"},
                "spec": {
                    "containers": [
                        {
                            "name": "box",
                            "image": nodeimages.BUSYBOX_IMAGE,
                            "imagePullPolicy": "Never",
                            "command": ["sleep", "3600"],
                        }
                    ],
                    "terminationGracePeriodSeconds": 1,
                },
            }
        ]
    )
    managed.kubectl_ok("wait", "--for=condition=Ready", "pod/gateway-exec", "--timeout=60s", timeout=70)

    # the gateway's token for cluster1 comes from its ManagedServiceAccount: kubectl through the hub
    # works once the gateway holds it
    last: list[bytes] = []

    def listed() -> bool:
        done = user_kubectl(hub, kubeconfig, "get", "pods", "-A", "-o", "wide")
        last[:] = [done.stdout + done.stderr]
        return done.returncode == 0 and b"gateway-exec" in done.stdout

    try:
        wait_for("kubectl get pods -A through the gateway", listed, 90)
    except AssertionError as exc:
        msas = hub.kubectl("get", "managedserviceaccounts", "-A", "-o", "yaml").stdout
        logs = hub.kubectl(
            "-n", ADDON_NAMESPACE, "logs", "deployment/cluster-proxy-cluster-gateway", "--tail=40"
        ).stdout
        raise AssertionError(f"{exc}\n{last[0].decode()}\n{msas}\n--- gateway\n{logs}") from None
    pods = user_kubectl(hub, kubeconfig, "get", "pods", "-A", "-o", "json")
    names = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in json.loads(pods.stdout)["items"]}
    direct = json.loads(managed.kubectl_ok("get", "pods", "-A", "-o", "json"))["items"]
    assert names == {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in direct}
    assert any(ns == AGENT_NAMESPACE for ns, _ in names), names
    times["get pods through the gateway"] = time.monotonic() - started

    # kubectl exec (v5.channel.k8s.io to the hub; SPDY from cluster1's API server to its kubelet)
    token = os.urandom(12).hex()
    echoed = user_kubectl(hub, kubeconfig, "exec", "gateway-exec", "--", "echo", token)
    assert echoed.returncode == 0, echoed.stderr.decode()
    assert echoed.stdout.decode().strip() == token
    # stdin through, and its end (v5's close signal lets cat finish), bytes unchanged
    payload = os.urandom(256 * 1024)
    copied = user_kubectl(hub, kubeconfig, "exec", "-i", "gateway-exec", "--", "cat", input=payload)
    assert copied.returncode == 0, copied.stderr.decode()
    assert hashlib.sha256(copied.stdout).hexdigest() == hashlib.sha256(payload).hexdigest()
    # an exit code comes back too
    failed = user_kubectl(hub, kubeconfig, "exec", "gateway-exec", "--", "sh", "-c", "exit 3")
    assert failed.returncode == 3, (failed.returncode, failed.stderr.decode())
    times["exec through the gateway"] = time.monotonic() - started
    managed.kubectl_ok("delete", "pod", "gateway-exec", "--wait=false")
    managed.kubectl_ok("delete", "clusterrolebinding,clusterrole", GRANT)

    # disable, then uninstall in docs/kubernetes.md's order
    disable(hub, managed)
    # the manager deleted the gateway's ManagedServiceAccounts with the addon; the gateway's finalizer
    # lets them go (their ServiceAccounts deleted through the tunnel, or released once the agent is gone)
    wait_for(
        "cluster1's ManagedServiceAccounts gone",
        lambda: hub.kubectl("-n", DIRECT, "get", "managedserviceaccounts", "-o", "name").stdout.strip() == "",
        60,
        hub,
    )
    gateway_log = hub.kubectl(
        "-n", ADDON_NAMESPACE, "logs", "deployment/cluster-proxy-cluster-gateway"
    ).stdout
    finalized = [
        f"{record['event']} {record.get('name')}"
        for record in (json.loads(line) for line in gateway_log.splitlines() if line.startswith("{"))
        if record.get("event") in ("managedserviceaccount_deleted", "managedserviceaccount_released")
    ]
    print(f"the gateway's finalizer: {finalized}")
    times["disabled"] = time.monotonic() - started
    uninstall(hub, ("hub-gateway", "hub-configuration", "hub"))
    assert hub.kubectl("get", "crd", MSA_CRD).returncode != 0
    assert hub.kubectl("get", "apiservice", APISERVICE).returncode != 0
    times["uninstalled"] = time.monotonic() - started
    assert real_clusters.network is not None
    print(
        f"set {real_clusters.network.tag}, times (s from the test's start): "
        + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
    )
