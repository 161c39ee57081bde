"""The addon-manager's reading of its inputs: the ManagedProxyConfiguration (its defaults are the
CRD's: checked against the CRD file itself), where agents reach the hub, the AddOnDeploymentConfig
an addon uses, the agent namespace; and its command line."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

from clusterproxy_addon_manager.config import (
    AGENT_NAMESPACE,
    Endpoints,
    EntrypointWaiting,
    agent_namespace,
    canonical_quantity,
    deploy_config_ref,
    parse_deploy_config,
    parse_mpc,
    resolve_endpoints,
)
from clusterproxy_addon_manager.main import parse_settings

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "deploy/kustomize/base/crds/proxy.open-cluster-management.io_managedproxyconfigurations.yaml"


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def crd_defaults(schema: dict[str, Any]) -> Any:
    """What the API server stores for ``spec: {}``: every default, applied into defaulted parents."""
    if schema.get("type") != "object":
        return schema.get("default")
    if "default" not in schema:
        return None
    value = dict(schema["default"])
    for name, sub in (schema.get("properties") or {}).items():
        if name not in value:
            child = crd_defaults(sub)
            if child is not None:
                value[name] = child
    return value


def test_crd_is_structural_and_cluster_scoped() -> None:
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["scope"] == "Cluster"
    assert crd["spec"]["group"] == "proxy.open-cluster-management.io"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}

    def check(node: dict[str, Any], where: str) -> None:
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{where}: no type"
        for name, sub in (node.get("properties") or {}).items():
            check(sub, f"{where}.{name}")
        if "items" in node:
            check(node["items"], f"{where}[]")

    check(crd_schema(), "")


def test_code_defaults_are_the_crds() -> None:
    stored_spec = crd_defaults(crd_schema()["properties"]["spec"])
    from_crd = parse_mpc({"metadata": {"name": "x"}, "spec": stored_spec}, default_namespace="ns")
    from_nothing = parse_mpc({"metadata": {"name": "x"}, "spec": {}}, default_namespace="ns")
    assert from_crd == from_nothing
    assert from_nothing.server_image == "cluster-proxy/proxy-server:dev"
    assert from_nothing.agent_image == "cluster-proxy/proxy-agent:dev"
    assert from_nothing.entrypoint.type == "LoadBalancerService"
    assert from_nothing.entrypoint.service_name == "proxy-agent-entrypoint"
    assert (from_nothing.client_port, from_nothing.agent_port, from_nothing.admin_port) == (8090, 8091, 8092)
    assert from_nothing.signer_port == 8443
    assert from_nothing.namespace == "ns"  # the manager's --namespace: the CRD has no default for it


def test_mpc_fields() -> None:
    cfg = parse_mpc(
        {
            "metadata": {"name": "cluster-proxy", "uid": "u", "generation": 7},
            "spec": {
                "proxyServer": {
                    "image": "cluster-proxy/proxy-server:v1",
                    "replicas": 2,
                    "namespace": "hub-ns",
                    "inClusterServiceName": "px",
                    "entrypoint": {"type": "Hostname", "hostname": {"value": "hub.example.com"}, "port": 443},
                    "additionalArgs": ["--dial-timeout=5s"],
                    "nodePlacement": {"nodeSelector": {"b": "2", "a": "1"}, "tolerations": [{"key": "k"}]},
                },
                "proxyAgent": {"image": "a:1", "replicas": 3, "imagePullSecrets": ["pull"]},
                "authentication": {
                    "signer": {"type": "SelfSigned", "selfSigned": {"additionalSANs": ["x.y"]}}
                },
            },
        },
        default_namespace="ignored",
    )
    assert (cfg.uid, cfg.generation, cfg.namespace, cfg.server_replicas) == ("u", 7, "hub-ns", 2)
    assert cfg.entrypoint.hostname == "hub.example.com" and cfg.entrypoint.port == 443
    assert cfg.node_selector == (("a", "1"), ("b", "2"))
    assert cfg.image_pull_secrets == ("pull",)
    assert cfg.additional_sans == ("x.y",)


def test_resources_default_and_replace_each_half() -> None:
    default = parse_mpc({"metadata": {"name": "x"}, "spec": {}}, default_namespace="ns")
    assert default.server_resources.as_dict() == {
        "requests": {"cpu": "200m", "memory": "192Mi"},
        "limits": {"cpu": "2", "memory": "1Gi"},
    }
    assert default.agent_resources.as_dict() == {
        "requests": {"cpu": "50m", "memory": "64Mi"},
        "limits": {"cpu": "1", "memory": "512Mi"},
    }
    cfg = parse_mpc(
        {
            "metadata": {"name": "x"},
            "spec": {
                "proxyServer": {"resources": {"limits": {"cpu": 4, "memory": "2048Mi"}}},
                "proxyAgent": {"resources": {"requests": {"cpu": "0.1"}, "limits": {}}},
            },
        },
        default_namespace="ns",
    )
    # written as the API server stores them, so the Deployment on the server compares equal
    assert cfg.server_resources.as_dict() == {
        "requests": {"cpu": "200m", "memory": "192Mi"},
        "limits": {"cpu": "4", "memory": "2Gi"},
    }
    assert cfg.agent_resources.as_dict() == {"requests": {"cpu": "100m"}}


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("1000m", "1"),
        ("1500m", "1500m"),
        ("0.5", "500m"),
        ("2", "2"),
        ("2000", "2k"),
        ("2048", "2048"),
        ("1024Mi", "1Gi"),
        ("1.5Gi", "1536Mi"),
        ("0.5Ki", "512"),
        ("192Mi", "192Mi"),
        ("1e3", "1e3"),
        ("0", "0"),
        ("not a quantity", "not a quantity"),
    ],
)
def test_quantities_are_written_as_the_api_server_stores_them(given: str, stored: str) -> None:
    assert canonical_quantity(given) == stored


def lb_service(name: str, address: dict[str, str] | None) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"loadBalancer": {"ingress": [address] if address else []}}}


def test_endpoints_per_entrypoint_type() -> None:
    hostname = parse_mpc(
        {
            "metadata": {"name": "m"},
            "spec": {"proxyServer": {"entrypoint": {"type": "Hostname", "hostname": {"value": "h.example"}}}},
        },
        default_namespace="ns",
    )
    assert resolve_endpoints(hostname, {}, signer_entrypoint_service="s") == Endpoints(
        "h.example", 8091, "h.example", 8443
    )

    port_forward = parse_mpc(
        {"metadata": {"name": "m"}, "spec": {"proxyServer": {"entrypoint": {"type": "PortForward"}}}},
        default_namespace="ns",
    )
    assert resolve_endpoints(port_forward, {}, signer_entrypoint_service="s") == Endpoints(
        "127.0.0.1", 8091, "127.0.0.1", 8443
    )

    lb = parse_mpc({"metadata": {"name": "m"}, "spec": {}}, default_namespace="ns")
    waiting = resolve_endpoints(
        lb,
        {"proxy-agent-entrypoint": lb_service("proxy-agent-entrypoint", {"ip": "203.0.113.7"})},
        signer_entrypoint_service="sig",
    )
    assert isinstance(waiting, EntrypointWaiting)
    assert (
        waiting.reason == "WaitingForLoadBalancer"
        and "sig" in waiting.message
        and "proxy-agent-entrypoint" not in waiting.message
    )
    ready = resolve_endpoints(
        lb,
        {
            "proxy-agent-entrypoint": lb_service("proxy-agent-entrypoint", {"ip": "203.0.113.7"}),
            "sig": lb_service("sig", {"hostname": "signer.elb.example"}),
        },
        signer_entrypoint_service="sig",
    )
    assert ready == Endpoints("203.0.113.7", 8091, "signer.elb.example", 8443)


def test_deploy_config_reference_precedence() -> None:
    addon_own = {
        "metadata": {"namespace": "cluster1"},
        "spec": {
            "configs": [
                {
                    "group": "addon.open-cluster-management.io",
                    "resource": "addondeploymentconfigs",
                    "name": "mine",
                }
            ]
        },
    }
    cma = {
        "spec": {
            "supportedConfigs": [
                {
                    "group": "addon.open-cluster-management.io",
                    "resource": "addondeploymentconfigs",
                    "defaultConfig": {"name": "all", "namespace": "shared"},
                }
            ]
        }
    }
    assert deploy_config_ref(addon_own, cma) == ("cluster1", "mine")  # namespace defaults to the addon's
    assert deploy_config_ref({"metadata": {"namespace": "cluster2"}, "spec": {}}, cma) == ("shared", "all")
    assert deploy_config_ref({"metadata": {"namespace": "cluster2"}, "spec": {}}, None) is None
    other = {
        "metadata": {"namespace": "c"},
        "spec": {"configs": [{"group": "x.io", "resource": "addondeploymentconfigs", "name": "n"}]},
    }
    assert deploy_config_ref(other, None) is None


def test_deploy_config_settings_and_problems() -> None:
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    settings = parse_deploy_config(
        {
            "spec": {
                "proxyConfig": {
                    "httpsProxy": "http://p:3128",
                    "noProxy": "a,b",
                    "caBundle": base64.b64encode(pem.encode()).decode(),
                },
                "agentInstallNamespace": "open-cluster-management-agent-addon",
                "registries": [{"source": "cluster-proxy/", "mirror": "m/"}],
            }
        }
    )
    assert (
        settings.https_proxy == "http://p:3128"
        and settings.no_proxy == "a,b"
        and settings.ca_bundle_pem == pem
    )
    assert settings.install_namespace == ""  # OCM's default means "unset"
    assert settings.registries == (("cluster-proxy/", "m/"),)
    broken = parse_deploy_config({"spec": {"proxyConfig": {"caBundle": "%%%"}}})
    assert broken.ca_bundle_pem == "" and "caBundle" in broken.problems[0]
    not_pem = parse_deploy_config(
        {"spec": {"proxyConfig": {"caBundle": base64.b64encode(b"hello").decode()}}}
    )
    assert not_pem.ca_bundle_pem == "" and "no PEM" in not_pem.problems[0]


def test_agent_namespace_rules() -> None:
    default = {"spec": {"installNamespace": "open-cluster-management-agent-addon"}}
    assert agent_namespace(default, None) == AGENT_NAMESPACE
    assert agent_namespace({"spec": {"installNamespace": "mine"}}, None) == "mine"
    from clusterproxy_addon_manager.config import ProxySettings

    assert agent_namespace(default, ProxySettings(install_namespace="from-adc")) == "from-adc"
    assert (
        agent_namespace({"spec": {"installNamespace": "mine"}}, ProxySettings(install_namespace="from-adc"))
        == "mine"
    )


# --- command line --------------------------------------------------------------------------------------


def test_flags_defaults_and_env_twins() -> None:
    defaults = parse_settings([], environ={})
    assert defaults.namespace == "open-cluster-management-addon"
    assert defaults.mpc_name == "cluster-proxy"
    assert defaults.create_default_configuration is True
    assert defaults.admin_urls == []
    assert (defaults.resync_period, defaults.availability_poll, defaults.token_ttl) == (600.0, 10.0, 86400.0)
    assert defaults.admin_listen == ("0.0.0.0", 8094)
    assert defaults.signer is None and str(defaults.credentials_dir) == "/var/lib/cluster-proxy"
    env = parse_settings(
        [],
        environ={
            "CLUSTER_PROXY_ADDON_MANAGER_KUBECONFIG": "/k",
            "CLUSTER_PROXY_ADDON_MANAGER_NAMESPACE": "ns1",
            "CLUSTER_PROXY_ADDON_MANAGER_MPC_NAME": "other",
            "CLUSTER_PROXY_ADDON_MANAGER_ADMIN_URL": "https://10.0.0.1:8092,https://10.0.0.2:8092",
            "CLUSTER_PROXY_ADDON_MANAGER_SIGNER": "https://signer.hub:8443/",
            "CLUSTER_PROXY_ADDON_MANAGER_CREDENTIALS_DIR": "/run/manager",
            "CLUSTER_PROXY_ADDON_MANAGER_RESYNC_PERIOD": "1m",
            "CLUSTER_PROXY_ADDON_MANAGER_AVAILABILITY_POLL": "2s",
            "CLUSTER_PROXY_ADDON_MANAGER_TOKEN_TTL": "1h",
            "CLUSTER_PROXY_ADDON_MANAGER_LOG_LEVEL": "debug",
            "CLUSTER_PROXY_ADDON_MANAGER_CREATE_DEFAULT_CONFIGURATION": "false",
        },
    )
    assert str(env.kubeconfig) == "/k" and env.namespace == "ns1" and env.mpc_name == "other"
    assert env.create_default_configuration is False
    assert env.admin_urls == ["https://10.0.0.1:8092", "https://10.0.0.2:8092"]
    assert env.signer == "https://signer.hub:8443" and str(env.credentials_dir) == "/run/manager"
    assert (env.resync_period, env.availability_poll, env.token_ttl, env.log_level) == (
        60.0,
        2.0,
        3600.0,
        "debug",
    )
    flags = parse_settings(
        ["--namespace", "ns2", "--admin-url", "https://h:1/"],
        environ={"CLUSTER_PROXY_ADDON_MANAGER_NAMESPACE": "ns1"},
    )
    assert flags.namespace == "ns2" and flags.admin_urls == ["https://h:1"]
    assert (
        parse_settings(["--no-create-default-configuration"], environ={}).create_default_configuration
        is False
    )
    assert (
        parse_settings(
            ["--create-default-configuration"],
            environ={"CLUSTER_PROXY_ADDON_MANAGER_CREATE_DEFAULT_CONFIGURATION": "false"},
        ).create_default_configuration
        is True
    )


@pytest.mark.parametrize("bad", ["-cluster-proxy", "Cluster-Proxy", "proxy_", "a" * 254, ""])
def test_object_names_are_checked(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_settings([f"--mpc-name={bad}"], environ={})
    assert info.value.code == 2 and "a Kubernetes object name" in capsys.readouterr().err


def test_a_plain_admin_url_is_refused_with_the_https_one(capsys: pytest.CaptureFixture[str]) -> None:
    """The proxy-servers list their clusters over mutual TLS only: a plain URL would be answered 403
    at every poll, so it is refused at start, naming the URL to use instead."""
    with pytest.raises(SystemExit) as exc:
        parse_settings(["--admin-url", "http://10.0.0.1:8092"], environ={})
    assert exc.value.code == 2
    assert "https://10.0.0.1:8092 (the same port)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--admin-url", "ftp://h:1"], "--admin-url"),
        (["--signer", "http://signer:8443"], "--signer"),
        (["--signer", "https://signer"], "--signer"),
        (["--token-ttl", "48h"], "--token-ttl"),
        (["--availability-poll", "0s"], "--availability-poll"),
        (["--namespace", "Not_A_Name"], "--namespace"),
        (["--workers", "0"], "--workers"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(argv, environ={})
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
