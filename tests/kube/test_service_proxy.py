"""Issue 35, point 1: the hub's HTTPS endpoint per cluster, ``https://HUB/<cluster>/<path>`` (the
cluster-gateway's ``--service-proxy-listen``; docs/cluster-gateway.md, "The HTTPS endpoint").

A gateway of tests/support/gateway_rig.py with its service proxy: cluster1's API server joined as
``cluster1-<tag>`` through the addon's ManifestWork (which brings the service proxy's ClusterRole into
cluster1), the service proxy's credential projected as the ManagedServiceAccount controller would, its
serving certificate from the cert-signer (a server token). Here:

- in cluster1, a ServiceAccount ``reader`` (its own token: a managed cluster's token) that may list
  namespaces; ExternalName Services ``echo`` and ``other`` that lead to an HTTP server of the test (the
  emulated pod network resolves them for the agent); a fake kubelet with a pod for ``exec``;
- on the hub, a ServiceAccount ``robot`` (a hub token), impersonated in cluster1 as
  ``cluster:hub:system:serviceaccount:<ns>:robot``.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import secrets
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from tests.support.fake_kubelet import running_fake_kubelet
from tests.support.gateway_rig import (
    ExecRig,
    Gateway,
    _bind,
    _exec,
    _kubectl,
    _managed_cluster,
    _user,
    running_gateway,
)
from tests.support.kubeapi import KubeClusters
from tests.support.waiting import poll_until

pytestmark = pytest.mark.slow


class _Echo(http.server.BaseHTTPRequestHandler):
    """An in-cluster service: answers with what it received."""

    def do_GET(self) -> None:
        body = json.dumps(
            {"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Rig:
    gateway: Gateway
    cluster: str  # the ManagedCluster
    namespace: str  # in cluster1: the echo Services, the pod, the test's grants
    hub_namespace: str
    reader_token: str  # cluster1's ServiceAccount "reader"
    robot_token: str  # the hub's ServiceAccount "robot"
    robot_user: str  # its name in cluster1
    echo_port: int
    exec_rig: ExecRig

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.gateway.service_proxy_port}"

    def context(self) -> ssl.SSLContext:
        assert self.gateway.ca_bundle is not None
        return ssl.create_default_context(cafile=str(self.gateway.ca_bundle))

    def call(
        self, path: str, token: str | None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        """GET ``path`` of the endpoint: status, headers, JSON body."""
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(self.url + path, headers=sent)
        try:
            with urllib.request.urlopen(request, context=self.context(), timeout=30) as answer:
                return answer.status, dict(answer.headers), json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), json.loads(exc.read())

    def kubeconfig(self, token: str) -> Path:
        """What a user writes for the endpoint: ``server: https://HUB:PORT/<cluster>`` and a token."""
        path = self.gateway.directory / f"sp-{secrets.token_hex(3)}.kubeconfig"
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "c",
                            "cluster": {
                                "server": f"{self.url}/{self.cluster}",
                                "certificate-authority": str(self.gateway.ca_bundle),
                            },
                        }
                    ],
                    "users": [{"name": "u", "user": {"token": token}}],
                    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "c",
                }
            )
        )
        return path


