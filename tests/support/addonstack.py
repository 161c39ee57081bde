"""The addon as the tests on bare API servers (tests/kube) run it: the addon-manager process on the hub
API server, a ManagedProxyConfiguration with an entrypoint of type Hostname ``127.0.0.1`` and free
ports, the cert-signer and proxy-server started from the Deployments the manager wrote, and managed
clusters joined with :meth:`AddonStack.join` (ManagedCluster + ManagedClusterAddOn -> the ManifestWork's
manifests applied to the cluster's API server -> the agent started from its Deployment). The pods and
the applying are :mod:`tests.support.localpods`' (its docstring says why they stay and which tests on
real nodes and real OCM cover what they leave out).
"""

from __future__ import annotations

import json
import secrets
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support.kubeapi import KubeCluster
from tests.support.localpods import WORK_GROUP, WORK_PLURAL, WORK_VERSION, Kubelet, Pod, WorkApplier
from tests.support.waiting import poll_until

__all__ = [
    "ADDON_NAME",
    "MANIFEST_WORK",
    "WORK_GROUP",
    "WORK_PLURAL",
    "WORK_VERSION",
    "AddonStack",
    "Member",
    "install_mpc_crd",
]

MPC_CRD = (
    Path(__file__).resolve().parents[2]
    / "deploy/kustomize/base/crds/proxy.open-cluster-management.io_managedproxyconfigurations.yaml"
)
MPC_GROUP, MPC_VERSION, MPC_PLURAL = (
    "proxy.open-cluster-management.io",
    "v1alpha1",
    "managedproxyconfigurations",
)
ADDON_GROUP, ADDON_VERSION = "addon.open-cluster-management.io", "v1alpha1"
ADDON_NAME = "cluster-proxy"
MANIFEST_WORK = "addon-cluster-proxy-deploy"
SERVER_DEPLOYMENT = "cluster-proxy"
SIGNER_DEPLOYMENT = "cluster-proxy-cert-signer"
AGENT_DEPLOYMENT = "cluster-proxy-proxy-agent"
STORE_PREFIX = "cluster-proxy-ca"


def install_mpc_crd(hub: KubeCluster, timeout: float = 60.0) -> None:
    """The ManagedProxyConfiguration CRD of deploy/kustomize/base/crds, Established."""
    applied = hub.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(MPC_CRD), timeout=timeout)
    assert applied.returncode == 0, f"the MPC CRD was refused:\n{applied.stderr}"
    name = yaml.safe_load(MPC_CRD.read_text())["metadata"]["name"]
    waited = hub.kubectl("wait", "--for=condition=Established", f"--timeout={timeout:g}s", f"crd/{name}")
    assert waited.returncode == 0, f"the MPC CRD is not Established:\n{waited.stdout}{waited.stderr}"


@dataclass
class Member:
    """A managed cluster of the addon: its ManagedCluster ``name`` on the hub, its API server ``api``
    where the work agent applies and the kubelet runs its agent."""

    name: str
    api: KubeCluster
    install_namespace: str
    work_applier: WorkApplier
    kubelet: Kubelet
    agent: Pod | None = None


@dataclass(frozen=True)
class Ports:
    client: int
    agent: int
    admin: int
    signer: int


