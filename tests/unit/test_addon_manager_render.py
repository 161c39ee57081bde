"""What the addon-manager renders, checked without an API server: object kinds, names, labels and
owners; and every container's command line accepted by the real program's own parser (a misspelt
flag or a path the program refuses fails here), with the paths of the pod's volumes mapped to a
temporary folder as a kubelet would mount them."""

from __future__ import annotations

import base64
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest

from clusterproxy_addon_manager import render, render_agent, render_hub, render_registration
from clusterproxy_addon_manager.config import Endpoints, ProxySettings, parse_mpc
from clusterproxy_agent.main import parse_settings as parse_agent
from clusterproxy_certsigner.main import build_parser as signer_parser
from clusterproxy_protocol.config import parse_args_or_exit
from clusterproxy_protocol.pki import DevCA
from clusterproxy_server.main import build_parser as server_parser, config_from_args
from clusterproxy_server.workers import default_workers
from tests.support.netpol import ANYWHERE, IN_CLUSTER, ingress_by_pod

MPC_UID = "0b5e2c9e-1111-4aaa-8bbb-000000000001"
ADDON_UID = "0b5e2c9e-2222-4aaa-8bbb-000000000002"
TOKEN = "0123456789ab." + "A" * 43
PROJECT_IMAGES = ("cluster-proxy/proxy-server:", "cluster-proxy/proxy-agent:", "cluster-proxy/cert-signer:")


def mpc(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
        "kind": "ManagedProxyConfiguration",
        "metadata": {"name": "cluster-proxy", "uid": MPC_UID, "generation": 3},
        "spec": spec,
    }


HOSTNAME_SPEC = {
    "proxyServer": {"entrypoint": {"type": "Hostname", "hostname": {"value": "hub.example.com"}}}
}
ENDPOINTS = Endpoints("hub.example.com", 8091, "hub.example.com", 8443)


@pytest.fixture(scope="module")
def ca_pem(tmp_path_factory: pytest.TempPathFactory) -> str:
    return DevCA.create_or_load(tmp_path_factory.mktemp("ca") / "ca").ca_path.read_text()


def hub(
    ca_pem: str, spec: dict[str, Any] | None = None, endpoints: Endpoints | None = ENDPOINTS
) -> list[dict[str, Any]]:
    cfg = parse_mpc(
        mpc(**(spec if spec is not None else HOSTNAME_SPEC)),
        default_namespace="open-cluster-management-addon",
    )
    return render_hub.hub_objects(
        render_hub.HubInputs(
            cfg=cfg,
            endpoints=endpoints,
            ca_bundle_pem=ca_pem,
            server_token=TOKEN,
            store_prefix="cluster-proxy-ca",
            signer_image="cluster-proxy/cert-signer:dev",
        )
    )


