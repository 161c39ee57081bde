"""Pure helpers of ``cluster-proxy local up``: local.json shape, port plan, child command lines, curl."""

from __future__ import annotations

import base64
import json
import shlex
from pathlib import Path

import pytest
from cryptography import x509

from clusterproxy_cli.local_pki import issue_certificates
from clusterproxy_cli.local_plan import (
    SignerPlan,
    busy_ports,
    echo_argv,
    free_ports,
    local_agent_argv,
    local_server_argv,
    local_signer_argv,
    plan_ports,
    signer_certificates,
    signer_parties,
)
from clusterproxy_cli.state import (
    ProxySettings,
    Target,
    build_local_json,
    curl_commands,
    curl_kube_apiserver,
    proxy_settings,
    read_local_json,
    write_local_json,
)
from clusterproxy_protocol.config import ConfigError
from clusterproxy_protocol.pki import agent_identity_from_cert


def _proxy(tmp_path: Path) -> ProxySettings:
    return ProxySettings(
        "127.0.0.1",
        40000,
        tmp_path / "ca.crt",
        tmp_path / "a.crt",
        tmp_path / "a.key",
        "http://127.0.0.1:40002",
    )


def test_local_json_shape_round_trips(tmp_path: Path) -> None:
    echo1, echo2 = Target("echo", "127.0.0.1", 40010), Target("echo", "127.0.0.1", 40011)
    doc = build_local_json(
        _proxy(tmp_path),
        {
            "cluster1": {"targets": [echo1], "agent_id": "cluster1-agent-1", "kube_apiserver": echo1},
            "cluster2": {"targets": [echo2]},
        },
        {"proxy-server": 11, "cluster1-agent": 12},
        tmp_path,
    )
    path = write_local_json(tmp_path / "state", doc)
    assert path == tmp_path / "state" / "local.json"
    loaded = read_local_json(tmp_path / "state")
    assert loaded == json.loads(json.dumps(doc))
    assert loaded["proxy"] == {
        "client_url": "https://127.0.0.1:40000",
        "admin_url": "http://127.0.0.1:40002",
        "api_url": "https://127.0.0.1:40002",  # the same port over mutual TLS: agents, clusters
        "ca": str((tmp_path / "ca.crt").resolve()),
        "cert": str((tmp_path / "a.crt").resolve()),
        "key": str((tmp_path / "a.key").resolve()),
    }
    assert all(Path(loaded["proxy"][k]).is_absolute() for k in ("ca", "cert", "key"))
    assert loaded["clusters"]["cluster1"] == {
        "targets": [{"name": "echo", "address": "127.0.0.1:40010"}],
        "agent_id": "cluster1-agent-1",
        "kube_apiserver": "127.0.0.1:40010",
    }
    assert loaded["clusters"]["cluster2"] == {"targets": [{"name": "echo", "address": "127.0.0.1:40011"}]}
    assert loaded["pids"] == {"proxy-server": 11, "cluster1-agent": 12}
    settings = proxy_settings(loaded)
    assert (settings.host, settings.port) == ("127.0.0.1", 40000)
    assert settings.admin_url == "http://127.0.0.1:40002"


def test_ipv6_addresses_are_bracketed(tmp_path: Path) -> None:
    proxy = ProxySettings("::1", 8090, tmp_path / "ca", tmp_path / "c", tmp_path / "k")
    assert proxy.client_url == "https://[::1]:8090"
    assert Target("echo", "fd00::2", 80).address == "[fd00::2]:80"
    doc = build_local_json(proxy, {}, {}, tmp_path)
    assert (proxy_settings(doc).host, proxy_settings(doc).port) == ("::1", 8090)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("not json", "cannot read"),
        ("[]", "missing object 'proxy'"),
        ('{"proxy": {"client_url": "https://h:1", "ca": "c", "cert": "c"}}', "proxy.key"),
        (
            '{"proxy": {"client_url": "https://h:1", "ca": "c", "cert": "c", "key": "k"}, "clusters": []}',
            "clusters",
        ),
    ],
)
def test_read_local_json_rejects_bad_files(tmp_path: Path, content: str, needle: str) -> None:
    (tmp_path / "local.json").write_text(content)
    with pytest.raises(ConfigError, match=needle):
        read_local_json(tmp_path)


def test_proxy_settings_rejects_non_https(tmp_path: Path) -> None:
    doc = {"proxy": {"client_url": "http://h:1", "ca": "c", "cert": "c", "key": "k"}}
    with pytest.raises(ConfigError, match="https://HOST:PORT"):
        proxy_settings(doc)


def test_curl_commands_name_the_cluster_both_ways(tmp_path: Path) -> None:
    proxy = _proxy(tmp_path)
    commands = curl_commands(proxy, "cluster1", Target("echo", "127.0.0.1", 40010))
    by_user = shlex.split(commands["proxy-user"])
    assert by_user[0] == "curl"
    assert "--proxytunnel" in by_user  # CONNECT even for an http:// target
    assert by_user[by_user.index("--proxy") + 1] == "https://cluster1@127.0.0.1:40000"
    assert by_user[by_user.index("--proxy-cacert") + 1] == str(proxy.ca)
    assert by_user[by_user.index("--proxy-cert") + 1] == str(proxy.cert)
    assert by_user[by_user.index("--proxy-key") + 1] == str(proxy.key)
    assert by_user[-1] == "http://127.0.0.1:40010/"
    by_header = shlex.split(commands["header"])
    assert by_header[by_header.index("--proxy") + 1] == "https://127.0.0.1:40000"
    assert by_header[by_header.index("--proxy-header") + 1] == "cluster-proxy-cluster: cluster1"
    # What curl sends for the proxy URL's user name is what the server maps to the cluster.
    assert base64.b64decode(base64.b64encode(b"cluster1:")).split(b":")[0] == b"cluster1"
    kube = shlex.split(curl_kube_apiserver(proxy, "cluster2"))
    assert kube[-1] == "http://cluster2:443/"
    assert "--proxy-header" not in kube


