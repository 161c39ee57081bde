"""Certificate roles: every certificate carries exactly one (server, agent, client) as a role URI SAN
its EKU agrees with; the signer issues each kind with its role and a renewal keeps it; a CSR cannot
ask for another role; the agent refuses a hub without the server role."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from clusterproxy_agent.tunnel import HandshakeError, check_server_role
from clusterproxy_castore.filestore import FileStore
from clusterproxy_castore.models import Binding
from clusterproxy_castore.rotation import ensure_ca
from clusterproxy_castore.tokens import create_token
from clusterproxy_certsigner.core import SignerCore
from clusterproxy_certsigner.errors import Forbidden
from clusterproxy_protocol import certclient
from clusterproxy_protocol.pki import (
    CLIENT_ROLE_URI,
    SERVER_ROLE_URI,
    CertRole,
    DevCA,
    PemPair,
    agent_uri,
    certificate_role,
)
from clusterproxy_server.handshake import role_refusal

SERVER_AUTH = ExtendedKeyUsageOID.SERVER_AUTH
CLIENT_AUTH = ExtendedKeyUsageOID.CLIENT_AUTH


def load(pair: PemPair) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pair.cert.read_bytes())


def pem_cert(pem: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem.encode())


def uris(cert: x509.Certificate) -> list[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.UniformResourceIdentifier)


# --- the verifier ----------------------------------------------------------------------------------------


def test_the_development_ca_gives_each_certificate_its_role(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path / "ca")
    server = load(ca.issue_server("proxy-server", ["localhost"], tmp_path))
    agent = load(ca.issue_agent("cluster1", "agent-a", tmp_path))
    client = load(ca.issue_client("alice", tmp_path))
    robot = load(ca.issue_client(None, tmp_path, uris=["spiffe://hub/robots/r2"], stem="robot"))
    assert certificate_role(server).role is CertRole.SERVER
    assert certificate_role(agent).role is CertRole.AGENT
    assert certificate_role(client).role is CertRole.CLIENT
    assert certificate_role(robot).role is CertRole.CLIENT
    assert uris(server) == [SERVER_ROLE_URI]
    assert uris(client) == [CLIENT_ROLE_URI]
    assert uris(agent) == [agent_uri("cluster1", "agent-a")]
    assert uris(robot) == ["spiffe://hub/robots/r2", CLIENT_ROLE_URI]
    with pytest.raises(ValueError, match="added by the CA"):
        ca.issue_client("mallory", tmp_path, uris=[SERVER_ROLE_URI])


ROLELESS = {
    # (SANs, EKUs) -> a piece of the reason
    "no role URI (a client certificate from before roles)": ([], [CLIENT_AUTH], "no cluster-proxy role"),
    "no role URI (a server certificate from before roles)": (
        [x509.DNSName("localhost")],
        [SERVER_AUTH],
        "no cluster-proxy role",
    ),
    "two roles": (
        [
            x509.UniformResourceIdentifier(CLIENT_ROLE_URI),
            x509.UniformResourceIdentifier(agent_uri("cluster1", "a")),
        ],
        [CLIENT_AUTH],
        "names 2 roles",
    ),
    "an unknown role": (
        [x509.UniformResourceIdentifier("cluster-proxy://hub/admin")],
        [CLIENT_AUTH],
        "is not a cluster-proxy role URI",
    ),
    "an unknown role, other case": (
        [x509.UniformResourceIdentifier("CLUSTER-PROXY://hub/client")],
        [CLIENT_AUTH],
        "is not a cluster-proxy role URI",
    ),
    "an agent with serverAuth": (
        [x509.UniformResourceIdentifier(agent_uri("cluster1", "a"))],
        [SERVER_AUTH, CLIENT_AUTH],
        "an agent certificate has clientAuth only",
    ),
    "a client with serverAuth": (
        [x509.UniformResourceIdentifier(CLIENT_ROLE_URI)],
        [CLIENT_AUTH, SERVER_AUTH],
        "extended key usage clientAuth, serverAuth",
    ),
    "a server without serverAuth": (
        [x509.UniformResourceIdentifier(SERVER_ROLE_URI)],
        [CLIENT_AUTH],
        "a server certificate has serverAuth",
    ),
    "a client with code signing too": (
        [x509.UniformResourceIdentifier(CLIENT_ROLE_URI)],
        [CLIENT_AUTH, ExtendedKeyUsageOID.CODE_SIGNING],
        "1.3.6.1.5.5.7.3.3",
    ),
}


@pytest.mark.parametrize("case", list(ROLELESS))
def test_a_certificate_without_exactly_one_consistent_role_has_none(tmp_path: Path, case: str) -> None:
    sans, eku, reason = ROLELESS[case]
    ca = DevCA.create_or_load(tmp_path / "ca")
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "someone")])
    cert = load(ca.issue_custom(subject, sans, eku, tmp_path, "leaf"))
    check = certificate_role(cert)
    assert check.role is None and check.found == "none"
    assert check.problem is not None and reason in check.problem


def test_a_role_uri_without_extended_key_usage_is_no_role(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path / "ca")
    # the DevCA always writes an EKU: take a signer-free route through cryptography
    key = certclient.generate_key()
    ca_key = serialization.load_pem_private_key((tmp_path / "ca" / "ca.key").read_bytes(), None)
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "old")]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(CLIENT_ROLE_URI)]), critical=False
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    check = certificate_role(cert)
    assert check.role is None and "without an extended key usage" in str(check.problem)


def test_the_refusal_names_the_role_found_and_the_port(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path / "ca")
    agent = certificate_role(load(ca.issue_agent("cluster1", "agent-a", tmp_path)))
    legacy = certificate_role(
        load(ca.issue_custom(x509.Name([]), [x509.DNSName("x")], [SERVER_AUTH], tmp_path, "legacy"))
    )
    assert role_refusal(agent, "agent", CertRole.AGENT) is None
    assert role_refusal(agent, "client", CertRole.CLIENT) == (
        "a certificate with role agent is refused on the client port, which accepts client certificates only"
    )
    refusal = role_refusal(legacy, "agent", CertRole.AGENT)
    assert refusal is not None and refusal.startswith("a certificate with no role (the certificate has no")
    assert "on the agent port, which accepts agent certificates only" in refusal


def test_the_agent_accepts_a_server_role_hub_only(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path / "ca")

    def der(pair: PemPair) -> bytes:
        return load(pair).public_bytes(serialization.Encoding.DER)

    check_server_role(der(ca.issue_server("hub", ["localhost"], tmp_path)))
    legacy = ca.issue_custom(x509.Name([]), [x509.DNSName("localhost")], [SERVER_AUTH], tmp_path, "legacy")
    with pytest.raises(HandshakeError, match=r"with no role \(the certificate has no cluster-proxy role"):
        check_server_role(der(legacy))
    disguised = ca.issue_custom(
        x509.Name([]),
        [x509.DNSName("localhost"), x509.UniformResourceIdentifier(CLIENT_ROLE_URI)],
        [SERVER_AUTH],
        tmp_path,
        "disguised",
    )
    with pytest.raises(HandshakeError, match="with no role"):
        check_server_role(der(disguised))
    with pytest.raises(HandshakeError, match="with role agent"):
        check_server_role(der(ca.issue_agent("cluster1", "a", tmp_path)))


# --- the signer ------------------------------------------------------------------------------------------


@pytest.fixture
def core(tmp_path: Path) -> SignerCore:
    store = FileStore(tmp_path / "store")
    ensure_ca(store, now=dt.datetime.now(dt.UTC))
    return SignerCore(store, cert_ttl=dt.timedelta(hours=1))


def _token(core: SignerCore, binding: Binding) -> str:
    return create_token(core.store, binding, dt.timedelta(minutes=10)).token


BINDINGS = {
    CertRole.SERVER: Binding(kind="server", name="proxy-server", hosts=("localhost", "127.0.0.1")),
    CertRole.AGENT: Binding(kind="agent", cluster="cluster1", agent_id="agent-a"),
    CertRole.CLIENT: Binding(kind="client", name="alice", organization="ops"),
}


def _csr(role: CertRole, key: object) -> str:
    if role is CertRole.SERVER:
        return certclient.server_csr(key, "proxy-server", ["localhost", "127.0.0.1"])
    if role is CertRole.AGENT:
        return certclient.agent_csr(key, "cluster1", "agent-a")
    return certclient.client_csr(key, "alice", "ops")


def _bootstrap(core: SignerCore, role: CertRole) -> x509.Certificate:
    result = core.bootstrap(_token(core, BINDINGS[role]), _csr(role, certclient.generate_key()))
    return pem_cert(result.record.cert_pem)


@pytest.mark.parametrize("role", list(CertRole))
def test_the_signer_issues_each_kind_with_its_role_and_renewals_keep_it(
    core: SignerCore, role: CertRole
) -> None:
    cert = _bootstrap(core, role)
    assert certificate_role(cert).role is role
    # three renewals in a row, each with the certificate before it, as a renewer does (csr_like
    # copies the role URI into the CSR: the signer takes it as the same role)
    for _ in range(3):
        renewed = core.renew(cert, certclient.csr_like(cert, certclient.generate_key()))
        new_cert = pem_cert(renewed.record.cert_pem)
        assert new_cert.serial_number != cert.serial_number
        assert certificate_role(new_cert).role is role
        assert renewed.record.identity.kind == role.value
        core.trust_bundle(new_cert, None, (renewed.record.serial,))  # its holder presents it
        cert = new_cert


def _csr_with_role_uri(key: object, subject: x509.Name, sans: list[x509.GeneralName]) -> str:
    builder = x509.CertificateSigningRequestBuilder().subject_name(subject)
    builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode()  # type: ignore[arg-type]


def test_a_renewal_csr_cannot_change_the_role(core: SignerCore) -> None:
    client = _bootstrap(core, CertRole.CLIENT)
    server = _bootstrap(core, CertRole.SERVER)
    agent = _bootstrap(core, CertRole.AGENT)
    key = certclient.generate_key()
    attempts = [
        # a client asking to become the hub's server
        (client, _csr_with_role_uri(key, client.subject, [x509.UniformResourceIdentifier(SERVER_ROLE_URI)])),
        # a client asking to become an agent of cluster1
        (
            client,
            _csr_with_role_uri(
                key, client.subject, [x509.UniformResourceIdentifier(agent_uri("cluster1", "agent-a"))]
            ),
        ),
        # the server asking for the client role beside its names
        (
            server,
            _csr_with_role_uri(
                key,
                server.subject,
                [x509.DNSName("localhost"), x509.UniformResourceIdentifier(CLIENT_ROLE_URI)],
            ),
        ),
        # an agent asking for the client role as well as its own
        (
            agent,
            _csr_with_role_uri(
                key,
                agent.subject,
                [
                    x509.UniformResourceIdentifier(agent_uri("cluster1", "agent-a")),
                    x509.UniformResourceIdentifier(CLIENT_ROLE_URI),
                ],
            ),
        ),
    ]
    for cert, csr in attempts:
        with pytest.raises(Forbidden) as info:
            core.renew(cert, csr)
        assert (info.value.status, info.value.error) == (403, "role_mismatch")
        assert "role is fixed by its token and kept by every renewal" in info.value.reason
    # none of them used up the renewal: each renews into its own role
    for cert, role in ((client, CertRole.CLIENT), (server, CertRole.SERVER), (agent, CertRole.AGENT)):
        renewed = core.renew(cert, certclient.csr_like(cert, certclient.generate_key()))
        assert certificate_role(pem_cert(renewed.record.cert_pem)).role is role


def test_a_bootstrap_csr_cannot_ask_for_another_role_than_its_token(core: SignerCore) -> None:
    token = _token(core, BINDINGS[CertRole.CLIENT])
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "alice")])
    csr = _csr_with_role_uri(
        certclient.generate_key(), subject, [x509.UniformResourceIdentifier(SERVER_ROLE_URI)]
    )
    with pytest.raises(Forbidden) as info:
        core.bootstrap(token, csr)
    assert info.value.error == "role_mismatch" and "asks for the server role" in info.value.reason
    # the token is still good for what it was made for
    issued = core.bootstrap(token, certclient.client_csr(certclient.generate_key(), "alice", "ops"))
    assert certificate_role(pem_cert(issued.record.cert_pem)).role is CertRole.CLIENT


def test_a_certificate_from_before_roles_gets_its_role_at_renewal(core: SignerCore) -> None:
    """The migration path: a leaf the signer issued before roles renews into a role-bearing one."""
    key = certclient.generate_key()
    issued = core.bootstrap(_token(core, BINDINGS[CertRole.SERVER]), _csr(CertRole.SERVER, key)).record
    authorities = core.store.read_authorities()
    assert authorities.active is not None
    ca_key = core.store.load_ca_key(authorities.active.id)
    current = pem_cert(issued.cert_pem)
    # the same leaf as this signer built it before roles: DNS/IP names, no role URI
    old_sans = [n for n in uris_and_hosts(current) if not isinstance(n, x509.UniformResourceIdentifier)]
    legacy = (
        x509.CertificateBuilder()
        .subject_name(current.subject)
        .issuer_name(current.issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(current.not_valid_before_utc)
        .not_valid_after(current.not_valid_after_utc)
        .add_extension(x509.ExtendedKeyUsage([SERVER_AUTH, CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(old_sans), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    core.store.put_issued(
        replace(
            issued,
            serial=format(legacy.serial_number, "x"),
            cert_pem=legacy.public_bytes(serialization.Encoding.PEM).decode(),
        )
    )
    assert certificate_role(legacy).role is None
    renewed = core.renew(legacy, certclient.csr_like(legacy, certclient.generate_key()))
    assert certificate_role(pem_cert(renewed.record.cert_pem)).role is CertRole.SERVER


def uris_and_hosts(cert: x509.Certificate) -> list[x509.GeneralName]:
    return list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
