"""Upgraded connections through the cluster-gateway: a real ``exec`` through the hub's aggregated API.

The path: the ``kubernetes`` Python client's ``stream()`` (WebSocket, ``v4.channel.k8s.io``) with a
kubeconfig from ``cluster-proxy kubeconfig`` -> the hub kube-apiserver's aggregator -> the gateway ->
the tunnel -> cluster1's kube-apiserver -> the kubelet of the pod's node. There is no kubelet in the
test clusters: tests/support/fake_kubelet.py stands in for one, and a Node in cluster1 points at it
(``status.addresses`` InternalIP 127.0.0.1, ``status.daemonEndpoints.kubeletEndpoint.port``). The test
API servers run without ``--kubelet-certificate-authority`` (tests/support/kubeapi.py), so cluster1
does not verify the fake kubelet's self-signed certificate, and without ``--kubelet-client-certificate``,
so it presents none.

The client offers ``v4.channel.k8s.io`` alone: offered ``v5.channel.k8s.io`` (the client's default,
and kubectl 1.30+'s), kube-apiserver translates the WebSocket into SPDY toward the kubelet, which a
WebSocket fake kubelet cannot serve.

The gateway's ServiceAccount in cluster1 may ``get``/``create`` ``pods/exec`` in the test's namespace
(v1.32 asks for both for a WebSocket exec); the hub admin calls the hub.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.stream import stream

from tests.kube import test_gateway as base
from tests.kube.gateway_rig import SA_NAME, SA_NAMESPACE, Gateway, running_gateway
from tests.support.fake_kubelet import FakeKubelet, running_fake_kubelet
from tests.support.kubeapi import KubeClusters
from tests.support.workagent import poll_until

pytestmark = pytest.mark.slow

V4 = "v4.channel.k8s.io"
STDIN_BYTES = 1 << 20
CHUNK = 64 << 10
EXEC_TIMEOUT = 60


@dataclass
class ExecRig:
    gateway: Gateway
    kubelet: FakeKubelet
    cluster: str  # the ManagedCluster of cluster1
    namespace: str  # in cluster1: the pod and the gateway's exec grant
    pod: str
    container: str
    directory: Path


def _ignore_conflict(call: Any) -> None:
    try:
        call()
    except client.exceptions.ApiException as exc:
        if exc.status != 409:
            raise


@pytest.fixture(scope="module")
def rig(kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExecRig]:
    directory = tmp_path_factory.mktemp("upgrade")
    with (
        running_gateway(kube_clusters, directory, ("cluster1",)) as gateway,
        running_fake_kubelet(directory / "kubelet") as kubelet,
    ):
        tag = gateway.stack.tag
        node, namespace, pod, container = f"fake-node-{tag}", f"exec-{tag}", "target", "main"
        with gateway.clusters["cluster1"].api.api_client() as admin:
            core = client.CoreV1Api(admin)
            core.create_node({"metadata": {"name": node}})
            core.patch_node_status(
                node,
                {
                    "status": {
                        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet.port}},
                    }
                },
            )
            core.create_namespace({"metadata": {"name": namespace}})
            # the ServiceAccount admission wants the namespace's default ServiceAccount (no controller makes it)
            core.create_namespaced_service_account(namespace, {"metadata": {"name": "default"}})
            core.create_namespaced_pod(
                namespace,
                {
                    "metadata": {"name": pod},
                    "spec": {
                        "nodeName": node,
                        "automountServiceAccountToken": False,
                        "containers": [{"name": container, "image": "never-pulled"}],
                    },
                },
            )
            rbac = client.RbacAuthorizationV1Api(admin)
            role = "gateway-exec"
            _ignore_conflict(
                lambda: rbac.create_namespaced_role(
                    namespace,
                    {
                        "metadata": {"name": role},
                        "rules": [
                            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
                            {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["get", "create"]},
                        ],
                    },
                )
            )
            _ignore_conflict(
                lambda: rbac.create_namespaced_role_binding(
                    namespace,
                    {
                        "metadata": {"name": role},
                        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
                        "subjects": [{"kind": "ServiceAccount", "name": SA_NAME, "namespace": SA_NAMESPACE}],
                    },
                )
            )
        try:
            yield ExecRig(
                gateway,
                kubelet,
                gateway.clusters["cluster1"].name,
                namespace,
                pod,
                container,
                directory,
            )
        finally:
            with gateway.clusters["cluster1"].api.api_client() as admin:
                core = client.CoreV1Api(admin)
                core.delete_node(node)
                core.delete_namespace(namespace)


def _core(kubeconfig: Path) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))


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


def _refused(call: Any) -> tuple[int, str, dict[str, Any]]:
    """The status, Content-Type and JSON body of a WebSocket handshake answered without 101 (the client
    raises ApiException(status=0) carrying websocket-client's 'Handshake status N REASON -+-+- HEADERS
    -+-+- BODY')."""
    with pytest.raises(client.exceptions.ApiException) as raised:
        call()
    reason = str(raised.value.reason)
    assert reason.startswith("Handshake status "), reason
    head, headers, body = reason.split(" -+-+- ", 2)
    return (
        int(head.split()[2]),
        ast.literal_eval(headers).get("content-type", ""),
        json.loads(body),
    )


def test_exec_through_the_hub_carries_a_mebibyte_of_stdin_and_the_answer(rig: ExecRig) -> None:
    gateway = rig.gateway
    kubeconfig = base._cluster_kubeconfig(gateway, rig.cluster)
    stdin = os.urandom(STDIN_BYTES)
    command = ["digest", f"--marker={secrets.token_hex(4)}"]
    before = len(rig.kubelet.execs)
    session = _exec(_core(kubeconfig), rig, command, stdin)

    answer = json.loads(session.read_stdout())
    assert answer == {
        "sha256": hashlib.sha256(stdin).hexdigest(),
        "bytes": STDIN_BYTES,
        "command": command,
        "pod": f"{rig.namespace}/{rig.pod}/{rig.container}",
    }
    assert session.returncode == 0  # the channel-3 status Success, relayed
    assert [e.command for e in rig.kubelet.execs[before:]] == [command]
    assert not rig.kubelet.refused
    # it went through the gateway: the 101 is in its log
    poll_until(
        lambda: any(
            r.get("event") == "proxy_upgraded" and r.get("cluster") == rig.cluster
            for r in gateway.process.events()
        ),
        timeout=10,
        what="the gateway's proxy_upgraded",
    )


def test_exec_of_a_missing_pod_is_cluster1s_404_unchanged(rig: ExecRig) -> None:
    gateway = rig.gateway
    missing = f"missing-{secrets.token_hex(3)}"
    through = _refused(
        lambda: _exec(_core(base._cluster_kubeconfig(gateway, rig.cluster)), rig, ["x"], b"", pod=missing)
    )
    straight = _refused(
        lambda: _exec(_core(gateway.clusters["cluster1"].api.kubeconfig), rig, ["x"], b"", pod=missing)
    )
    assert through[:2] == (404, "application/json"), through
    assert through[2]["message"] == f'pods "{missing}" not found', through
    assert through == straight


def test_exec_by_a_hub_user_without_rbac_on_the_proxy_is_the_hubs_403(rig: ExecRig) -> None:
    gateway = rig.gateway
    user = f"no-proxy-{gateway.stack.tag}"
    kubeconfig = base._cluster_kubeconfig(gateway, rig.cluster, base._hub_user(gateway, user))
    before = len(rig.kubelet.execs)
    status, _, body = _refused(lambda: _exec(_core(kubeconfig), rig, ["x"], b"never"))
    assert status == 403, body
    assert body["reason"] == "Forbidden"
    assert f'User "{user}" cannot' in body["message"] and "clustergateways/proxy" in body["message"], body
    assert len(rig.kubelet.execs) == before
