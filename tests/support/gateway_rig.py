"""A cluster-gateway behind the hub's aggregator, for the gateway's test modules (tests/kube) and the
bench: :func:`running_gateway`, and what they share (the APIService, the token Secret a test projects,
the reader role of the gateway's ServiceAccount, kubectl with a hub user's or a cluster's kubeconfig,
ManagedClusters made and deleted, an exec through the gateway to the fake kubelet, Roles bound).

The ManagedClusters are named ``<api server>-<stack tag>`` (``cluster1-3f2a1c``) unless ``tagged`` is
False: a cluster's namespace on the hub stays Terminating once deleted (no controller-manager runs), so
only one module of a session may use a name, and test_gateway.py has ``cluster1`` and ``cluster2``
(untagged, as a user sees them). Which API server answered is proved by a namespace that exists only
there (``Managed.only_here``).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.stream import stream

from tests.support import require
from tests.support.addonstack import (
    MANIFEST_WORK,
    WORK_GROUP,
    WORK_PLURAL,
    WORK_VERSION,
    AddonStack,
    enable_addon,
)
from tests.support.fake_kubelet import FakeKubelet
from tests.support.kubeapi import KubeCluster, KubeClusters, free_port
from tests.support.procs import BIN, Process
from tests.support.waiting import poll_until

__all__ = [
    "APISERVICE",
    "SA_NAME",
    "SA_NAMESPACE",
    "SA_USER",
    "SERVICE_PROXY_SA",
    "Gateway",
    "Managed",
    "running_gateway",
]

GROUP_PATH = "/apis/cluster.core.oam.dev/v1alpha1"
APISERVICE = "v1alpha1.cluster.core.oam.dev"
SA_NAMESPACE = "open-cluster-management-managed-serviceaccount"
SA_NAME = "cluster-gateway"
SA_USER = f"system:serviceaccount:{SA_NAMESPACE}:{SA_NAME}"
TOKEN_SECRET = "cluster-gateway"
SERVICE_PROXY_SA = "cluster-proxy-service-proxy"  # its credential Secret on the hub has this name too
READER = "cluster-gateway-test-reader"
RBAC = "rbac.authorization.k8s.io"
V4 = "v4.channel.k8s.io"  # the exec subprotocol the fake kubelet speaks
CHUNK = 64 << 10
EXEC_TIMEOUT = 60


@dataclass
class Managed:
    name: str  # the ManagedCluster
    api: KubeCluster
    only_here: str  # a namespace that exists on this cluster's API server alone


@dataclass
class Gateway:
    stack: AddonStack
    hub: KubeCluster
    process: Process
    port: int
    clusters: dict[str, Managed]
    directory: Path
    kube_clusters: KubeClusters
    service_proxy_port: int = 0  # with service_proxy: https://127.0.0.1:PORT/<cluster>/...
    ca_bundle: Path | None = None  # the signer's trust bundle: verifies the service proxy's certificate

    @property
    def allowlist(self) -> str:
        """The service proxy's allow-list ConfigMap (in the stack's namespace on the hub)."""
        return f"{self.stack.namespace}/cluster-proxy-service-proxy-allowlist"

    def proxy_path(self, cluster: str, rest: str) -> str:
        return f"{GROUP_PATH}/clustergateways/{cluster}/proxy{rest}"


def ignore_conflict(call: Any) -> None:
    try:
        call()
    except client.exceptions.ApiException as exc:
        if exc.status != 409:
            raise


def _project_token(hub: KubeCluster, managed: Managed, name: str = SA_NAME) -> None:
    """What the ManagedServiceAccount controller does (tests/kube/test_managed_serviceaccount.py shows
    it): a ServiceAccount ``name`` in the managed cluster, its token in the hub Secret of that name."""
    with managed.api.api_client() as admin:
        core = client.CoreV1Api(admin)
        ignore_conflict(lambda: core.create_namespace({"metadata": {"name": SA_NAMESPACE}}))
        ignore_conflict(
            lambda: core.create_namespaced_service_account(SA_NAMESPACE, {"metadata": {"name": name}})
        )
        token = core.create_namespaced_service_account_token(
            name, SA_NAMESPACE, {"spec": {"expirationSeconds": 3600}}
        ).status.token
    with hub.api_client() as admin:
        client.CoreV1Api(admin).create_namespaced_secret(
            managed.name,
            {
                "metadata": {"name": name},
                "stringData": {"token": token, "ca.crt": managed.api.ca_path.read_text()},
            },
        )


def _set_reader(api: KubeCluster, allowed: bool) -> None:
    """Whether the gateway's ServiceAccount may read namespaces and manage ConfigMaps in ``api``."""
    with api.api_client() as admin:
        rbac = client.RbacAuthorizationV1Api(admin)
        if not allowed:
            with contextlib.suppress(client.exceptions.ApiException):
                rbac.delete_cluster_role_binding(READER)
            return
        ignore_conflict(
            lambda: rbac.create_cluster_role(
                {
                    "metadata": {"name": READER},
                    "rules": [
                        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
                        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["*"]},
                    ],
                }
            )
        )
        ignore_conflict(
            lambda: rbac.create_cluster_role_binding(
                {
                    "metadata": {"name": READER},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": READER,
                    },
                    "subjects": [{"kind": "ServiceAccount", "name": SA_NAME, "namespace": SA_NAMESPACE}],
                }
            )
        )


