"""CSR policy: key types and sizes, proof of possession, names matched against a binding, and leaves
built from the identity only (compatible with clusterproxy_protocol.pki)."""

from __future__ import annotations

import datetime as dt

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from clusterproxy_castore.models import Binding, Identity
from clusterproxy_certsigner.crypto import issue_leaf
from clusterproxy_certsigner.csr import match_csr, normalize_host, parse_csr
from clusterproxy_certsigner.errors import Forbidden, InvalidCSR
from clusterproxy_protocol import certclient
from clusterproxy_protocol.pki import agent_identity_from_cert, new_ca, peer_identity

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
AGENT = Binding(kind="agent", cluster="cluster1")


def _csr(
    key, names: list[x509.GeneralName], subject: list[x509.NameAttribute] | None = None, algo=None
) -> str:
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name(subject or [x509.NameAttribute(NameOID.COMMON_NAME, "agent-1")])
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(key, algo).public_bytes(serialization.Encoding.PEM).decode()


def _uri(cluster: str, agent: str) -> x509.UniformResourceIdentifier:
    return x509.UniformResourceIdentifier(f"cluster-proxy://cluster/{cluster}/agent/{agent}")


@pytest.mark.parametrize(
    "make_key",
    [
        lambda: ec.generate_private_key(ec.SECP256R1()),
        lambda: ec.generate_private_key(ec.SECP384R1()),
        lambda: rsa.generate_private_key(public_exponent=65537, key_size=3072),
    ],
    ids=["p256", "p384", "rsa3072"],
)
def test_accepted_keys(make_key) -> None:
    csr = parse_csr(_csr(make_key(), [_uri("cluster1", "agent-1")], algo=hashes.SHA256()))
    assert match_csr(csr, AGENT) == Identity(kind="agent", name="agent-1", cluster="cluster1")


@pytest.mark.parametrize(
    ("make_key", "algo", "words"),
    [
        (
            lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
            hashes.SHA256(),
            "2048 bits",
        ),
        (
            lambda: rsa.generate_private_key(public_exponent=65537, key_size=1024),
            hashes.SHA256(),
            "1024 bits",
        ),
        (lambda: ec.generate_private_key(ec.SECP521R1()), hashes.SHA256(), "secp521r1"),
        (lambda: ec.generate_private_key(ec.SECP256K1()), hashes.SHA256(), "secp256k1"),
        (lambda: ed25519.Ed25519PrivateKey.generate(), None, "Ed25519"),
    ],
    ids=["rsa2048", "rsa1024", "p521", "secp256k1", "ed25519"],
)
def test_refused_keys_name_the_problem(make_key, algo, words: str) -> None:
    with pytest.raises(InvalidCSR) as info:
        parse_csr(_csr(make_key(), [_uri("cluster1", "agent-1")], algo=algo))
    assert info.value.error == "unsupported_key"
    assert info.value.status == 400
    assert words in info.value.reason


def test_garbage_and_tampered_csrs() -> None:
    with pytest.raises(InvalidCSR, match="not a PEM certificate signing request"):
        parse_csr("-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n")
    with pytest.raises(InvalidCSR, match="at most"):
        parse_csr("A" * 20_000)
    # a CSR whose public key was swapped: the signature no longer verifies (no proof of possession)
    good = x509.load_pem_x509_csr(certclient.agent_csr(certclient.generate_key(), "cluster1", "a").encode())
    other = certclient.generate_key().public_key()
    der = bytearray(good.public_bytes(serialization.Encoding.DER))
    old_spki = good.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    new_spki = other.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    assert len(old_spki) == len(new_spki)
    start = bytes(der).index(old_spki)
    der[start : start + len(old_spki)] = new_spki
    tampered = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM)
    with pytest.raises(InvalidCSR, match="signature does not verify"):
        parse_csr(tampered)


def test_agent_csr_must_match_the_cluster_and_bound_agent_id() -> None:
    key = certclient.generate_key()
    other = parse_csr(certclient.agent_csr(key, "cluster2", "agent-1"))
    with pytest.raises(Forbidden) as info:
        match_csr(other, AGENT)
    assert info.value.error == "cluster_mismatch"
    assert "'cluster2'" in info.value.reason and "'cluster1'" in info.value.reason
    bound = Binding(kind="agent", cluster="cluster1", agent_id="agent-7")
    with pytest.raises(Forbidden, match="agent id"):
        match_csr(parse_csr(certclient.agent_csr(key, "cluster1", "agent-1")), bound)
    assert match_csr(parse_csr(certclient.agent_csr(key, "cluster1", "agent-7")), bound).name == "agent-7"