@contextlib.contextmanager
def _echo_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def rig(kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    directory = tmp_path_factory.mktemp("service-proxy")
    tag = secrets.token_hex(3)
    namespace = f"sp-{tag}"
    cluster1 = kube_clusters["cluster1"]
    with cluster1.api_client() as admin:
        core = client.CoreV1Api(admin)
        core.create_namespace({"metadata": {"name": namespace}})
        # before the agent starts: the emulated pod network's table is written when its container starts
        for name in ("echo", "other"):
            core.create_namespaced_service(
                namespace,
                {"metadata": {"name": name}, "spec": {"type": "ExternalName", "externalName": "localhost"}},
            )
    with (
        _echo_server() as echo_port,
        running_gateway(
            kube_clusters,
            directory,
            ("cluster1",),
            service_proxy=True,
            extra_args=[f"--audit-log={directory / 'audit.jsonl'}"],
        ) as gateway,
        running_fake_kubelet(directory / "kubelet") as kubelet,
    ):
        managed = gateway.clusters["cluster1"].name
        node, pod, container = f"sp-node-{tag}", "target", "main"
        with cluster1.api_client() as admin:
            core = client.CoreV1Api(admin)
            core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
            core.create_namespaced_service_account(namespace, {"metadata": {"name": "default"}})
            reader_token = core.create_namespaced_service_account_token(
                "reader", namespace, {"spec": {"expirationSeconds": 3600}}
            ).status.token
            _bind(
                admin,
                "",
                f"sp-reader-{tag}",
                [{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]}],
                {"kind": "ServiceAccount", "name": "reader", "namespace": namespace},
            )
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
        hub_namespace = f"sp-hub-{tag}"
        with gateway.hub.api_client() as admin:
            core = client.CoreV1Api(admin)
            core.create_namespace({"metadata": {"name": hub_namespace}})
            core.create_namespaced_service_account(hub_namespace, {"metadata": {"name": "robot"}})
            robot_token = core.create_namespaced_service_account_token(
                "robot", hub_namespace, {"spec": {"expirationSeconds": 3600}}
            ).status.token
        exec_rig = ExecRig(gateway, kubelet, managed, namespace, pod, container, directory)
        try:
            yield Rig(
                gateway,
                managed,
                namespace,
                hub_namespace,
                reader_token,
                robot_token,
                f"cluster:hub:system:serviceaccount:{hub_namespace}:robot",
                echo_port,
                exec_rig,
            )
        finally:
            with cluster1.api_client() as admin:
                client.CoreV1Api(admin).delete_node(node)
                rbac = client.RbacAuthorizationV1Api(admin)
                for name in (f"sp-reader-{tag}", f"sp-impersonator-{tag}"):
                    with contextlib.suppress(client.exceptions.ApiException):
                        rbac.delete_cluster_role_binding(name)
                    with contextlib.suppress(client.exceptions.ApiException):
                        rbac.delete_cluster_role(name)
    with cluster1.api_client() as admin, contextlib.suppress(client.exceptions.ApiException):
        client.CoreV1Api(admin).delete_namespace(namespace)


def _events(rig: Rig, event: str) -> list[dict[str, Any]]:
    return [r for r in rig.gateway.process.events() if r.get("event") == event]


# --- authentication and forwarding ---------------------------------------------------------------------


def test_a_managed_clusters_token_passes_unchanged_and_its_rbac_decides(rig: Rig) -> None:
    """kubectl with ``server: https://HUB/<cluster>`` and cluster1's own token: cluster1's namespaces
    (one that exists only there), and cluster1's 403 naming that ServiceAccount for what it may not do."""
    kubeconfig = rig.kubeconfig(rig.reader_token)
    done = _kubectl(kubeconfig, "get", "ns", "-o", "name")
    assert done.returncode == 0, f"{done.stderr}\n{rig.gateway.process.tail()}"
    assert f"namespace/{rig.gateway.clusters['cluster1'].only_here}" in done.stdout.split()
    done = _kubectl(kubeconfig, "get", "secrets", "-n", "kube-system")
    assert done.returncode != 0
    assert (
        f'User "system:serviceaccount:{rig.namespace}:reader" cannot list resource "secrets"' in done.stderr
    ), done.stderr
    records = [
        r
        for r in _events(rig, "service_proxy_request")
        if r.get("path") == "/" + rig.cluster + "/api/v1/namespaces"
    ]
    assert records and records[-1]["source"] == "managed", records
    assert records[-1]["user"] == f"system:serviceaccount:{rig.namespace}:reader"
    # the gateway logs at debug here: still no token in its log
    assert rig.reader_token not in rig.gateway.process.log_path.read_text()


