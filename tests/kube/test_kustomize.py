"""The kustomize overlays against real API servers, as docs/kubernetes.md tells a user to apply them.

- The hub: ``kubectl apply -k deploy/kustomize/overlays/hub/crds``, wait for the CRD, then
  ``kubectl apply -k deploy/kustomize/overlays/hub``: both exit 0, every object ``kubectl kustomize``
  renders exists afterwards (read back by kind, name and namespace), and applying again reports every
  object ``unchanged``.
- A managed cluster: ``kubectl apply -k deploy/kustomize/overlays/managed`` as shipped (the example),
  the same checks, and the agent's ServiceAccount may do nothing.
- The addon-manager started from the hub's stored Deployment as its ServiceAccount, with only the
  overlay's RBAC: it registers the addon and deploys the hub side; the overlay applied again after it
  is unchanged.
- The by-hand path end to end: a cert-signer on the hub's Secrets store and a proxy-server (processes
  on loopback, as the addon-manager would run them), the admin's steps with the real CLI (the trust
  bundle, a bootstrap token for cluster1), an overlay of the admin's own applied to cluster1, and the
  agent started from the Deployment, ConfigMap and Secret read back from cluster1's API server (the
  test plays the kubelet: tests/unit/test_kustomize_render.py): it bootstraps and its tunnel reaches
  the proxy-server.

These tests run on API servers of their own (a hub and cluster1: this module's ``kube_clusters``
fixture), not on the session's shared ones: the hub overlay creates cluster-scoped and fixed-name
objects (the CRD, the ManagedProxyConfiguration ``cluster-proxy``, the namespace
``open-cluster-management-addon``) that other tests create their own way, a namespace can never be
deleted there (no controller-manager), and the documented install (CRDs first) means something only on a
hub that has never seen the CRD.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml

from clusterproxy_cli.commands import SIGNER, executable
from tests.support import kubeapi, require
from tests.support.certs import SERVER_HOSTS, SignedHub, SignerProcess
from tests.support.kube_identities import token_kubeconfig
from tests.support.kubeapi import KubeCluster, KubeClusters, install_crds
from tests.support.procs import Process
from tests.support.waiting import wait_until
from tests.unit.test_kustomize_render import (
    KUSTOMIZE,
    MY_CLUSTER_KUSTOMIZATION,
    NAMESPACE,
    key_of,
    only,
    own_overlay,
    pod_of,
    render,
    start_pod,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HUB = KUSTOMIZE / "overlays" / "hub"
HUB_CRDS = HUB / "crds"
MANAGED = KUSTOMIZE / "overlays" / "managed"
HUB_NAMESPACE = "open-cluster-management-addon"
MPC_CRD = "managedproxyconfigurations.proxy.open-cluster-management.io"


@pytest.fixture(scope="module")
def kube_clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeClusters]:
    """This module's own hub (with the OCM CRDs, the prerequisite) and cluster1, nothing of this
    project on either. It overrides the session fixture of the same name on purpose: the conftest then
    builds missing binaries before the first test (outside any test's timeout) and marks these tests
    ``kube``, as for every test on real API servers."""
    require(shutil.which("kubectl") is not None, "kubectl (apt-get install kubernetes-client)")
    directory = tmp_path_factory.mktemp("kustomize")
    with KubeClusters(directory, names=("hub", "cluster1"), built=kubeapi.binaries()) as running:
        install_crds(running["hub"])
        yield running


def kubectl_ok(cluster: KubeCluster, *args: str, input: str | None = None) -> str:
    done = cluster.kubectl(*args, input=input)
    assert done.returncode == 0, (
        f"kubectl {' '.join(args)} on {cluster.name} exited {done.returncode}:\n{done.stderr}"
    )
    return done.stdout


def assert_every_object_exists(cluster: KubeCluster, overlay: Path) -> list[dict[str, Any]]:
    """Every object the overlay renders, read back from ``cluster`` by kind, name and namespace
    (``kubectl get -f`` of the rendered manifests: one missing object is an error)."""
    rendered = render(overlay)
    answer = json.loads(
        kubectl_ok(cluster, "get", "-f", "-", "-o", "json", input=yaml.safe_dump_all(rendered))
    )
    live = answer["items"] if answer.get("kind") == "List" else [answer]
    assert sorted(key_of(o) for o in live) == sorted(key_of(o) for o in rendered)
    for obj in live:
        labels = obj["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/part-of") == "cluster-proxy", key_of(obj)
    return live


def resource_versions(cluster: KubeCluster, overlay: Path) -> dict[tuple[str, str, str], str]:
    return {key_of(o): o["metadata"]["resourceVersion"] for o in assert_every_object_exists(cluster, overlay)}


def assert_apply_changes_nothing(cluster: KubeCluster, overlay: Path) -> None:
    """``kubectl apply -k`` again: every object reported ``unchanged`` and none written (the same
    resourceVersion). A generated Secret is reported ``configured`` although nothing changes: kustomize
    line-wraps base64 values longer than 70 characters and kubectl compares the text, not the bytes
    (kubernetes-sigs/kustomize#4653); its unchanged resourceVersion is the check that counts."""
    before = resource_versions(cluster, overlay)
    output = kubectl_ok(cluster, "apply", "-k", str(overlay))
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == len(before), output
    for line in lines:
        assert line.endswith(" unchanged") or (line.startswith("secret/") and line.endswith(" configured")), (
            output
        )
    assert resource_versions(cluster, overlay) == before, "applying again wrote objects"


@pytest.fixture(scope="module")
def hub_installed(kube_clusters: KubeClusters) -> KubeCluster:
    """The hub installed as docs/kubernetes.md says: the CRDs, wait for them, the hub overlay."""
    hub = kube_clusters["hub"]
    kubectl_ok(hub, "apply", "-k", str(HUB_CRDS))
    kubectl_ok(hub, "wait", "--for=condition=Established", "--timeout=60s", f"crd/{MPC_CRD}")
    kubectl_ok(hub, "apply", "-k", str(HUB))
    return hub


def test_the_hub_installs_and_every_rendered_object_exists(hub_installed: KubeCluster) -> None:
    live = assert_every_object_exists(hub_installed, HUB)
    kinds = {o["kind"] for o in live}
    assert {
        "CustomResourceDefinition",
        "Namespace",
        "ServiceAccount",
        "Deployment",
        "ManagedProxyConfiguration",
    } <= kinds
    mpc = only(live, "ManagedProxyConfiguration")
    # stored through the CRD's schema: what the overlay leaves out took the CRD's defaults
    assert mpc["spec"]["deploy"]["ports"]["signer"] == 8443
    assert mpc["spec"]["authentication"]["signer"]["type"] == "SelfSigned"
    assert mpc["spec"]["proxyServer"]["image"] == "cluster-proxy/proxy-server:dev"


def test_applying_the_hub_again_changes_nothing(hub_installed: KubeCluster) -> None:
    assert_apply_changes_nothing(hub_installed, HUB)
    assert_apply_changes_nothing(hub_installed, HUB_CRDS)


def test_the_managed_overlay_as_shipped_applies_and_again_changes_nothing(
    kube_clusters: KubeClusters,
) -> None:
    cluster1 = kube_clusters["cluster1"]
    kubectl_ok(cluster1, "apply", "-k", str(MANAGED))
    assert_every_object_exists(cluster1, MANAGED)
    assert_apply_changes_nothing(cluster1, MANAGED)


def test_the_agents_service_account_may_do_nothing(kube_clusters: KubeClusters) -> None:
    """The agent never calls the Kubernetes API, so its ServiceAccount is bound to nothing."""
    cluster1 = kube_clusters["cluster1"]
    kubectl_ok(cluster1, "apply", "-k", str(MANAGED))
    agent = f"system:serviceaccount:{NAMESPACE}:cluster-proxy"
    for verb, resource, scope in (
        ("get", "secrets", ("-n", NAMESPACE)),
        ("list", "configmaps", ("-n", NAMESPACE)),
        ("create", "leases.coordination.k8s.io", ("-n", NAMESPACE)),
        ("list", "pods", ("--all-namespaces",)),
        ("get", "nodes", ()),
    ):
        done = cluster1.kubectl("auth", "can-i", verb, resource, *scope, f"--as={agent}")
        assert done.stdout.strip() == "no", f"{agent} may {verb} {resource}: {done.stdout}{done.stderr}"


# --- the addon-manager as the hub overlay installs it --------------------------------------------------


def service_account_token_kubeconfig(cluster: KubeCluster, namespace: str, name: str, path: Path) -> Path:
    """What a pod of ServiceAccount ``name`` presents: a TokenRequest token (the kubelet mounts one)."""
    from kubernetes import client

    core = client.CoreV1Api(cluster.api_client())
    answer = core.create_namespaced_service_account_token(
        name, namespace, {"spec": {"expirationSeconds": 3600}}
    )
    return token_kubeconfig(cluster, path, f"system:serviceaccount:{namespace}:{name}", answer.status.token)


def hub_objects_of_the_manager(hub: KubeCluster) -> dict[str, Any]:
    found = {}
    for what in (
        "clustermanagementaddons.v1alpha1.addon.open-cluster-management.io/cluster-proxy",
        f"deployment.apps/cluster-proxy-cert-signer -n {HUB_NAMESPACE}",
        f"service/proxy-agent-entrypoint -n {HUB_NAMESPACE}",
    ):
        done = hub.kubectl("get", *what.split(), "-o", "json")
        if done.returncode != 0:
            return {}
        found[what.split()[0]] = json.loads(done.stdout)
    return found


async def test_the_addon_manager_runs_as_the_overlay_installs_it(
    hub_installed: KubeCluster, tmp_path: Path
) -> None:
    """The manager started from the hub's stored Deployment (its args, its env) as its ServiceAccount
    (with only the overlay's RBAC) registers the addon and deploys the hub side from the default
    ManagedProxyConfiguration; applying the overlay again afterwards changes nothing: the overlay and
    the manager write different objects."""
    hub = hub_installed
    objects = json.loads(
        kubectl_ok(hub, "get", "deployments,configmaps,secrets", "-n", HUB_NAMESPACE, "-o", "json")
    )["items"]
    deployment = next(o for o in objects if o["metadata"]["name"] == "cluster-proxy-addon-manager")
    (command,) = start_pod(pod_of(deployment, objects, tmp_path / "pods"))
    argv = [executable(command.argv[0])]
    argv += ["--admin-listen=127.0.0.1:0" if a.startswith("--admin-listen=") else a for a in command.argv[1:]]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    kubeconfig = service_account_token_kubeconfig(
        hub, HUB_NAMESPACE, account, tmp_path / "manager.kubeconfig"
    )
    # In a pod the manager finds the mounted token; here $KUBECONFIG holds the same identity.
    manager = Process("addon-manager", argv, tmp_path, env={**command.env, "KUBECONFIG": str(kubeconfig)})
    try:
        await manager.wait_event("manager_synced", timeout=30)
        found: dict[str, Any] = {}

        def deployed() -> bool:
            found.update(hub_objects_of_the_manager(hub))
            return bool(found)

        await wait_until(
            lambda: trio.to_thread.run_sync(deployed),
            timeout=30,
            what=f"the manager's hub objects:\n{manager.tail()}",
        )
        cma = found["clustermanagementaddons.v1alpha1.addon.open-cluster-management.io/cluster-proxy"]
        assert cma["spec"]["addOnConfiguration"]["crName"] == "cluster-proxy", cma  # the default MPC
        signer = found["deployment.apps/cluster-proxy-cert-signer"]["spec"]["template"]["spec"]["containers"][
            0
        ]
        assert signer["image"] == "cluster-proxy/cert-signer:dev"  # --cert-signer-image from the overlay
        assert found["service/proxy-agent-entrypoint"]["spec"]["type"] == "LoadBalancer"

        def entrypoint_condition() -> dict[str, Any] | None:
            mpc = json.loads(
                kubectl_ok(hub, "get", "managedproxyconfiguration", "cluster-proxy", "-o", "json")
            )
            found = [c for c in mpc.get("status", {}).get("conditions", []) if c["type"] == "EntrypointReady"]
            return found[0] if found else None

        # no load-balancer provider here: the default entrypoint waits, and says so (docs/kubernetes.md)
        await wait_until(
            lambda: trio.to_thread.run_sync(entrypoint_condition), timeout=30, what="EntrypointReady"
        )
        condition = await trio.to_thread.run_sync(entrypoint_condition)
        assert condition is not None and (condition["status"], condition["reason"]) == (
            "False",
            "WaitingForLoadBalancer",
        )
        refused = [e for e in manager.events() if "forbidden" in json.dumps(e).lower()]
        assert not refused, refused[:3]
        output = kubectl_ok(hub, "apply", "-k", str(HUB))
        assert all(line.endswith(" unchanged") for line in output.splitlines() if line.strip()), output
    finally:
        manager.stop()


# --- the by-hand path, end to end ----------------------------------------------------------------------


class HubSigner(SignerProcess):
    """``cluster-proxy-cert-signer serve`` on the hub's Secrets store (``kubernetes:NAMESPACE``), as
    the addon-manager deploys it, with the hub admin's kubeconfig."""

    def __init__(self, hub: KubeCluster, log_dir: Path) -> None:
        super().__init__(log_dir / "signer", log_dir)
        self.hub = hub

    async def start(self) -> HubSigner:
        argv = [
            executable(SIGNER),
            "serve",
            "--store",
            f"kubernetes:{HUB_NAMESPACE}",
            "--kubeconfig",
            str(self.hub.kubeconfig),
            "--listen",
            "127.0.0.1:0",
            *[arg for host in SERVER_HOSTS for arg in ("--tls-host", host)],
            "--log-format",
            "json",
        ]
        self.process = Process("cert-signer", argv, self.log_dir)
        started = await self.process.wait_event("signer_started")
        self.port = int(str(started["listen"]).rsplit(":", 1)[1])
        return self

    @property
    def store(self) -> Any:  # the server's token below is made in this store
        from clusterproxy_certsigner.kubestore import KubernetesSecretStore

        return KubernetesSecretStore(namespace=HUB_NAMESPACE, kubeconfig=self.hub.kubeconfig)


async def admin_cli(hub: KubeCluster, *args: str) -> str:
    """What the admin runs on a workstation with the hub's kubeconfig (docs/kubernetes.md)."""
    argv = [
        executable(SIGNER),
        *args,
        "--store",
        f"kubernetes:{HUB_NAMESPACE}",
        "--kubeconfig",
        str(hub.kubeconfig),
    ]
    done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, f"{' '.join(args)}: {done.stderr.decode()}"
    return done.stdout.decode()


def live_objects(cluster: KubeCluster, namespace: str) -> list[dict[str, Any]]:
    answer = json.loads(
        kubectl_ok(cluster, "get", "deployments,configmaps,secrets", "-n", namespace, "-o", "json")
    )
    return answer["items"]


async def test_an_agent_from_a_managed_overlay_of_your_own_reaches_the_hub(
    hub_installed: KubeCluster, kube_clusters: KubeClusters, tmp_path: Path
) -> None:
    hub, cluster1 = hub_installed, kube_clusters["cluster1"]
    signer = await HubSigner(hub, tmp_path).start()
    proxy = SignedHub(pki=None, log_dir=tmp_path, signer=signer)  # type: ignore[arg-type]
    agent: Process | None = None
    try:
        await proxy.start_server()

        # The admin's files, made with the real CLI against the hub's store.
        bundle = tmp_path / "bundle.crt"
        await admin_cli(hub, "trust-bundle", "--out", str(bundle))
        token = json.loads(
            await admin_cli(hub, "token", "create", "--cluster", "cluster1", "--ttl", "10m", "--json")
        )
        mine = own_overlay(
            tmp_path / "my-cluster1",
            "managed",
            MY_CLUSTER_KUSTOMIZATION,
            {
                "agent.env": f"cluster=cluster1\nhub-agent-address=127.0.0.1:{proxy.agent_port}\n"
                f"hub-signer-url=https://127.0.0.1:{signer.port}\n",
                "ca.crt": bundle.read_text(),
                "bootstrap-token": token["token"] + "\n",
            },
        )
        kubectl_ok(cluster1, "apply", "-k", str(mine))
        assert_every_object_exists(cluster1, mine)

        # Play the kubelet with what cluster1 stores. A pod has a network namespace of its own; these
        # processes share the machine's, so the admin port moves to a free one.
        objects = live_objects(cluster1, NAMESPACE)
        deployment = next(o for o in objects if o["metadata"]["name"] == "cluster-proxy-proxy-agent")
        (command,) = start_pod(pod_of(deployment, objects, tmp_path / "pods"))
        # The console script is on the image's PATH; here it is next to this Python.
        argv = [executable(command.argv[0])]
        argv += [
            "--admin-listen=127.0.0.1:0" if a.startswith("--admin-listen=") else a for a in command.argv[1:]
        ]
        agent = Process("agent-cluster1", argv, tmp_path, env=command.env)
        await agent.wait_event("cert_bootstrapped", timeout=30)

        def cluster1_connected() -> bool:
            return any(a["cluster"] == "cluster1" for a in proxy.agents_connected())

        await wait_until(
            lambda: trio.to_thread.run_sync(cluster1_connected), timeout=30, what="cluster1's tunnel"
        )
        listed = await admin_cli(hub, "token", "list")
        rows = [line.split() for line in listed.splitlines() if line.split()[:1] == [token["id"]]]
        assert rows and rows[0][-1] == "used", listed
    finally:
        if agent is not None:
            agent.stop()
        proxy.stop()