def _register(hub: KubeCluster, namespace: str, port: int) -> None:
    """The APIService (as deploy/kustomize's overlay ships it: no caBundle, the gateway writes its
    serving CA there) with an ExternalName Service."""
    with hub.api_client() as admin:
        client.CoreV1Api(admin).create_namespaced_service(
            namespace,
            {
                "metadata": {"name": "cluster-gateway"},
                "spec": {
                    "type": "ExternalName",
                    "externalName": "localhost",
                    "ports": [{"name": "https", "port": port, "targetPort": port}],
                },
            },
        )
        client.ApiregistrationV1Api(admin).create_api_service(
            {
                "metadata": {"name": APISERVICE},
                "spec": {
                    "group": "cluster.core.oam.dev",
                    "version": "v1alpha1",
                    "service": {"namespace": namespace, "name": "cluster-gateway", "port": port},
                    "groupPriorityMinimum": 5000,
                    "versionPriority": 10,
                },
            }
        )


@contextlib.contextmanager
def running_gateway(
    kube_clusters: KubeClusters,
    directory: Path,
    apis: Sequence[str] = ("cluster1", "cluster2"),
    *,
    extra_args: Sequence[str] = (),
    log_level: str = "debug",
    tagged: bool = True,
    managed_serviceaccounts: bool = False,
    service_proxy: bool = False,
) -> Iterator[Gateway]:
    """The addon's stack, the API servers ``apis`` joined (each with the token Secret of a
    ServiceAccount ``cluster-gateway`` there), the APIService and the gateway process; all removed on
    exit. ``Gateway.clusters`` is keyed by API server name; ``Managed.name`` is the ManagedCluster
    (the API server's name itself when not ``tagged``).

    With ``managed_serviceaccounts`` no token Secret is made by hand: the gateway runs with
    ``--managed-serviceaccounts`` and writes it from the ManagedServiceAccount the addon-manager
    creates (the hub needs that CRD first: tests/kube/crds/authentication).

    With ``service_proxy`` the gateway also serves its HTTPS endpoint on 127.0.0.1 (its certificate
    from the cert-signer with a server token, as an admin mints one), each cluster's service-proxy
    credential projected like the gateway's token (its RBAC comes with the addon's ManifestWork)."""
    hub = kube_clusters["hub"]
    stack = AddonStack(hub, directory)
    process = None
    registered = False
    try:
        stack.start()
        managed: dict[str, Managed] = {}
        for api_name in apis:
            api = kube_clusters[api_name]
            name = f"{api_name}-{stack.tag}" if tagged else api_name
            only_here = f"only-in-{api_name}-{stack.tag}"
            with api.api_client() as admin:
                client.CoreV1Api(admin).create_namespace({"metadata": {"name": only_here}})
            stack.join(name, api)
            managed[api_name] = Managed(name, api, only_here)
            if not managed_serviceaccounts:
                _project_token(hub, managed[api_name])
                if service_proxy:
                    _project_token(hub, managed[api_name], SERVICE_PROXY_SA)
        port = free_port()
        _register(hub, stack.namespace, port)
        registered = True
        signer_cli = [
            str(BIN / "cluster-proxy-cert-signer"),
            f"--store={stack.store}",
            f"--kubeconfig={hub.kubeconfig}",
        ]
        bundle = directory / "bootstrap-ca.crt"
        made = subprocess.run(
            [*signer_cli[:1], "trust-bundle", *signer_cli[1:], f"--out={bundle}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert made.returncode == 0, made.stderr
        minted = subprocess.run(
            [*signer_cli[:1], "token", "create", *signer_cli[1:], "--client=cluster-gateway", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert minted.returncode == 0, minted.stderr
        credentials = directory / "gateway-credentials"
        env = {"CLUSTER_PROXY_GATEWAY_BOOTSTRAP_TOKEN": json.loads(minted.stdout)["token"]}
        service_proxy_port = 0
        service_proxy_args: list[str] = []
        if service_proxy:
            server_token = subprocess.run(
                [
                    *signer_cli[:1],
                    "token",
                    "create",
                    *signer_cli[1:],
                    "--server=cluster-proxy-service-proxy",
                    "--host=127.0.0.1",
                    "--json",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert server_token.returncode == 0, server_token.stderr
            env["CLUSTER_PROXY_GATEWAY_SERVICE_PROXY_BOOTSTRAP_TOKEN"] = json.loads(server_token.stdout)[
                "token"
            ]
            service_proxy_port = free_port()
            service_proxy_args = [
                f"--service-proxy-listen=127.0.0.1:{service_proxy_port}",
                "--service-proxy-host=127.0.0.1",
                f"--service-proxy-allowlist={stack.namespace}/cluster-proxy-service-proxy-allowlist",
            ]
        process = Process(
            "cluster-gateway",
            [
                str(BIN / "cluster-proxy-cluster-gateway"),
                f"--listen=127.0.0.1:{port}",
                f"--serving-name=cluster-gateway.{stack.namespace}.svc",
                f"--apiservice={APISERVICE}",
                f"--state-dir={directory / 'gateway-state'}",
                f"--kubeconfig={hub.kubeconfig}",
                f"--proxy-server=127.0.0.1:{stack.ports.client}",
                f"--signer=https://127.0.0.1:{stack.ports.signer}",
                f"--bootstrap-ca={bundle}",
                f"--proxy-ca={credentials / 'ca.crt'}",
                f"--proxy-cert={credentials / 'tls.crt'}",
                f"--proxy-key={credentials / 'tls.key'}",
                *(["--managed-serviceaccounts"] if managed_serviceaccounts else []),
                "--log-format=json",
                f"--log-level={log_level}",
                *service_proxy_args,
                *extra_args,
            ],
            directory,
            env=env,
        )
        poll_until(
            lambda: (
                any(r.get("event") == "gateway_started" for r in process.events())
                or (process.popen.poll() is not None and _exited(process))
            ),
            timeout=60,
            what="the gateway's gateway_started",
        )
        waited = hub.kubectl("wait", "--for=condition=Available", "--timeout=60s", f"apiservice/{APISERVICE}")
        assert waited.returncode == 0, f"{waited.stderr}\n--- gateway\n{process.tail()}"
        yield Gateway(
            stack, hub, process, port, managed, directory, kube_clusters, service_proxy_port, bundle
        )
    finally:
        if registered:
            with hub.api_client() as admin, contextlib.suppress(client.exceptions.ApiException):
                client.ApiregistrationV1Api(admin).delete_api_service(APISERVICE)
        if process is not None:
            process.stop()
        for api_name in apis:
            with contextlib.suppress(Exception):
                _set_reader(kube_clusters[api_name], False)
        stack.close()


def _exited(process: Process) -> bool:
    raise AssertionError(f"the gateway exited:\n{process.tail()}")


# --- talking to the hub and the clusters through the gateway --------------------------------------------


def _kubectl(kubeconfig: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    kubectl = shutil.which("kubectl")
    require(kubectl is not None, "kubectl (apt-get install kubernetes-client)")
    assert kubectl is not None
    return subprocess.run(
        [kubectl, f"--kubeconfig={kubeconfig}", f"--cache-dir={kubeconfig.parent / 'kubectl-cache'}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _hub_user(gateway: Gateway, name: str) -> Path:
    """A hub kubeconfig of user ``name`` (a client certificate of the hub's CA, no groups)."""
    pair = gateway.kube_clusters.ca.issue(f"hub-user-{name}", name)
    path = gateway.directory / f"hub-{name}.kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "hub",
                        "cluster": {
                            "server": gateway.hub.url,
                            "certificate-authority": str(gateway.hub.ca_path),
                        },
                    }
                ],
                "users": [
                    {
                        "name": name,
                        "user": {"client-certificate": str(pair.cert), "client-key": str(pair.key)},
                    }
                ],
                "contexts": [{"name": "hub", "context": {"cluster": "hub", "user": name}}],
                "current-context": "hub",
            }
        )
    )
    return path


def _cluster_kubeconfig(gateway: Gateway, cluster: str, hub_kubeconfig: Path | None = None) -> Path:
    out = gateway.directory / f"{cluster}-{secrets.token_hex(2)}.kubeconfig"
    done = subprocess.run(
        [
            str(BIN / "cluster-proxy"),
            "kubeconfig",
            cluster,
            f"--kubeconfig={hub_kubeconfig or gateway.hub.kubeconfig}",
            f"--output={out}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return out


def _names(output: str) -> set[str]:
    return {line.split("/", 1)[-1] for line in output.split()}


def _managed_cluster(gateway: Gateway, name: str) -> None:
    """A ManagedCluster with the addon and no agent anywhere."""
    with gateway.hub.api_client() as admin:
        enable_addon(admin, name, f"cp-agent-{gateway.stack.tag}")


def _delete_managed_cluster(gateway: Gateway, name: str) -> None:
    with gateway.hub.api_client() as admin:
        custom = client.CustomObjectsApi(admin)
        for delete in (
            lambda: custom.delete_namespaced_custom_object(
                WORK_GROUP, WORK_VERSION, name, WORK_PLURAL, MANIFEST_WORK
            ),
            lambda: custom.delete_namespaced_custom_object(
                "addon.open-cluster-management.io", "v1alpha1", name, "managedclusteraddons", "cluster-proxy"
            ),
            lambda: custom.delete_cluster_custom_object(
                "cluster.open-cluster-management.io", "v1", "managedclusters", name
            ),
            lambda: client.CoreV1Api(admin).delete_namespace(name),
        ):
            with contextlib.suppress(client.exceptions.ApiException):
                delete()


# --- an exec through the gateway to the fake kubelet ------------------------------------------------------


@dataclass
class ExecRig:
    gateway: Gateway
    kubelet: FakeKubelet
    cluster: str  # the ManagedCluster of cluster1
    namespace: str  # in cluster1: the pod and the gateway's exec grant
    pod: str
    container: str
    directory: Path


def _exec(
    core: client.CoreV1Api, rig: ExecRig, command: list[str], stdin: bytes, pod: str | None = None
) -> Any:
    """An exec with ``stdin`` (then the fake kubelet's end-of-stdin: an empty stdin message); the
    client once the exec is over, with its stdout and returncode."""
    session = stream(
        core.connect_get_namespaced_pod_exec,
        pod or rig.pod,
        rig.namespace,
        command=command,
        container=rig.container,
        stdin=True,
        stdout=True,
        stderr=True,
        tty=False,
        binary=True,
        _preload_content=False,
        _headers={"sec-websocket-protocol": V4},
    )
    try:
        for start in range(0, len(stdin), CHUNK):
            session.write_stdin(stdin[start : start + CHUNK])
        session.write_channel(0, b"")
        session.run_forever(timeout=EXEC_TIMEOUT)
        assert not session.is_open(), f"the exec did not end within {EXEC_TIMEOUT}s"
        return session
    finally:
        session.close()


# --- RBAC -------------------------------------------------------------------------------------------------


def _bind(api: Any, namespace: str, name: str, rules: list[dict[str, Any]], subject: dict[str, str]) -> None:
    """A Role and its RoleBinding in ``namespace`` (a ClusterRole and binding when it is "")."""
    rbac = client.RbacAuthorizationV1Api(api)
    kind = "Role" if namespace else "ClusterRole"
    binding = {
        "metadata": {"name": name},
        "roleRef": {"apiGroup": RBAC, "kind": kind, "name": name},
        "subjects": [subject],
    }
    if namespace:
        rbac.create_namespaced_role(namespace, {"metadata": {"name": name}, "rules": rules})
        rbac.create_namespaced_role_binding(namespace, binding)
    else:
        ignore_conflict(lambda: rbac.create_cluster_role({"metadata": {"name": name}, "rules": rules}))
        ignore_conflict(lambda: rbac.create_cluster_role_binding(binding))


def _user(name: str) -> dict[str, str]:
    return {"kind": "User", "name": name, "apiGroup": RBAC}