def test_a_hub_serviceaccount_is_impersonated_with_upstreams_name(rig: Rig) -> None:
    """A hub token: cluster1 answers as ``cluster:hub:system:serviceaccount:NS:robot``: 403 until a
    RoleBinding there grants that user, then exactly what it grants (real kubectl)."""
    path = f"/{rig.cluster}/api/v1/namespaces/{rig.namespace}/configmaps"
    status, _, body = rig.call(path, rig.robot_token)
    assert status == 403, body
    assert f'User "{rig.robot_user}" cannot list resource "configmaps"' in body["message"], body
    with rig.gateway.clusters["cluster1"].api.api_client() as admin:
        _bind(
            admin,
            rig.namespace,
            "robot-configmaps",
            [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}],
            _user(rig.robot_user),
        )
    status, _, body = poll_until(
        lambda: (answer := rig.call(path, rig.robot_token))[0] == 200 and answer,
        timeout=15,
        what="the robot's list once cluster1 binds its hub name",
    )
    assert body["kind"] == "ConfigMapList"
    kubeconfig = rig.kubeconfig(rig.robot_token)
    done = _kubectl(kubeconfig, "get", "configmaps", "-n", rig.namespace, "-o", "name")
    assert done.returncode == 0, done.stderr
    done = _kubectl(kubeconfig, "get", "secrets", "-n", rig.namespace)
    assert done.returncode != 0 and f'User "{rig.robot_user}" cannot list resource "secrets"' in done.stderr
    record = [r for r in _events(rig, "service_proxy_request") if r.get("path") == path][-1]
    assert (record["source"], record["user"]) == ("hub", rig.robot_user)


def test_what_the_endpoint_refuses_it_says_why(rig: Rig) -> None:
    unknown = secrets.token_urlsafe(24)
    status, headers, body = rig.call(f"/{rig.cluster}/api/v1/namespaces", unknown)
    assert status == 401 and headers.get("WWW-Authenticate", "").startswith("Bearer"), (status, headers)
    assert "valid neither in cluster" in body["message"] and body["reason"] == "Unauthorized", body
    status, headers, body = rig.call(f"/{rig.cluster}/api/v1/namespaces", None)
    assert status == 401 and "no bearer token" in body["message"], body
    assert headers.get("WWW-Authenticate", "").startswith("Bearer")
    status, _, body = rig.call("/no-such-cluster/api/v1/namespaces", rig.reader_token)
    assert status == 404 and "no ManagedCluster 'no-such-cluster'" in body["message"], body
    # a cluster with the addon but no agent: first its credential is missing, then its tunnel
    ghost = f"ghost-{rig.gateway.stack.tag}"
    _managed_cluster(rig.gateway, ghost)
    with rig.gateway.hub.api_client() as admin:
        core = client.CoreV1Api(admin)
        status, _, body = poll_until(
            lambda: (
                (answer := rig.call(f"/{ghost}/api/v1/namespaces", rig.reader_token))[0] == 503 and answer
            ),
            timeout=15,
            what="503 for the ghost cluster's missing credential",
        )
        assert f"Secret {ghost}/cluster-proxy-service-proxy on the hub does not exist" in body["message"], (
            body
        )
        secret = core.read_namespaced_secret("cluster-proxy-service-proxy", rig.cluster)
        core.create_namespaced_secret(
            ghost, {"metadata": {"name": "cluster-proxy-service-proxy"}, "data": secret.data}
        )
        status, _, body = poll_until(
            lambda: (
                (answer := rig.call(f"/{ghost}/api/v1/namespaces", rig.reader_token))[0] == 503
                and "no tunnel" in answer[2]["message"]
                and answer
            ),
            timeout=15,
            what="503 for the ghost cluster's missing tunnel",
        )
        assert f"no tunnel to cluster '{ghost}'" in body["message"], body


