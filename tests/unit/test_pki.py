"""The development CA: files, permissions, certificate contents, identities."""

from __future__ import annotations

import datetime as dt
import ipaddress
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store

from clusterproxy_protocol.config import ConfigError
from clusterproxy_protocol.pki import (
    AGENT_ORGANIZATION,
    DevCA,
    PemPair,
    agent_identity_from_cert,
    peer_identity,
)


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def eku(cert: x509.Certificate) -> list[x509.ObjectIdentifier]:
    return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_create_writes_ca_files_with_private_key_0600(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path / "ca")
    assert ca.ca_path == tmp_path / "ca" / "ca.crt"
    assert mode(tmp_path / "ca" / "ca.key") == 0o600
    cert = load(ca.ca_path)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "cluster-proxy-dev-ca"
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"
    assert cert.signature_hash_algorithm.name == "sha256"
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=3649) < lifetime < dt.timedelta(days=3651)
    key = serialization.load_pem_private_key((tmp_path / "ca" / "ca.key").read_bytes(), None)
    assert key.public_key() == cert.public_key()
    # no temporary files left behind
    assert sorted(p.name for p in (tmp_path / "ca").iterdir() if not p.name.startswith(".ca.lock")) == [
        "ca.crt",
        "ca.key",
    ]


def test_second_call_loads_the_same_ca(tmp_path: Path) -> None:
    first = DevCA.create_or_load(tmp_path)
    before = first.ca_path.read_bytes()
    second = DevCA.create_or_load(tmp_path)
    assert second.ca_path.read_bytes() == before
    assert second.cert.serial_number == first.cert.serial_number
    # and the loaded CA can still sign verifiable leaves
    pair = second.issue_client("alice", tmp_path / "out")
    load(pair.cert).verify_directly_issued_by(first.cert)


def test_concurrent_create_yields_one_ca(tmp_path: Path) -> None:
    serials: list[int] = []

    def worker() -> None:
        serials.append(DevCA.create_or_load(tmp_path).cert.serial_number)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(serials) == 8
    assert len(set(serials)) == 1


def test_incomplete_ca_directory_is_a_config_error(tmp_path: Path) -> None:
    DevCA.create_or_load(tmp_path)
    (tmp_path / "ca.key").unlink()
    with pytest.raises(ConfigError, match=r"ca\.key"):
        DevCA.create_or_load(tmp_path)


def test_mismatched_ca_key_is_a_config_error(tmp_path: Path) -> None:
    DevCA.create_or_load(tmp_path / "a")
    DevCA.create_or_load(tmp_path / "b")
    (tmp_path / "a" / "ca.key").write_bytes((tmp_path / "b" / "ca.key").read_bytes())
    with pytest.raises(ConfigError, match="does not match"):
        DevCA.create_or_load(tmp_path / "a")


def test_server_certificate_sans_eku_and_chain(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path / "ca")
    pair = ca.issue_server("proxy-server", ["localhost", "127.0.0.1", "[::1]", "Hub.Example.com"], tmp_path)
    assert pair == PemPair(cert=tmp_path / "proxy-server.crt", key=tmp_path / "proxy-server.key")
    assert mode(pair.key) == 0o600
    cert = load(pair.cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "hub.example.com"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    assert eku(cert) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=364) < lifetime < dt.timedelta(days=366)
    # a real path validation, as a TLS client would do it
    verifier = PolicyBuilder().store(Store([ca.cert])).build_server_verifier(x509.DNSName("localhost"))
    chain = verifier.verify(cert, [])
    assert chain[-1] == ca.cert
    key = serialization.load_pem_private_key(pair.key.read_bytes(), None)
    assert key.public_key() == cert.public_key()


def test_server_certificate_needs_hosts_and_rejects_garbage(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path)
    with pytest.raises(ValueError, match="at least one host"):
        ca.issue_server("s", [], tmp_path)
    with pytest.raises(ValueError, match="invalid host"):
        ca.issue_server("s", ["http://x/"], tmp_path)


def test_days_sets_the_lifetime(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path)
    cert = load(ca.issue_client("bob", tmp_path, days=2).cert)
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=2) <= lifetime <= dt.timedelta(days=2, minutes=6)


def test_client_certificate(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path / "ca")
    pair = ca.issue_client("alice", tmp_path, organization="operators")
    assert pair.cert == tmp_path / "alice.crt"
    cert = load(pair.cert)
    assert cert.subject.rfc4514_string() == "O=operators,CN=alice"
    assert eku(cert) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    cert.verify_directly_issued_by(ca.cert)
    ident = peer_identity(cert.public_bytes(serialization.Encoding.DER))
    assert ident["common_name"] == "alice"
    assert ident["organizations"] == ["operators"]
    assert ident["sans"] == ["URI:cluster-proxy://hub/client"]
    assert ident["role"] == "client"
    assert ident["agent"] is None
    assert agent_identity_from_cert(cert) is None


def test_agent_certificate_binds_cluster_and_id(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path / "ca")
    pair = ca.issue_agent("cluster1", "agent-7f9c", tmp_path)
    cert = load(pair.cert)
    assert agent_identity_from_cert(cert) == ("cluster1", "agent-7f9c")
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "agent-7f9c"
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == AGENT_ORGANIZATION
    assert eku(cert) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    cert.verify_directly_issued_by(ca.cert)
    ident = peer_identity(cert.public_bytes(serialization.Encoding.DER))
    assert ident["sans"] == ["URI:cluster-proxy://cluster/cluster1/agent/agent-7f9c"]
    assert ident["agent"] == {"cluster": "cluster1", "agent_id": "agent-7f9c"}
    assert ident["role"] == "agent"
    assert ident["subject"] == f"O={AGENT_ORGANIZATION},CN=agent-7f9c"


def test_two_agents_in_one_directory_do_not_collide(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path / "ca")
    a = ca.issue_agent("cluster1", "a", tmp_path)
    b = ca.issue_agent("cluster2", "a", tmp_path)
    assert a.cert != b.cert
    assert agent_identity_from_cert(load(a.cert)) == ("cluster1", "a")
    assert agent_identity_from_cert(load(b.cert)) == ("cluster2", "a")


@pytest.mark.parametrize(("cluster", "agent_id"), [("a/b", "x"), ("c", "x/../y"), ("", "x"), ("c", "")])
def test_agent_names_that_would_break_the_uri_are_refused(
    tmp_path: Path, cluster: str, agent_id: str
) -> None:
    ca = DevCA.create_or_load(tmp_path)
    with pytest.raises(ValueError, match="invalid"):
        ca.issue_agent(cluster, agent_id, tmp_path)


def test_server_certificate_is_not_an_agent(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path)
    cert = load(ca.issue_server("srv", ["localhost"], tmp_path).cert)
    assert agent_identity_from_cert(cert) is None
    ident = peer_identity(cert.public_bytes(serialization.Encoding.DER))
    assert ident["sans"] == ["DNS:localhost", "URI:cluster-proxy://hub/server"]
    assert ident["role"] == "server"


def test_reissue_replaces_files_atomically(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path / "ca")
    first = ca.issue_client("alice", tmp_path)
    serial1 = load(first.cert).serial_number
    second = ca.issue_client("alice", tmp_path)
    assert second == first
    assert load(second.cert).serial_number != serial1
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
