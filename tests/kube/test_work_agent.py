"""The stand-ins of tests/support/workagent.py checked on their own, against a real API server (cluster1)
and the hub, with a small Deployment whose program reports what it was given:

- the kubelet: command and args exactly (``$(VAR)`` expanded, ``$$`` escaped, an unknown reference kept),
  env from values, Secrets, ConfigMaps, the downward API and envFrom, service links; Secret, ConfigMap
  and emptyDir volumes at rewritten mount paths (an init container's shell line included); the
  ServiceAccount's identity through KUBECONFIG and the mapped token directory; cluster DNS and
  kube-proxy for Python (a Service's short name to its cluster IP, and on to the pod's port;
  ``kubernetes.default.svc`` to the API server); the readiness probe and the Deployment's status;
  restart with the same emptyDir and a refreshed Secret; a clean stop; errors that name what is missing;
- the work agent: server-side apply with the field manager ``work-agent``, the ManifestWork's status as
  OCM's agent writes it (a refused manifest included), a new generation applied (what it no longer
  holds deleted), a deleted work's objects removed.
"""

from __future__ import annotations

import base64
import secrets
import signal
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.support.kubeapi import KubeCluster, KubeClusters, free_port
from tests.support.workagent import (
    FIELD_MANAGER,
    Kubelet,
    Pod,
    WorkAgent,
    WorkAgentError,
    expand,
    poll_until,
    rewrite_mount_paths,
)

pytestmark = pytest.mark.slow

# What the container runs: it serves HTTP on $PORT (its readiness probe and the Service "echo" lead
# there), counts its starts in the emptyDir, and prints one JSON line with everything it was given.
REPORTER = textwrap.dedent(
    """
    import http.server, json, os, pathlib, socket, ssl, sys, threading, urllib.request

    args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    server = http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state = pathlib.Path(os.environ["STATE"])
    starts = int(state.read_text()) + 1 if state.exists() else 1
    state.write_text(str(starts))
    report = {"event": "report", "argv": sys.argv[1:], "env": dict(os.environ), "starts": starts}
    token_file = pathlib.Path(args["token-file"])
    report["token_file"] = [token_file.read_text(), oct(token_file.stat().st_mode & 0o777)]
    report["settings_mode"] = pathlib.Path(args["settings"], "mode").read_text()
    report["seed"] = pathlib.Path(os.environ["SEED"]).read_text()
    report["echo_address"] = socket.getaddrinfo("echo", 80, type=socket.SOCK_STREAM)[0][4][0]
    with urllib.request.urlopen("http://echo/", timeout=5) as answer:
        report["echo_status"] = answer.status
    try:
        socket.getaddrinfo("nothing-here." + os.environ["POD_NAMESPACE"] + ".svc", 80)
        report["unknown_service"] = "resolved"
    except socket.gaierror as exc:
        report["unknown_service"] = str(exc)
    sa_dir = pathlib.Path(args["sa-dir"])
    if sa_dir.is_dir():
        # in-cluster access as client libraries do it: the kubernetes Service's address from the
        # environment, the mounted token and CA
        context = ssl.create_default_context(cafile=str(sa_dir / "ca.crt"))
        host = os.environ["KUBERNETES_SERVICE_HOST"] + ":" + os.environ["KUBERNETES_SERVICE_PORT"]
        review = urllib.request.Request(
            "https://" + host + "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            data=json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).encode(),
            headers={"Authorization": "Bearer " + (sa_dir / "token").read_text(), "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(review, context=context, timeout=10) as answer:
            report["whoami"] = json.loads(answer.read())["status"]["userInfo"]["username"]
        with urllib.request.urlopen("https://kubernetes.default.svc/version", context=context, timeout=10) as answer:
            report["version_by_name"] = json.loads(answer.read())["gitVersion"]
        from kubernetes import client, config
        config.load_kube_config()
        core = client.CoreV1Api()
        report["kubeconfig_configmaps"] = sorted(c.metadata.name for c in core.list_namespaced_config_map(os.environ["POD_NAMESPACE"]).items)
        try:
            core.list_namespaced_secret(os.environ["POD_NAMESPACE"])
            report["kubeconfig_secrets"] = "allowed"
        except client.exceptions.ApiException as exc:
            report["kubeconfig_secrets"] = exc.status
    print(json.dumps(report), flush=True)
    threading.Event().wait()
    """
)