def work(
    ca_pem: str,
    spec: dict[str, Any] | None = None,
    proxy: ProxySettings = ProxySettings(),
    namespace: str = "open-cluster-management-cluster-proxy",
) -> dict[str, Any]:
    cfg = parse_mpc(
        mpc(**(spec if spec is not None else HOSTNAME_SPEC)),
        default_namespace="open-cluster-management-addon",
    )
    return render_agent.agent_manifest_work(
        render_agent.AgentInputs(
            cfg=cfg,
            cluster="cluster1",
            namespace=namespace,
            endpoints=ENDPOINTS,
            ca_bundle_pem=ca_pem,
            token=TOKEN,
            proxy=proxy,
            addon_uid=ADDON_UID,
        )
    )


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def container(deployment: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


SERVICEACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


class Pod:
    """A pod's volumes as folders: Secret volumes hold their keys as files, emptyDirs start empty,
    and the init containers' copy has run (it is a shell one-liner: done here the way it would be)."""

    def __init__(self, root: Path, deployment: dict[str, Any], secrets: dict[str, dict[str, Any]]) -> None:
        self.root = root
        self.spec = deployment["spec"]["template"]["spec"]
        self.dirs: dict[str, Path] = {}
        for volume in self.spec.get("volumes", []):
            folder = root / volume["name"]
            folder.mkdir(parents=True)
            if "secret" in volume:
                for key, value in secrets[volume["secret"]["secretName"]]["data"].items():
                    (folder / key).write_bytes(base64.b64decode(value))
            self.dirs[volume["name"]] = folder
        for init in self.spec.get("initContainers", []):
            assert init["command"][:2] == ["/bin/sh", "-c"]
            script = init["command"][2]
            test, _, copy = script.partition(" || ")
            assert test.startswith("test -s ")
            _, source, target = copy.split()
            target_path = self.path(init, target)
            if not (target_path.exists() and target_path.stat().st_size):
                target_path.write_bytes(self.path(init, source).read_bytes())

    def path(self, c: dict[str, Any], path: str) -> Path:
        for mount in c.get("volumeMounts", []):
            root = mount["mountPath"].rstrip("/")
            if path == root:
                return self.dirs[mount["name"]]
            if path.startswith(root + "/"):
                return self.dirs[mount["name"]] / path[len(root) + 1 :]
        if self.spec.get("automountServiceAccountToken") and path.startswith(SERVICEACCOUNT_MOUNT + "/"):
            return self.root / "serviceaccount" / path[len(SERVICEACCOUNT_MOUNT) + 1 :]  # the kubelet's mount
        raise AssertionError(f"{path} is on no volume of container {c['name']}")

    def argv(self, c: dict[str, Any]) -> list[str]:
        """The container's arguments with every volume path mapped to its folder."""
        out = []
        for arg in c.get("args", []):
            flag, eq, value = arg.partition("=")
            if eq and value.startswith("/"):
                arg = f"{flag}={self.path(c, value)}"
            out.append(arg)
        return out

    def env(self, c: dict[str, Any], secrets: dict[str, dict[str, Any]]) -> dict[str, str]:
        env = {}
        for item in c.get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
            else:
                ref = item["valueFrom"]["secretKeyRef"]
                env[item["name"]] = base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode()
        return env


def secrets_of(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}


# --- hub -----------------------------------------------------------------------------------------------


def test_hub_objects_names_labels_owner(ca_pem: str) -> None:
    objects = hub(ca_pem)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert names == {
        ("ServiceAccount", "cluster-proxy"),
        ("ServiceAccount", "cluster-proxy-cert-signer"),
        ("Role", "cluster-proxy-cert-signer"),
        ("RoleBinding", "cluster-proxy-cert-signer"),
        ("Secret", "cluster-proxy-server-bootstrap"),
        ("Deployment", "cluster-proxy"),
        ("Deployment", "cluster-proxy-cert-signer"),
        ("Service", "proxy-entrypoint"),
        ("Service", "proxy-agent-entrypoint"),
        ("Service", "cluster-proxy-cert-signer"),
        ("Service", "cluster-proxy-admin"),
        ("NetworkPolicy", "cluster-proxy"),
        ("NetworkPolicy", "cluster-proxy-cert-signer"),
        ("PodDisruptionBudget", "cluster-proxy"),
    }
    for obj in objects:
        meta = obj["metadata"]
        assert meta["namespace"] == "open-cluster-management-addon"
        assert meta["labels"]["app.kubernetes.io/part-of"] == "cluster-proxy"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "cluster-proxy-addon-manager"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
                "kind": "ManagedProxyConfiguration",
                "name": "cluster-proxy",
                "uid": MPC_UID,
                "controller": True,
            }
        ]
    # Hostname: the agents' entrypoint is a ClusterIP Service the operator exposes at the host name
    assert find(objects, "Service", "proxy-agent-entrypoint")["spec"]["type"] == "ClusterIP"
    assert find(objects, "Service", "cluster-proxy-admin")["spec"]["clusterIP"] == "None"
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        images = [c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]]
        images += [c["image"] for c in deployment["spec"]["template"]["spec"].get("initContainers", [])]
        assert all(image.startswith(PROJECT_IMAGES) for image in images), images


