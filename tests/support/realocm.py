"""Real Open Cluster Management on the real clusters (:mod:`tests.support.realclusters`): OCM's own
programs and CRDs (:mod:`tests.support.ocmbuild`), joined as a user joins a cluster.

- The hub runs OCM's cluster-manager controllers: registration (ManagedClusters, their CSRs' RBAC,
  leases, addon registration), the addon manager and placement, each as its own process on the hub's
  node, with the hub's OCM CRDs installed first.
- A managed cluster runs the klusterlet's agents on its node: registration (bootstrap kubeconfig in,
  its own hub kubeconfig out, from a CSR the hub's kube-controller-manager signs) and, once
  registration has written that kubeconfig, work (applies ManifestWorks to the node).
- The user's part, as ``clusteradm`` does it: a bootstrap identity on the hub (a ServiceAccount
  token bound to the bootstrap ClusterRole below, which OCM v1.0.0's manifests do not carry:
  ``clusteradm init`` creates it), then on the hub the cluster's CSR approved and the cluster
  accepted (``hubAcceptsClient: true``).

The agents talk to their own cluster as its admin and the hub controllers as the hub's admin: the
klusterlet's and cluster-manager's own RBAC is the operator's business, which these tests do not run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from tests.support import ocmbuild
from tests.support.realclusters import DIRECT, HUB, PROXIED, RealClusters
from tests.support.realnode import RealCluster

HUB_NAMESPACE = "open-cluster-management-hub"
BOOTSTRAP_NAMESPACE = "open-cluster-management"
AGENT_NAMESPACE = "open-cluster-management-agent"
BOOTSTRAP_ACCOUNT = "cluster-bootstrap"
BOOTSTRAP_ROLE = "system:open-cluster-management:bootstrap"
POLL = 0.2

# What a joining cluster's bootstrap identity may do on the hub (clusteradm init's ClusterRole):
# create its CSR and watch it be signed, create and read its ManagedCluster.
BOOTSTRAP_RULES = [
    {
        "apiGroups": ["certificates.k8s.io"],
        "resources": ["certificatesigningrequests"],
        "verbs": ["create", "get", "list", "watch"],
    },
    {
        "apiGroups": ["cluster.open-cluster-management.io"],
        "resources": ["managedclusters"],
        "verbs": ["get", "create"],
    },
    {
        "apiGroups": ["cluster.open-cluster-management.io"],
        "resources": ["managedclustersets/join"],
        "verbs": ["create"],
    },
]


def _apply_crds(cluster: RealCluster, files: list[Path]) -> None:
    assert files, "no OCM CRDs found in the module"
    args = [arg for f in files for arg in ("-f", str(f))]
    cluster.kubectl_ok("apply", "--server-side", "--force-conflicts", *args, timeout=120)
    names = [yaml.safe_load(f.read_text())["metadata"]["name"] for f in files]
    cluster.kubectl_ok(
        "wait", "--for=condition=Established", "--timeout=60s", *(f"crd/{n}" for n in names), timeout=70
    )


def _namespace(name: str) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def start_hub(hub: RealCluster) -> None:
    """OCM's hub: its CRDs, then the registration controller, the addon manager and placement on the
    hub's node (each serving its health on its own loopback port there)."""
    binaries = ocmbuild.ocm_binaries()
    _apply_crds(hub, ocmbuild.hub_crds())
    hub.apply([_namespace(HUB_NAMESPACE), _namespace(BOOTSTRAP_NAMESPACE)])
    common = [f"--kubeconfig={hub.kubeconfig}", f"--namespace={HUB_NAMESPACE}", "--disable-leader-election"]
    for name, argv, port in (
        ("ocm-registration", [str(binaries.registration), "controller"], 9443),
        ("ocm-addon-manager", [str(binaries.addon), "manager"], 9444),
        ("ocm-placement", [str(binaries.placement), "controller"], 9445),
    ):
        hub.start_program(name, [*argv, *common, f"--listen=127.0.0.1:{port}"])


def bootstrap_kubeconfig(hub: RealCluster, path: Path, proxy_url: str = "") -> Path:
    """What a user hands a cluster to join the hub (``clusteradm join``'s input): the hub's address
    and CA, a token of the bootstrap ServiceAccount, and the forward proxy to reach it through."""
    hub.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": BOOTSTRAP_ACCOUNT, "namespace": BOOTSTRAP_NAMESPACE},
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": BOOTSTRAP_ROLE},
                "rules": BOOTSTRAP_RULES,
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": BOOTSTRAP_ROLE},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": BOOTSTRAP_ROLE,
                },
                "subjects": [
                    {"kind": "ServiceAccount", "name": BOOTSTRAP_ACCOUNT, "namespace": BOOTSTRAP_NAMESPACE}
                ],
            },
        ]
    )
    token = hub.kubectl_ok(
        "-n", BOOTSTRAP_NAMESPACE, "create", "token", BOOTSTRAP_ACCOUNT, "--duration=2h"
    ).strip()
    cluster: dict[str, object] = {"server": hub.url, "certificate-authority": str(hub.ca.path)}
    if proxy_url:
        cluster["proxy-url"] = proxy_url
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "hub", "cluster": cluster}],
                "users": [{"name": "bootstrap", "user": {"token": token}}],
                "contexts": [{"name": "hub", "context": {"cluster": "hub", "user": "bootstrap"}}],
                "current-context": "hub",
            }
        )
    )
    return path


