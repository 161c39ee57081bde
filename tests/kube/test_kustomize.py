"""The kustomize overlays against real API servers, as docs/kubernetes.md tells a user to apply them.

- The hub: ONE ``kubectl apply -k deploy/kustomize/overlays/hub`` on an API server that has never
  seen the CRD exits 0, every object ``kubectl kustomize`` renders exists afterwards (read back by
  kind, name and namespace), and applying again reports every object ``unchanged``.
- A managed cluster: ``kubectl apply -k deploy/kustomize/overlays/managed`` as shipped (the example),
  the same checks, and the agent's ServiceAccount may do nothing.
- The addon-manager's pod run from the hub's stored Deployment as its ServiceAccount, with only the
  overlay's RBAC: it creates the default ManagedProxyConfiguration (the CRD's defaults), registers the
  addon and deploys the hub side; then ``kubectl apply -k deploy/kustomize/overlays/hub-configuration``
  exits 0 and the configuration takes its values, an overlay of one's own on it (a Hostname entrypoint,
  two replicas) reaches what the manager deploys, and the hub overlay applied again is unchanged.
- The by-hand path end to end: a cert-signer on the hub's Secrets store and a proxy-server (processes
  on loopback, as the addon-manager would run them), the admin's steps with the real CLI (the trust
  bundle, a bootstrap token for cluster1), an overlay of the admin's own applied to cluster1, and the
  agent's pod run from the Deployment, ConfigMap and Secret stored on cluster1 (the tests play the
  kubelet: tests.support.localpods.Kubelet): it bootstraps, its tunnel reaches the proxy-server and
  the Deployment reports READY 1/1.
- The health-collector the hub overlay installs: its ServiceAccount may list and watch the addons and
  the clusters and get its own bootstrap Secret, nothing else; its pod, run from the stored Deployment
  (ports given by an overlay of one's own to match a configuration with ports of its own) beside the
  manager, cert-signer and proxy-server run from what the manager wrote and cluster1's agent from its
  ManifestWork, finds the proxy-server by the headless Service, bootstraps its client certificate with
  the token of the Secret the manager keeps (no step of the admin's) and probes cluster1's
  kube-apiserver through the tunnel: the row is healthy. The used token is replaced in the Secret at
  once; a new collector pod (empty credentials) bootstraps again with it, and that one is replaced too.
- The addon-manager's ServiceAccount: Secrets in its own namespace (the store, the bootstrap Secrets),
  none anywhere else.

These tests run on API servers of their own (a hub and cluster1: this module's ``kube_clusters``
fixture), not on the session's shared ones: the hub overlay creates cluster-scoped and fixed-name
objects (the CRD, the ManagedProxyConfiguration ``cluster-proxy``, the namespace
``open-cluster-management-addon``) that other tests create their own way, a namespace can never be
deleted there (no controller-manager), and the one-command install means something only on a hub that
has never seen the CRD.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml
from kubernetes import client

from clusterproxy_cli.commands import SIGNER, executable
from tests.support import kubeapi, require
from tests.support.certs import KubeSigner, SignedHub
from tests.support.kubeapi import KubeCluster, KubeClusters, free_port, install_crds
from tests.support.kustomize import (
    KUSTOMIZE,
    MY_CLUSTER_KUSTOMIZATION,
    MY_HUB_KUSTOMIZATION,
    NAMESPACE,
    key_of,
    own_overlay,
    render,
)
from tests.support.localpods import Container, Kubelet, Pod, WorkApplier
from tests.support.procs import json_records
from tests.support.waiting import poll_until, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HUB = KUSTOMIZE / "overlays" / "hub"
HUB_CONFIGURATION = KUSTOMIZE / "overlays" / "hub-configuration"
MANAGED = KUSTOMIZE / "overlays" / "managed"
HUB_NAMESPACE = "open-cluster-management-addon"
MPC_CRD = "managedproxyconfigurations.proxy.open-cluster-management.io"


def is_refusal(record: dict[str, Any]) -> bool:
    """A log record that tells of an API refusal: 'forbidden' or a 403 status in what it says (not in its
    timestamp, serial or dates, where the digits 403 turn up by chance: a run failed on '06:28:14.603403Z')."""
    said = {k: v for k, v in record.items() if k not in ("timestamp", "serial", "not_after", "not_before")}
    text = json.dumps(said).lower()
    return "forbidden" in text or re.search(r"\b403\b", text) is not None


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
    """The hub installed as docs/kubernetes.md says: one ``kubectl apply -k`` of the hub overlay, on
    an API server that has never seen the CRD (exit 0, checked by kubectl_ok)."""
    hub = kube_clusters["hub"]
    assert hub.kubectl("get", "crd", MPC_CRD).returncode != 0, "the CRD was there before the install"
    kubectl_ok(hub, "apply", "-k", str(HUB))
    return hub


def network_policies(cluster: KubeCluster, namespace: str) -> dict[str, dict[str, Any]]:
    """The NetworkPolicies the API server holds in ``namespace``, by name (read back, as stored)."""
    listed = json.loads(kubectl_ok(cluster, "get", "networkpolicies", "-n", namespace, "-o", "json"))
    return {p["metadata"]["name"]: p for p in listed["items"]}


def assert_policies_stored(cluster: KubeCluster, overlay: Path) -> None:
    """Every NetworkPolicy the overlay renders is stored as rendered: the API server's validation
    took its selectors and named ports, and defaulted nothing away."""
    rendered = [o for o in render(overlay) if o["kind"] == "NetworkPolicy"]
    assert rendered, f"{overlay.name} renders no NetworkPolicy"
    for policy in rendered:
        stored = network_policies(cluster, policy["metadata"]["namespace"]).get(policy["metadata"]["name"])
        assert stored is not None, key_of(policy)
        assert stored["spec"] == policy["spec"], (stored["spec"], policy["spec"])


def test_the_hub_installs_in_one_apply_and_every_rendered_object_exists(hub_installed: KubeCluster) -> None:
    live = assert_every_object_exists(hub_installed, HUB)
    kinds = {o["kind"] for o in live}
    assert {"CustomResourceDefinition", "Namespace", "ServiceAccount", "Deployment", "NetworkPolicy"} <= kinds
    assert "ManagedProxyConfiguration" not in kinds  # the manager creates it: tested below
    kubectl_ok(hub_installed, "wait", "--for=condition=Established", "--timeout=60s", f"crd/{MPC_CRD}")
    assert_policies_stored(hub_installed, HUB)
    assert set(network_policies(hub_installed, HUB_NAMESPACE)) >= {
        "cluster-proxy-addon-manager",
        "cluster-proxy-health-collector",
    }


def test_applying_the_hub_again_changes_nothing(hub_installed: KubeCluster) -> None:
    assert_apply_changes_nothing(hub_installed, HUB)


def test_the_managed_overlay_as_shipped_applies_and_again_changes_nothing(
    kube_clusters: KubeClusters,
) -> None:
    cluster1 = kube_clusters["cluster1"]
    kubectl_ok(cluster1, "apply", "-k", str(MANAGED))
    assert_every_object_exists(cluster1, MANAGED)
    assert_policies_stored(cluster1, MANAGED)
    assert set(network_policies(cluster1, NAMESPACE)) == {"cluster-proxy-proxy-agent"}
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


def with_free_admin_port(pod: Pod) -> Pod:
    """The one change to a pod the tests make: its admin port moves to a free one. A pod has a network
    namespace of its own; these processes share the machine's, where the Deployment's fixed port may
    be taken. The readiness probe follows (the container's named port ``admin``)."""
    port = free_port()
    for container in pod.containers.values():
        spec = container.spec
        spec["args"] = [
            f"--admin-listen=127.0.0.1:{port}" if a.startswith("--admin-listen=") else a for a in spec["args"]
        ]
        for declared in spec.get("ports") or []:
            if declared.get("name") == "admin":
                declared["containerPort"] = port
    return pod


def events(container: Container, event: str | None = None) -> list[dict[str, Any]]:
    return json_records(container.log_path, event) if container.log_path.exists() else []


def wait_event(container: Container, event: str, timeout: float) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        if not container.running:
            raise AssertionError(f"{container.name} exited ({container.returncode}):\n{container.tail()}")
        seen = events(container, event)
        return seen[0] if seen else None

    return poll_until(found, timeout=timeout, what=f"{event} from {container.name}:\n{container.tail()}")


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


def entrypoint_condition(hub: KubeCluster) -> dict[str, Any] | None:
    mpc = json.loads(kubectl_ok(hub, "get", "managedproxyconfiguration", "cluster-proxy", "-o", "json"))
    found = [c for c in mpc.get("status", {}).get("conditions", []) if c["type"] == "EntrypointReady"]
    return found[0] if found else None


def mpc_of(hub: KubeCluster) -> dict[str, Any] | None:
    done = hub.kubectl("get", "managedproxyconfiguration", "cluster-proxy", "-o", "json")
    return json.loads(done.stdout) if done.returncode == 0 else None


def proxy_server_replicas(hub: KubeCluster) -> int | None:
    done = hub.kubectl("get", "deployment", "cluster-proxy", "-n", HUB_NAMESPACE, "-o", "json")
    return json.loads(done.stdout)["spec"]["replicas"] if done.returncode == 0 else None


def assert_configuration_applies_unchanged(hub: KubeCluster, overlay: Path) -> None:
    """:func:`assert_apply_changes_nothing` for the configuration, which the manager's status writes
    change meanwhile: its generation (its spec), not its resourceVersion, stays."""
    before = mpc_of(hub)
    output = kubectl_ok(hub, "apply", "-k", str(overlay))
    assert output.strip().endswith(" unchanged") and len(output.strip().splitlines()) == 1, output
    after = mpc_of(hub)
    assert before is not None and after is not None
    assert after["metadata"]["generation"] == before["metadata"]["generation"], "applying again changed it"


def test_the_addon_manager_runs_as_the_overlay_installs_it(
    hub_installed: KubeCluster, tmp_path: Path
) -> None:
    """The manager's pod run from the hub's stored Deployment (tests.support.localpods.Kubelet: its
    command, args and environment, its ServiceAccount's token through $KUBECONFIG, with only the
    overlay's RBAC) creates the default ManagedProxyConfiguration with the CRD's defaults, registers the
    addon and deploys the hub side from it. Then the declared configuration: ``overlays/hub-configuration``
    applies (exit 0) and the configuration takes its values; an overlay of one's own on it (a Hostname
    entrypoint, two replicas) reaches what the manager deploys. Applying the hub overlay again changes
    nothing: the overlay and the manager write different objects."""
    hub = hub_installed
    assert mpc_of(hub) is None, "the hub overlay holds no configuration: the manager creates it"
    kubelet = Kubelet(hub, tmp_path / "kubelet")
    try:
        pod = with_free_admin_port(kubelet.pod(HUB_NAMESPACE, "cluster-proxy-addon-manager"))
        pod.start()
        manager = pod.container()
        created = wait_event(manager, "default_configuration_created", timeout=30)
        assert created["name"] == "cluster-proxy"
        wait_event(manager, "manager_synced", timeout=30)
        mpc = mpc_of(hub)
        assert mpc is not None
        # an empty spec, filled in by the CRD's defaults
        spec = mpc["spec"]
        assert spec["proxyServer"]["image"] == "cluster-proxy/proxy-server:dev"
        assert spec["proxyAgent"]["image"] == "cluster-proxy/proxy-agent:dev"
        assert spec["proxyServer"]["entrypoint"]["type"] == "LoadBalancerService"
        assert spec["deploy"]["ports"]["signer"] == 8443
        assert spec["authentication"]["signer"]["type"] == "SelfSigned"
        assert mpc["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "cluster-proxy-addon-manager"

        found = poll_until(
            lambda: hub_objects_of_the_manager(hub), timeout=30, what="the manager's hub objects"
        )
        cma = found["clustermanagementaddons.v1alpha1.addon.open-cluster-management.io/cluster-proxy"]
        assert cma["spec"]["addOnConfiguration"]["crName"] == "cluster-proxy", cma  # the default MPC
        signer = found["deployment.apps/cluster-proxy-cert-signer"]["spec"]["template"]["spec"]["containers"][
            0
        ]
        assert signer["image"] == "cluster-proxy/cert-signer:dev"  # --cert-signer-image from the overlay
        assert found["service/proxy-agent-entrypoint"]["spec"]["type"] == "LoadBalancer"
        # the hub side's NetworkPolicies, written by the manager as its ServiceAccount (the overlay's
        # RBAC) and taken by the API server: each pod's own ports only
        policies = poll_until(
            lambda: (
                (p := network_policies(hub, HUB_NAMESPACE))
                and {"cluster-proxy", "cluster-proxy-cert-signer"} <= set(p)
                and p
            ),
            timeout=30,
            what="the manager's NetworkPolicies",
        )
        ports = {
            name: [port["port"] for rule in policies[name]["spec"]["ingress"] for port in rule["ports"]]
            for name in ("cluster-proxy", "cluster-proxy-cert-signer")
        }
        assert ports == {
            "cluster-proxy": ["agent", "client", "admin"],
            "cluster-proxy-cert-signer": ["https"],
        }
        # no load-balancer provider here: the default entrypoint waits, and says so (docs/kubernetes.md)
        condition = poll_until(lambda: entrypoint_condition(hub), timeout=30, what="EntrypointReady")
        assert (condition["status"], condition["reason"]) == ("False", "WaitingForLoadBalancer")

        # the configuration declared with kustomize, applied after the hub overlay: a plain apply
        kubectl_ok(hub, "apply", "-k", str(HUB_CONFIGURATION))
        (declared,) = assert_every_object_exists(hub, HUB_CONFIGURATION)
        assert declared["metadata"]["uid"] == mpc["metadata"]["uid"], "the configuration was replaced"
        assert declared["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kustomize"
        assert "kubectl.kubernetes.io/last-applied-configuration" in declared["metadata"]["annotations"]
        assert declared["spec"]["proxyServer"]["entrypoint"] == {
            "type": "LoadBalancerService",
            "loadBalancerService": {"name": "proxy-agent-entrypoint"},
            "port": 8091,
        }
        assert_configuration_applies_unchanged(hub, HUB_CONFIGURATION)

        # an overlay of one's own on it (docs/kubernetes.md, "Configuring the hub")
        mine = own_overlay(tmp_path / "my-hub", "hub-configuration", MY_HUB_KUSTOMIZATION, {})
        kubectl_ok(hub, "apply", "-k", str(mine))
        poll_until(
            lambda: proxy_server_replicas(hub) == 2 or None, timeout=30, what="2 proxy-server replicas"
        )
        condition = poll_until(
            lambda: (c := entrypoint_condition(hub)) and c["status"] == "True" and c,
            timeout=30,
            what="EntrypointReady True with the Hostname entrypoint",
        )
        assert_configuration_applies_unchanged(hub, mine)

        refused = [e for e in events(manager) if "forbidden" in json.dumps(e).lower()]
        assert not refused, refused[:3]
        assert len(events(manager, "default_configuration_created")) == 1
        output = kubectl_ok(hub, "apply", "-k", str(HUB))
        assert all(line.endswith(" unchanged") for line in output.splitlines() if line.strip()), output
    finally:
        kubelet.close()


# --- the by-hand path, end to end ----------------------------------------------------------------------


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


async def test_an_agent_from_a_managed_overlay_of_your_own_reaches_the_hub(
    hub_installed: KubeCluster, kube_clusters: KubeClusters, tmp_path: Path
) -> None:
    hub, cluster1 = hub_installed, kube_clusters["cluster1"]
    signer = await KubeSigner(hub, HUB_NAMESPACE, tmp_path).start()
    proxy = SignedHub(pki=None, log_dir=tmp_path, signer=signer)  # type: ignore[arg-type]
    kubelet = Kubelet(cluster1, tmp_path / "kubelet")
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

        # The agent's pod, run from what cluster1 stores (no ServiceAccount token: it mounts none).
        pod = with_free_admin_port(kubelet.pod(NAMESPACE, "cluster-proxy-proxy-agent"))
        await trio.to_thread.run_sync(pod.start)
        agent = pod.container()
        await trio.to_thread.run_sync(lambda: wait_event(agent, "cert_bootstrapped", timeout=30))

        def cluster1_connected() -> bool:
            return any(a["cluster"] == "cluster1" for a in proxy.agents_connected())

        await wait_until(
            lambda: trio.to_thread.run_sync(cluster1_connected), timeout=30, what="cluster1's tunnel"
        )
        # READY 1/1, as docs/kubernetes.md says to check: the readiness probe (/readyz: a tunnel is up)
        # passes and the kubelet reports it in the Deployment's status.
        await trio.to_thread.run_sync(pod.wait_ready)
        stored = json.loads(
            kubectl_ok(
                cluster1, "get", "deployment", "cluster-proxy-proxy-agent", "-n", NAMESPACE, "-o", "json"
            )
        )
        assert stored["status"].get("readyReplicas") == 1, stored["status"]
        listed = await admin_cli(hub, "token", "list")
        rows = [line.split() for line in listed.splitlines() if line.split()[:1] == [token["id"]]]
        assert rows and rows[0][-1] == "used", listed
    finally:
        kubelet.close()
        proxy.stop()


# --- the health-collector as the hub overlay installs it ------------------------------------------------

COLLECTOR = "cluster-proxy-health-collector"
COLLECTOR_SECRET = "cluster-proxy-health-collector-bootstrap"
COLLECTOR_ACCOUNT = f"system:serviceaccount:{HUB_NAMESPACE}:{COLLECTOR}"


def test_the_collectors_service_account_may_only_read_what_it_shows(hub_installed: KubeCluster) -> None:
    """The overlay's RBAC for the collector: list and watch the addons and the clusters, get its own
    bootstrap Secret; nothing else (no other Secret, no write)."""
    allowed = [
        ("list", "managedclusteraddons.addon.open-cluster-management.io", "--all-namespaces"),
        ("watch", "managedclusteraddons.addon.open-cluster-management.io", "--all-namespaces"),
        ("list", "managedclusters.cluster.open-cluster-management.io", ""),
        ("get", f"secrets/{COLLECTOR_SECRET}", f"--namespace={HUB_NAMESPACE}"),
    ]
    refused = [
        ("get", "secrets/cluster-proxy-server-bootstrap", f"--namespace={HUB_NAMESPACE}"),
        ("list", "secrets", f"--namespace={HUB_NAMESPACE}"),
        ("update", "managedclusteraddons.addon.open-cluster-management.io", "--all-namespaces"),
        ("create", "manifestworks.work.open-cluster-management.io", "--all-namespaces"),
        ("get", "managedproxyconfigurations.proxy.open-cluster-management.io", ""),
    ]
    for verb, resource, scope in [*allowed, *refused]:
        done = hub_installed.kubectl("auth", "can-i", verb, resource, *([scope] if scope else []),
                                     f"--as={COLLECTOR_ACCOUNT}")  # fmt: skip
        want = "yes" if (verb, resource, scope) in allowed else "no"
        assert done.stdout.strip() == want, (
            f"{COLLECTOR_ACCOUNT} {verb} {resource}: {done.stdout}{done.stderr}"
        )


def bootstrap_secret(hub: KubeCluster, name: str) -> dict[str, Any] | None:
    """The Secret's keys decoded, and its metadata; None while it does not exist."""
    done = hub.kubectl("get", "secret", name, "-n", HUB_NAMESPACE, "-o", "json")
    if done.returncode != 0:
        return None
    secret = json.loads(done.stdout)
    decoded = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return {**decoded, "metadata": secret["metadata"]}


def token_state(hub: KubeCluster, token: str) -> tuple[str, str]:
    """What the signer's store says of ``token`` (the admin's ``cluster-proxy-cert-signer token list``):
    its binding in words (FOR) and its STATE (used, unused, expired)."""
    store = f"kubernetes:{HUB_NAMESPACE}/cluster-proxy-ca"
    done = subprocess.run([executable(SIGNER), "token", "list", "--store", store, "--kubeconfig",
                           str(hub.kubeconfig)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    token_id = token.split(".", 1)[0]
    found = [line.split() for line in done.stdout.splitlines() if line.split()[:1] == [token_id]]
    assert found, f"token {token_id} is not in the store:\n{done.stdout}"
    return " ".join(found[0][1:-2]), found[0][-1]


def wait_token_replaced(hub: KubeCluster, used: str, manager: Pod, signer: Pod, timeout: float = 30.0) -> str:
    """The collector's Secret holds an unused token other than ``used`` within ``timeout``; that
    token. Printed: how long after the signer issued the certificate for ``used`` the manager minted
    the next one (their logs' timestamps)."""
    replaced: str = poll_until(
        lambda: (t := (bootstrap_secret(hub, COLLECTOR_SECRET) or {}).get("bootstrap-token")) != used and t,
        timeout=timeout,
        what=f"the used token replaced in {COLLECTOR_SECRET}:\n{manager.container().tail()}",
        interval=0.2,
    )
    assert token_state(hub, replaced) == ("client 'health-collector'", "unused")
    why = f"token {used.split('.', 1)[0]} was used"
    minted = [r for r in events(manager.container(), "token_minted") if r.get("reason") == why]
    assert minted and minted[0]["group"] == "hub-client health-collector", events(manager.container())[-5:]
    token_id = used.split(".", 1)[0]
    (issued,) = [r for r in events(signer.container(), "cert_issued") if r.get("token_id") == token_id]
    took = dt.datetime.fromisoformat(minted[0]["timestamp"]) - dt.datetime.fromisoformat(issued["timestamp"])
    print(
        f"the used token replaced: the next one minted {took.total_seconds() * 1000:+.0f} ms from the signer's "
        "cert_issued (logged after its store write)"
    )
    return replaced


def with_free_listen_port(pod: Pod) -> Pod:
    """:func:`with_free_admin_port` for the collector, whose one port is ``--listen`` (named ``http``)."""
    port = free_port()
    for container in pod.containers.values():
        spec = container.spec
        spec["args"] = [
            f"--listen=127.0.0.1:{port}" if a.startswith("--listen=") else a for a in spec["args"]
        ]
        for declared in spec.get("ports") or []:
            if declared.get("name") == "http":
                declared["containerPort"] = port
    return pod


def collector_document(pod: Pod) -> dict[str, Any]:
    listen = next(a for a in pod.container().spec["args"] if a.startswith("--listen="))
    with urllib.request.urlopen(f"http://{listen.split('=', 1)[1]}/api/v1/clusters", timeout=5) as answer:
        return json.loads(answer.read())


def test_the_health_collector_runs_as_the_overlay_installs_it(
    hub_installed: KubeCluster, kube_clusters: KubeClusters, tmp_path: Path
) -> None:
    """The whole hub from the overlays, and the collector's pod from its stored Deployment as its
    ServiceAccount (only the overlay's RBAC):

    - a configuration of one's own with ports of its own (free ones: these pods share the machine's
      network) and an overlay of one's own on the hub that gives the collector the same ports (what
      the Deployment's comment asks for); the addon-manager, the cert-signer and the proxy-server run
      from what the manager wrote; cluster1 enables the addon and its agent runs from its ManifestWork;
    - no Secret made by hand: the manager keeps cluster-proxy-health-collector-bootstrap (its
      --hub-client in the overlay) with the trust bundle and a token bound to health-collector;
    - the collector bootstraps with it, finds the proxy-server through the headless Service
      (--admin-service), reads the addons and probes cluster1's kube-apiserver through the tunnel by
      the bare cluster name: the row is healthy;
    - the used token is replaced in the Secret (the manager watches the signer's store), a new pod with
      an empty credentials emptyDir bootstraps with the new one, which is replaced in turn."""
    hub, cluster1 = hub_installed, kube_clusters["cluster1"]
    ports = {name: free_port() for name in ("proxyServer", "agentServer", "adminServer", "signer")}
    configuration = own_overlay(
        tmp_path / "my-hub-configuration",
        "hub-configuration",
        {
            "patches": [
                {
                    "target": {"kind": "ManagedProxyConfiguration", "name": "cluster-proxy"},
                    "patch": yaml.safe_dump(
                        {
                            "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
                            "kind": "ManagedProxyConfiguration",
                            "metadata": {"name": "cluster-proxy"},
                            "spec": {
                                "proxyServer": {
                                    "replicas": 1,
                                    "entrypoint": {
                                        "type": "Hostname",
                                        "hostname": {"value": "127.0.0.1"},
                                        "port": ports["agentServer"],
                                    },
                                },
                                "proxyAgent": {"additionalArgs": ["--admin-listen=127.0.0.1:0"]},
                                "deploy": {"ports": ports},
                            },
                        }
                    ),
                }
            ]
        },
        {},
    )
    kubectl_ok(hub, "apply", "-k", str(configuration))
    collector_ports = [
        f"--admin-service=cluster-proxy-admin.$(POD_NAMESPACE).svc:{ports['adminServer']}",
        f"--proxy=proxy-entrypoint.$(POD_NAMESPACE).svc:{ports['proxyServer']}",
        f"--signer=https://cluster-proxy-cert-signer.$(POD_NAMESPACE).svc:{ports['signer']}",
    ]
    stored = json.loads(kubectl_ok(hub, "get", "deployment", COLLECTOR, "-n", HUB_NAMESPACE, "-o", "json"))
    args = stored["spec"]["template"]["spec"]["containers"][0]["args"]
    patch = [
        {"op": "replace", "path": f"/spec/template/spec/containers/0/args/{i}", "value": value}
        for value in collector_ports
        for i, arg in enumerate(args)
        if arg.split("=", 1)[0] == value.split("=", 1)[0]
    ]
    assert len(patch) == 3, args
    my_hub = own_overlay(
        tmp_path / "my-hub",
        "hub",
        {"patches": [{"target": {"kind": "Deployment", "name": COLLECTOR}, "patch": yaml.safe_dump(patch)}]},
        {},
    )
    kubectl_ok(hub, "apply", "-k", str(my_hub))

    hub_kubelet = Kubelet(hub, tmp_path / "hub")
    cluster_kubelet = Kubelet(cluster1, tmp_path / "cluster1")
    work_agent = None
    try:
        manager = with_free_admin_port(hub_kubelet.pod(HUB_NAMESPACE, "cluster-proxy-addon-manager")).start()
        wait_event(manager.container(), "manager_synced", timeout=60)

        def deployed_with_ports(name: str) -> bool:
            done = hub.kubectl("get", "deployment", name, "-n", HUB_NAMESPACE, "-o", "json")
            return done.returncode == 0 and str(ports["signer"]) in done.stdout

        for name in ("cluster-proxy-cert-signer", "cluster-proxy"):
            poll_until(lambda n=name: deployed_with_ports(n), timeout=60, what=f"{name} with the new ports")
        signer = hub_kubelet.run(HUB_NAMESPACE, "cluster-proxy-cert-signer").wait_ready(90)
        server = hub_kubelet.run(HUB_NAMESPACE, "cluster-proxy").wait_ready(90)

        # cluster1 enables the addon; its agent runs from the ManifestWork the manager writes
        kubectl_ok(hub, "create", "namespace", "cluster1")
        with hub.api_client() as api:
            enable_the_addon(client.CustomObjectsApi(api))
        work_agent = WorkApplier(hub, cluster1, "cluster1").start()
        applied = work_agent.wait_applied("addon-cluster-proxy-deploy", timeout=60)
        assert applied.ok, applied.errors()
        # the agent's NetworkPolicy from the ManifestWork, taken by cluster1's API server
        assert "cluster-proxy-proxy-agent" in network_policies(cluster1, "cp-agent-health")
        agent = cluster_kubelet.run("cp-agent-health", "cluster-proxy-proxy-agent")
        wait_event(agent.container(), "tunnel_connected", timeout=60)

        # no step of the admin's: the manager keeps the collector's bootstrap Secret (--hub-client)
        secret = poll_until(
            lambda: bootstrap_secret(hub, COLLECTOR_SECRET), timeout=60, what=f"the Secret {COLLECTOR_SECRET}"
        )
        assert secret["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "cluster-proxy-addon-manager"
        assert "BEGIN CERTIFICATE" in secret["ca.crt"], secret
        first_token = secret["bootstrap-token"]
        assert token_state(hub, first_token) == ("client 'health-collector'", "unused")

        # the collector, from the stored Deployment, as its ServiceAccount
        started = time.monotonic()
        collector = with_free_listen_port(hub_kubelet.pod(HUB_NAMESPACE, COLLECTOR)).start()
        collector.wait_ready(60)

        def row(pod: Pod, want: dict[str, Any]) -> dict[str, Any] | None:
            if not pod.container().running:
                raise AssertionError(f"the collector exited:\n{pod.container().tail()}")
            document = collector_document(pod)
            found = [c for c in document["clusters"] if c["name"] == "cluster1"]
            if found and all(found[0][k] == v for k, v in want.items()):
                return {**found[0], "problems": document["problems"], "servers": document["proxy_servers"]}
            return None

        healthy = poll_until(
            lambda: row(collector, {"installed": True, "available": True, "probed": True}),
            timeout=90,
            what="cluster1 healthy with the manager's token",
            interval=0.5,
        )
        assert healthy["problems"] == [] and healthy["latency_ms"] > 0, healthy
        assert [s["reachable"] for s in healthy["servers"]] == [True], healthy["servers"]
        print(
            f"\nthe collector started -> cluster1 healthy after {time.monotonic() - started:.1f}s "
            f"(kube-apiserver /healthz through the tunnel: {healthy['latency_ms']} ms)"
        )
        logged = events(collector.container())
        assert [e for e in logged if e.get("event") == "cert_bootstrapped"], collector.container().tail()
        refused = [e for e in logged if is_refusal(e)]
        assert not refused, refused[:3]
        # the probe went through the manager's proxy-server, by the bare cluster name, as health-collector
        poll_until(
            lambda: [r for r in events(server.container(), "stream_closed")
                     if r.get("target") == "cluster1:443" and r.get("client") == "health-collector"],
            timeout=10,
            what="the proxy-server's stream_closed for cluster1:443 from health-collector",
        )  # fmt: skip

        # the used token is replaced at once (the manager watches the signer's store), long before
        # its resync (10 min)
        assert token_state(hub, first_token)[1] == "used"
        second_token = wait_token_replaced(hub, first_token, manager, signer)

        # a new pod (its credentials emptyDir starts empty) finds that token and bootstraps again
        collector.stop(grace=10)
        started = time.monotonic()
        renewed = with_free_listen_port(hub_kubelet.pod(HUB_NAMESPACE, COLLECTOR)).start()
        renewed.wait_ready(60)
        healthy = poll_until(
            lambda: row(renewed, {"installed": True, "available": True, "probed": True}),
            timeout=90,
            what="cluster1 healthy from a new collector pod",
            interval=0.5,
        )
        assert healthy["problems"] == [], healthy
        bootstrapped = events(renewed.container(), "cert_bootstrapped")
        assert bootstrapped, renewed.container().tail()
        print(
            f"a new collector pod -> bootstrapped, cluster1 healthy after {time.monotonic() - started:.1f}s"
        )
        assert token_state(hub, second_token)[1] == "used"
        wait_token_replaced(hub, second_token, manager, signer)
    finally:
        if work_agent is not None:
            work_agent.close()
        cluster_kubelet.close(grace=10)
        hub_kubelet.close(grace=10)


def enable_the_addon(custom: Any) -> None:
    """cluster1 as a ManagedCluster with the addon enabled (its agent in a namespace of its own)."""
    custom.create_cluster_custom_object(
        "cluster.open-cluster-management.io",
        "v1",
        "managedclusters",
        {
            "apiVersion": "cluster.open-cluster-management.io/v1",
            "kind": "ManagedCluster",
            "metadata": {"name": "cluster1"},
            "spec": {"hubAcceptsClient": True},
        },
    )
    custom.create_namespaced_custom_object(
        "addon.open-cluster-management.io",
        "v1alpha1",
        "cluster1",
        "managedclusteraddons",
        {
            "apiVersion": "addon.open-cluster-management.io/v1alpha1",
            "kind": "ManagedClusterAddOn",
            "metadata": {"name": "cluster-proxy", "namespace": "cluster1"},
            "spec": {"installNamespace": "cp-agent-health"},
        },
    )


# --- the cluster-gateway's overlay ---------------------------------------------------------------------

HUB_GATEWAY = KUSTOMIZE / "overlays" / "hub-gateway"


def test_the_gateway_overlay_applies_and_again_changes_nothing(hub_installed: KubeCluster) -> None:
    """The last overlay shipped (tests/kube/test_gateway_deploy.py runs its pod, through an overlay of
    its own): applied after the hub's, every object exists, its NetworkPolicy as rendered, and
    applying again changes nothing. Last in this module: its APIService stays unavailable here (no
    gateway runs), which the API server's discovery reports to every later kubectl."""
    hub = hub_installed
    try:
        kubectl_ok(hub, "apply", "-k", str(HUB_GATEWAY))
        assert_every_object_exists(hub, HUB_GATEWAY)
        assert_policies_stored(hub, HUB_GATEWAY)
        assert "cluster-proxy-cluster-gateway" in network_policies(hub, HUB_NAMESPACE)
        assert_apply_changes_nothing(hub, HUB_GATEWAY)
    finally:
        hub.kubectl("delete", "apiservice", "v1alpha1.cluster.core.oam.dev", "--ignore-not-found")