@dataclass
class Scene:
    cluster: KubeCluster
    namespace: str
    port: int
    kubelet: Kubelet
    directory: Path


def _core(cluster: KubeCluster) -> Any:
    return client.CoreV1Api(cluster.api_client())


def _deployment(name: str, port: int, *, automount: bool | None = None, **container: Any) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "serviceAccountName": "reporter",
        "terminationGracePeriodSeconds": 5,
        "initContainers": [
            {
                "name": "seed",
                "image": "busybox",
                "command": ["/bin/sh", "-c", "test -s /work/seed.txt || echo seeded-once > /work/seed.txt"],
                "volumeMounts": [{"name": "work", "mountPath": "/work"}],
            }
        ],
        "containers": [
            {
                "name": "main",
                "image": "cluster-proxy/test:dev",
                "command": ["python", "-c", REPORTER],
                "args": [
                    "--token-file=/etc/creds/sub/token",
                    "--settings=/etc/settings",
                    "--sa-dir=/var/run/secrets/kubernetes.io/serviceaccount",
                    "--greeting=$(GREETING)",
                    "--escaped=$$(GREETING)",
                    "--unknown=$(NOT_DEFINED)",
                    "--not-a-mount=/etc/settingsx/a",
                ],
                "env": [
                    {"name": "PORT", "value": str(port)},
                    {"name": "STATE", "value": "/work/starts"},
                    {"name": "SEED", "value": "/work/seed.txt"},
                    {
                        "name": "GREETING",
                        "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}},
                    },
                    {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
                    {"name": "COMBINED", "value": "$(GREETING)-$(TOKEN)-$(ECHO_SERVICE_PORT)"},
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                    {"name": "TIER", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['tier']"}}},
                    {
                        "name": "MAYBE",
                        "valueFrom": {"secretKeyRef": {"name": "absent", "key": "x", "optional": True}},
                    },
                ],
                "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CFG_"}],
                "ports": [{"name": "http", "containerPort": port}],
                "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
                "volumeMounts": [
                    {"name": "creds", "mountPath": "/etc/creds", "readOnly": True},
                    {"name": "settings", "mountPath": "/etc/settings"},
                    {"name": "work", "mountPath": "/work"},
                ],
                **container,
            }
        ],
        "volumes": [
            {
                "name": "creds",
                "secret": {
                    "secretName": "creds",
                    "items": [{"key": "token", "path": "sub/token", "mode": 0o400}],
                },
            },
            {"name": "settings", "configMap": {"name": "settings"}},
            {"name": "work", "emptyDir": {}},
        ],
    }
    if automount is not None:
        pod["automountServiceAccountToken"] = automount
    labels = {"app": name, "tier": "backend"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


@pytest.fixture(scope="module")
def scene(kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    cluster = kube_clusters["cluster1"]
    namespace = f"wa-{secrets.token_hex(3)}"
    port = free_port()
    with cluster.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": namespace}})
        core.create_namespaced_secret(
            namespace, {"metadata": {"name": "creds"}, "stringData": {"token": "s3cret", "unused": "x"}}
        )
        core.create_namespaced_config_map(
            namespace, {"metadata": {"name": "settings"}, "data": {"mode": "fast", "greeting": "hello"}}
        )
        core.create_namespaced_service_account(namespace, {"metadata": {"name": "reporter"}})
        rbac = client.RbacAuthorizationV1Api(api)
        rbac.create_namespaced_role(
            namespace,
            {
                "metadata": {"name": "read-configmaps"},
                "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}],
            },
        )
        rbac.create_namespaced_role_binding(
            namespace,
            {
                "metadata": {"name": "reporter"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "read-configmaps",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "reporter", "namespace": namespace}],
            },
        )
        core.create_namespaced_service(
            namespace,
            {
                "metadata": {"name": "echo"},
                "spec": {"selector": {"app": "reporter"}, "ports": [{"port": 80, "targetPort": "http"}]},
            },
        )
        apps = client.AppsV1Api(api)
        apps.create_namespaced_deployment(namespace, _deployment("reporter", port))
        apps.create_namespaced_deployment(namespace, _deployment("no-token", free_port(), automount=False))
    kubelet = Kubelet(cluster, tmp_path_factory.mktemp("kubelet"))
    try:
        yield Scene(cluster, namespace, port, kubelet, kubelet.directory)
    finally:
        kubelet.close(grace=5)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")


@pytest.fixture(scope="module")
def reporter(scene: Scene) -> Pod:
    return scene.kubelet.run(scene.namespace, "reporter").wait_ready(60)


def _report(pod: Pod) -> dict[str, Any]:
    return pod.container("main").wait_event("report", timeout=60)


def test_expand_and_rewrite_follow_the_kubelet_rules() -> None:
    values = {"A": "1", "B": "$(A)"}
    assert expand("x$(A)y$(B)$$(A)$(C)$", values.get) == "x1y$(A)$(A)$(C)$"
    assert expand("$(A", values.get) == "$(A"
    assert expand("a$bc", values.get) == "a$bc"
    mounts = {"/etc/x": Path("/tmp/v/x"), "/etc/x/inner": Path("/tmp/v/inner")}
    assert rewrite_mount_paths("--ca=/etc/x/ca.crt", mounts) == "--ca=/tmp/v/x/ca.crt"
    assert rewrite_mount_paths("--in=/etc/x/inner/f", mounts) == "--in=/tmp/v/inner/f"
    assert rewrite_mount_paths("cp /etc/x/a /etc/xy/b /a/etc/x", mounts) == "cp /tmp/v/x/a /etc/xy/b /a/etc/x"
    assert rewrite_mount_paths("/etc/x", mounts) == "/tmp/v/x"


def test_command_args_and_environment_are_the_containers(scene: Scene, reporter: Pod) -> None:
    report = _report(reporter)
    volumes = reporter.directory / "volumes"
    identity = reporter.directory / "serviceaccount"
    assert report["argv"] == [
        f"--token-file={volumes / 'creds'}/sub/token",
        f"--settings={volumes / 'settings'}",
        f"--sa-dir={identity}",
        "--greeting=hello",
        "--escaped=$(GREETING)",
        "--unknown=$(NOT_DEFINED)",
        "--not-a-mount=/etc/settingsx/a",
    ]
    env = report["env"]
    assert env["GREETING"] == "hello" and env["TOKEN"] == "s3cret"
    assert env["COMBINED"] == "hello-s3cret-80"  # service link variables are there for $(VAR)
    assert env["POD_NAME"] == reporter.name and env["HOSTNAME"] == reporter.name
    assert env["POD_NAMESPACE"] == scene.namespace and env["TIER"] == "backend"
    assert "MAYBE" not in env  # optional and absent
    assert env["CFG_mode"] == "fast" and env["CFG_greeting"] == "hello"
    assert env["STATE"] == f"{volumes / 'work'}/starts"
    echo_ip = env["ECHO_SERVICE_HOST"]
    assert echo_ip.startswith("10.0.0.") and env["ECHO_SERVICE_PORT"] == "80"
    assert env["ECHO_PORT"] == f"tcp://{echo_ip}:80"
    assert env["KUBERNETES_SERVICE_HOST"] == "10.0.0.1" and env["KUBERNETES_SERVICE_PORT"] == "443"
    assert env["KUBECONFIG"] == str(identity / "kubeconfig")
    assert not {"VIRTUAL_ENV", "PYTEST_CURRENT_TEST"} & set(env), "the test's environment leaked in"


def test_volumes_and_init_container(reporter: Pod) -> None:
    report = _report(reporter)
    assert report["token_file"] == ["s3cret", "0o400"]  # items: key, path and mode
    assert report["settings_mode"] == "fast"
    assert report["seed"] == "seeded-once\n"  # written by the init container's shell line
    assert not (reporter.directory / "volumes" / "creds" / "unused").exists()


def test_identity_and_pod_network(scene: Scene, reporter: Pod) -> None:
    report = _report(reporter)
    assert report["whoami"] == f"system:serviceaccount:{scene.namespace}:reporter"
    assert report["version_by_name"].startswith("v1.")  # kubernetes.default.svc -> the API server
    assert report["kubeconfig_configmaps"] == ["settings"]  # through $KUBECONFIG
    assert report["kubeconfig_secrets"] == 403  # the Role allows ConfigMaps only
    assert report["echo_address"] == report["env"]["ECHO_SERVICE_HOST"]
    assert report["echo_status"] == 200  # echo:80 -> the pod's own port, named "http"
    assert "not known" in report["unknown_service"]


def test_no_token_when_automount_is_off(scene: Scene) -> None:
    pod = scene.kubelet.run(scene.namespace, "no-token")
    report = _report(pod)
    assert "KUBECONFIG" not in report["env"]
    assert (
        report["argv"][2] == "--sa-dir=/var/run/secrets/kubernetes.io/serviceaccount"
    )  # no mount, no mapping
    assert "whoami" not in report
    pod.stop(grace=5)


def test_readiness_writes_the_deployment_status(scene: Scene, reporter: Pod) -> None:
    assert reporter.probe() == (True, f"http://127.0.0.1:{scene.port}/: 200")
    with scene.cluster.api_client() as api:
        status = client.AppsV1Api(api).read_namespaced_deployment_status("reporter", scene.namespace).status
    assert (status.replicas, status.ready_replicas, status.available_replicas) == (1, 1, 1)


def test_restart_keeps_the_empty_dir_and_reads_secrets_again(scene: Scene, reporter: Pod) -> None:
    first = _report(reporter)
    with scene.cluster.api_client() as api:
        client.CoreV1Api(api).patch_namespaced_secret(
            "creds", scene.namespace, {"data": {"token": base64.b64encode(b"rotated").decode()}}
        )
    main = reporter.container("main")
    old_pid = main.pid
    reporter.restart(grace=5)
    second = _report(reporter)
    assert main.pid != old_pid and main.starts == 2
    assert second["starts"] == first["starts"] + 1  # the emptyDir kept its file
    assert second["env"]["TOKEN"] == "rotated" and second["token_file"][0] == "rotated"
    assert second["seed"] == "seeded-once\n"
    assert reporter.init_containers[0].starts == 1  # init containers do not run again
    assert main.text(all_runs=True).count("=== start") == 2


def test_stop_sends_sigterm(scene: Scene) -> None:
    pod = scene.kubelet.run(scene.namespace, "no-token")
    _report(pod)
    pod.stop(grace=5)
    assert pod.container("main").returncode == -signal.SIGTERM


def test_what_cannot_be_emulated_is_an_error_naming_it(scene: Scene) -> None:
    def attempt(deployment: dict[str, Any]) -> str:
        name = deployment["metadata"]["name"]
        with scene.cluster.api_client() as api:
            client.AppsV1Api(api).create_namespaced_deployment(scene.namespace, deployment)
        with pytest.raises(WorkAgentError) as refused:
            scene.kubelet.run(scene.namespace, name).stop(grace=1)
        return str(refused.value)

    missing_secret = _deployment("missing-secret", free_port())
    missing_secret["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "X", "valueFrom": {"secretKeyRef": {"name": "nowhere", "key": "k"}}}
    )
    assert f"Secret {scene.namespace}/nowhere not found" in attempt(missing_secret)

    host_path = _deployment("host-path", free_port())
    host_path["spec"]["template"]["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/etc"}})
    assert "volume 'host' of type hostPath is not emulated" in attempt(host_path)

    unknown_program = _deployment("unknown-program", free_port(), command=["no-such-program"])
    assert "program 'no-such-program'" in attempt(unknown_program)

    no_account = _deployment("no-account", free_port())
    no_account["spec"]["template"]["spec"]["serviceAccountName"] = "ghost"
    assert f"ServiceAccount {scene.namespace}/ghost not found" in attempt(no_account)


