"""The cluster-gateway's pure parts, without API servers: who the aggregator names, kubectl's table
negotiation, and ``cluster-proxy kubeconfig``'s document (the real flows: test_gateway.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from clusterproxy_cli.kubeconfig import gateway_kubeconfig
from clusterproxy_gateway import objects
from clusterproxy_gateway.http import IncomingRequest
from clusterproxy_gateway.inventory import ClusterEntry, RequestHeaderConfig
from clusterproxy_gateway.server import GatewayServer, Identity
from clusterproxy_protocol.config import ConfigError
from tests.support.procs import BIN

CONFIG = RequestHeaderConfig(client_ca_pem=b"", allowed_names=("front-proxy-client",))


def _server() -> GatewayServer:
    return GatewayServer(inventory=None, proxy=None, requestheader=CONFIG)  # type: ignore[arg-type]


def _request(*headers: tuple[str, str]) -> IncomingRequest:
    return IncomingRequest("GET", "/", [(k.encode(), v.encode()) for k, v in headers])


def test_the_aggregator_names_the_user_groups_and_extra() -> None:
    identity = _server().authenticate(
        _request(
            ("X-Remote-User", "alice"),
            ("X-Remote-Group", "dev"),
            ("X-Remote-Group", "system:authenticated"),
            ("X-Remote-Extra-Scopes", "a"),
            ("X-Remote-Extra-Scopes", "b"),
        ),
        "front-proxy-client",
    )
    assert identity == Identity("alice", ("dev", "system:authenticated"), {"scopes": ("a", "b")})


@pytest.mark.parametrize(
    ("peer", "headers", "words"),
    [
        (None, [("X-Remote-User", "mallory")], "no client certificate"),
        ("someone-else", [("X-Remote-User", "mallory")], "not one of the requestheader allowed names"),
        ("front-proxy-client", [], "named no user"),
    ],
)
def test_anyone_but_the_aggregator_is_refused_in_words(
    peer: str | None, headers: list[tuple[str, str]], words: str
) -> None:
    refused = _server().authenticate(_request(*headers), peer)
    assert isinstance(refused, str) and words in refused


def test_kubectl_get_asks_for_a_table() -> None:
    accept = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json"
    assert objects.wants_table(accept)
    assert not objects.wants_table("application/json")
    entry = ClusterEntry("cluster1", "uid", "2026-01-01T00:00:00Z", 7, True, "")
    table = objects.table([entry], 7)
    assert [c["name"] for c in table["columnDefinitions"]] == [
        "Name",
        "Provider",
        "Credential-Type",
        "Endpoint-Type",
    ]
    assert table["rows"][0]["cells"] == ["cluster1", "cluster-proxy", "ServiceAccountToken", "ClusterProxy"]


def _hub(**cluster: Any) -> dict[str, Any]:
    return {
        "clusters": [{"name": "hub", "cluster": {"server": "https://10.0.0.1:6443/", **cluster}}],
        "users": [
            {"name": "admin", "user": {"client-certificate": "pki/admin.crt", "client-key": "/abs/admin.key"}}
        ],
        "contexts": [{"name": "hub", "context": {"cluster": "hub", "user": "admin", "namespace": "team"}}],
        "current-context": "hub",
    }


def test_the_kubeconfig_points_at_the_proxy_subresource_with_absolute_files(tmp_path: Path) -> None:
    document = gateway_kubeconfig(
        _hub(**{"certificate-authority": "ca.crt"}),
        "cluster1",
        context=None,
        path=tmp_path / "hub.kubeconfig",
    )
    cluster = document["clusters"][0]["cluster"]
    assert (
        cluster["server"]
        == "https://10.0.0.1:6443/apis/cluster.core.oam.dev/v1alpha1/clustergateways/cluster1/proxy"
    )
    assert cluster["certificate-authority"] == str(tmp_path.resolve() / "ca.crt")
    user = document["users"][0]["user"]
    assert user == {
        "client-certificate": str(tmp_path.resolve() / "pki/admin.crt"),
        "client-key": "/abs/admin.key",
    }
    assert document["contexts"][0]["context"]["namespace"] == "team"
    assert document["current-context"] == "cluster1"


@pytest.mark.parametrize(
    ("hub", "cluster", "context", "words"),
    [
        (_hub(), "cluster1", "nope", "no context named 'nope'"),
        (_hub(server="http://10.0.0.1:8080"), "cluster1", None, "HTTPS address"),
        (
            _hub(server="https://h/apis/cluster.core.oam.dev/v1alpha1/clustergateways/c/proxy"),
            "c2",
            None,
            "already points",
        ),
    ],
)
def test_kubeconfig_errors_say_what_to_do(
    tmp_path: Path, hub: dict[str, Any], cluster: str, context: str | None, words: str
) -> None:
    with pytest.raises(ConfigError, match=words):
        gateway_kubeconfig(hub, cluster, context=context, path=tmp_path / "hub.kubeconfig")


def test_the_cli_writes_the_file_private_and_refuses_a_bad_name(tmp_path: Path) -> None:
    hub = tmp_path / "hub.kubeconfig"
    hub.write_text(yaml.safe_dump(_hub()))
    out = tmp_path / "c1.kubeconfig"
    done = subprocess.run(
        [str(BIN / "cluster-proxy"), "kubeconfig", "c1", f"--kubeconfig={hub}", f"--output={out}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert out.stat().st_mode & 0o777 == 0o600
    assert yaml.safe_load(out.read_text())["clusters"][0]["name"] == "c1"
    bad = subprocess.run(
        [str(BIN / "cluster-proxy"), "kubeconfig", "Not_A_Name", f"--kubeconfig={hub}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 1 and "invalid cluster name" in bad.stderr
