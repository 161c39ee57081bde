"""Through the tunnel to a real API server: everything started from what the addon-manager wrote.

The addon-manager runs on the hub API server with a ManagedProxyConfiguration whose entrypoint is
``Hostname 127.0.0.1``; the cert-signer and the proxy-server run from the Deployments it wrote; the
ManagedClusters ``<tag>-cluster1`` and ``<tag>-cluster2`` get their ManifestWork applied to the
cluster1 and cluster2 API servers and their agents run from the Deployment in it, with the agent's
in-cluster default ``--kube-apiserver`` (``kubernetes.default.svc:443``, which a pod resolves to its own
API server: tests.support.localpods' names under .svc). Then, on the hub, a user with a hub client
certificate reaches each cluster's API server by naming only the cluster:

- the Python ``kubernetes`` client: ``host = https://<cluster>`` (the bare cluster name, upstream's
  ``cfg.Host = clusterName``) through the proxy-server's client port as an HTTPS proxy
  (``proxy_ssl_context`` carries the hub client certificate), the API server verified against its own
  CA under the name every API server's certificate holds (``tls_server_name = kubernetes.default.svc``);
- the real ``kubectl`` with ``proxy-url: https://<cluster>@HUB:PORT`` and ``server:
  https://kubernetes.default.svc`` (Go presents the client certificate to the HTTPS proxy), and with
  ``cluster-proxy port-forward <cluster> <cluster>:443`` (the bare cluster name as the target);
- kubectl cannot use the bare cluster name through ``proxy-url``: Go checks the proxy's and the target's
  certificates with one TLS configuration, so the API server's certificate would have to name the
  cluster (or ``tls-server-name`` would have to fit the proxy too); the refusal is checked here.

Each cluster sees a namespace that exists only there; cluster2 through the same hub never sees
cluster1's.
"""

from __future__ import annotations

import re
import shutil
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.support import require
from tests.support.addonstack import AddonStack
from tests.support.kubeapi import KubeCluster, KubeClusters
from tests.support.procs import BIN, Process
from tests.support.waiting import poll_until

pytestmark = pytest.mark.slow

API_SERVER_NAME = "kubernetes.default.svc"  # on every kube-apiserver's serving certificate
READER_ROLE = "cluster-proxy-test-namespace-reader"


@dataclass
class Reach:
    """One managed cluster as a hub user reaches it."""

    name: str  # the ManagedCluster, the agent's --cluster
    api: KubeCluster
    only_here: str  # a namespace that exists on this cluster's API server alone
    token: str  # a ServiceAccount token of this cluster that may list namespaces


@dataclass
class Tunnel:
    stack: AddonStack
    hub_ca: Path
    cert: Path
    key: Path
    clusters: dict[str, Reach]
    directory: Path

    @property
    def proxy(self) -> str:
        return f"127.0.0.1:{self.stack.ports.client}"


