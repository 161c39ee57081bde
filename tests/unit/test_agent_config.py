"""cluster-proxy-agent command line: every bad value stops the start with exit 2, naming flag and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from clusterproxy_agent.egress import BUILTIN_DENY
from clusterproxy_agent.main import parse_settings
from clusterproxy_protocol.pki import DevCA


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("agent-pki")
    ca = DevCA.create_or_load(directory / "ca")
    agent = ca.issue_agent("cluster1", "agent-a", directory)
    other = ca.issue_agent("cluster1", "agent-b", directory)
    return {"ca": ca.ca_path, "cert": agent.cert, "key": agent.key, "other_key": other.key}


def base_args(certs: dict[str, Path]) -> list[str]:
    return [
        "--server",
        "hub.example.com:8091",
        "--cluster",
        "cluster1",
        "--ca",
        str(certs["ca"]),
        "--cert",
        str(certs["cert"]),
        "--key",
        str(certs["key"]),
    ]


def test_defaults(certs: dict[str, Path]) -> None:
    s = parse_settings(base_args(certs), environ={})
    assert s.server == ("hub.example.com", 8091)
    assert s.server_name == "hub.example.com"
    assert s.cluster == "cluster1"
    assert s.agent_id  # the host name
    assert s.kube_apiserver == ("kubernetes.default.svc", 443)
    assert s.dial_timeout == 10.0
    assert s.admin_listen == ("0.0.0.0", 8093)
    assert (s.backoff_initial, s.backoff_max) == (0.5, 30.0)
    assert (s.keepalive_interval, s.keepalive_timeout) == (30.0, 20.0)
    assert s.drain_timeout == 30.0
    assert (s.log_level, s.log_format) == ("info", "auto")
    policy = s.policy()
    assert [r.text for r in policy.allow] == ["kubernetes.default.svc:443", "*.svc", "*.svc.cluster.local"]
    assert policy.deny == BUILTIN_DENY


def test_in_a_pod_the_kube_apiserver_is_the_kubelets_address_not_a_name(certs: dict[str, Path]) -> None:
    # a node drain evicts the cluster's DNS with the agent: the kubelet's address needs no lookup
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    s = parse_settings(base_args(certs), environ=pod)
    assert s.kube_apiserver == ("10.96.0.1", 443)
    assert s.policy().allow[0].text == "10.96.0.1:443"
    ipv6 = {"KUBERNETES_SERVICE_HOST": "fd00:10:96::1", "KUBERNETES_SERVICE_PORT": "6443"}
    assert parse_settings(base_args(certs), environ=ipv6).kube_apiserver == ("fd00:10:96::1", 6443)
    # the flag wins over the environment
    given = parse_settings([*base_args(certs), "--kube-apiserver=api.internal:6443"], environ=pod)
    assert given.kube_apiserver == ("api.internal", 6443)


def test_a_bad_kubelet_address_is_named(certs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    bad = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "https"}
    with pytest.raises(SystemExit) as exited:
        parse_settings(base_args(certs), environ=bad)
    assert exited.value.code == 2
    assert "KUBERNETES_SERVICE_PORT='https'" in capsys.readouterr().err


def test_every_flag(certs: dict[str, Path]) -> None:
    s = parse_settings(
        [
            *base_args(certs),
            "--server-name=proxy.hub",
            "--agent-id=pod-7",
            "--kube-apiserver=[fd00::1]:6443",
            "--dial-timeout=1500ms",
            "--allow=10.0.0.0/8",
            "--allow=*.svc:443",
            "--deny=10.9.0.0/16",
            "--no-default-deny",
            "--admin-listen=127.0.0.1:0",
            "--connect-timeout=3s",
            "--backoff-initial=100ms",
            "--backoff-max=2s",
            "--keepalive-interval=5s",
            "--keepalive-timeout=7s",
            "--drain-timeout=0",
            "--log-level=debug",
            "--log-format=json",
        ],
        environ={},
    )
    assert s.server_name == "proxy.hub"
    assert s.agent_id == "pod-7"
    assert s.kube_apiserver == ("fd00::1", 6443)
    assert s.dial_timeout == 1.5
    assert [r.text for r in s.allow] == ["10.0.0.0/8", "*.svc:443"]
    assert [r.text for r in s.policy().deny] == ["10.9.0.0/16"]
    assert s.admin_listen == ("127.0.0.1", 0)
    assert (s.connect_timeout, s.backoff_initial, s.backoff_max) == (3.0, 0.1, 2.0)
    assert (s.keepalive_interval, s.keepalive_timeout, s.drain_timeout) == (5.0, 7.0, 0.0)
    assert (s.log_level, s.log_format) == ("debug", "json")


def test_environment_twins(certs: dict[str, Path]) -> None:
    environ = {
        "CLUSTER_PROXY_AGENT_SERVER": "10.0.0.1:443",
        "CLUSTER_PROXY_AGENT_CLUSTER": "prod-eu",
        "CLUSTER_PROXY_AGENT_AGENT_ID": "a1",
        "CLUSTER_PROXY_AGENT_CA": str(certs["ca"]),
        "CLUSTER_PROXY_AGENT_CERT": str(certs["cert"]),
        "CLUSTER_PROXY_AGENT_KEY": str(certs["key"]),
        "CLUSTER_PROXY_AGENT_ALLOW": "10.0.0.0/8, *.svc:443",
        "CLUSTER_PROXY_AGENT_DEFAULT_DENY": "false",
        "CLUSTER_PROXY_AGENT_DIAL_TIMEOUT": "2s",
    }
    s = parse_settings([], environ=environ)
    assert s.server == ("10.0.0.1", 443)
    assert s.cluster == "prod-eu"
    assert s.agent_id == "a1"
    assert [r.text for r in s.allow] == ["10.0.0.0/8", "*.svc:443"]
    assert s.default_deny is False
    assert s.dial_timeout == 2.0
    # the command line wins over the environment
    assert parse_settings(["--dial-timeout", "3s"], environ=environ).dial_timeout == 3.0


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--dial-timeout", "banana"], ["--dial-timeout", "'banana'"]),
        (["--dial-timeout", "0s"], ["--dial-timeout", "'0s'"]),
        (["--dial-timeout=-1s"], ["--dial-timeout", "'-1s'"]),
        (["--server", "hub.example.com"], ["--server", "'hub.example.com'"]),
        (["--server", "hub:0"], ["--server", "'hub:0'"]),
        (["--server", "hub:http"], ["--server", "'hub:http'"]),
        (["--cluster", "Bad_Name"], ["--cluster", "'Bad_Name'"]),
        (["--cluster=-leading"], ["--cluster", "'-leading'"]),
        (["--agent-id", "a b"], ["--agent-id", "'a b'"]),
        (["--kube-apiserver", "::1:443"], ["--kube-apiserver", "'::1:443'"]),
        (["--allow", "10.0.0.0/33"], ["--allow", "'10.0.0.0/33'"]),
        (["--deny", "*.svc:99999"], ["--deny", "'*.svc:99999'"]),
        (["--admin-listen", "nowhere"], ["--admin-listen", "'nowhere'"]),
        (["--backoff-initial", "soon"], ["--backoff-initial", "'soon'"]),
        (["--keepalive-timeout", "0"], ["--keepalive-timeout", "'0'"]),
        (["--drain-timeout", "forever"], ["--drain-timeout", "'forever'"]),
        (["--log-level", "loud"], ["--log-level", "'loud'"]),
        (["--log-format", "xml"], ["--log-format", "'xml'"]),
        (["--ca", "/no/such/ca.pem"], ["--ca", "/no/such/ca.pem"]),
        (
            ["--backoff-initial", "5s", "--backoff-max", "1s"],
            ["--backoff-max", "1s", "--backoff-initial", "5s"],
        ),
    ],
)
def test_bad_values_exit_2_naming_flag_and_value(
    certs: dict[str, Path], capsys: pytest.CaptureFixture[str], args: list[str], named: list[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_settings([*base_args(certs), *args], environ={})
    assert info.value.code == 2
    err = capsys.readouterr().err
    for text in named:
        assert text in err, err


def test_bad_environment_value_names_the_variable(
    certs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_settings(base_args(certs), environ={"CLUSTER_PROXY_AGENT_ALLOW": "*.svc,10.0.0.1/8"})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "CLUSTER_PROXY_AGENT_ALLOW" in err
    assert "'10.0.0.1/8'" in err
    assert "did you mean 10.0.0.0/8" in err


def test_required_settings_are_listed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_settings([], environ={})
    assert info.value.code == 2
    err = capsys.readouterr().err
    for flag in ("--server", "--cluster", "--ca", "--cert", "--key"):
        assert flag in err
    assert "CLUSTER_PROXY_AGENT_SERVER" in err


def test_key_that_does_not_match_the_certificate(
    certs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = base_args(certs)
    args[args.index("--key") + 1] = str(certs["other_key"])
    with pytest.raises(SystemExit) as info:
        parse_settings(args, environ={})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert str(certs["other_key"]) in err
    assert "does not match" in err
