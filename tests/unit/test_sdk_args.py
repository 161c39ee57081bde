"""SDK argument handling: authorities, cluster names, proxy addresses, TLS files."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from clusterproxy_protocol.config import ConfigError
from clusterproxy_protocol.pki import DevCA
from clusterproxy_sdk import TLSFiles, check_cluster, format_authority, parse_address


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [
        ("example.svc", 80, "example.svc:80"),
        ("10.0.0.1", 443, "10.0.0.1:443"),
        ("::1", 8080, "[::1]:8080"),
        ("[fd00::5]", 22, "[fd00::5]:22"),
        ("fe80::1%eth0", 1, "[fe80::1%eth0]:1"),
        ("kubernetes.default.svc.cluster.local", 65535, "kubernetes.default.svc.cluster.local:65535"),
    ],
)
def test_format_authority(host: str, port: int, expected: str) -> None:
    assert format_authority(host, port) == expected


@pytest.mark.parametrize(
    ("host", "port", "needle"),
    [
        ("svc", 0, "invalid port 0"),
        ("svc", 65536, "invalid port 65536"),
        ("svc", "80", "invalid port '80'"),
        ("svc", True, "invalid port True"),
        ("", 80, "invalid host ''"),
        ("a b", 80, "invalid host 'a b'"),
        ("a/b", 80, "invalid host 'a/b'"),
        ("user@host", 80, "invalid host 'user@host'"),
        ("1:2:3:zz::", 80, "invalid host '1:2:3:zz::'"),
    ],
)
def test_format_authority_rejects(host: object, port: object, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        format_authority(host, port)  # type: ignore[arg-type]
    assert needle in str(info.value)


@pytest.mark.parametrize("name", ["cluster1", "a", "prod.eu-west-1", "x" * 253])
def test_check_cluster_accepts_dns_names(name: str) -> None:
    assert check_cluster(name) == name


@pytest.mark.parametrize("name", ["", "Cluster1", "under_score", "-lead", "trail-", "x" * 254, "a b", "a:b"])
def test_check_cluster_rejects(name: str) -> None:
    with pytest.raises(ValueError, match="invalid cluster name"):
        check_cluster(name)


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:8090", ("127.0.0.1", 8090)),
        ("https://hub.example.com:443", ("hub.example.com", 443)),
        ("https://cluster1@127.0.0.1:8090/", ("127.0.0.1", 8090)),
        ("[::1]:8090", ("::1", 8090)),
        (("::1", 8090), ("::1", 8090)),
        (("[::1]", 8090), ("::1", 8090)),
    ],
)
def test_parse_address(address: str | tuple[str, int], expected: tuple[str, int]) -> None:
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["hub", "hub:", "hub:0", "hub:99999", "::1:8090", ("hub", 0)])
def test_parse_address_rejects(address: str | tuple[str, int]) -> None:
    with pytest.raises(ValueError):
        parse_address(address)


def test_tls_files_context_offers_h2_and_requires_verification(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path)
    client = ca.issue_client("someone", tmp_path)
    context = TLSFiles(ca.ca_path, client.cert, client.key).context()
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname
    assert context.minimum_version == ssl.TLSVersion.TLSv1_3


def test_tls_files_names_the_missing_file(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path)
    missing = tmp_path / "nope.crt"
    with pytest.raises(ConfigError, match=r"nope\.crt"):
        TLSFiles(ca.ca_path, missing, tmp_path / "nope.key").context()