def _reader_token(api: KubeCluster, namespace: str) -> str:
    """A ServiceAccount of ``api`` allowed to list namespaces, and a TokenRequest token of it."""
    with api.api_client() as admin:
        core = client.CoreV1Api(admin)
        core.create_namespaced_service_account(namespace, {"metadata": {"name": "hub-reader"}})
        rbac = client.RbacAuthorizationV1Api(admin)
        rbac.create_cluster_role(
            {
                "metadata": {"name": f"{READER_ROLE}-{namespace}"},
                "rules": [{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list"]}],
            }
        )
        rbac.create_cluster_role_binding(
            {
                "metadata": {"name": f"{READER_ROLE}-{namespace}"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": f"{READER_ROLE}-{namespace}",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "hub-reader", "namespace": namespace}],
            }
        )
        answer = core.create_namespaced_service_account_token(
            "hub-reader", namespace, {"spec": {"expirationSeconds": 3600}}
        )
        return answer.status.token


@pytest.fixture(scope="module")
def tunnel(kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tunnel]:
    directory = tmp_path_factory.mktemp("through-tunnel")
    stack = AddonStack(kube_clusters["hub"], directory)
    try:
        stack.start()
        reach = {}
        for api_name in ("cluster1", "cluster2"):
            api = kube_clusters[api_name]
            name = f"{stack.tag}-{api_name}"
            only_here = f"only-in-{api_name}-{stack.tag}"
            with api.api_client() as admin:
                client.CoreV1Api(admin).create_namespace({"metadata": {"name": only_here}})
            reach[api_name] = Reach(name, api, only_here, _reader_token(api, only_here))
            stack.join(name, api)
        hub_ca, cert, key = stack.client_certificate()
        print(f"\nsetup: {stack.timings}")
        yield Tunnel(stack, hub_ca, cert, key, reach, directory)
    finally:
        stack.close()


def _proxy_context(tunnel: Tunnel) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(tunnel.hub_ca))
    context.load_cert_chain(str(tunnel.cert), str(tunnel.key))
    return context


def _python_client(tunnel: Tunnel, reach: Reach) -> client.ApiClient:
    """The Python client naming only the cluster: ``https://<cluster>``, the proxy-server as its proxy."""
    config = client.Configuration(
        host=f"https://{reach.name}",
        api_key={"authorization": reach.token},
        api_key_prefix={"authorization": "Bearer"},
        ssl_ca_cert=str(reach.api.ca_path),
        tls_server_name=API_SERVER_NAME,
        proxy=f"https://{tunnel.proxy}",
        proxy_ssl_context=_proxy_context(tunnel),
    )
    return client.ApiClient(config)


def _namespaces_via_python(tunnel: Tunnel, reach: Reach) -> set[str]:
    with _python_client(tunnel, reach) as api:
        return {ns.metadata.name for ns in client.CoreV1Api(api).list_namespace().items}


def _kubeconfig(path: Path, *, server: str, ca: Path, token: str, **cluster: Any) -> Path:
    user: dict[str, Any] = {"token": token}
    if "client-certificate" in cluster:
        user["client-certificate"] = cluster.pop("client-certificate")
        user["client-key"] = cluster.pop("client-key")
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": server, "certificate-authority": str(ca), **cluster}}
                ],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    return path


def _kubectl(kubeconfig: Path, *args: str) -> tuple[int, str, str]:
    import subprocess

    kubectl = shutil.which("kubectl")
    require(kubectl is not None, "kubectl (apt-get install kubernetes-client)")
    assert kubectl is not None
    done = subprocess.run(
        [kubectl, f"--kubeconfig={kubeconfig}", f"--cache-dir={kubeconfig.parent / 'kubectl-cache'}", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout, done.stderr


def _proxy_url_kubeconfig(tunnel: Tunnel, reach: Reach, server: str, proxy_user: str | None) -> Path:
    """kubectl's proxy-url form: one CA bundle for the proxy and the API server (Go verifies both with
    it), the hub client certificate (Go presents it to both), the cluster's token."""
    bundle = tunnel.directory / f"bundle-{reach.name}.pem"
    bundle.write_bytes(tunnel.hub_ca.read_bytes() + reach.api.ca_path.read_bytes())
    user = f"{proxy_user}@" if proxy_user else ""
    return _kubeconfig(
        tunnel.directory
        / f"proxy-url-{reach.name}-{proxy_user or 'bare'}-{server.split('//')[1]}.kubeconfig",
        server=server,
        ca=bundle,
        token=reach.token,
        **{
            "proxy-url": f"https://{user}{tunnel.proxy}",
            "client-certificate": str(tunnel.cert),
            "client-key": str(tunnel.key),
        },
    )


def _names(kubectl_output: str) -> set[str]:
    return {line.removeprefix("namespace/") for line in kubectl_output.split()}


def test_python_client_lists_cluster1_namespaces_by_bare_cluster_name(tunnel: Tunnel) -> None:
    cluster1, cluster2 = tunnel.clusters["cluster1"], tunnel.clusters["cluster2"]
    started = time.monotonic()
    names = _namespaces_via_python(tunnel, cluster1)
    elapsed = time.monotonic() - started
    assert cluster1.only_here in names
    assert cluster2.only_here not in names
    assert tunnel.stack.namespace not in names  # the hub's
    agent = tunnel.stack.members[cluster1.name].agent
    assert agent is not None  # its in-cluster default, which the pod network leads to cluster1's API server
    assert agent.container().events("agent_starting")[0]["kube_apiserver"] == "kubernetes.default.svc:443"
    server = tunnel.stack.server
    assert server is not None
    # the proxy-server was asked for "<cluster>:443" (no other way of naming the cluster) and routed it
    poll_until(
        lambda: [
            r
            for r in server.container().events("stream_closed")
            if r.get("target") == f"{cluster1.name}:443" and r.get("cluster") == cluster1.name
        ],
        timeout=10,
        what=f"the proxy-server's stream_closed for {cluster1.name}:443",
    )
    print(f"\nlist namespaces of {cluster1.name} through the tunnel: {elapsed * 1000:.0f} ms (first call)")


def test_kubectl_proxy_url_with_client_certificate_lists_cluster1(tunnel: Tunnel) -> None:
    cluster1, cluster2 = tunnel.clusters["cluster1"], tunnel.clusters["cluster2"]
    config = _proxy_url_kubeconfig(tunnel, cluster1, f"https://{API_SERVER_NAME}", cluster1.name)
    code, out, err = _kubectl(config, "get", "namespaces", "-o", "name")
    assert code == 0, err
    names = _names(out)
    assert cluster1.only_here in names and cluster2.only_here not in names
    # kubectl presented the hub client certificate to the proxy-server (which requires one)
    server = tunnel.stack.server
    assert server is not None
    streams = poll_until(
        lambda: [
            r
            for r in server.container().events("stream_closed")
            if r.get("target") == f"{API_SERVER_NAME}:443" and r.get("cluster") == cluster1.name
        ],
        timeout=10,
        what="the proxy-server's stream_closed for kubectl's stream",
    )
    assert {r["client"] for r in streams} == {"hub-admin"}, streams


def test_kubectl_cannot_use_the_bare_cluster_name_through_proxy_url(tunnel: Tunnel) -> None:
    """Go verifies the proxy and the target with one TLS configuration: ``server: https://<cluster>``
    fails on the API server's certificate, ``tls-server-name`` fails on the proxy's."""
    cluster1 = tunnel.clusters["cluster1"]
    bare = _proxy_url_kubeconfig(tunnel, cluster1, f"https://{cluster1.name}", None)
    code, _, err = _kubectl(bare, "get", "namespaces", "-o", "name")
    assert code != 0
    assert "x509" in err and cluster1.name in err, err
    print(f"\nkubectl, server https://{cluster1.name} through proxy-url: {err.strip().splitlines()[-1]}")

    named = yaml.safe_load(bare.read_text())
    named["clusters"][0]["cluster"]["tls-server-name"] = API_SERVER_NAME
    with_name = bare.with_name("bare-tls-server-name.kubeconfig")
    with_name.write_text(yaml.safe_dump(named))
    code, _, err = _kubectl(with_name, "get", "namespaces", "-o", "name")
    assert code != 0
    assert "x509" in err and API_SERVER_NAME in err, err
    print(f"kubectl, the same with tls-server-name {API_SERVER_NAME}: {err.strip().splitlines()[-1]}")


def test_kubectl_through_port_forward_by_bare_cluster_name(tunnel: Tunnel) -> None:
    cluster1, cluster2 = tunnel.clusters["cluster1"], tunnel.clusters["cluster2"]
    forward = Process(
        f"port-forward-{cluster1.name}",
        [
            str(BIN / "cluster-proxy"),
            "port-forward",
            cluster1.name,
            f"{cluster1.name}:443",
            "--listen=127.0.0.1:0",
            f"--proxy={tunnel.proxy}",
            f"--ca={tunnel.hub_ca}",
            f"--cert={tunnel.cert}",
            f"--key={tunnel.key}",
        ],
        tunnel.directory,
    )
    try:
        listening = poll_until(
            lambda: (
                re.search(r"Forwarding from 127\.0\.0\.1:(\d+)", forward.log_path.read_text())
                or (
                    forward.popen.poll() is not None
                    and pytest.fail(f"port-forward exited:\n{forward.tail()}")
                )
            ),
            timeout=30,
            what="the port-forward's Forwarding line",
        )
        config = _kubeconfig(
            tunnel.directory / "port-forward.kubeconfig",
            server=f"https://127.0.0.1:{listening.group(1)}",
            ca=cluster1.api.ca_path,
            token=cluster1.token,
            **{"tls-server-name": API_SERVER_NAME},
        )
        code, out, err = _kubectl(config, "get", "namespaces", "-o", "name")
        assert code == 0, f"{err}\n--- port-forward\n{forward.tail()}"
        names = _names(out)
        assert cluster1.only_here in names and cluster2.only_here not in names
    finally:
        forward.stop()


def test_cluster2_through_the_same_hub_is_isolated_from_cluster1(tunnel: Tunnel) -> None:
    cluster1, cluster2 = tunnel.clusters["cluster1"], tunnel.clusters["cluster2"]
    names = _namespaces_via_python(tunnel, cluster2)
    assert cluster2.only_here in names
    assert cluster1.only_here not in names

    config = _proxy_url_kubeconfig(tunnel, cluster2, f"https://{API_SERVER_NAME}", cluster2.name)
    code, out, err = _kubectl(config, "get", "namespaces", "-o", "name")
    assert code == 0, err
    assert cluster2.only_here in _names(out) and cluster1.only_here not in _names(out)

    # cluster1's credentials go to cluster2's API server when the bare name says cluster2: refused there
    stray = Reach(cluster2.name, cluster2.api, cluster2.only_here, cluster1.token)
    with pytest.raises(client.exceptions.ApiException) as refused:
        _namespaces_via_python(tunnel, stray)
    assert refused.value.status == 401