class AddonStack:
    """The addon as the tests run it: the addon-manager process on the hub API server, a
    ManagedProxyConfiguration with an entrypoint of type Hostname ``127.0.0.1`` and free ports, the
    cert-signer and proxy-server started from the Deployments the manager wrote (:class:`Kubelet`),
    and managed clusters joined with :meth:`join` (ManagedCluster + ManagedClusterAddOn -> the
    ManifestWork applied by a :class:`WorkApplier` -> the agent started from its Deployment)."""

    def __init__(self, hub: KubeCluster, directory: Path, *, manager_args: Iterable[str] = ()) -> None:
        from tests.support.kubeapi import free_port

        tag = secrets.token_hex(3)
        self.hub = hub
        self.directory = directory
        self.tag = tag
        self.namespace = f"cp-hub-{tag}"
        self.mpc_name = f"cp-{tag}"
        self.ports = Ports(free_port(), free_port(), free_port(), free_port())
        self.manager_args = list(manager_args)
        self.hub_kubelet = Kubelet(hub, directory / "hub")
        self.api = hub.api_client()
        self.members: dict[str, Member] = {}
        self.manager: Any = None
        self.signer: Pod | None = None
        self.server: Pod | None = None
        self._admin_tls: ssl.SSLContext | None = None
        self.timings: dict[str, float] = {}

    # hub
    @property
    def store(self) -> str:
        return f"kubernetes:{self.namespace}/{STORE_PREFIX}"

    @property
    def admin_url(self) -> str:
        """The proxy-server's admin port for its agents and clusters: mutual TLS with a hub client
        certificate (:meth:`admin_tls`); its certificate names the entrypoint's host, 127.0.0.1."""
        return f"https://127.0.0.1:{self.ports.admin}"

    def mpc(self, **agent: Any) -> dict[str, Any]:
        return {
            "apiVersion": f"{MPC_GROUP}/{MPC_VERSION}",
            "kind": "ManagedProxyConfiguration",
            "metadata": {"name": self.mpc_name},
            "spec": {
                "proxyServer": {
                    "entrypoint": {
                        "type": "Hostname",
                        "hostname": {"value": "127.0.0.1"},
                        "port": self.ports.agent,
                    },
                },
                # Pods share the machine's network here: the agents' admin port (fixed 8093 in the
                # Deployment) would collide between clusters and with other users of the machine.
                "proxyAgent": {
                    "additionalArgs": ["--admin-listen=127.0.0.1:0", "--log-level=debug"],
                    **agent,
                },
                "deploy": {
                    "ports": {
                        "proxyServer": self.ports.client,
                        "agentServer": self.ports.agent,
                        "adminServer": self.ports.admin,
                        "signer": self.ports.signer,
                    }
                },
            },
        }

    def start(self, timeout: float = 90.0) -> AddonStack:
        from kubernetes import client

        from tests.support.procs import BIN as VENV_BIN, Process

        started = time.monotonic()
        install_mpc_crd(self.hub)
        client.CoreV1Api(self.api).create_namespace({"metadata": {"name": self.namespace}})
        client.CustomObjectsApi(self.api).create_cluster_custom_object(
            MPC_GROUP, MPC_VERSION, MPC_PLURAL, self.mpc()
        )
        (self.directory / "logs").mkdir(parents=True, exist_ok=True)
        self.manager = Process(
            "addon-manager",
            [
                str(VENV_BIN / "cluster-proxy-addon-manager"),
                f"--kubeconfig={self.hub.kubeconfig}",
                f"--namespace={self.namespace}",
                f"--mpc-name={self.mpc_name}",
                f"--admin-url={self.admin_url}",
                # its own hub client certificate for that URL, from the signer the manager deploys
                # (no cluster DNS here for the default, the signer's Service)
                f"--signer=https://127.0.0.1:{self.ports.signer}",
                f"--credentials-dir={self.directory / 'addon-manager'}",
                "--admin-listen=127.0.0.1:0",
                "--log-format=json",
                "--log-level=debug",
                *self.manager_args,
            ],
            self.directory / "logs",
        )
        self.wait_manager_event("manager_synced", timeout=timeout)
        self._deployment(SIGNER_DEPLOYMENT, timeout)
        self.signer = self.hub_kubelet.run(self.namespace, SIGNER_DEPLOYMENT).wait_ready(timeout)
        self._deployment(SERVER_DEPLOYMENT, timeout)
        self.server = self.hub_kubelet.run(self.namespace, SERVER_DEPLOYMENT).wait_ready(timeout)
        self.admin_tls()
        self.timings["hub_ready"] = time.monotonic() - started
        return self

    def wait_manager_event(self, event: str, timeout: float = 60.0, **match: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            for record in self.manager.events():
                if record.get("event") == event and all(record.get(k) == v for k, v in match.items()):
                    return record
            if self.manager.popen.poll() is not None:
                raise AssertionError(
                    f"the addon-manager exited ({self.manager.popen.returncode}):\n{self.manager.tail()}"
                )
            return None

        try:
            return poll_until(
                found, timeout=timeout, interval=0.05, what=f"{event} in the addon-manager's log"
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.manager.tail()}") from None

    def _deployment(self, name: str, timeout: float) -> dict[str, Any]:
        try:
            return self.hub_kubelet.wait_deployment(self.namespace, name, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the addon-manager's log:\n{self.manager.tail()}") from None

    def admin_tls(self) -> ssl.SSLContext:
        """The hub client TLS the tests read the proxy-server's agents with (its certificate made once,
        from the running signer: :meth:`client_certificate`)."""
        if self._admin_tls is None:
            from clusterproxy_protocol.tls import client_context
            from clusterproxy_protocol.wire import ALPN_HTTP1

            ca, cert, key = self.client_certificate("stack-reader")
            self._admin_tls = client_context(cert, key, ca, alpn=[ALPN_HTTP1])
        return self._admin_tls

    def agents_connected(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(
            f"{self.admin_url}/api/v1/agents", timeout=5, context=self.admin_tls()
        ) as answer:
            return json.loads(answer.read())

    def tunnels(self, cluster: str) -> int:
        return sum(1 for agent in self.agents_connected() if agent["cluster"] == cluster)

    # managed clusters
    def join(self, name: str, api: KubeCluster, timeout: float = 60.0) -> Member:
        """ManagedCluster ``name`` (its namespace on the hub) and its ManagedClusterAddOn
        ``cluster-proxy`` (installNamespace unique to this stack); the work agent applies the
        ManifestWork to ``api``; the agent runs from its Deployment and holds a tunnel."""
        install_namespace = f"cp-agent-{self.tag}"
        enable_addon(self.api, name, install_namespace)
        member = Member(
            name,
            api,
            install_namespace,
            WorkApplier(self.hub, api, name).start(),
            Kubelet(api, self.directory / name),
        )
        self.members[name] = member
        started = time.monotonic()
        applied = member.work_applier.wait_applied(MANIFEST_WORK, timeout)
        assert applied.ok, f"the work agent could not apply {name}'s ManifestWork: {applied.errors()}"
        member.agent = member.kubelet.run(install_namespace, AGENT_DEPLOYMENT)
        self.wait_tunnel(name, timeout=timeout)
        self.timings[f"join_{name}"] = time.monotonic() - started
        return member

    def wait_tunnel(self, cluster: str, *, present: bool = True, timeout: float = 60.0) -> float:
        """Seconds until ``cluster`` holds a tunnel (or none, ``present=False``) on the proxy-server."""
        started = time.monotonic()
        member = self.members.get(cluster)

        def reached() -> bool:
            if present and member is not None and member.agent is not None:
                agent = member.agent.container()
                if not agent.running:
                    raise AssertionError(f"{cluster}'s agent exited ({agent.returncode}):\n{agent.tail()}")
            return (self.tunnels(cluster) > 0) == present

        try:
            poll_until(
                reached,
                timeout=timeout,
                interval=0.05,
                what=f"{cluster} {'connected' if present else 'disconnected'}",
            )
        except AssertionError as exc:
            logs = member.agent.container().tail() if member is not None and member.agent is not None else ""
            server = self.server.container().tail() if self.server is not None else ""
            raise AssertionError(f"{exc}\n--- agent\n{logs}\n--- proxy-server\n{server}") from None
        return time.monotonic() - started

    # a hub user
    def client_certificate(self, name: str = "hub-admin") -> tuple[Path, Path, Path]:
        """(ca, cert, key) of a hub client: a token from the signer's store (``cluster-proxy-cert-signer
        token create --client``, as an admin does), traded with the running signer for a certificate."""
        import trio

        from clusterproxy_protocol.certclient import CertFiles, SignerEndpoint, bootstrap_files, client_csr

        signer_cli = str(self.hub_kubelet.bin_dir / "cluster-proxy-cert-signer")
        common = [f"--store={self.store}", f"--kubeconfig={self.hub.kubeconfig}"]
        directory = self.directory / "clients" / name
        directory.mkdir(parents=True, exist_ok=True)
        ca = directory / "ca.crt"
        bundle = subprocess.run(
            [signer_cli, "trust-bundle", *common, f"--out={ca}"], capture_output=True, text=True, timeout=60
        )
        assert bundle.returncode == 0, f"trust-bundle failed:\n{bundle.stderr}"
        made = subprocess.run(
            [signer_cli, "token", "create", *common, f"--client={name}", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert made.returncode == 0, f"token create failed:\n{made.stderr}"
        token = json.loads(made.stdout)["token"]
        files = CertFiles(directory / "tls.crt", directory / "tls.key", ca)
        endpoint = SignerEndpoint.parse(f"https://127.0.0.1:{self.ports.signer}", ca)
        trio.run(bootstrap_files, endpoint, token, files, lambda key: client_csr(key, name))
        return ca, files.cert, files.key

    def close(self) -> None:
        """Stop every process, then delete what the stack created on the hub (the addons, their
        ManifestWorks, the ManagedClusters, the MPC; namespaces stay Terminating: no controller-manager)
        so that the next stack's manager does not find them."""
        for member in self.members.values():
            member.work_applier.close()
            member.kubelet.close(grace=10)
        self.hub_kubelet.close(grace=10)
        if self.manager is not None:
            self.manager.stop()
        self._delete_objects()
        self.api.close()

    def _delete_objects(self) -> None:
        from kubernetes import client

        custom = client.CustomObjectsApi(self.api)
        deletions: list[Callable[[], Any]] = []
        for name in self.members:
            deletions += [
                lambda n=name: custom.delete_namespaced_custom_object(
                    ADDON_GROUP, ADDON_VERSION, n, "managedclusteraddons", ADDON_NAME
                ),
                lambda n=name: custom.delete_namespaced_custom_object(
                    WORK_GROUP, WORK_VERSION, n, WORK_PLURAL, MANIFEST_WORK
                ),
                lambda n=name: custom.delete_cluster_custom_object(
                    "cluster.open-cluster-management.io", "v1", "managedclusters", n
                ),
                lambda n=name: client.CoreV1Api(self.api).delete_namespace(n),
            ]
        deletions += [
            lambda: custom.delete_cluster_custom_object(MPC_GROUP, MPC_VERSION, MPC_PLURAL, self.mpc_name),
            lambda: client.CoreV1Api(self.api).delete_namespace(self.namespace),
        ]
        for delete in deletions:
            try:
                delete()
            except Exception as exc:
                if getattr(exc, "status", None) != 404:
                    raise


def enable_addon(api: Any, name: str, install_namespace: str) -> None:
    """On the hub behind ``api`` (a kubernetes ApiClient): ManagedCluster ``name`` (accepted, its
    namespace made) and its ManagedClusterAddOn ``cluster-proxy`` installing into ``install_namespace``."""
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    custom.create_cluster_custom_object(
        "cluster.open-cluster-management.io",
        "v1",
        "managedclusters",
        {
            "apiVersion": "cluster.open-cluster-management.io/v1",
            "kind": "ManagedCluster",
            "metadata": {"name": name},
            "spec": {"hubAcceptsClient": True},
        },
    )
    custom.create_namespaced_custom_object(
        ADDON_GROUP,
        ADDON_VERSION,
        name,
        "managedclusteraddons",
        {
            "apiVersion": f"{ADDON_GROUP}/{ADDON_VERSION}",
            "kind": "ManagedClusterAddOn",
            "metadata": {"name": ADDON_NAME, "namespace": name},
            "spec": {"installNamespace": install_namespace},
        },
    )