@pytest.mark.parametrize("entrypoint", ["Hostname", "LoadBalancerService"])
def test_hub_pods_accept_their_own_ports_only(ca_pem: str, entrypoint: str) -> None:
    """The agent port and the signer from anywhere (agents dial in from other clusters, users enrol
    from their machines), the client and admin ports from the cluster's pods (hub clients and
    Prometheus; the kubelet's probes pass whatever a policy says), nothing else; each policy applied
    before its pods."""
    spec = {"proxyServer": {"entrypoint": {"type": entrypoint, "hostname": {"value": "hub.example.com"}}}}
    objects = hub(ca_pem, spec)
    assert ingress_by_pod(objects) == {
        "cluster-proxy": {"agent": ANYWHERE, "client": IN_CLUSTER, "admin": IN_CLUSTER},
        "cluster-proxy-cert-signer": {"https": ANYWHERE},
    }
    order = [(o["kind"], o["metadata"]["name"]) for o in objects]
    for name in ("cluster-proxy", "cluster-proxy-cert-signer"):
        assert order.index(("NetworkPolicy", name)) < order.index(("Deployment", name))


def test_the_agent_accepts_its_admin_port_only(ca_pem: str) -> None:
    manifests = work(ca_pem, namespace="agents-here")["spec"]["workload"]["manifests"]
    assert ingress_by_pod(manifests) == {"cluster-proxy-proxy-agent": {"admin": IN_CLUSTER}}
    policy = find(manifests, "NetworkPolicy", "cluster-proxy-proxy-agent")
    assert policy["metadata"]["namespace"] == "agents-here"


def test_load_balancer_entrypoint_adds_the_signers_own(ca_pem: str) -> None:
    objects = hub(ca_pem, {"proxyServer": {"entrypoint": {"type": "LoadBalancerService"}}}, endpoints=None)
    assert find(objects, "Service", "proxy-agent-entrypoint")["spec"]["type"] == "LoadBalancer"
    signer = find(objects, "Service", "cluster-proxy-cert-signer-entrypoint")
    assert signer["spec"]["type"] == "LoadBalancer"
    assert signer["spec"]["ports"][0]["port"] == 8443


def test_server_command_line_is_accepted_by_the_server(ca_pem: str, tmp_path: Path) -> None:
    spec = {
        "proxyServer": {
            **HOSTNAME_SPEC["proxyServer"],
            "replicas": 3,
            "additionalArgs": ["--dial-timeout=20s"],
        },
        "authentication": {"signer": {"selfSigned": {"additionalSANs": ["proxy.corp.example"]}}},
    }
    objects = hub(ca_pem, spec)
    deployment = find(objects, "Deployment", "cluster-proxy")
    assert deployment["spec"]["replicas"] == 3
    c = container(deployment, "proxy-server")
    assert c["command"] == ["cluster-proxy-server"]
    pod = Pod(tmp_path, deployment, secrets_of(objects))
    parser = server_parser()
    args = parse_args_or_exit(parser, pod.argv(c), environ=pod.env(c, secrets_of(objects)))
    config = config_from_args(args)
    assert config.server_count == 3
    assert config.dial_timeout == 20.0
    # a rolling upgrade: readiness fails and the Service drops the pod during the delay, then the drain;
    # Kubernetes must not SIGKILL before both are over
    assert config.shutdown_delay == 5.0
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > config.shutdown_delay + config.drain_timeout
    assert config.bootstrap_token == TOKEN
    assert config.signer == "https://cluster-proxy-cert-signer.open-cluster-management-addon.svc:8443"
    assert {
        "hub.example.com",
        "proxy.corp.example",
        "proxy-entrypoint.open-cluster-management-addon.svc",
    } <= set(config.tls_hosts)
    # the CA bundle the init container seeded is the one the manager put in the Secret
    assert config.ca.read_text() == ca_pem
    assert (config.agent_listen, config.client_listen, config.admin_listen) == (
        ("0.0.0.0", 8091),
        ("0.0.0.0", 8090),
        ("0.0.0.0", 8092),
    )


