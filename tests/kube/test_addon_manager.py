"""The addon-manager as a process against the real hub API server (tests/kube/conftest.py).

Each test gets its own ManagedProxyConfiguration and hub namespace (``am-<random>``) and its own
manager process (``--mpc-name`` and ``--namespace`` point at them), and names its managed clusters
uniquely, so tests do not see each other's objects. Timings are printed (``-s``) and collected in
LATENCIES; every wait has a deadline. Objects are created and read with the ``kubernetes`` client,
not with the manager's own code.

No pod runs (no kubelet), so "the work agent" is the test: it writes a ManifestWork's status the way
OCM's work agent would; and "the cloud" too: it writes a LoadBalancer Service's status.
"""

from __future__ import annotations

import base64
import contextlib
import json
import secrets
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from clusterproxy_addon_manager.hubclient import CLIENT_NAME, TOKEN_GROUP
from clusterproxy_protocol.pki import DevCA
from tests.support.certs import KubeSigner, SignedHub
from tests.support.kubeapi import KubeCluster, KubeClusters, free_port
from tests.support.procs import Process
from tests.support.waiting import poll_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MPC_CRD = ROOT / "deploy/kustomize/base/crds/proxy.open-cluster-management.io_managedproxyconfigurations.yaml"
RBAC = ROOT / "deploy/kustomize/base/addon-manager/rbac.yaml"
MANAGER = str(Path(sys.executable).parent / "cluster-proxy-addon-manager")
WORK = "addon-cluster-proxy-deploy"
LABEL = "app.kubernetes.io/managed-by=cluster-proxy-addon-manager"
LATENCY_BOUND = 5.0
#: measured times of this run, by what was measured (printed at the end of the module)
LATENCIES: dict[str, list[float]] = {}

MPC = ("proxy.open-cluster-management.io", "v1alpha1", "managedproxyconfigurations")
MANAGED_CLUSTER = ("cluster.open-cluster-management.io", "v1", "managedclusters")
ADDON = ("addon.open-cluster-management.io", "v1alpha1", "managedclusteraddons")
DEPLOY_CONFIG = ("addon.open-cluster-management.io", "v1alpha1", "addondeploymentconfigs")
MANIFEST_WORK = ("work.open-cluster-management.io", "v1", "manifestworks")

T = TypeVar("T")


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def wait_for(
    probe: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.01
) -> tuple[T, float]:
    """Poll ``probe`` until it returns something truthy; (that value, seconds it took)."""
    started = time.monotonic()
    value = poll_until(probe, timeout=timeout, what=what, interval=interval)
    return value, time.monotonic() - started


def record(what: str, seconds: float) -> None:
    LATENCIES.setdefault(what, []).append(seconds)
    print(f"[addon-manager] {what}: {seconds * 1000:.0f} ms")


@pytest.fixture(scope="module", autouse=True)
def print_latencies() -> Iterator[None]:
    yield
    for what, values in LATENCIES.items():
        print(
            f"[addon-manager] {what}: n={len(values)} min={min(values) * 1000:.0f} ms "
            f"max={max(values) * 1000:.0f} ms"
        )


@pytest.fixture(scope="module")
def hub(kube_clusters: KubeClusters) -> KubeCluster:
    """The hub with the ManagedProxyConfiguration CRD installed (the OCM CRDs already are)."""
    cluster = kube_clusters["hub"]
    applied = cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(MPC_CRD))
    assert applied.returncode == 0, applied.stderr
    waited = cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/managedproxyconfigurations.proxy.open-cluster-management.io",
    )
    assert waited.returncode == 0, waited.stderr
    return cluster


class Manager:
    """``cluster-proxy-addon-manager`` as a process, logging JSON to a file."""

    def __init__(self, log_dir: Path, name: str, argv: list[str]) -> None:
        self.argv = argv
        self.process = Process(name, [MANAGER, *argv], log_dir)
        self.admin = ""

    def wait_started(self, *, synced: bool = True, timeout: float = 20.0) -> None:
        started, _ = wait_for(
            lambda: self.event("manager_started"), timeout=timeout, what="manager_started", interval=0.02
        )
        self.admin = started["admin_port"]
        if synced:
            wait_for(
                lambda: self.event("manager_synced"),
                timeout=timeout,
                what=f"manager_synced:\n{self.process.tail()}",
            )

    def event(self, name: str) -> dict[str, Any] | None:
        if self.process.popen.poll() is not None:
            raise AssertionError(
                f"the manager exited ({self.process.popen.returncode}):\n{self.process.tail()}"
            )
        found = [r for r in self.process.events() if r.get("event") == name]
        return found[-1] if found else None

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.process.events() if r.get("event") == name]

    def readyz(self) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.admin}/readyz", timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def kill(self) -> None:
        self.process.kill(signal.SIGKILL)
        self.process.popen.wait(10)

    def stop(self) -> None:
        self.process.stop()


