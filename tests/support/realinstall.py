"""The addon installed on the real clusters as a user installs it (docs/kubernetes.md): the steps
the tests of ``tests/real_platform`` share. The project's images imported into each node's
containerd, ``kubectl apply -k`` of the hub overlays, the load balancer played as k3s's ServiceLB
plays it (the LoadBalancer Services' ingress address is the hub node's own: kube-proxy forwards the
ports there, the managed nodes may reach them: ``realclusters.HUB_LB_PORTS``), the addon enabled as
``clusteradm addon enable`` does, a hub client certificate enrolled, requests through the tunnel.

Needs the project's images: ``bash scripts/compose.sh images``.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio

from clusterproxy_sdk import TLSFiles, open_tunnel
from tests.support import nodeimages
from tests.support.realclusters import DIRECT, HUB, PROXIED, RealClusters
from tests.support.realnode import RealCluster
from tests.support.tunnel_load import version_over_tls

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = REPO / "deploy" / "kustomize" / "overlays"
ADDON_NAMESPACE = "open-cluster-management-addon"
AGENT_NAMESPACE = "open-cluster-management-cluster-proxy"  # the manager's default (config.py)
LB_SERVICES = ("proxy-agent-entrypoint", "cluster-proxy-cert-signer-entrypoint")
PART_OF = "app.kubernetes.io/part-of=cluster-proxy"


def wait_for(what: str, check: object, timeout: float, cluster: RealCluster | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            detail = ""
            if cluster is not None:
                detail = cluster.kubectl("get", "pods", "-A", "-o", "wide").stdout
            raise AssertionError(f"{what}: not after {timeout:g}s\n{detail}")
        time.sleep(0.5)


def rollout(cluster: RealCluster, namespace: str, deployment: str, timeout: float = 120) -> None:
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


def play_load_balancer(hub: RealCluster) -> None:
    """What a load-balancer provider does for the manager's LoadBalancer Services: an ingress
    address (the hub node's, as k3s's ServiceLB gives)."""
    status = json.dumps({"status": {"loadBalancer": {"ingress": [{"ip": hub.network.node_ip}]}}})
    for name in LB_SERVICES:
        wait_for(
            f"Service {name}",
            lambda n=name: hub.kubectl("-n", ADDON_NAMESPACE, "get", "svc", n).returncode == 0,
            60,
            hub,
        )
        hub.kubectl_ok(
            "-n", ADDON_NAMESPACE, "patch", "svc", name, "--subresource=status", "--type=merge", "-p", status
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def port_forward(hub: RealCluster, service: str, port: int) -> Iterator[int]:
    """``kubectl port-forward svc/<service>`` on a free local port (through the hub's real kubelet)."""
    local = free_port()
    forward = subprocess.Popen(
        [
            str(hub.kubectl_binary),
            f"--kubeconfig={hub.kubeconfig}",
            "-n",
            ADDON_NAMESPACE,
            "port-forward",
            f"svc/{service}",
            f"{local}:{port}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert forward.stdout is not None
        line = forward.stdout.readline()  # "Forwarding from 127.0.0.1:PORT -> PORT" once it listens
        assert "Forwarding from" in line, f"port-forward: {line}{forward.stderr.read()}"  # type: ignore[union-attr]
        yield local
    finally:
        forward.terminate()
        forward.wait(10)


def enroll(hub: RealCluster, folder: Path) -> tuple[Path, Path, Path]:
    """A hub client certificate as docs/kubernetes.md makes one: the operator's token from the
    cert-signer (``kubectl exec``, through the real kubelet), the user's ``cluster-proxy enroll``
    against the signer's load-balancer address. Returns the CA, certificate and key files."""
    signer = json.loads(
        hub.kubectl_ok("-n", ADDON_NAMESPACE, "get", "deployment", "cluster-proxy-cert-signer", "-o", "json")
    )
    args = signer["spec"]["template"]["spec"]["containers"][0].get("args", [])
    store = next(a.split("=", 1)[1] for a in args if a.startswith("--store="))
    token = (
        hub.kubectl_ok(
            "-n",
            ADDON_NAMESPACE,
            "exec",
            "deployment/cluster-proxy-cert-signer",
            "--",
            "cluster-proxy-cert-signer",
            "token",
            "create",
            f"--store={store}",
            "--client=alice",
            "--ttl=10m",
        )
        .strip()
        .splitlines()[-1]
    )
    bundle = hub.kubectl_ok(
        "-n",
        ADDON_NAMESPACE,
        "get",
        "secret",
        "cluster-proxy-server-bootstrap",
        "-o",
        "jsonpath={.data.ca\\.crt}",
    )
    ca = folder / "hub-ca.crt"
    ca.write_bytes(base64.b64decode(bundle))
    out = folder / "alice"
    done = subprocess.run(
        [
            str(REPO / ".venv" / "bin" / "cluster-proxy"),
            "enroll",
            f"--signer=https://{hub.network.node_ip}:8443",
            f"--ca={ca}",
            "--name=alice",
            f"--out={out}",
        ],
        env={**os.environ, "CLUSTER_PROXY_ENROLL_TOKEN": token},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"enroll: {done.stdout}{done.stderr}"
    return out / "ca.crt", out / "client.crt", out / "client.key"


def kube_apiserver_version(
    hub: RealCluster, managed: RealCluster, client: tuple[Path, Path, Path]
) -> tuple[int, str]:
    """GET /version of ``managed``'s real kube-apiserver by its bare cluster name, with the SDK
    through the proxy-server's client port (port-forwarded, as a user on the hub's side reaches it);
    TLS to the API server end to end inside the stream. Returns the status and the body."""
    ca, cert, key = client

    async def request(port: int) -> tuple[int, str]:
        tls = TLSFiles(ca=str(ca), cert=str(cert), key=str(key))
        async with open_tunnel(
            f"127.0.0.1:{port}", tls, server_hostname=f"proxy-entrypoint.{ADDON_NAMESPACE}.svc"
        ) as tunnel:
            stream = await tunnel.connect_kube_apiserver(managed.name)
            return await version_over_tls(stream, managed.admin_ssl_context())

    with port_forward(hub, "proxy-entrypoint", 8090) as port:
        return trio.run(request, port)


def collector(hub: RealCluster) -> dict[str, object]:
    """The health-collector's document, through ``kubectl port-forward`` as docs/kubernetes.md shows."""
    with port_forward(hub, "cluster-proxy-health-collector", 8080) as port:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/clusters", timeout=5) as page:
                    return json.loads(page.read())
            except OSError:
                assert time.monotonic() < deadline, "the health-collector did not answer"
                time.sleep(0.5)


def ours(cluster: RealCluster, *kinds: str) -> str:
    """Every object of ours (the project's label) of ``kinds`` left on ``cluster``."""
    done = cluster.kubectl("get", ",".join(kinds), "-A", "-l", PART_OF, "-o", "name")
    return done.stdout.strip()


def enable(hub: RealCluster, cluster: str, https_proxy: str = "") -> None:
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


def agent_running(managed: RealCluster) -> None:
    wait_for(
        f"the agent's Deployment on {managed.name}",
        lambda: (
            managed.kubectl("-n", AGENT_NAMESPACE, "get", "deployment", "-o", "name").stdout.strip() != ""
        ),
        120,
        managed,
    )
    name = managed.kubectl_ok("-n", AGENT_NAMESPACE, "get", "deployment", "-o", "name").split()[0]
    rollout(managed, AGENT_NAMESPACE, name.split("/", 1)[1])


def wait_available(hub: RealCluster, cluster: str) -> dict[str, Any]:
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
        hub.kubectl_ok(
            "-n",
            cluster,
            "get",
            "managedclusteraddon",
            "cluster-proxy",
            "-o",
            "json",
            "--show-managed-fields",
        )
    )
    assert done.returncode == 0, (
        f"{cluster}: the addon not Available: {json.dumps(addon.get('status'), indent=1)}"
    )
    return addon


def probed_healthy(hub: RealCluster, cluster: str) -> bool:
    rows = collector(hub).get("clusters") or []
    row = next((r for r in rows if r.get("name") == cluster), None)  # type: ignore[union-attr]
    return bool(row and row.get("probed") and row.get("state") == "healthy")


def import_images(clusters: RealClusters) -> None:
    """The project's images in each node's containerd (``docker save``, cached by image ID)."""
    hub = clusters[HUB]
    with ThreadPoolExecutor(3) as pool:
        hub_archive = pool.submit(nodeimages.project_images_archive, nodeimages.HUB_IMAGES)
        agent_archive = pool.submit(nodeimages.project_images_archive, nodeimages.AGENT_IMAGES)
        jobs = [pool.submit(hub.import_images, [hub_archive.result()])]
        jobs += [
            pool.submit(clusters[name].import_images, [agent_archive.result()]) for name in (DIRECT, PROXIED)
        ]
        for job in jobs:
            job.result()


def install_hub(hub: RealCluster) -> None:
    """docs/kubernetes.md, "Installing the hub": the hub overlay, then its configuration."""
    hub.kubectl_ok("apply", "-k", str(OVERLAYS / "hub"), timeout=120)
    rollout(hub, ADDON_NAMESPACE, "cluster-proxy-addon-manager")
    hub.kubectl_ok("apply", "-k", str(OVERLAYS / "hub-configuration"), timeout=120)
    play_load_balancer(hub)
    for deployment in ("cluster-proxy-cert-signer", "cluster-proxy", "cluster-proxy-health-collector"):
        rollout(hub, ADDON_NAMESPACE, deployment)


def disable(hub: RealCluster, managed: RealCluster) -> None:
    """The addon disabled for ``managed`` (its ManagedClusterAddOn deleted); returns once nothing of
    ours is left there."""
    hub.kubectl_ok(
        "-n", managed.name, "delete", "managedclusteraddon", "cluster-proxy", "--timeout=120s", timeout=130
    )
    wait_for(
        f"nothing of ours on {managed.name}",
        lambda: (
            managed.kubectl("get", "namespace", AGENT_NAMESPACE).returncode != 0
            and not ours(managed, "deployments", "serviceaccounts", "clusterroles", "clusterrolebindings")
        ),
        120,
        managed,
    )


def uninstall(hub: RealCluster, overlays: tuple[str, ...] = ("hub-configuration", "hub")) -> None:
    """docs/kubernetes.md's uninstall: the overlays deleted in that order; returns once nothing of
    ours (namespace, cluster-scoped objects with our label) is left on the hub."""
    for overlay in overlays:
        hub.kubectl_ok("delete", "-k", str(OVERLAYS / overlay), "--timeout=180s", timeout=190)
    wait_for(
        "nothing of ours on the hub",
        lambda: (
            hub.kubectl("get", "namespace", ADDON_NAMESPACE).returncode != 0
            and not ours(hub, "clusterroles", "clusterrolebindings", "crds", "apiservices")
        ),
        120,
        hub,
    )