def test_a_watch_streams_through_the_endpoint(rig: Rig) -> None:
    path = f"/{rig.cluster}/api/v1/namespaces"
    status, _, listed = rig.call(path, rig.reader_token)
    assert status == 200
    watched = f"watched-{secrets.token_hex(3)}"
    request = urllib.request.Request(
        f"{rig.url}{path}?watch=1&resourceVersion={listed['metadata']['resourceVersion']}",
        headers={"Authorization": f"Bearer {rig.reader_token}"},
    )
    with urllib.request.urlopen(request, context=rig.context(), timeout=30) as answer:
        assert answer.status == 200
        with rig.gateway.clusters["cluster1"].api.api_client() as admin:
            client.CoreV1Api(admin).create_namespace({"metadata": {"name": watched}})
        try:
            while True:
                line = answer.readline()
                assert line, "the watch ended before the namespace arrived"
                event = json.loads(line)
                if event["object"]["metadata"]["name"] == watched:
                    assert event["type"] == "ADDED"
                    break
        finally:
            with rig.gateway.clusters["cluster1"].api.api_client() as admin:
                client.CoreV1Api(admin).delete_namespace(watched)


def test_exec_with_a_hub_token_is_upgraded_and_carried(rig: Rig) -> None:
    """A WebSocket exec (v4.channel.k8s.io, tests/kube/test_gateway_upgrade.py's fake kubelet) by the
    hub's robot, impersonated in cluster1, with 1 MiB of stdin whose digest comes back."""
    with rig.gateway.clusters["cluster1"].api.api_client() as admin:
        _bind(
            admin,
            rig.namespace,
            "robot-exec",
            [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
                {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["get", "create"]},
            ],
            _user(rig.robot_user),
        )
    core = client.CoreV1Api(config.new_client_from_config(config_file=str(rig.kubeconfig(rig.robot_token))))
    stdin = os.urandom(1 << 20)
    command = ["digest", f"--marker={secrets.token_hex(4)}"]
    session = _exec(core, rig.exec_rig, command, stdin)
    answer = json.loads(session.read_stdout())
    assert answer["sha256"] == hashlib.sha256(stdin).hexdigest() and answer["bytes"] == len(stdin)
    assert session.returncode == 0
    poll_until(
        lambda: any(
            r.get("status") == 101 and r.get("path", "").endswith(f"/pods/{rig.exec_rig.pod}/exec")
            for r in _events(rig, "service_proxy_request")
        ),
        timeout=10,
        what="the endpoint's record of the exec, status 101",
    )


# --- Impersonate-* from the caller ---------------------------------------------------------------------