class Env:
    """One test's world on the hub: its MPC, hub namespace, clusters, and manager processes."""

    def __init__(self, hub: KubeCluster, tmp_path: Path) -> None:
        self.hub = hub
        self.tmp = tmp_path
        self.name = unique("am")  # the MPC's name and the hub namespace of the proxy-servers
        self.api = hub.api_client()
        self.custom = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.clusters: list[str] = []
        self.managers: list[Manager] = []

    # the manager
    def start_manager(
        self, *extra: str, kubeconfig: Path | None = None, namespace: str | None = None, synced: bool = True
    ) -> Manager:
        argv = [
            f"--kubeconfig={kubeconfig or self.hub.kubeconfig}",
            f"--namespace={namespace or self.name}",
            f"--mpc-name={self.name}",
            "--admin-listen=127.0.0.1:0",
            "--availability-poll=1s",
            f"--credentials-dir={self.tmp / 'manager-credentials'}",
            "--resync-period=5m",
            "--log-format=json",
            "--log-level=debug",
            *extra,
        ]
        manager = Manager(self.tmp, f"manager-{len(self.managers)}", argv)
        self.managers.append(manager)
        manager.wait_started(synced=synced)
        return manager

    # objects
    def create_namespace(self, name: str) -> None:
        with contextlib.suppress(ApiException):
            self.core.create_namespace({"metadata": {"name": name}})

    def create_mpc(self, spec: dict[str, Any] | None = None) -> dict[str, Any]:
        self.create_namespace(self.name)
        if spec is None:
            spec = {"proxyServer": {"entrypoint": {"type": "Hostname", "hostname": {"value": "127.0.0.1"}}}}
        spec = {**spec, "proxyServer": {"namespace": self.name, **spec.get("proxyServer", {})}}
        body = {
            "apiVersion": "/".join(MPC[:2]),
            "kind": "ManagedProxyConfiguration",
            "metadata": {"name": self.name},
            "spec": spec,
        }
        return self.custom.create_cluster_custom_object(MPC[0], MPC[1], MPC[2], body)

    def patch_mpc(self, patch: dict[str, Any]) -> None:
        self.custom.patch_cluster_custom_object(MPC[0], MPC[1], MPC[2], self.name, patch)

    def mpc(self) -> dict[str, Any]:
        return self.custom.get_cluster_custom_object(MPC[0], MPC[1], MPC[2], self.name)

    def add_cluster(self, prefix: str = "c") -> str:
        name = unique(f"{self.name}-{prefix}")
        self.create_namespace(name)
        self.custom.create_cluster_custom_object(
            *MANAGED_CLUSTER,
            {
                "apiVersion": "/".join(MANAGED_CLUSTER[:2]),
                "kind": "ManagedCluster",
                "metadata": {"name": name},
                "spec": {"hubAcceptsClient": True},
            },
        )
        self.clusters.append(name)
        return name

    def add_addon(self, cluster: str, configs: list[dict[str, Any]] | None = None) -> None:
        body = {
            "apiVersion": "/".join(ADDON[:2]),
            "kind": "ManagedClusterAddOn",
            "metadata": {"name": "cluster-proxy", "namespace": cluster},
            "spec": {"configs": configs} if configs else {},
        }
        self.custom.create_namespaced_custom_object(ADDON[0], ADDON[1], cluster, ADDON[2], body)

    def delete_addon(self, cluster: str) -> None:
        self.custom.delete_namespaced_custom_object(ADDON[0], ADDON[1], cluster, ADDON[2], "cluster-proxy")

    def delete_cluster(self, cluster: str) -> None:
        self.custom.delete_cluster_custom_object(*MANAGED_CLUSTER, cluster)

    def addon(self, cluster: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(
            ADDON[0], ADDON[1], cluster, ADDON[2], "cluster-proxy"
        )

    def conditions(self, cluster: str) -> dict[str, dict[str, Any]]:
        return {c["type"]: c for c in (self.addon(cluster).get("status") or {}).get("conditions") or []}

    def mpc_conditions(self) -> dict[str, dict[str, Any]]:
        return {c["type"]: c for c in (self.mpc().get("status") or {}).get("conditions") or []}

    def work(self, cluster: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(
                MANIFEST_WORK[0], MANIFEST_WORK[1], cluster, MANIFEST_WORK[2], WORK
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def works(self) -> list[dict[str, Any]]:
        """Every ManifestWork of this manager in this test's clusters."""
        found = self.custom.list_cluster_custom_object(*MANIFEST_WORK, label_selector=LABEL)["items"]
        return [w for w in found if w["metadata"]["namespace"] in self.clusters]

    def cleanup(self) -> None:
        for manager in self.managers:
            manager.stop()
        for cluster in self.clusters:
            for delete in (
                lambda c=cluster: self.delete_addon(c),
                lambda c=cluster: self.delete_cluster(c),
                lambda c=cluster: self.custom.delete_namespaced_custom_object(
                    MANIFEST_WORK[0], MANIFEST_WORK[1], c, MANIFEST_WORK[2], WORK
                ),
            ):
                with contextlib.suppress(ApiException):
                    delete()
        with contextlib.suppress(ApiException):
            self.custom.delete_cluster_custom_object(*MPC, self.name)
        self.api.close()


@pytest.fixture
def env(hub: KubeCluster, tmp_path: Path) -> Iterator[Env]:
    world = Env(hub, tmp_path)
    try:
        yield world
    finally:
        world.cleanup()


# --- reading a ManifestWork ----------------------------------------------------------------------------


def manifests(work: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["kind"]: m for m in work["spec"]["workload"]["manifests"]}


def agent_container(work: dict[str, Any]) -> dict[str, Any]:
    return manifests(work)["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def work_token(work: dict[str, Any]) -> str:
    return base64.b64decode(manifests(work)["Secret"]["data"]["bootstrap-token"]).decode()


def has_arg(work: dict[str, Any] | None, arg: str) -> bool:
    return work is not None and arg in agent_container(work)["args"]


# --- tests ---------------------------------------------------------------------------------------------


def test_work_appears_and_goes_within_5s(env: Env) -> None:
    env.create_mpc()
    env.start_manager()
    cluster = env.add_cluster()

    started = time.monotonic()
    env.add_addon(cluster)
    work, _ = wait_for(lambda: env.work(cluster), timeout=LATENCY_BOUND, what="the ManifestWork")
    record("addon created -> ManifestWork", time.monotonic() - started)

    # what the agent needs is all there
    container = agent_container(work)
    assert container["command"] == ["cluster-proxy-agent"]
    assert f"--cluster={cluster}" in container["args"]
    assert "--server=127.0.0.1:8091" in container["args"]
    assert "--signer=https://127.0.0.1:8443" in container["args"]
    addon = env.addon(cluster)
    assert work["metadata"]["ownerReferences"][0]["uid"] == addon["metadata"]["uid"]
    token = work_token(work)
    store_secret = env.core.read_namespaced_secret(f"cluster-proxy-ca-token-{token.split('.')[0]}", env.name)
    record_json = json.loads(base64.b64decode(store_secret.data["record.json"]))
    assert record_json["binding"]["cluster"] == cluster and record_json["used_at"] is None
    bundle = base64.b64decode(manifests(work)["Secret"]["data"]["ca.crt"]).decode()
    authorities = env.core.read_namespaced_secret("cluster-proxy-ca-authorities", env.name)
    cas = [base64.b64decode(v).decode().strip() for k, v in authorities.data.items() if k.endswith(".crt")]
    assert cas and all(ca in bundle for ca in cas)  # the agent trusts the store's CA(s)

    # the hub side, owned by the MPC (its conditions are written once all of it is)
    conditions, _ = wait_for(
        lambda: (c := env.mpc_conditions()) and "ProxyServerDeployed" in c and c,
        timeout=5,
        what="MPC conditions",
    )
    uid = env.mpc()["metadata"]["uid"]
    for deployment in ("cluster-proxy", "cluster-proxy-cert-signer"):
        found = env.apps.read_namespaced_deployment(deployment, env.name)
        assert found.metadata.owner_references[0].uid == uid
    for service in (
        "proxy-entrypoint",
        "proxy-agent-entrypoint",
        "cluster-proxy-cert-signer",
        "cluster-proxy-admin",
    ):
        assert env.core.read_namespaced_service(service, env.name).metadata.owner_references[0].uid == uid
    assert conditions["ProxyServerDeployed"]["status"] == "True"
    assert conditions["EntrypointReady"]["status"] == "True"
    assert conditions["ProxyServerSecretsSigned"]["status"] == "False"  # no proxy-server has run

    started = time.monotonic()
    env.delete_addon(cluster)
    wait_for(
        lambda: env.work(cluster) is None,
        timeout=LATENCY_BOUND,
        what="the ManifestWork to go (addon deleted)",
    )
    record("addon deleted -> ManifestWork gone", time.monotonic() - started)
    # its unused token goes with it
    token_secret = f"cluster-proxy-ca-token-{token.split('.')[0]}"
    wait_for(
        lambda: (
            not env.core.list_namespaced_secret(
                env.name, field_selector=f"metadata.name={token_secret}"
            ).items
        ),
        timeout=5,
        what="the unused token to be deleted",
    )

    env.add_addon(cluster)
    wait_for(lambda: env.work(cluster), timeout=LATENCY_BOUND, what="the ManifestWork again")
    started = time.monotonic()
    env.delete_cluster(cluster)
    wait_for(
        lambda: env.work(cluster) is None,
        timeout=LATENCY_BOUND,
        what="the ManifestWork to go (cluster deleted)",
    )
    record("cluster deleted -> ManifestWork gone", time.monotonic() - started)


def test_mpc_edit_updates_every_work(env: Env) -> None:
    env.create_mpc()
    env.start_manager()
    clusters = [env.add_cluster() for _ in range(3)]
    for cluster in clusters:
        env.add_addon(cluster)
    before = {}
    for cluster in clusters:
        before[cluster], _ = wait_for(
            lambda c=cluster: env.work(c), timeout=LATENCY_BOUND, what=f"work of {cluster}"
        )

    started = time.monotonic()
    env.patch_mpc(
        {
            "spec": {
                "proxyAgent": {
                    "replicas": 2,
                    "image": "cluster-proxy/proxy-agent:v2",
                    "additionalArgs": ["--dial-timeout=5s"],
                }
            }
        }
    )

    def updated(cluster: str) -> dict[str, Any] | None:
        work = env.work(cluster)
        if work is None or not has_arg(work, "--dial-timeout=5s"):
            return None
        return work

    for cluster in clusters:
        work, _ = wait_for(
            lambda c=cluster: updated(c), timeout=LATENCY_BOUND, what=f"updated work of {cluster}"
        )
        deployment = manifests(work)["Deployment"]
        assert deployment["spec"]["replicas"] == 2
        assert agent_container(work)["image"] == "cluster-proxy/proxy-agent:v2"
        assert agent_container(work)["args"][-1] == "--dial-timeout=5s"
        # the same object, updated in place, the same (unused) token: nothing was re-minted
        assert work["metadata"]["uid"] == before[cluster]["metadata"]["uid"]
        assert work_token(work) == work_token(before[cluster])
    record("MPC edited -> every ManifestWork updated (3 clusters)", time.monotonic() - started)
    assert len(env.works()) == 3


def test_deploy_config_proxy_lands_in_its_clusters_agent(env: Env) -> None:
    env.create_mpc()
    env.start_manager()
    cluster1, cluster2 = env.add_cluster("one"), env.add_cluster("two")
    proxy_ca = DevCA.create_or_load(env.tmp / "proxy-ca").ca_path.read_text()
    env.custom.create_namespaced_custom_object(
        DEPLOY_CONFIG[0],
        DEPLOY_CONFIG[1],
        cluster2,
        DEPLOY_CONFIG[2],
        {
            "apiVersion": "/".join(DEPLOY_CONFIG[:2]),
            "kind": "AddOnDeploymentConfig",
            "metadata": {"name": "proxy-settings", "namespace": cluster2},
            "spec": {
                "proxyConfig": {
                    "httpProxy": "http://squid.corp:3128",
                    "httpsProxy": "http://squid.corp:3128",
                    "noProxy": "10.0.0.0/8,.cluster.local",
                    "caBundle": base64.b64encode(proxy_ca.encode()).decode(),
                }
            },
        },
    )
    env.add_addon(cluster1)
    env.add_addon(
        cluster2,
        configs=[
            {
                "group": "addon.open-cluster-management.io",
                "resource": "addondeploymentconfigs",
                "name": "proxy-settings",
            }
        ],
    )
    work2, _ = wait_for(lambda: env.work(cluster2), timeout=LATENCY_BOUND, what="cluster2's work")
    work1, _ = wait_for(lambda: env.work(cluster1), timeout=LATENCY_BOUND, what="cluster1's work")
    env2 = {e["name"]: e.get("value") for e in agent_container(work2)["env"]}
    assert env2["HTTPS_PROXY"] == "http://squid.corp:3128"
    assert env2["HTTP_PROXY"] == "http://squid.corp:3128"
    assert env2["NO_PROXY"] == "10.0.0.0/8,.cluster.local"
    assert "--proxy-ca-file=/etc/cluster-proxy/bootstrap/proxy-ca.crt" in agent_container(work2)["args"]
    assert base64.b64decode(manifests(work2)["Secret"]["data"]["proxy-ca.crt"]).decode() == proxy_ca
    assert not any(e["name"].endswith("_PROXY") for e in agent_container(work1)["env"])

    started = time.monotonic()
    env.custom.patch_namespaced_custom_object(
        DEPLOY_CONFIG[0],
        DEPLOY_CONFIG[1],
        cluster2,
        DEPLOY_CONFIG[2],
        "proxy-settings",
        {"spec": {"proxyConfig": {"httpsProxy": "http://other.corp:8080"}}},
    )

    def moved() -> bool:
        work = env.work(cluster2)
        return (
            work is not None
            and {"name": "HTTPS_PROXY", "value": "http://other.corp:8080"} in agent_container(work)["env"]
        )

    wait_for(moved, timeout=LATENCY_BOUND, what="the edited proxy in cluster2's work")
    record("AddOnDeploymentConfig edited -> its cluster's ManifestWork updated", time.monotonic() - started)


def test_manifest_applied_follows_the_works_status(env: Env) -> None:
    env.create_mpc()
    env.start_manager()
    cluster = env.add_cluster()
    env.add_addon(cluster)
    wait_for(lambda: env.work(cluster), timeout=LATENCY_BOUND, what="the work")
    waiting, _ = wait_for(
        lambda: env.conditions(cluster).get("ManifestApplied"), timeout=5, what="ManifestApplied"
    )
    assert (waiting["status"], waiting["reason"]) == ("Unknown", "WaitingForWorkAgent")

    def report(status: str, reason: str, message: str) -> None:
        # as OCM's work agent does: the Applied condition on the ManifestWork's status subresource
        current = env.work(cluster)
        assert current is not None
        current["status"] = {
            "conditions": [
                {
                    "type": "Applied",
                    "status": status,
                    "reason": reason,
                    "message": message,
                    "observedGeneration": current["metadata"]["generation"],
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ]
        }
        env.custom.replace_namespaced_custom_object_status(
            MANIFEST_WORK[0], MANIFEST_WORK[1], cluster, MANIFEST_WORK[2], WORK, current
        )

    report("False", "AppliedManifestWorkFailed", "namespaces is forbidden")
    failed, _ = wait_for(
        lambda: (c := env.conditions(cluster).get("ManifestApplied")) and c["status"] == "False" and c,
        timeout=5,
        what="ManifestApplied False",
    )
    assert "namespaces is forbidden" in failed["message"]
    started = time.monotonic()
    report("True", "AppliedManifestWorkComplete", "Apply manifest work complete")
    wait_for(
        lambda: env.conditions(cluster).get("ManifestApplied", {}).get("status") == "True",
        timeout=5,
        what="ManifestApplied True",
    )
    record("work status Applied -> addon ManifestApplied", time.monotonic() - started)


def own_token_states(env: Env) -> list[bool]:
    """Whether each token minted for the manager's own certificate was used, from the signer's store."""
    tokens = env.core.list_namespaced_secret(env.name, label_selector="cluster-proxy.io/kind=token").items
    records = [json.loads(base64.b64decode(s.data["record.json"])) for s in tokens]
    return [
        r.get("used_at") is not None for r in records if r["description"] == f"addon-manager {TOKEN_GROUP}"
    ]


def test_without_its_certificate_available_is_unknown_and_no_token_is_minted(env: Env) -> None:
    """The proxy-servers list their clusters over mutual TLS only: while the signer that issues the
    manager's own certificate does not answer, AVAILABLE is Unknown and says so, and the manager leaves
    no unused token behind."""
    env.create_mpc()
    cluster = env.add_cluster()
    silent = free_port()  # nothing listens there
    env.start_manager("--admin-url=https://127.0.0.1:1", f"--signer=https://127.0.0.1:{silent}")
    env.add_addon(cluster)
    signer = f"https://127.0.0.1:{silent}"

    def unknown() -> dict[str, Any] | None:
        found = env.conditions(cluster).get("Available")
        return found if found and signer in found["message"] else None

    said, took = wait_for(unknown, timeout=10, what=f"Available naming {signer}")
    record("no signer -> Available Unknown naming it", took)
    assert (said["status"], said["reason"]) == ("Unknown", "NoClientCertificate"), said
    assert "does not answer" in said["message"] and "mutual TLS" in said["message"], said
    assert own_token_states(env) == []


async def test_available_follows_the_agents_tunnel(env: Env, tmp_path: Path) -> None:
    """A real cert-signer on the manager's store, a proxy-server and an agent bootstrapped from it (not
    from the ManifestWork: that end-to-end run is another test's); the manager polls the server's
    admin API (--admin-url) with a hub client certificate of its own, which the signer issued for a
    token the manager minted (--signer)."""
    env.create_mpc()
    cluster = env.add_cluster()
    signer = await KubeSigner(env.hub, env.name, tmp_path).start()
    proxy = SignedHub(None, tmp_path, signer=signer)  # type: ignore[arg-type]
    try:
        await proxy.start_server()
        manager = await trio.to_thread.run_sync(
            lambda: env.start_manager(
                f"--admin-url=https://127.0.0.1:{proxy.admin_port}", f"--signer={signer.url}"
            )
        )
        env.add_addon(cluster)

        def available() -> str | None:
            return env.conditions(cluster).get("Available", {}).get("status")

        def kubectl_available() -> str:
            shown = env.hub.kubectl("get", "managedclusteraddon", "-n", cluster, "--no-headers")
            assert shown.returncode == 0, shown.stderr
            return shown.stdout.split()[1]  # NAME AVAILABLE DEGRADED PROGRESSING

        await trio.to_thread.run_sync(
            lambda: wait_for(
                lambda: available() == "False", timeout=20, what="Available False (no agent yet)"
            )
        )
        # the manager's own certificate: bootstrapped from its token, issued by the signer
        bootstrapped = manager.event("cert_bootstrapped")
        assert bootstrapped is not None and bootstrapped["name"] == CLIENT_NAME, manager.process.tail()
        assert own_token_states(env) == [True]
        issued = [e for e in signer.process.events() if e.get("event") == "cert_issued"]  # type: ignore[union-attr]
        assert any(e.get("identity") == f"client:{CLIENT_NAME}" for e in issued), issued

        agent = proxy.start_agent(cluster, "agent-a")
        await proxy.wait_agent(cluster, "agent-a")
        started = time.monotonic()
        await trio.to_thread.run_sync(
            lambda: wait_for(lambda: available() == "True", timeout=10, what="Available True")
        )
        record("agent connected -> Available True", time.monotonic() - started)
        assert kubectl_available() == "True"

        agent.kill(signal.SIGKILL)
        started = time.monotonic()
        await trio.to_thread.run_sync(
            lambda: wait_for(
                lambda: available() == "False", timeout=30, what="Available False after the agent died"
            )
        )
        record("agent killed -> Available False", time.monotonic() - started)
        assert kubectl_available() == "False"
        assert "no agent of cluster" in env.conditions(cluster)["Available"]["message"]

        files = proxy.files[f"agent-{cluster}-agent-a"]
        again = proxy.start_agent(cluster, "agent-a", token=None, files=files, name="agent-again")
        await proxy.wait_agent(cluster, "agent-a")
        started = time.monotonic()
        await trio.to_thread.run_sync(
            lambda: wait_for(lambda: available() == "True", timeout=30, what="Available True again")
        )
        record("agent back -> Available True", time.monotonic() - started)
        assert kubectl_available() == "True"
        again.stop()

        # no answer from any proxy-server: Unknown, with the reason
        assert proxy.server is not None
        proxy.server.stop()
        unknown, _ = await trio.to_thread.run_sync(
            lambda: wait_for(
                lambda: (c := env.conditions(cluster).get("Available")) and c["status"] == "Unknown" and c,
                timeout=15,
                what="Available Unknown",
            )
        )
        assert unknown["reason"] == "ProxyServerUnreachable"
        assert manager.process.popen.poll() is None
        assert own_token_states(env) == [True], "the manager minted again"
    finally:
        proxy.stop()


def test_manager_killed_and_restarted_converges(env: Env) -> None:
    env.create_mpc()
    manager = env.start_manager()
    kept, dropped = env.add_cluster("kept"), env.add_cluster("dropped")
    for cluster in (kept, dropped):
        env.add_addon(cluster)
    before = {
        c: wait_for(lambda c=c: env.work(c), timeout=LATENCY_BOUND, what=f"work of {c}")[0]
        for c in (kept, dropped)
    }
    # killed once the hub side is written too (a kill between minting a token and writing it leaves
    # an orphan token, pruned at a later resync: not what this test counts)
    wait_for(lambda: env.mpc_conditions().get("ProxyServerDeployed"), timeout=5, what="the hub side")
    manager.kill()

    # while it is down: an addon goes, a cluster comes, the MPC changes
    env.delete_addon(dropped)
    added = env.add_cluster("added")
    env.add_addon(added)
    env.patch_mpc({"spec": {"proxyAgent": {"image": "cluster-proxy/proxy-agent:after-restart"}}})
    assert env.work(dropped) is not None and env.work(added) is None

    started = time.monotonic()
    env.start_manager()

    def converged() -> bool:
        works = {w["metadata"]["namespace"]: w for w in env.works()}
        return set(works) == {kept, added} and all(
            agent_container(w)["image"] == "cluster-proxy/proxy-agent:after-restart" for w in works.values()
        )

    wait_for(converged, timeout=10, what="the restarted manager to converge")
    record("manager restarted (SIGKILL) -> converged", time.monotonic() - started)
    after = env.work(kept)
    assert after is not None
    # the kept cluster's work was updated in place, and its unused token reused, not re-minted
    assert after["metadata"]["uid"] == before[kept]["metadata"]["uid"]
    assert work_token(after) == work_token(before[kept])
    expected = sorted(
        ["addon-manager proxy-server", f"addon-manager cluster {kept}", f"addon-manager cluster {added}"]
    )

    def token_groups() -> list[str]:
        tokens = env.core.list_namespaced_secret(env.name, label_selector="cluster-proxy.io/kind=token").items
        return sorted(json.loads(base64.b64decode(s.data["record.json"]))["description"] for s in tokens)

    # the dropped cluster's token is deleted right after its work, by a second request of the same
    # reconcile: the works can be seen converged between the two (a fresh-clone CI run did)
    try:
        wait_for(lambda: token_groups() == expected, timeout=5, what="the dropped cluster's token to go")
    except AssertionError:
        assert token_groups() == expected


def test_hub_api_server_restart_is_survived(env: Env, hub: KubeCluster) -> None:
    env.create_mpc()
    manager = env.start_manager()
    before = env.add_cluster("before")
    env.add_addon(before)
    wait_for(lambda: env.work(before), timeout=LATENCY_BOUND, what="work before the restart")

    failures = len(manager.events("watch_failed"))
    hub.stop()
    # down until the manager has noticed (its watches fail and back off), then back
    wait_for(lambda: len(manager.events("watch_failed")) > failures, timeout=30, what="the manager to notice")
    hub.start()
    restarted = time.monotonic()
    assert manager.process.popen.poll() is None

    # a change made after the restart is reconciled by the same process
    after = env.add_cluster("after")
    env.add_addon(after)
    wait_for(lambda: env.work(after), timeout=20, what="a work for a cluster added after the restart")
    record("hub API server back -> new addon reconciled", time.monotonic() - restarted)
    env.patch_mpc({"spec": {"proxyAgent": {"additionalArgs": ["--dial-timeout=7s"]}}})
    wait_for(
        lambda: has_arg(env.work(before), "--dial-timeout=7s"),
        timeout=LATENCY_BOUND,
        what="an MPC edit after the restart",
    )


def test_load_balancer_entrypoint_waits_for_its_address(env: Env) -> None:
    env.create_mpc({"proxyServer": {"entrypoint": {"type": "LoadBalancerService"}}})
    env.start_manager()
    cluster = env.add_cluster()
    env.add_addon(cluster)
    waiting, _ = wait_for(
        lambda: env.conditions(cluster).get("ManifestApplied"), timeout=5, what="ManifestApplied"
    )
    assert (waiting["status"], waiting["reason"]) == ("False", "WaitingForLoadBalancer")
    assert env.work(cluster) is None
    wait_for(lambda: env.mpc_conditions().get("EntrypointReady"), timeout=5, what="the hub side")
    entry = env.core.read_namespaced_service("proxy-agent-entrypoint", env.name)
    assert entry.spec.type == "LoadBalancer"
    assert env.mpc_conditions()["EntrypointReady"]["reason"] == "WaitingForLoadBalancer"

    # the cloud provisions the two load balancers
    for service, address in (
        ("proxy-agent-entrypoint", "203.0.113.10"),
        ("cluster-proxy-cert-signer-entrypoint", "203.0.113.11"),
    ):
        env.core.patch_namespaced_service_status(
            service, env.name, {"status": {"loadBalancer": {"ingress": [{"ip": address}]}}}
        )
    work, _ = wait_for(lambda: env.work(cluster), timeout=LATENCY_BOUND, what="the work once addresses exist")
    assert "--server=203.0.113.10:8091" in agent_container(work)["args"]
    assert "--signer=https://203.0.113.11:8443" in agent_container(work)["args"]
    wait_for(
        lambda: env.mpc_conditions().get("EntrypointReady", {}).get("status") == "True",
        timeout=5,
        what="EntrypointReady",
    )
    server = env.apps.read_namespaced_deployment("cluster-proxy", env.name).spec.template.spec.containers[0]
    assert "--tls-host=203.0.113.10" in server.args  # agents verify the address they dial


def test_mpc_deleted_takes_the_hub_side_with_it(env: Env) -> None:
    env.create_mpc()
    env.start_manager()
    wait_for(lambda: env.mpc_conditions().get("ProxyServerDeployed"), timeout=10, what="the hub side")
    env.custom.delete_cluster_custom_object(*MPC, env.name)

    def hub_side_gone() -> bool:
        deployments = env.apps.list_namespaced_deployment(env.name, label_selector=LABEL).items
        services = env.core.list_namespaced_service(env.name, label_selector=LABEL).items
        accounts = env.core.list_namespaced_service_account(env.name, label_selector=LABEL).items
        return not deployments and not services and not accounts

    wait_for(hub_side_gone, timeout=LATENCY_BOUND, what="the hub objects to go with the MPC")
    # the CA stays: agents holding its certificates keep working if the MPC comes back
    env.core.read_namespaced_secret("cluster-proxy-ca-authorities", env.name)


# --- the default configuration ---------------------------------------------------------------------------


def mpc_or_none(env: Env) -> dict[str, Any] | None:
    try:
        return env.mpc()
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_an_absent_configuration_is_created_with_the_crds_defaults(env: Env) -> None:
    """No MPC at the start: the manager creates it (an empty spec; the API server fills in the CRD's
    defaults) and deploys from it. Deleted while the manager runs, it stays deleted and the hub side
    goes (as before); a restarted manager creates it again."""
    env.create_namespace(env.name)
    manager = env.start_manager()
    # created before manager_synced is logged, so it exists now
    created = manager.event("default_configuration_created")
    assert created is not None and created["name"] == env.name, manager.process.tail()
    mpc = env.mpc()
    assert mpc["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "cluster-proxy-addon-manager"
    spec = mpc["spec"]
    assert spec["proxyServer"]["image"] == "cluster-proxy/proxy-server:dev"
    assert spec["proxyAgent"]["image"] == "cluster-proxy/proxy-agent:dev"
    assert (spec["proxyServer"]["replicas"], spec["proxyAgent"]["replicas"]) == (1, 1)
    assert spec["proxyServer"]["entrypoint"]["type"] == "LoadBalancerService"
    assert spec["authentication"]["signer"]["type"] == "SelfSigned"
    assert "namespace" not in spec["proxyServer"]  # the manager's own: --namespace
    wait_for(lambda: env.mpc_conditions().get("ProxyServerDeployed"), timeout=10, what="the hub side from it")
    env.apps.read_namespaced_deployment("cluster-proxy", env.name)

    first_uid = mpc["metadata"]["uid"]
    env.custom.delete_cluster_custom_object(*MPC, env.name)
    wait_for(
        lambda: not env.apps.list_namespaced_deployment(env.name, label_selector=LABEL).items,
        timeout=LATENCY_BOUND,
        what="the hub side to go with the deleted MPC",
    )
    assert mpc_or_none(env) is None, "the running manager created the deleted MPC again"
    assert len(manager.events("default_configuration_created")) == 1
    manager.stop()

    restarted = env.start_manager()
    assert restarted.event("default_configuration_created") is not None
    assert env.mpc()["metadata"]["uid"] != first_uid


def test_an_existing_configuration_is_not_overwritten(env: Env) -> None:
    env.create_mpc(
        {"proxyServer": {"replicas": 2, "entrypoint": {"type": "Hostname", "hostname": {"value": "h1"}}}}
    )
    before = env.mpc()
    manager = env.start_manager()
    wait_for(lambda: env.mpc_conditions().get("ProxyServerDeployed"), timeout=10, what="the hub side")
    after = env.mpc()
    assert after["spec"] == before["spec"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["metadata"].get("labels") == before["metadata"].get("labels")
    assert manager.event("default_configuration_created") is None
    assert env.apps.read_namespaced_deployment("cluster-proxy", env.name).spec.replicas == 2


def test_no_configuration_is_created_when_told_not_to(env: Env) -> None:
    env.create_namespace(env.name)
    manager = env.start_manager("--no-create-default-configuration")
    # the decision is taken before manager_synced is logged
    assert manager.event("default_configuration_created") is None
    assert mpc_or_none(env) is None
    status, body = manager.readyz()
    assert status == 200, body


def test_missing_crds_are_named(kube_clusters: KubeClusters, tmp_path: Path) -> None:
    """cluster1 has no OCM or MPC CRDs: the manager says which are missing and how to install them,
    and is not ready."""
    cluster1 = kube_clusters["cluster1"]
    manager = Manager(
        tmp_path,
        "manager",
        [f"--kubeconfig={cluster1.kubeconfig}", "--admin-listen=127.0.0.1:0", "--log-format=json"],
    )
    try:
        manager.wait_started(synced=False)
        records, _ = wait_for(
            lambda: (
                len(found := [r for r in manager.events("watch_failed") if r["level"] == "error"]) >= 6
                and found
            ),
            timeout=10,
            what="errors for the missing CRDs",
        )
        errors = " ".join(r["error"] for r in records)
        assert (
            "the CRD managedproxyconfigurations.proxy.open-cluster-management.io is not installed" in errors
        )
        assert (
            "kubectl apply -f deploy/kustomize/base/crds/proxy.open-cluster-management.io_managedproxyconfigurations.yaml"
            in errors
        )
        assert "the CRD manifestworks.work.open-cluster-management.io is not installed" in errors
        status, body = manager.readyz()
        assert status == 503 and "is not installed" in body
    finally:
        manager.stop()


def _token_kubeconfig(hub: KubeCluster, path: Path, namespace: str, account: str) -> Path:
    api = hub.api_client()
    try:
        core = client.CoreV1Api(api)
        with contextlib.suppress(ApiException):
            core.create_namespaced_service_account(namespace, {"metadata": {"name": account}})
        token = core.create_namespaced_service_account_token(
            account, namespace, {"spec": {"expirationSeconds": 3600}}
        ).status.token
    finally:
        api.close()
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "hub", "cluster": {"server": hub.url, "certificate-authority": str(hub.ca_path)}}
                ],
                "users": [{"name": account, "user": {"token": token}}],
                "contexts": [{"name": "hub", "context": {"cluster": "hub", "user": account}}],
                "current-context": "hub",
            }
        )
    )
    return path


def test_rbac_file_is_all_the_manager_needs(env: Env, hub: KubeCluster) -> None:
    """Run as a ServiceAccount bound by deploy/kustomize/base/addon-manager/rbac.yaml and nothing
    else: the hub side, the CA store, a ManifestWork and the statuses are all written."""
    namespace = "open-cluster-management-addon"
    env.create_namespace(namespace)
    applied = hub.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(RBAC))
    assert applied.returncode == 0, applied.stderr
    kubeconfig = _token_kubeconfig(
        hub, env.tmp / "manager.kubeconfig", namespace, "cluster-proxy-addon-manager"
    )
    # the MPC names no namespace: the manager's own, where the Role is
    env.create_mpc(
        {
            "proxyServer": {
                "namespace": namespace,
                "entrypoint": {"type": "Hostname", "hostname": {"value": "127.0.0.1"}},
            }
        }
    )
    manager = env.start_manager(kubeconfig=kubeconfig, namespace=namespace)
    cluster = env.add_cluster()
    env.add_addon(cluster)
    wait_for(lambda: env.work(cluster), timeout=LATENCY_BOUND, what="the work, as the ServiceAccount")
    wait_for(
        lambda: env.conditions(cluster).get("ManifestApplied"),
        timeout=5,
        what="addon status, as the ServiceAccount",
    )
    wait_for(
        lambda: env.mpc_conditions().get("ProxyServerDeployed"),
        timeout=5,
        what="MPC status, as the ServiceAccount",
    )
    env.apps.read_namespaced_deployment("cluster-proxy-cert-signer", namespace)
    env.core.read_namespaced_secret("cluster-proxy-ca-authorities", namespace)
    problems = [r for r in manager.process.events() if "forbidden" in json.dumps(r).lower()]
    assert not problems, problems
    # the shared namespace is cleaned the way it would be: the hub side goes with the MPC, deleted by
    # the manager (its RBAC covers that too); the CA store stays
    env.custom.delete_cluster_custom_object(*MPC, env.name)
    wait_for(
        lambda: (
            not env.apps.list_namespaced_deployment(namespace, label_selector=LABEL).items
            and not env.core.list_namespaced_service(namespace, label_selector=LABEL).items
        ),
        timeout=LATENCY_BOUND,
        what="the hub side to go with the MPC",
    )
    manager.stop()

    # without the bindings: the first refusal names verb and resource and says what to grant
    bare = _token_kubeconfig(hub, env.tmp / "bare.kubeconfig", namespace, unique("no-rbac"))
    refused = env.start_manager(kubeconfig=bare, namespace=namespace, synced=False)
    records, _ = wait_for(
        lambda: [r for r in refused.events("watch_failed") if r["level"] == "error"],
        timeout=10,
        what="a forbidden error",
    )
    assert any(
        "forbidden: the addon-manager may not list" in r["error"]
        and "deploy/kustomize/base/addon-manager/rbac.yaml" in r["error"]
        for r in records
    ), records
    status, body = refused.readyz()
    assert status == 503 and "forbidden" in body


def test_used_tokens_are_replaced_and_the_servers_certificate_reported(env: Env) -> None:
    """Bootstrap with the tokens the manager handed out, as the signer does for a pod (its core, on
    the real Secrets store): each used token is replaced at once, and the MPC reports the proxy-server's
    certificate."""
    from clusterproxy_castore.kubestore import KubernetesSecretStore
    from clusterproxy_certsigner.core import SignerCore
    from clusterproxy_protocol import certclient

    env.create_mpc()
    env.start_manager()
    cluster = env.add_cluster()
    env.add_addon(cluster)
    work, _ = wait_for(lambda: env.work(cluster), timeout=LATENCY_BOUND, what="the work")
    signing, _ = wait_for(
        lambda: env.mpc_conditions().get("ProxyServerSecretsSigned"),
        timeout=5,
        what="ProxyServerSecretsSigned",
    )
    assert (signing["status"], signing["reason"]) == ("False", "WaitingForProxyServer")
    core = SignerCore(KubernetesSecretStore(namespace=env.name, prefix="cluster-proxy-ca", api=env.core))

    agent_token = work_token(work)
    started = time.monotonic()
    core.bootstrap(agent_token, certclient.agent_csr(certclient.generate_key(), cluster, "pod-a"))
    replaced, _ = wait_for(
        lambda: (w := env.work(cluster)) and work_token(w) != agent_token and w,
        timeout=LATENCY_BOUND,
        what="a new agent token after the first was used",
    )
    record("agent token used -> a new one in the ManifestWork", time.monotonic() - started)
    assert replaced["metadata"]["uid"] == work["metadata"]["uid"]

    def server_token() -> str:
        secret = env.core.read_namespaced_secret("cluster-proxy-server-bootstrap", env.name)
        return base64.b64decode(secret.data["bootstrap-token"]).decode()

    first = server_token()
    deployment = env.apps.read_namespaced_deployment("cluster-proxy", env.name)
    hosts = [
        a.split("=", 1)[1]
        for a in deployment.spec.template.spec.containers[0].args
        if a.startswith("--tls-host=")
    ]
    started = time.monotonic()
    core.bootstrap(first, certclient.server_csr(certclient.generate_key(), "proxy-server", hosts))
    wait_for(lambda: server_token() != first, timeout=LATENCY_BOUND, what="a new server token")
    record("server token used -> a new one in its Secret", time.monotonic() - started)
    signed, _ = wait_for(
        lambda: (c := env.mpc_conditions().get("ProxyServerSecretsSigned")) and c["status"] == "True" and c,
        timeout=5,
        what="ProxyServerSecretsSigned True",
    )
    assert signed["reason"] == "CertificateIssued"


def test_moving_the_proxy_server_namespace(env: Env) -> None:
    env.create_mpc()
    env.start_manager()
    cluster = env.add_cluster()
    env.add_addon(cluster)
    before, _ = wait_for(lambda: env.work(cluster), timeout=LATENCY_BOUND, what="the work")
    wait_for(lambda: env.mpc_conditions().get("ProxyServerDeployed"), timeout=5, what="the hub side")
    moved = f"{env.name}-moved"
    env.create_namespace(moved)
    env.patch_mpc({"spec": {"proxyServer": {"namespace": moved}}})

    def settled() -> bool:
        old = env.apps.list_namespaced_deployment(env.name, label_selector=LABEL).items
        new = env.apps.list_namespaced_deployment(moved, label_selector=LABEL).items
        return not old and {d.metadata.name for d in new} == {"cluster-proxy", "cluster-proxy-cert-signer"}

    wait_for(settled, timeout=LATENCY_BOUND, what="the hub side to move")
    assert not env.core.list_namespaced_service(env.name, label_selector=LABEL).items
    # the agent now bootstraps from the new namespace's store: a new CA bundle and a token minted there
    after, _ = wait_for(
        lambda: (w := env.work(cluster)) and work_token(w) != work_token(before) and w,
        timeout=LATENCY_BOUND,
        what="the work to follow the move",
    )
    token_id = work_token(after).split(".")[0]
    env.core.read_namespaced_secret(f"cluster-proxy-ca-token-{token_id}", moved)
    assert manifests(after)["Secret"]["data"]["ca.crt"] != manifests(before)["Secret"]["data"]["ca.crt"]


def hub_reconciles_ok(manager: Manager) -> float:
    """``cluster_proxy_addon_manager_reconciles_total{kind="hub",result="ok"}`` from its /metrics."""
    with urllib.request.urlopen(f"http://{manager.admin}/metrics", timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        series = line.startswith("cluster_proxy_addon_manager_reconciles_total{")
        if series and 'kind="hub"' in line and 'result="ok"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_hub_clients_bootstrap_secrets_are_kept_replaced_and_reused(env: Env) -> None:
    """``--hub-client``: the health-collector's Secret in the proxy-server namespace and the gateway's in
    another namespace, each with the trust bundle and an unused token bound to its client name (the
    signer's core refuses it for another name); a bootstrap with it (as the signer does for a pod)
    replaces it at once in its Secret; a restarted manager reuses both tokens, minting none; two
    clients naming one Secret are refused at start."""
    from clusterproxy_castore.kubestore import KubernetesSecretStore
    from clusterproxy_certsigner.core import SignerCore
    from clusterproxy_certsigner.errors import SignerError
    from clusterproxy_protocol import certclient

    env.create_mpc()
    elsewhere = unique("am-gw")
    env.create_namespace(elsewhere)
    clients = {"health-collector": (env.name, "hc-bootstrap"), "cluster-gateway": (elsewhere, "gw-bootstrap")}
    flags = [
        "--hub-client=health-collector=hc-bootstrap",
        f"--hub-client=cluster-gateway={elsewhere}/gw-bootstrap",
    ]
    manager = env.start_manager(*flags)
    store = KubernetesSecretStore(namespace=env.name, prefix="cluster-proxy-ca", api=env.core)
    core = SignerCore(store)

    def secret(name: str) -> dict[str, Any] | None:
        namespace, secret_name = clients[name]
        try:
            found = env.core.read_namespaced_secret(secret_name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return {
            **{k: base64.b64decode(v).decode() for k, v in (found.data or {}).items()},
            "labels": found.metadata.labels or {},
        }

    tokens = {}
    for name in clients:
        kept, _ = wait_for(lambda n=name: secret(n), timeout=LATENCY_BOUND, what=f"the Secret of {name}")
        assert kept["labels"]["app.kubernetes.io/managed-by"] == "cluster-proxy-addon-manager", kept
        assert kept["ca.crt"].strip() == store.read_authorities().bundle_pem().strip(), "not the trust bundle"
        record_ = store.get_token(kept["bootstrap-token"].split(".", 1)[0])
        assert record_ is not None and record_.used_at is None
        assert (record_.binding.kind, record_.binding.name) == ("client", name), record_.binding
        tokens[name] = kept["bootstrap-token"]

    # a token is good for its own name only
    with pytest.raises(SignerError):
        core.bootstrap(
            tokens["cluster-gateway"], certclient.client_csr(certclient.generate_key(), "someone-else")
        )
    for name in clients:
        started = time.monotonic()
        core.bootstrap(tokens[name], certclient.client_csr(certclient.generate_key(), name))
        replaced, _ = wait_for(
            lambda n=name: (s := secret(n)) and s["bootstrap-token"] != tokens[n] and s,
            timeout=LATENCY_BOUND,
            what=f"a new token for {name} after the first was used",
        )
        record(f"{name} token used -> a new one in its Secret", time.monotonic() - started)
        tokens[name] = replaced["bootstrap-token"]

    # a restarted manager reads them back: nothing minted
    manager.kill()
    restarted = env.start_manager(*flags)
    wait_for(lambda: hub_reconciles_ok(restarted) >= 1, timeout=LATENCY_BOUND, what="a hub reconcile")
    assert [r for r in restarted.events("token_minted") if str(r.get("group")).startswith("hub-client")] == []
    assert {name: (secret(name) or {}).get("bootstrap-token") for name in clients} == tokens
    restarted.stop()

    # one Secret for two clients: refused at start, in words
    refused = Manager(
        env.tmp,
        "manager-refused",
        ["--hub-client=a=same", "--hub-client=b=same", f"--kubeconfig={env.hub.kubeconfig}"],
    )
    assert refused.process.popen.wait(30) == 2
    assert "name the same Secret same" in refused.process.tail()
