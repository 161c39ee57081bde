"""Real nodes under the three clusters: what a kubelet, kube-proxy, CoreDNS and the CNI bridge do that
no emulator does, and a teardown that leaves the machine as it was.

Run: ``.venv/bin/pytest -m platform tests/real_platform`` (as root; the first run builds the programs).
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support import nodeimages
from tests.support.nodenet import machine_state
from tests.support.platform_layer import left_behind
from tests.support.realclusters import CLUSTERS, RealClusters
from tests.support.realnode import RealCluster

pytestmark = [pytest.mark.platform, pytest.mark.slow, pytest.mark.timeout(600)]

GREETING = "hello from a Secret volume"
FS_GROUP = 2000
HUB_NODE_PORT = 30080


def _web(namespace: str, *, node_port: int | None = None) -> list[dict[str, object]]:
    """A namespace, a Secret, a busybox pod serving the Secret's files over HTTP as a non-root user
    on a read-only root, and a Service in front of it (a NodePort one when ``node_port``)."""
    labels = {"app": "web"}
    service_port: dict[str, object] = {"port": 80, "targetPort": 8080}
    if node_port is not None:
        service_port["nodePort"] = node_port
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "greeting", "namespace": namespace},
            "stringData": {"greeting": GREETING},
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "web", "namespace": namespace, "labels": labels},
            "spec": {
                "terminationGracePeriodSeconds": 1,
                "securityContext": {
                    "runAsNonRoot": True,
                    "runAsUser": nodeimages.NONROOT,
                    "runAsGroup": nodeimages.NONROOT,
                    "fsGroup": FS_GROUP,
                },
                "containers": [
                    {
                        "name": "web",
                        "image": nodeimages.BUSYBOX_IMAGE,
                        "imagePullPolicy": "Never",
                        "command": [
                            "/bin/sh",
                            "-c",
                            "echo web started; exec httpd -f -p 8080 -h /etc/greeting",
                        ],
                        "ports": [{"containerPort": 8080}],
                        "readinessProbe": {
                            "httpGet": {"path": "/greeting", "port": 8080},
                            "periodSeconds": 1,
                        },
                        "securityContext": {
                            "readOnlyRootFilesystem": True,
                            "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]},
                        },
                        "volumeMounts": [
                            {"name": "greeting", "mountPath": "/etc/greeting", "readOnly": True}
                        ],
                    }
                ],
                "volumes": [{"name": "greeting", "secret": {"secretName": "greeting", "defaultMode": 0o440}}],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": namespace},
            "spec": {
                "type": "NodePort" if node_port is not None else "ClusterIP",
                "selector": labels,
                "ports": [service_port],
            },
        },
    ]


def _exec(cluster: RealCluster, namespace: str, *command: str) -> str:
    return cluster.kubectl_ok("-n", namespace, "exec", "web", "--", *command)


def _http_get(
    cluster: RealCluster, namespace: str, host: str, port: int, path: str = "/greeting", *, proxy: str = ""
) -> subprocess.CompletedProcess[str]:
    """An HTTP GET from the pod, through ``proxy`` (``host:port``) when given, with busybox's nc (its
    wget crashes in name and service lookups: static glibc has no NSS).

    nc's input stays open until the exchange ends (it exits when the server closes), as an HTTP
    client's does: nc shuts its sending side down at the end of its input, and tinyproxy (1.11) ends
    its relay on reading that end from the client, sending on only what it had already read from the
    server. A request piped into nc half-closed at once, and tinyproxy dropped every byte of the
    response that came after the client's end: busybox httpd writes its headers and the file apart, and
    when the file came after tinyproxy's relay had seen the end, the pod got the headers of a 200 and
    an empty body."""
    target, (connect_host, connect_port) = path, (host, str(port))
    if proxy:
        target = f"http://{host}:{port}{path}"
        connect_host, connect_port = proxy.split(":")
    # kubectl forwards its stdin to nc's: a pipe whose writing end this process holds until kubectl
    # has exited (kubectl exits when nc does)
    reading, writing = os.pipe()
    try:
        os.write(writing, f"GET {target} HTTP/1.0\r\n\r\n".encode())
        kubectl = [str(cluster.kubectl_binary), f"--kubeconfig={cluster.kubeconfig}", "-n", namespace]
        return subprocess.run(
            [*kubectl, "exec", "-i", "web", "--", "nc", "-w", "5", connect_host, connect_port],
            stdin=reading,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.close(reading)
        os.close(writing)


def _body(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done
    head, _, body = done.stdout.partition("\n\n")
    assert head.startswith("HTTP/1.") and " 200 " in head.splitlines()[0], done.stdout
    return body


def _run_web(cluster: RealCluster, namespace: str, node_port: int | None = None) -> None:
    cluster.apply(_web(namespace, node_port=node_port))
    cluster.kubectl_ok(
        "-n", namespace, "wait", "--for=condition=Ready", "pod/web", "--timeout=90s", timeout=100
    )


def _check_pod(cluster: RealCluster) -> None:
    namespace = f"web-{uuid.uuid4().hex[:6]}"
    _run_web(cluster, namespace)
    pod = json.loads(cluster.kubectl_ok("-n", namespace, "get", "pod", "web", "-o", "json"))
    assert pod["spec"]["nodeName"] == cluster.node_name
    prefix = cluster.network.pod_subnet.rsplit(".", 2)[0]
    assert pod["status"]["podIP"].startswith(prefix + "."), pod["status"]["podIP"]
    # the kubelet's log of the container, through the API server
    assert "web started" in cluster.kubectl_ok("-n", namespace, "logs", "web")
    # kubectl exec (the API server to the kubelet to containerd's stream server)
    identity = _exec(cluster, namespace, "id")
    assert f"uid={nodeimages.NONROOT}" in identity and str(FS_GROUP) in identity, identity
    assert _exec(cluster, namespace, "stat", "-L", "-c", "%a %g", "/etc/greeting/greeting").split() == [
        "440",
        str(FS_GROUP),
    ]
    assert _exec(cluster, namespace, "cat", "/etc/greeting/greeting") == GREETING
    read_only = cluster.kubectl("-n", namespace, "exec", "web", "--", "sh", "-c", "echo x > /written")
    assert read_only.returncode != 0 and "Read-only file system" in read_only.stderr, read_only
    # CoreDNS answers the Service's name; kube-proxy routes its ClusterIP (back to this very pod)
    service_ip = cluster.kubectl_ok(
        "-n", namespace, "get", "service", "web", "-o", "jsonpath={.spec.clusterIP}"
    )
    name = f"web.{namespace}.svc.cluster.local"
    assert service_ip in _exec(cluster, namespace, "nslookup", name)
    assert _body(_http_get(cluster, namespace, service_ip, 80)) == GREETING
    cluster.kubectl_ok("delete", "namespace", namespace, "--wait=false")


def _unreachable(cluster: RealCluster, namespace: str, host: str, port: int) -> None:
    done = _http_get(cluster, namespace, host, port)
    assert not done.stdout, f"{cluster.name} reached {host}:{port}: {done.stdout}"


def test_teardown_leaves_the_machine_as_it_was(tmp_path: Path) -> None:
    """Three clusters up (a pod each), then down: nothing of theirs is left on the machine (this test
    runs before the session's clusters start, so the snapshot compares like with like)."""
    before = machine_state()
    with RealClusters(tmp_path / "clusters") as clusters:
        with ThreadPoolExecutor(len(CLUSTERS)) as pool:
            for done in [pool.submit(_run_web, c, "teardown") for c in clusters]:
                done.result()
        up = clusters.timings["up"]
    assert clusters.network is not None
    left = left_behind(before, machine_state(), clusters.network.tag)  # not other sessions' sets
    assert not left, left
    print(f"up {up:.1f}s, down {clusters.timings['down']:.1f}s")


def test_each_node_runs_pods_as_a_kubelet_does(real_clusters: RealClusters) -> None:
    """On each cluster: the node Ready, a pod running as non-root on a read-only root with a Secret
    volume under fsGroup, its logs and ``kubectl exec``, a Service name through CoreDNS and its
    ClusterIP through kube-proxy."""
    with ThreadPoolExecutor(len(CLUSTERS)) as pool:
        for done in [pool.submit(_check_pod, c) for c in real_clusters]:
            done.result()


def test_pod_networks_are_separate(real_clusters: RealClusters) -> None:
    """cluster1's pods reach the hub only at the port the hub's node exposes; cluster2's only through
    the forward proxy; neither reaches a hub pod's address."""
    hub, direct, proxied = (real_clusters[n] for n in CLUSTERS)
    namespace = f"net-{uuid.uuid4().hex[:6]}"
    with ThreadPoolExecutor(3) as pool:
        for done in [
            pool.submit(_run_web, hub, namespace, HUB_NODE_PORT),
            pool.submit(_run_web, direct, namespace),
            pool.submit(_run_web, proxied, namespace),
        ]:
            done.result()
    hub_node = hub.network.node_ip
    hub_pod = hub.kubectl_ok("-n", namespace, "get", "pod", "web", "-o", "jsonpath={.status.podIP}")
    assert _body(_http_get(direct, namespace, hub_node, HUB_NODE_PORT)) == GREETING
    _unreachable(direct, namespace, hub_pod, 8080)
    _unreachable(direct, namespace, hub_node, 10250)  # the hub's kubelet: not exposed
    _unreachable(proxied, namespace, hub_node, HUB_NODE_PORT)
    _unreachable(proxied, namespace, hub_pod, 8080)
    proxy = real_clusters.proxy_url.removeprefix("http://")
    assert _body(_http_get(proxied, namespace, hub_node, HUB_NODE_PORT, proxy=proxy)) == GREETING
    # the hub's API server (a plain HTTP request to it: Go's TLS server answers 400 in plain HTTP)
    hub_api = (hub.network.host_ip, 6443)
    assert "HTTPS server" in _http_get(direct, namespace, *hub_api, "/").stdout
    assert "HTTP" not in _http_get(proxied, namespace, *hub_api, "/").stdout
    for cluster in (hub, direct, proxied):
        cluster.kubectl_ok("delete", "namespace", namespace, "--wait=false")