def test_impersonate_headers_are_honoured_only_where_cluster1_allows_the_caller(rig: Rig) -> None:
    alice = f"alice-{rig.gateway.stack.tag}"
    path = f"/{rig.cluster}/api/v1/namespaces/{rig.namespace}/pods"
    # the hub's robot may not impersonate alice in cluster1: the endpoint's 403, from a SubjectAccessReview
    status, _, body = rig.call(path, rig.robot_token, {"Impersonate-User": alice})
    assert status == 403, body
    assert (
        f'User "{rig.robot_user}"' in body["message"]
        and f'cannot impersonate resource "users" "{alice}"' in (body["message"])
    ), body
    # a managed token's Impersonate-* go to cluster1 unchanged: its own 403 names the reader
    status, _, body = rig.call(path, rig.reader_token, {"Impersonate-User": alice})
    assert status == 403 and f"system:serviceaccount:{rig.namespace}:reader" in body["message"], body
    assert "cannot impersonate" in body["message"], body
    # cluster1 lets the robot impersonate alice (not a group): alice's own answer, then what she may do
    tag = rig.gateway.stack.tag
    with rig.gateway.clusters["cluster1"].api.api_client() as admin:
        _bind(
            admin,
            "",
            f"sp-impersonator-{tag}",
            [{"apiGroups": [""], "resources": ["users"], "verbs": ["impersonate"], "resourceNames": [alice]}],
            _user(rig.robot_user),
        )
    status, _, body = poll_until(
        lambda: (
            (answer := rig.call(path, rig.robot_token, {"Impersonate-User": alice}))[0] == 403
            and f'User "{alice}" cannot list resource "pods"' in answer[2]["message"]
            and answer
        ),
        timeout=15,
        what="cluster1 answering as alice",
    )
    with rig.gateway.clusters["cluster1"].api.api_client() as admin:
        _bind(
            admin,
            rig.namespace,
            "alice-pods",
            [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
            _user(alice),
        )
    status, _, body = poll_until(
        lambda: (answer := rig.call(path, rig.robot_token, {"Impersonate-User": alice}))[0] == 200 and answer,
        timeout=15,
        what="alice's list of pods",
    )
    assert [p["metadata"]["name"] for p in body["items"]] == [rig.exec_rig.pod]
    # a group the robot may not impersonate is still refused
    status, _, body = rig.call(
        path, rig.robot_token, {"Impersonate-User": alice, "Impersonate-Group": "admins"}
    )
    assert status == 403 and 'cannot impersonate resource "groups" "admins"' in body["message"], body


# --- in-cluster services -------------------------------------------------------------------------------


def test_services_are_reached_only_through_the_allow_list(rig: Rig) -> None:
    echo = (
        f"/{rig.cluster}/api/v1/namespaces/{rig.namespace}/services/http:echo:{rig.echo_port}/proxy-service"
    )
    other = echo.replace("http:echo:", "http:other:")
    status, _, body = rig.call(echo + "/hello?x=1", rig.reader_token)
    assert status == 403, body
    assert f"ConfigMap {rig.gateway.allowlist} does not exist on the hub" in body["message"], body
    status, _, body = rig.call(echo + "/hello", None)
    assert status == 401, body
    namespace, name = rig.gateway.allowlist.split("/")
    entries = [
        {"namespace": rig.namespace, "service": "echo", "port": str(rig.echo_port), "protocol": "http"}
    ]
    with rig.gateway.hub.api_client() as admin:
        client.CoreV1Api(admin).create_namespaced_config_map(
            namespace,
            {"metadata": {"name": name}, "data": {"echo": yaml.safe_dump(entries), "typo": "- service: x\n"}},
        )
    status, _, body = poll_until(
        lambda: (answer := rig.call(echo + "/hello?x=1", rig.robot_token))[0] == 200 and answer,
        timeout=15,
        what="the echo service once listed",
    )
    assert body["path"] == "/hello?x=1", body
    assert "authorization" not in body["headers"], body  # the caller's token stays in the endpoint
    assert body["headers"]["host"] == f"echo.{rig.namespace}.svc:{rig.echo_port}"
    status, _, body = rig.call(other + "/", rig.reader_token)
    assert status == 403, body
    assert f"not in the service proxy's allow-list (ConfigMap {rig.gateway.allowlist}" in body["message"], (
        body
    )
    assert "key 'typo', entry 0: namespace and service are required" in body["message"], body
    status, _, body = rig.call(echo.replace(f":{rig.echo_port}", ":1") + "/", rig.reader_token)
    assert status == 403, body  # another port of a listed service


# --- audit ---------------------------------------------------------------------------------------------


def test_every_request_has_one_audit_record_with_the_user_and_never_the_token(rig: Rig) -> None:
    marker = f"/{rig.cluster}/api/v1/namespaces/{rig.namespace}/configmaps/audited-{secrets.token_hex(3)}"
    status, _, _ = rig.call(marker, rig.reader_token)
    assert status == 403  # cluster1's answer: the reader may not get ConfigMaps
    status, _, _ = rig.call(marker, secrets.token_urlsafe(24))
    assert status == 401
    path = rig.gateway.directory / "audit.jsonl"

    def records() -> list[dict[str, Any]]:
        return [json.loads(line) for line in path.read_text().splitlines() if marker in line]

    found = poll_until(lambda: len(records()) == 2 and records(), timeout=10, what="two audit records")
    carried, refused = found
    assert carried["frontend"] == "service-proxy" and carried["client_kind"] == "token"
    assert (carried["client"], carried["target"], carried["method"]) == (
        f"system:serviceaccount:{rig.namespace}:reader",
        marker,
        "GET",
    )
    assert (carried["cluster"], carried["outcome"], carried["status"]) == (rig.cluster, "ok", 403)
    assert carried["bytes_to_client"] > 0 and carried["groups"]
    assert (refused["outcome"], refused["status"], refused["client"]) == ("refused", 401, "")
    assert "valid neither" in refused["reason"]
    text = path.read_text()
    assert rig.reader_token not in text and rig.robot_token not in text