def test_fixed_port_plan() -> None:
    ports = plan_ports(20000, ["cluster1", "cluster2"])
    assert (ports.client, ports.agent, ports.admin) == (20000, 20001, 20002)
    assert ports.agent_admin == {"cluster1": 20003, "cluster2": 20004}
    assert ports.echo == {"cluster1": 20010, "cluster2": 20011}
    assert ports.signer not in range(20000, 20012)  # a free port outside the plan
    with pytest.raises(ValueError, match="65535"):
        plan_ports(65530, ["cluster1", "cluster2"])


def test_ephemeral_port_plan_gives_distinct_free_ports() -> None:
    ports = plan_ports(0, ["cluster1", "cluster2"])
    values = ports.all()
    assert len(values) == 8 == len(set(values))
    assert all(1024 <= p <= 65535 for p in values)
    assert len(set(free_ports(5))) == 5


def test_certificates_bind_agents_to_their_clusters(tmp_path: Path) -> None:
    certs = issue_certificates(tmp_path / "pki", ["cluster1", "cluster2"])
    for cluster, pair in certs.agents.items():
        cert = x509.load_pem_x509_certificate(pair.cert.read_bytes())
        assert agent_identity_from_cert(cert) == (cluster, f"{cluster}-agent-1")
    server = x509.load_pem_x509_certificate(certs.server.cert.read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    client = x509.load_pem_x509_certificate(certs.client.cert.read_bytes())
    assert client.subject.rfc4514_string() == "CN=local-admin"
    # The CA is kept: a second start reuses it.
    again = issue_certificates(tmp_path / "pki", ["cluster1"])
    assert again.ca.read_bytes() == certs.ca.read_bytes()


def test_child_command_lines(tmp_path: Path) -> None:
    certs = issue_certificates(tmp_path / "pki", ["cluster1", "cluster2"])
    ports = plan_ports(20000, ["cluster1", "cluster2"])
    server = local_server_argv(ports, certs, ["cluster1", "cluster2"])
    assert server[0].endswith("cluster-proxy-server")

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    assert flag(server, "--client-listen") == "127.0.0.1:20000"
    assert flag(server, "--agent-listen") == "127.0.0.1:20001"
    assert flag(server, "--admin-listen") == "127.0.0.1:20002"
    assert flag(server, "--known-clusters") == "cluster1,cluster2"
    agent = local_agent_argv("cluster2", ports, certs)
    assert agent[0].endswith("cluster-proxy-agent")
    assert flag(agent, "--server") == "127.0.0.1:20001"
    assert flag(agent, "--cluster") == "cluster2"
    assert flag(agent, "--agent-id") == "cluster2-agent-1"
    assert flag(agent, "--cert") == str(certs.agents["cluster2"].cert)
    assert flag(agent, "--admin-listen") == "127.0.0.1:20004"
    assert flag(agent, "--kube-apiserver") == "127.0.0.1:20011"
    assert "127.0.0.1:20011" in flag(agent, "--allow")
    echo = echo_argv("cluster1", ports)
    assert echo[1:3] == ["-m", "clusterproxy_cli.echo"]
    assert flag(echo, "--listen") == "127.0.0.1:20010"
    assert flag(echo, "--name") == "cluster1-echo"
    assert "--signer" not in server + agent


def test_child_command_lines_with_the_signer(tmp_path: Path) -> None:
    clusters = ["cluster1", "cluster2"]
    certs = signer_certificates(tmp_path / "pki", clusters)
    ports = plan_ports(20000, clusters)
    plan = SignerPlan(tmp_path / "pki" / "store", "https://127.0.0.1:20100", "2m", "2s", {"cluster1": "t1"})

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    signer = local_signer_argv(plan.store, ports, plan.cert_ttl)
    assert signer[0].endswith("cluster-proxy-cert-signer") and signer[1] == "serve"
    assert flag(signer, "--store") == str(plan.store)
    assert flag(signer, "--listen") == f"127.0.0.1:{ports.signer}"
    assert flag(signer, "--cert-ttl") == "2m" and flag(signer, "--log-format") == "json"
    server = local_server_argv(ports, certs, clusters, plan)
    assert flag(server, "--signer") == plan.url and flag(server, "--trust-refresh") == "2s"
    assert "--bootstrap-token" not in server  # it has a certificate already
    assert [server[i + 1] for i, a in enumerate(server) if a == "--tls-host"] == ["localhost", "127.0.0.1"]
    assert flag(server, "--cert") == str(tmp_path / "pki" / "proxy-server" / "tls.crt")
    agent = local_agent_argv("cluster1", ports, certs, plan)
    assert flag(agent, "--bootstrap-token") == "t1"
    assert flag(agent, "--ca") == str(tmp_path / "pki" / "cluster1-agent" / "ca.crt")


def test_every_party_gets_a_token_bound_to_its_identity(tmp_path: Path) -> None:
    certs = signer_certificates(tmp_path, ["cluster1"])
    bindings = {party.name: party.binding for party in signer_parties(certs, ["cluster1"])}
    assert bindings == {
        "client": ("--client", "local-admin"),
        "proxy-server": ("--server", "proxy-server", "--host", "localhost", "--host", "127.0.0.1"),
        "cluster1": ("--cluster", "cluster1", "--agent-id", "cluster1-agent-1"),
    }


def test_busy_ports_are_found() -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        free = free_ports(1)[0]
        assert busy_ports([taken, free]) == [taken]