def test_signer_command_line_is_accepted_by_the_signer(ca_pem: str, tmp_path: Path) -> None:
    objects = hub(ca_pem)
    deployment = find(objects, "Deployment", "cluster-proxy-cert-signer")
    c = container(deployment, "cert-signer")
    assert c["command"] == ["cluster-proxy-cert-signer"]
    pod = Pod(tmp_path, deployment, secrets_of(objects))
    args = parse_args_or_exit(signer_parser(), pod.argv(c), environ={})
    assert args.command == "serve"
    assert args.store == ("kubernetes", "open-cluster-management-addon/cluster-proxy-ca")
    assert args.listen == ("0.0.0.0", 8443)
    # agents verify the signer by the host they dial, the proxy-servers by its in-cluster name
    assert "hub.example.com" in args.tls_host
    assert "cluster-proxy-cert-signer.open-cluster-management-addon.svc" in args.tls_host
    role = find(objects, "Role", "cluster-proxy-cert-signer")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "create", "update", "delete"]}
    ]


# --- managed cluster -----------------------------------------------------------------------------------


def test_manifest_work_holds_the_agent(ca_pem: str) -> None:
    mw = work(ca_pem)
    assert mw["metadata"]["name"] == "addon-cluster-proxy-deploy"
    assert mw["metadata"]["namespace"] == "cluster1"
    assert mw["metadata"]["ownerReferences"][0]["kind"] == "ManagedClusterAddOn"
    assert mw["metadata"]["ownerReferences"][0]["uid"] == ADDON_UID
    manifests = mw["spec"]["workload"]["manifests"]
    assert [(m["kind"], m["metadata"]["name"]) for m in manifests] == [
        ("Namespace", "open-cluster-management-cluster-proxy"),
        ("ServiceAccount", "cluster-proxy"),
        ("Secret", "cluster-proxy-agent-bootstrap"),
        # the managed service accounts' namespace and the agent's rights there
        ("Namespace", render.SERVICEACCOUNT_NAMESPACE),
        ("Role", render.SERVICEACCOUNT_ROLE),
        ("RoleBinding", render.SERVICEACCOUNT_ROLE),
        # the service proxy's ServiceAccount there: reviews and impersonation only
        ("ClusterRole", render.SERVICE_PROXY_ROLE),
        ("ClusterRoleBinding", render.SERVICE_PROXY_ROLE),
        # before the pods it guards
        ("NetworkPolicy", "cluster-proxy-proxy-agent"),
        ("Deployment", "cluster-proxy-proxy-agent"),
    ]
    for manifest in manifests[1:3] + manifests[-2:]:
        assert manifest["metadata"]["namespace"] == "open-cluster-management-cluster-proxy"
    assert render.token_from_manifest_work(mw) == TOKEN
    secret = manifests[2]
    assert base64.b64decode(secret["data"]["ca.crt"]).decode() == ca_pem