def start_agents(managed: RealCluster, bootstrap: Path) -> Path:
    """The klusterlet's registration agent on ``managed``'s node; returns the folder it writes its
    hub kubeconfig into (the work agent starts once that exists: :func:`start_work_agent`)."""
    binaries = ocmbuild.ocm_binaries()
    _apply_crds(managed, ocmbuild.managed_crds())
    managed.apply([_namespace(AGENT_NAMESPACE)])
    hub_dir = managed.directory / "hub-kubeconfig"
    hub_dir.mkdir(exist_ok=True)
    managed.start_program(
        "ocm-registration-agent",
        [
            str(binaries.registration),
            "agent",
            f"--spoke-cluster-name={managed.name}",
            f"--bootstrap-kubeconfig={bootstrap}",
            f"--hub-kubeconfig-dir={hub_dir}",
            f"--kubeconfig={managed.kubeconfig}",
            f"--namespace={AGENT_NAMESPACE}",
            "--disable-leader-election",
            "--listen=127.0.0.1:9443",
        ],
    )
    return hub_dir


def accept(hub: RealCluster, cluster: str, timeout: float = 90.0) -> None:
    """The user's part on the hub: approve the cluster's pending CSR and accept the cluster."""
    deadline = time.monotonic() + timeout
    while True:
        listed = json.loads(
            hub.kubectl_ok(
                "get", "csr", "-l", f"open-cluster-management.io/cluster-name={cluster}", "-o", "json"
            )
        )
        pending = [
            c["metadata"]["name"] for c in listed["items"] if not c.get("status", {}).get("conditions")
        ]
        exists = hub.kubectl("get", "managedcluster", cluster).returncode == 0
        if pending and exists:
            break
        assert time.monotonic() < deadline, f"no CSR and ManagedCluster from {cluster} in {timeout:g}s"
        time.sleep(POLL)
    hub.kubectl_ok("certificate", "approve", *pending)
    hub.kubectl_ok(
        "patch", "managedcluster", cluster, "--type=merge", "-p", '{"spec":{"hubAcceptsClient":true}}'
    )


def start_work_agent(managed: RealCluster, hub_dir: Path, timeout: float = 90.0) -> None:
    """The klusterlet's work agent, with the hub kubeconfig registration wrote once its CSR was
    signed."""
    kubeconfig = hub_dir / "kubeconfig"
    deadline = time.monotonic() + timeout
    while not (kubeconfig.exists() and (hub_dir / "tls.crt").exists()):
        assert time.monotonic() < deadline, (
            f"{managed.name}: no hub kubeconfig in {hub_dir} after {timeout:g}s"
        )
        time.sleep(POLL)
    managed.start_program(
        "ocm-work-agent",
        [
            str(ocmbuild.ocm_binaries().work),
            "agent",
            f"--spoke-cluster-name={managed.name}",
            f"--hub-kubeconfig={kubeconfig}",
            f"--hub-kubeconfig-dir={hub_dir}",  # watched for the rotated client certificate
            f"--workload-source-config={kubeconfig}",  # where ManifestWorks come from: the hub
            f"--kubeconfig={managed.kubeconfig}",
            f"--namespace={AGENT_NAMESPACE}",
            "--disable-leader-election",
            "--listen=127.0.0.1:9444",
        ],
    )


def wait_available(hub: RealCluster, cluster: str, timeout: float = 120.0) -> None:
    """The ManagedCluster joined and available, as the hub's registration controller judges it."""
    hub.kubectl_ok(
        "wait",
        "--for=condition=ManagedClusterConditionAvailable",
        f"--timeout={timeout:g}s",
        f"managedcluster/{cluster}",
        timeout=timeout + 10,
    )


def join_all(clusters: RealClusters, folder: Path) -> None:
    """OCM's hub and both managed clusters joined (cluster2 through its forward proxy), each step done
    only if an earlier test of the session has not done it; returns once both are available."""
    hub = clusters[HUB]
    if "ocm-registration" not in hub.processes:
        start_hub(hub)
    hub_dirs = {}
    for name, proxy in ((DIRECT, ""), (PROXIED, clusters.proxy_url)):
        if "ocm-registration-agent" not in clusters[name].processes:
            bootstrap = bootstrap_kubeconfig(hub, folder / f"{name}-bootstrap.kubeconfig", proxy)
            hub_dirs[name] = start_agents(clusters[name], bootstrap)
    for name, hub_dir in hub_dirs.items():
        accept(hub, name)
        start_work_agent(clusters[name], hub_dir)
    for name in (DIRECT, PROXIED):
        wait_available(hub, name)