def test_agent_csr_shape_is_checked() -> None:
    key = certclient.generate_key()
    extra = _csr(key, [_uri("cluster1", "a"), x509.DNSName("evil.example")], algo=hashes.SHA256())
    with pytest.raises(InvalidCSR, match="exactly one SAN"):
        match_csr(parse_csr(extra), AGENT)
    bad_uri = _csr(
        key, [x509.UniformResourceIdentifier("cluster-proxy://cluster/c1/agent/a/../b")], algo=hashes.SHA256()
    )
    with pytest.raises(InvalidCSR, match="is not cluster-proxy://"):
        match_csr(parse_csr(bad_uri), AGENT)
    wrong_cn = _csr(
        key, [_uri("cluster1", "agent-1")], [x509.NameAttribute(NameOID.COMMON_NAME, "root")], hashes.SHA256()
    )
    with pytest.raises(Forbidden, match="CN 'root'"):
        match_csr(parse_csr(wrong_cn), AGENT)


def test_server_hosts_must_be_a_subset_of_the_binding() -> None:
    binding = Binding(kind="server", name="proxy-server", hosts=("localhost", "127.0.0.1", "proxy.hub"))
    key = certclient.generate_key()
    ok = match_csr(parse_csr(certclient.server_csr(key, "proxy-server", ["LOCALHOST", "127.0.0.1"])), binding)
    assert ok == Identity(kind="server", name="proxy-server", hosts=("localhost", "127.0.0.1"))
    with pytest.raises(Forbidden) as info:
        match_csr(
            parse_csr(certclient.server_csr(key, "proxy-server", ["localhost", "evil.example"])), binding
        )
    assert info.value.error == "host_mismatch" and "'evil.example'" in info.value.reason
    with pytest.raises(Forbidden, match="CN"):
        match_csr(parse_csr(certclient.server_csr(key, "other", ["localhost"])), binding)
    with pytest.raises(InvalidCSR, match="at least one"):
        match_csr(parse_csr(certclient.server_csr(key, "proxy-server", [])), binding)


def test_client_name_and_organization() -> None:
    binding = Binding(kind="client", name="alice", organization="ops")
    key = certclient.generate_key()
    ident = match_csr(parse_csr(certclient.client_csr(key, "alice")), binding)
    assert ident == Identity(kind="client", name="alice", organization="ops")
    with pytest.raises(Forbidden, match="'bob'"):
        match_csr(parse_csr(certclient.client_csr(key, "bob")), binding)
    with pytest.raises(Forbidden, match="O='admins'"):
        match_csr(parse_csr(certclient.client_csr(key, "alice", "admins")), binding)


def test_normalize_host() -> None:
    assert normalize_host("[::1]") == "::1"
    assert normalize_host("Proxy.Example.") == "proxy.example"
    for bad in ("*.example.com", "a b", "", "x" * 300):
        with pytest.raises(ValueError):
            normalize_host(bad)


def test_leaf_is_built_from_the_identity_not_the_csr() -> None:
    ca_cert, ca_key = new_ca("test-ca", now=NOW, days=365)
    key = certclient.generate_key()
    # a CSR that asks for CA:TRUE and extra usages: none of it may reach the certificate
    greedy = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agent-1")]))
        .add_extension(x509.SubjectAlternativeName([_uri("cluster1", "agent-1")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    csr = parse_csr(greedy.public_bytes(serialization.Encoding.PEM))
    identity = match_csr(csr, AGENT)
    cert = issue_leaf(ca_cert, ca_key, csr.public_key(), identity, now=NOW, ttl=dt.timedelta(hours=1))
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert agent_identity_from_cert(cert) == ("cluster1", "agent-1")
    ident = peer_identity(cert.public_bytes(serialization.Encoding.DER))
    assert ident["organizations"] == ["cluster-proxy-agents"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == dt.timedelta(hours=1, minutes=5)
    ca_key.public_key().verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))


def test_server_leaf_has_both_ekus_and_never_outlives_the_ca() -> None:
    ca_cert, ca_key = new_ca("test-ca", now=NOW, days=1)
    identity = Identity(kind="server", name="proxy-server", hosts=("localhost", "10.0.0.1"))
    cert = issue_leaf(
        ca_cert, ca_key, certclient.generate_key().public_key(), identity, now=NOW, ttl=dt.timedelta(days=30)
    )
    eku = list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert eku == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    assert cert.not_valid_after_utc == ca_cert.not_valid_after_utc
    identity_seen = peer_identity(cert.public_bytes(serialization.Encoding.DER))
    assert identity_seen["sans"] == ["DNS:localhost", "IP:10.0.0.1", "URI:cluster-proxy://hub/server"]
    assert identity_seen["role"] == "server"