@pytest.mark.parametrize("replicas", [1, 3])
def test_agent_command_line_is_accepted_by_the_agent(ca_pem: str, tmp_path: Path, replicas: int) -> None:
    spec = {
        "proxyServer": HOSTNAME_SPEC["proxyServer"],
        "proxyAgent": {
            "image": "cluster-proxy/proxy-agent:v2",
            "replicas": replicas,
            "additionalArgs": ["--dial-timeout=5s"],
        },
    }
    manifests = work(ca_pem, spec)["spec"]["workload"]["manifests"]
    deployment = find(manifests, "Deployment", "cluster-proxy-proxy-agent")
    assert deployment["spec"]["replicas"] == replicas
    c = container(deployment, "proxy-agent")
    assert c["command"] == ["cluster-proxy-agent"]
    assert c["image"] == "cluster-proxy/proxy-agent:v2"
    pod = Pod(tmp_path, deployment, secrets_of(manifests))
    settings = parse_agent(pod.argv(c), environ=pod.env(c, secrets_of(manifests)))
    assert settings.cluster == "cluster1"
    assert settings.server == ("hub.example.com", 8091)
    assert settings.signer == "https://hub.example.com:8443"
    assert settings.bootstrap_token == TOKEN
    assert settings.dial_timeout == 5.0
    assert settings.ca.read_text() == ca_pem
    assert settings.proxy.proxy is None
    spec_pod = deployment["spec"]["template"]["spec"]
    # its own token: the managed service accounts' control endpoint (docs/managed-serviceaccount.md)
    assert spec_pod["automountServiceAccountToken"] is True
    assert settings.serviceaccounts is not None
    assert settings.serviceaccounts.namespace == render.SERVICEACCOUNT_NAMESPACE
    assert spec_pod["serviceAccountName"] == "cluster-proxy"


def test_deploy_config_proxy_reaches_the_agent(ca_pem: str, tmp_path: Path) -> None:
    proxy_ca = ca_pem  # any PEM bundle
    proxy = ProxySettings(
        http_proxy="http://proxy.corp:3128",
        https_proxy="https://proxy.corp:3129",
        no_proxy="10.0.0.0/8,.internal",
        ca_bundle_pem=proxy_ca,
        node_selector=(("zone", "a"),),
        registries=(("cluster-proxy/", "mirror.corp/cluster-proxy/"),),
    )
    manifests = work(ca_pem, proxy=proxy)["spec"]["workload"]["manifests"]
    deployment = find(manifests, "Deployment", "cluster-proxy-proxy-agent")
    c = container(deployment, "proxy-agent")
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HTTPS_PROXY"] == "https://proxy.corp:3129"
    assert env["HTTP_PROXY"] == "http://proxy.corp:3128"
    assert env["NO_PROXY"] == "10.0.0.0/8,.internal"
    assert c["image"] == "mirror.corp/cluster-proxy/proxy-agent:dev"
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {"zone": "a"}
    secrets = secrets_of(manifests)
    assert (
        base64.b64decode(secrets["cluster-proxy-agent-bootstrap"]["data"]["proxy-ca.crt"]).decode()
        == proxy_ca
    )
    pod = Pod(tmp_path, deployment, secrets)
    settings = parse_agent(pod.argv(c), environ=pod.env(c, secrets))
    assert settings.proxy.proxy is not None and settings.proxy.proxy.host == "proxy.corp"
    assert settings.proxy.proxy_source == "HTTPS_PROXY"
    assert settings.proxy_ca_file is not None and settings.proxy_ca_file.read_text() == proxy_ca
    assert settings.proxy.route("10.1.2.3", 8091).proxy is None  # exempt by NO_PROXY
    assert settings.proxy.route("hub.example.com", 8091).proxy is not None


def test_agent_namespace_is_the_one_given(ca_pem: str) -> None:
    manifests = work(ca_pem, namespace="custom-agents")["spec"]["workload"]["manifests"]
    assert manifests[0] == {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": "custom-agents", "labels": render.labels("proxy-agent")},
    }
    assert {m["metadata"].get("namespace") for m in manifests[1:3] + manifests[-1:]} == {"custom-agents"}


def test_ipv6_entrypoint_is_bracketed(ca_pem: str, tmp_path: Path) -> None:
    cfg = parse_mpc(mpc(**HOSTNAME_SPEC), default_namespace="ns")
    mw = render_agent.agent_manifest_work(
        render_agent.AgentInputs(
            cfg=cfg,
            cluster="cluster1",
            namespace="agents",
            endpoints=Endpoints("fd00::1", 8091, "fd00::1", 8443),
            ca_bundle_pem=ca_pem,
            token=TOKEN,
            proxy=ProxySettings(),
            addon_uid=ADDON_UID,
        )
    )
    manifests = mw["spec"]["workload"]["manifests"]
    deployment = find(manifests, "Deployment", "cluster-proxy-proxy-agent")
    c = container(deployment)
    pod = Pod(tmp_path, deployment, secrets_of(manifests))
    settings = parse_agent(pod.argv(c), environ=pod.env(c, secrets_of(manifests)))
    assert settings.server == ("fd00::1", 8091)
    assert settings.signer == "https://[fd00::1]:8443"