# --- the work agent -----------------------------------------------------------------------------------------


def _work(name: str, target_namespace: str, bad_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "work.open-cluster-management.io/v1",
        "kind": "ManifestWork",
        "metadata": {"name": name},
        "spec": {
            "workload": {
                "manifests": [
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": target_namespace}},
                    {
                        "apiVersion": "v1",
                        "kind": "ConfigMap",
                        "metadata": {"name": "applied", "namespace": target_namespace},
                        "data": {"k": "v"},
                    },
                    {
                        "apiVersion": "rbac.authorization.k8s.io/v1",
                        "kind": "ClusterRole",
                        "metadata": {"name": f"{target_namespace}-reader"},
                        "rules": [],
                    },
                    {
                        "apiVersion": "v1",
                        "kind": "ConfigMap",
                        "metadata": {"name": bad_name, "namespace": target_namespace},
                    },
                ]
            }
        },
    }


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in obj.get("conditions") or []}


def test_work_agent_applies_and_reports_like_ocm(kube_clusters: KubeClusters) -> None:
    hub, cluster1 = kube_clusters["hub"], kube_clusters["cluster1"]
    cluster_name = f"wa-cluster-{secrets.token_hex(3)}"
    target = f"wa-applied-{secrets.token_hex(3)}"
    custom = client.CustomObjectsApi(hub.api_client())
    _core(hub).create_namespace({"metadata": {"name": cluster_name}})
    args = ("work.open-cluster-management.io", "v1", cluster_name, "manifestworks")
    custom.create_namespaced_custom_object(*args, _work("w", target, "Not_A_Valid_Name"))
    agent = WorkAgent(hub, cluster1, cluster_name)
    try:
        applied = agent.apply("w")
        assert [r.ordinal for r in applied.results if r.error] == [3]
        assert "Not_A_Valid_Name" in applied.results[3].error

        status = custom.get_namespaced_custom_object(*args, "w")["status"]
        work = _conditions(status)
        assert (work["Applied"]["status"], work["Applied"]["reason"]) == (
            "False",
            "AppliedManifestWorkFailed",
        )
        assert work["Applied"]["observedGeneration"] == 1
        assert (work["Available"]["status"], work["Available"]["message"]) == (
            "False",
            "1 of 4 resources are not available",
        )
        manifests = status["resourceStatus"]["manifests"]
        assert [m["resourceMeta"] for m in manifests[:3]] == [
            {
                "ordinal": 0,
                "group": "",
                "version": "v1",
                "kind": "Namespace",
                "resource": "namespaces",
                "name": target,
                "namespace": "",
            },
            {
                "ordinal": 1,
                "group": "",
                "version": "v1",
                "kind": "ConfigMap",
                "resource": "configmaps",
                "name": "applied",
                "namespace": target,
            },
            {
                "ordinal": 2,
                "group": "rbac.authorization.k8s.io",
                "version": "v1",
                "kind": "ClusterRole",
                "resource": "clusterroles",
                "name": f"{target}-reader",
                "namespace": "",
            },
        ]
        assert _conditions(manifests[3])["Applied"]["reason"] == "AppliedManifestFailed"
        assert all(_conditions(m)["Applied"]["status"] == "True" for m in manifests[:3])

        with cluster1.api_client() as api:
            applied_map = client.CoreV1Api(api).read_namespaced_config_map("applied", target)
        managers = {(f.manager, f.operation) for f in applied_map.metadata.managed_fields}
        assert managers == {(FIELD_MANAGER, "Apply")}

        # a new generation is applied by the running agent
        agent.start(interval=0.1)
        fixed = custom.get_namespaced_custom_object(*args, "w")
        fixed["spec"]["workload"]["manifests"][3]["metadata"]["name"] = "now-valid"
        del fixed["spec"]["workload"]["manifests"][2]  # the ClusterRole leaves the work
        custom.replace_namespaced_custom_object(*args, "w", fixed)
        agent.wait_applied("w", timeout=30, generation=2)
        status = custom.get_namespaced_custom_object(*args, "w")["status"]
        work = _conditions(status)
        assert (work["Applied"]["status"], work["Applied"]["observedGeneration"]) == ("True", 2)
        assert (work["Available"]["status"], work["Available"]["reason"]) == ("True", "ResourcesAvailable")
        assert [m["resourceMeta"]["name"] for m in status["resourceStatus"]["manifests"]] == [
            target,
            "applied",
            "now-valid",
        ]
        with cluster1.api_client() as api, pytest.raises(client.exceptions.ApiException) as gone_role:
            client.RbacAuthorizationV1Api(api).read_cluster_role(f"{target}-reader")
        assert gone_role.value.status == 404  # applied by generation 1, not in generation 2: deleted

        # a deleted work: what it applied goes too
        custom.delete_namespaced_custom_object(*args, "w")

        def gone() -> bool:
            with cluster1.api_client() as api:
                names = {
                    c.metadata.name for c in client.CoreV1Api(api).list_namespaced_config_map(target).items
                }
            return not {"applied", "now-valid"} & names

        poll_until(gone, timeout=30, what="the deleted ManifestWork's ConfigMaps removed from cluster1")
        assert agent.last_error == ""
    finally:
        agent.close()
        hub.kubectl("delete", "namespace", cluster_name, "--wait=false")
        cluster1.kubectl("delete", "clusterrole", f"{target}-reader", "--ignore-not-found")