def test_cluster_management_addon_points_at_the_mpc() -> None:
    cma = render_registration.cluster_management_addon("cluster-proxy")
    assert cma["metadata"]["name"] == "cluster-proxy"
    assert cma["spec"]["addOnConfiguration"] == {
        "crdName": "managedproxyconfigurations.proxy.open-cluster-management.io",
        "crName": "cluster-proxy",
    }
    assert {
        "group": "proxy.open-cluster-management.io",
        "resource": "managedproxyconfigurations",
        "defaultConfig": {"name": "cluster-proxy"},
    } in cma["spec"]["supportedConfigs"]


def test_token_readers_tolerate_missing_or_broken_data() -> None:
    assert render.token_from_manifest_work(None) is None
    assert render.token_from_manifest_work({"spec": {}}) is None
    assert render.token_from_secret({"data": {"bootstrap-token": "not base64!"}}) is None
    assert render.token_from_secret({"data": {"bootstrap-token": base64.b64encode(b"abc").decode()}}) == "abc"


# --- production settings a real node checks --------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def image_user() -> tuple[int, int]:
    """The numeric user and group every project image runs as (its recipe's ``USER``)."""
    users = re.findall(r"^USER\s+(\d+):(\d+)\s*$", (ROOT / "deploy/images/Dockerfile").read_text(), re.M)
    assert len(users) == 1, users
    return int(users[0][0]), int(users[0][1])


def every_deployment(ca_pem: str) -> list[dict[str, Any]]:
    rendered = hub(ca_pem) + work(ca_pem)["spec"]["workload"]["manifests"]
    return [o for o in rendered if o["kind"] == "Deployment"]


def cpu_cores(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def test_every_container_runs_as_the_image_user_locked_down(ca_pem: str) -> None:
    """runAsNonRoot is checked by the kubelet against the numeric user; the image's USER is 65532, so
    the pod says the same number (a name would be refused: the kubelet cannot verify it)."""
    uid, gid = image_user()
    for deployment in every_deployment(ca_pem):
        where = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (uid, gid), (
            where
        )
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        writable = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (where, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (where, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (where, c["name"])
            # every folder a program writes is a writable volume: its credentials, the signer's TLS
            # folder and its tempfile scratch
            for mount in c["volumeMounts"]:
                if not mount.get("readOnly"):
                    assert mount["name"] in writable, (where, c["name"], mount)
            resources = c["resources"]
            assert set(resources) == {"requests", "limits"}, (where, c["name"])
            assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(
                resources["limits"]
            ), (where, c["name"])


def test_every_program_container_is_probed_on_its_own_port(ca_pem: str) -> None:
    for deployment in every_deployment(ca_pem):
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            ports = {p["name"] for p in c["ports"]}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                assert probe in c, (c["name"], probe)
                assert c[probe]["httpGet"]["port"] in ports, (c["name"], probe)
                assert c[probe]["timeoutSeconds"] >= 5, (c["name"], probe)  # the kubelet's 1 s: too tight
            # a slow start on a busy node (minutes) is not a hang: liveness waits for the startup probe
            startup = c["startupProbe"]
            assert startup["httpGet"] == c["livenessProbe"]["httpGet"], c["name"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, c["name"]
    signer = container(find(hub(ca_pem), "Deployment", "cluster-proxy-cert-signer"))
    # the signer's only port is HTTPS; the kubelet probes without verifying its certificate
    assert signer["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    server = container(find(hub(ca_pem), "Deployment", "cluster-proxy"))
    assert server["livenessProbe"]["httpGet"]["port"] == "admin"
    assert {"name": "admin", "containerPort": 8092, "protocol": "TCP"} in server["ports"]


def test_the_signer_has_a_writable_tmp_for_its_scratch_folder(ca_pem: str) -> None:
    deployment = find(hub(ca_pem), "Deployment", "cluster-proxy-cert-signer")
    mounts = {m["mountPath"]: m["name"] for m in container(deployment)["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]


def test_resources_default_to_the_crds_and_follow_the_mpc(ca_pem: str) -> None:
    server = find(hub(ca_pem), "Deployment", "cluster-proxy")["spec"]["template"]["spec"]
    assert container({"spec": {"template": {"spec": server}}})["resources"] == {
        "requests": {"cpu": "200m", "memory": "192Mi"},
        "limits": {"cpu": "2", "memory": "1Gi"},
    }
    assert server["initContainers"][0]["resources"] == server["containers"][0]["resources"]
    agent = find(work(ca_pem)["spec"]["workload"]["manifests"], "Deployment", "cluster-proxy-proxy-agent")
    assert container(agent)["resources"] == {
        "requests": {"cpu": "50m", "memory": "64Mi"},
        "limits": {"cpu": "1", "memory": "512Mi"},
    }
    # given: each half replaces the default's (limits {} is no limit at all)
    spec = {
        "proxyServer": {
            **HOSTNAME_SPEC["proxyServer"],
            "resources": {"limits": {"cpu": "4", "memory": "8Gi"}},
        },
        "proxyAgent": {"resources": {"requests": {"memory": "128Mi"}, "limits": {}}},
    }
    server_c = container(find(hub(ca_pem, spec), "Deployment", "cluster-proxy"))
    assert server_c["resources"] == {
        "requests": {"cpu": "200m", "memory": "192Mi"},
        "limits": {"cpu": "4", "memory": "8Gi"},
    }
    agent_c = container(
        find(work(ca_pem, spec)["spec"]["workload"]["manifests"], "Deployment", "cluster-proxy-proxy-agent")
    )
    assert agent_c["resources"] == {"requests": {"memory": "128Mi"}}


@pytest.mark.parametrize(("limit", "workers"), [("2", 2), ("1500m", 2), ("1", 1), ("250m", 1)])
def test_server_workers_follow_its_cpu_limit(ca_pem: str, tmp_path: Path, limit: str, workers: int) -> None:
    """No --workers on the command line: the server's default is its cgroup's CPU quota rounded up,
    and the kubelet writes the container's CPU limit as that quota (cpu.max: quota and period, in
    microseconds; runc's 100 ms period)."""
    spec = {"proxyServer": {**HOSTNAME_SPEC["proxyServer"], "resources": {"limits": {"cpu": limit}}}}
    c = container(find(hub(ca_pem, spec), "Deployment", "cluster-proxy"))
    assert not any(a.startswith("--workers") for a in c["args"])
    assert not any(e["name"] == "CLUSTER_PROXY_SERVER_WORKERS" for e in c["env"])
    period = 100_000
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(f"{math.ceil(cpu_cores(c['resources']['limits']['cpu']) * period)} {period}\n")
    assert default_workers(cpu_max) == min(workers, len(os.sched_getaffinity(0)))


def test_proxy_servers_are_spread_and_evicted_one_at_a_time(ca_pem: str) -> None:
    spec = {"proxyServer": {**HOSTNAME_SPEC["proxyServer"], "replicas": 3}}
    objects = hub(ca_pem, spec)
    deployment = find(objects, "Deployment", "cluster-proxy")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    budget = find(objects, "PodDisruptionBudget", "cluster-proxy")
    assert budget["apiVersion"] == "policy/v1"
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    [spread] = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    # a single-node cluster still runs every replica
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread["maxSkew"] == 1
    assert spread["labelSelector"]["matchLabels"].items() <= pod_labels.items()
