"""The signing API over real HTTPS on loopback: bootstrap with tokens, refusals with clear errors,
limits (413, 429), renewal over mTLS, and the CA key never leaving the signer."""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
import ssl
from pathlib import Path
from typing import Any

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from clusterproxy_certsigner.testing import RunningSigner, start_signer
from clusterproxy_protocol import certclient, http1client
from clusterproxy_protocol.certclient import CertFiles, SignerRequestError
from clusterproxy_protocol.pki import DevCA, agent_identity_from_cert, peer_identity
from clusterproxy_protocol.tls import client_context


@pytest.fixture
async def signer(nursery: trio.Nursery, tmp_path: Path) -> RunningSigner:
    return await start_signer(nursery, tmp_path / "signer")


def _files(directory: Path, name: str, bundle: Path) -> CertFiles:
    directory.mkdir(parents=True, exist_ok=True)
    ca = directory / f"{name}-ca.crt"
    ca.write_bytes(bundle.read_bytes())
    return CertFiles(cert=directory / f"{name}.crt", key=directory / f"{name}.key", ca=ca)


async def _raw(
    signer: RunningSigner, data: bytes, *, local_address: str | None = None
) -> tuple[int, dict[str, str], Any]:
    """Send ``data`` as is; the status, headers and JSON body of the answer."""
    ctx = client_context(None, None, signer.bundle, alpn=["http/1.1"])
    host, port = signer.address
    tcp = await trio.open_tcp_stream(host, port, local_address=local_address)
    stream = trio.SSLStream(tcp, ctx, server_hostname="localhost")
    async with stream:
        await stream.send_all(data)
        response = await http1client.read_response(stream)
        return response.status, response.headers, json.loads(response.body)


# --- bootstrap -----------------------------------------------------------------------------------------


async def test_agent_bootstraps_with_a_token(signer: RunningSigner, tmp_path: Path) -> None:
    files = _files(tmp_path / "agent", "agent", signer.bundle)
    issued = await certclient.bootstrap_files(
        signer.endpoint(),
        signer.agent_token("cluster1"),
        files,
        lambda k: certclient.agent_csr(k, "cluster1", "agent-1"),
    )
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    assert agent_identity_from_cert(cert) == ("cluster1", "agent-1")
    assert issued.serial == format(cert.serial_number, "x")
    assert oct(files.key.stat().st_mode & 0o777) == "0o600"
    # the certificate chains to the bundle it came with, and works for mTLS at once
    active = signer.store.read_authorities().active
    assert active is not None and cert.issuer == active.cert.subject
    active.cert.public_key().verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))
    bundle = await certclient.fetch_trust_bundle(
        signer.endpoint(files.ca), cert=files.cert, key=files.key, trusted=[active.fingerprint]
    )
    assert bundle.fingerprints == (active.fingerprint,)
    record = signer.store.get_issued(issued.serial)
    assert record is not None and record.trusted == (active.fingerprint,)


async def test_server_and_client_certificates_are_issued_the_same_way(
    signer: RunningSigner, tmp_path: Path
) -> None:
    server = _files(tmp_path / "s", "server", signer.bundle)
    await certclient.bootstrap_files(
        signer.endpoint(),
        signer.server_token("proxy-server", ("localhost", "127.0.0.1")),
        server,
        lambda k: certclient.server_csr(k, "proxy-server", ["localhost", "127.0.0.1"]),
    )
    client = _files(tmp_path / "c", "client", signer.bundle)
    await certclient.bootstrap_files(
        signer.endpoint(),
        signer.client_token("alice", "ops"),
        client,
        lambda k: certclient.client_csr(k, "alice", "ops"),
    )
    s = peer_identity(
        x509.load_pem_x509_certificate(server.cert.read_bytes()).public_bytes(serialization.Encoding.DER)
    )
    c = peer_identity(
        x509.load_pem_x509_certificate(client.cert.read_bytes()).public_bytes(serialization.Encoding.DER)
    )
    assert s["sans"] == ["DNS:localhost", "IP:127.0.0.1", "URI:cluster-proxy://hub/server"]
    assert s["common_name"] == "proxy-server" and s["role"] == "server"
    assert c["common_name"] == "alice" and c["organizations"] == ["ops"] and c["agent"] is None
    assert c["role"] == "client"


async def test_token_reuse_is_refused(signer: RunningSigner) -> None:
    token = signer.agent_token("cluster1")
    await certclient.bootstrap(
        signer.endpoint(), token, certclient.agent_csr(certclient.generate_key(), "cluster1", "a")
    )
    with pytest.raises(SignerRequestError) as info:
        await certclient.bootstrap(
            signer.endpoint(), token, certclient.agent_csr(certclient.generate_key(), "cluster1", "b")
        )
    assert (info.value.status, info.value.error) == (409, "token_used")
    assert "single-use" in info.value.reason


async def test_expired_token_is_refused(signer: RunningSigner) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=11)
    token = signer.agent_token("cluster1", ttl=dt.timedelta(minutes=10), now=past)
    with pytest.raises(SignerRequestError) as info:
        await certclient.bootstrap(
            signer.endpoint(), token, certclient.agent_csr(certclient.generate_key(), "cluster1", "a")
        )
    assert (info.value.status, info.value.error) == (410, "token_expired")
    assert "expired at" in info.value.reason


async def test_token_for_another_cluster_is_refused_and_not_burned(signer: RunningSigner) -> None:
    token = signer.agent_token("cluster1")
    with pytest.raises(SignerRequestError) as info:
        await certclient.bootstrap(
            signer.endpoint(), token, certclient.agent_csr(certclient.generate_key(), "cluster2", "a")
        )
    assert (info.value.status, info.value.error) == (403, "cluster_mismatch")
    assert "'cluster2'" in info.value.reason and "'cluster1'" in info.value.reason
    issued = await certclient.bootstrap(
        signer.endpoint(), token, certclient.agent_csr(certclient.generate_key(), "cluster1", "a")
    )
    assert issued.identity["cluster"] == "cluster1"


@pytest.mark.parametrize(
    ("make_key", "words"),
    [
        (lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048), "RSA key of 2048 bits"),
        (lambda: ec.generate_private_key(ec.SECP521R1()), "EC curve secp521r1"),
    ],
    ids=["rsa-2048-size", "p521-type"],
)
async def test_wrong_key_type_or_size_is_refused(signer: RunningSigner, make_key, words: str) -> None:
    key = make_key()
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "a")]))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier("cluster-proxy://cluster/cluster1/agent/a")]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
        .decode()
    )
    with pytest.raises(SignerRequestError) as info:
        await certclient.bootstrap(signer.endpoint(), signer.agent_token("cluster1"), csr)
    assert (info.value.status, info.value.error) == (400, "unsupported_key")
    assert words in info.value.reason


async def test_bad_requests_get_clear_json_errors(signer: RunningSigner) -> None:
    def post(path: str, body: bytes) -> bytes:
        return (
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode() + body

    status, _, body = await _raw(signer, post("/v1/bootstrap", b"{not json"))
    assert status == 400 and body["error"] == "bad_request" and "not valid JSON" in body["reason"]
    status, _, body = await _raw(signer, post("/v1/bootstrap", b'["a list"]'))
    assert status == 400 and "JSON object" in body["reason"]
    status, _, body = await _raw(signer, post("/v1/bootstrap", b'{"token": "nope", "csr_pem": "x"}'))
    assert status == 401 and body["error"] == "invalid_token"
    status, _, body = await _raw(signer, post("/v1/renew", b'{"csr_pem": "x"}'))
    assert status == 401 and body["error"] == "client_certificate_required"
    status, _, body = await _raw(signer, b"GET /v1/nothing HTTP/1.1\r\nhost: x\r\n\r\n")
    assert status == 404 and body["error"] == "not_found"
    status, headers, body = await _raw(signer, b"GET /v1/bootstrap HTTP/1.1\r\nhost: x\r\n\r\n")
    assert status == 405 and headers["allow"] == "POST"
    status, _, body = await _raw(signer, b"GARBAGE\r\n\r\n")
    assert status == 400 and body["error"] == "bad_request"


async def test_oversized_requests_get_413(signer: RunningSigner) -> None:
    big = {"token": signer.agent_token("cluster1"), "csr_pem": "A" * (100 << 10)}
    with pytest.raises(SignerRequestError) as info:
        await certclient.request_json(signer.endpoint(), "POST", "/v1/bootstrap", big)
    assert (info.value.status, info.value.error) == (413, "request_too_large")
    # without a content-length (chunked), the limit applies while reading
    chunk = b"B" * (16 << 10)
    chunked = (
        b"POST /v1/bootstrap HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 5
    )
    status, _, body = await _raw(signer, chunked)
    assert status == 413 and body["error"] == "request_too_large"


async def test_rate_limit_per_ip_and_per_token(nursery: trio.Nursery, tmp_path: Path) -> None:
    signer = await start_signer(
        nursery, tmp_path / "limited", ip_burst=3, ip_rate=0.01, token_burst=2, token_rate=0.001
    )
    for _ in range(3):
        await certclient.fetch_trust_bundle(signer.endpoint())
    with pytest.raises(SignerRequestError) as info:
        await certclient.fetch_trust_bundle(signer.endpoint())
    assert (info.value.status, info.value.error) == (429, "rate_limited")
    status, headers, body = await _raw(signer, b"GET /v1/trust-bundle HTTP/1.1\r\nhost: x\r\n\r\n")
    assert status == 429 and int(headers["retry-after"]) >= 1 and "127.0.0.1" in body["reason"]
    # another client address has its own bucket...
    status, _, _ = await _raw(
        signer, b"GET /v1/trust-bundle HTTP/1.1\r\nhost: x\r\n\r\n", local_address="127.0.0.2"
    )
    assert status == 200
    # ...and a token has one too: the third attempt with one token is limited whatever the address
    token = signer.agent_token("cluster1")
    wrong = json.dumps({"token": token, "csr_pem": "bad"}).encode()
    request = b"POST /v1/bootstrap HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(wrong), wrong)
    statuses = [(await _raw(signer, request, local_address=f"127.0.1.{i}"))[0] for i in range(3)]
    assert statuses == [400, 400, 429]


async def test_parties_behind_one_address_are_limited_per_certificate(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Many parties share an address (local mode: 127.0.0.1; agents behind one NAT): requests that
    authenticate with a certificate draw on that certificate's bucket, not on the address's, so
    their trust refreshes and renewals cannot starve each other (a proxy-server's certificate once
    expired that way)."""
    signer = await start_signer(
        nursery, tmp_path / "limited", ip_burst=3, ip_rate=0.001, cert_burst=4, cert_rate=0.001
    )
    parties = []
    for name in ("a", "b"):  # two bootstraps: two of the address's three
        files = _files(tmp_path / name, name, signer.bundle)
        await certclient.bootstrap_files(
            signer.endpoint(), signer.client_token(name), files, lambda k, n=name: certclient.client_csr(k, n)
        )
        parties.append(files)
    for files in parties:
        for _ in range(4):
            await certclient.fetch_trust_bundle(
                signer.endpoint(files.ca), cert=files.cert, key=files.key, trusted=[]
            )
    with pytest.raises(SignerRequestError) as info:
        await certclient.fetch_trust_bundle(
            signer.endpoint(parties[0].ca), cert=parties[0].cert, key=parties[0].key, trusted=[]
        )
    assert (info.value.status, info.value.error) == (429, "rate_limited")
    assert "CN=a" in info.value.reason
    # a renewal draws on the certificate's bucket too: b has none left
    b = parties[1]
    cert = x509.load_pem_x509_certificate(b.cert.read_bytes())
    with pytest.raises(SignerRequestError) as info:
        await certclient.renew(
            signer.endpoint(b.ca), b.cert, b.key, certclient.csr_like(cert, certclient.generate_key())
        )
    assert info.value.status == 429
    # requests without a certificate still share the address's bucket: one left
    await certclient.fetch_trust_bundle(signer.endpoint())
    with pytest.raises(SignerRequestError) as info:
        await certclient.fetch_trust_bundle(signer.endpoint())
    assert info.value.status == 429 and "127.0.0.1" in info.value.reason


# --- renewal -------------------------------------------------------------------------------------------


async def test_renewal_over_mtls(signer: RunningSigner, tmp_path: Path) -> None:
    files = _files(tmp_path / "agent", "agent", signer.bundle)
    first = await certclient.bootstrap_files(
        signer.endpoint(),
        signer.agent_token("cluster1"),
        files,
        lambda k: certclient.agent_csr(k, "cluster1", "agent-1"),
    )
    new_key = certclient.generate_key()
    renewed = await certclient.renew(
        signer.endpoint(files.ca), files.cert, files.key, certclient.csr_like(first.cert, new_key)
    )
    assert renewed.serial != first.serial
    assert agent_identity_from_cert(renewed.cert) == ("cluster1", "agent-1")
    assert renewed.cert.public_key() == new_key.public_key()
    record = signer.store.get_issued(first.serial)
    assert record is not None and record.successor == renewed.serial
    # the holder installs the renewed certificate and reports with it (so it did arrive)...
    renewed_files = _files(tmp_path / "agent-renewed", "agent", files.ca)
    certclient.write_credentials(renewed_files, new_key, renewed)
    await certclient.fetch_trust_bundle(
        signer.endpoint(files.ca), cert=renewed_files.cert, key=renewed_files.key, presenting=[renewed.serial]
    )
    # ...and from then on the old certificate cannot renew again
    with pytest.raises(SignerRequestError) as info:
        await certclient.renew(
            signer.endpoint(files.ca),
            files.cert,
            files.key,
            certclient.agent_csr(certclient.generate_key(), "cluster1", "agent-1"),
        )
    assert (info.value.status, info.value.error) == (409, "already_renewed")
    files = renewed_files
    # asking for another cluster with the current certificate is refused
    with pytest.raises(SignerRequestError) as info:
        await certclient.renew(
            signer.endpoint(files.ca),
            files.cert,
            files.key,
            certclient.agent_csr(certclient.generate_key(), "cluster2", "agent-1"),
        )
    assert (info.value.status, info.value.error) == (403, "cluster_mismatch")


async def test_renewal_with_a_foreign_certificate_fails_at_the_handshake(
    signer: RunningSigner, tmp_path: Path
) -> None:
    rogue = DevCA.create_or_load(tmp_path / "rogue-ca").issue_agent("cluster1", "agent-1", tmp_path / "rogue")
    cert = x509.load_pem_x509_certificate(rogue.cert.read_bytes())
    with pytest.raises(SignerRequestError) as info:
        await certclient.renew(
            signer.endpoint(), rogue.cert, rogue.key, certclient.csr_like(cert, certclient.generate_key())
        )
    assert info.value.status == 0 and info.value.error == "unreachable"


# --- the CA key stays inside -----------------------------------------------------------------------------


async def test_no_answer_ever_contains_a_private_key(signer: RunningSigner, tmp_path: Path) -> None:
    files = _files(tmp_path / "agent", "agent", signer.bundle)
    answers: list[str] = []
    issued = await certclient.bootstrap_files(
        signer.endpoint(),
        signer.agent_token("cluster1"),
        files,
        lambda k: certclient.agent_csr(k, "cluster1", "a"),
    )
    answers += [issued.cert_pem, issued.ca_bundle_pem]
    renewed = await certclient.renew(
        signer.endpoint(files.ca),
        files.cert,
        files.key,
        certclient.csr_like(issued.cert, certclient.generate_key()),
    )
    answers += [renewed.cert_pem, renewed.ca_bundle_pem]
    answers.append(
        json.dumps((await certclient.fetch_trust_bundle(signer.endpoint())).cas)
        + (await certclient.fetch_trust_bundle(signer.endpoint())).pem
    )
    for request in (
        b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n",
        b"GET /v1/ca.key HTTP/1.1\r\nhost: x\r\n\r\n",
        b"POST /v1/bootstrap HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}",
    ):
        answers.append(json.dumps(await _raw(signer, request)))
    everything = "\n".join(answers)
    authority = signer.store.read_authorities().active
    assert authority is not None
    key = signer.store.load_ca_key(authority.id)
    key_der = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    assert "PRIVATE KEY" not in everything
    assert base64.b64encode(key_der)[:40].decode() not in everything
    assert format(key.private_numbers().private_value, "x") not in everything
    kinds = set(re.findall(r"-----BEGIN ([A-Z ]+)-----", everything))
    assert kinds == {"CERTIFICATE"}
    # the handshake shows the signer's own leaf only
    ctx = client_context(None, None, signer.bundle, alpn=["http/1.1"])
    tcp = await trio.open_tcp_stream(*signer.address)
    stream = trio.SSLStream(tcp, ctx, server_hostname="localhost")
    async with stream:
        await stream.do_handshake()
        served = x509.load_der_x509_certificate(stream.getpeercert(binary_form=True))
        assert served.issuer == authority.cert.subject and served.subject != authority.cert.subject


async def test_signer_requires_tls_1_3_and_a_trusted_name(signer: RunningSigner) -> None:
    ctx = ssl.create_default_context(cafile=str(signer.bundle))
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    tcp = await trio.open_tcp_stream(*signer.address)
    stream = trio.SSLStream(tcp, ctx, server_hostname="localhost")
    with pytest.raises(trio.BrokenResourceError):
        await stream.do_handshake()
    await trio.aclose_forcefully(stream)
    with pytest.raises(SignerRequestError, match="certificate verify failed"):
        endpoint = signer.endpoint()
        await certclient.fetch_trust_bundle(
            certclient.SignerEndpoint(endpoint.host, endpoint.port, endpoint.ca, "wrong.example")
        )


async def test_a_store_failure_is_a_500_and_the_signer_keeps_serving(signer: RunningSigner) -> None:
    token = signer.agent_token("cluster1")
    token_id = token.split(".", 1)[0]
    (signer.store.root / "tokens" / f"{token_id}.json").write_text("{corrupt")
    with pytest.raises(SignerRequestError) as info:
        await certclient.bootstrap(
            signer.endpoint(), token, certclient.agent_csr(certclient.generate_key(), "cluster1", "a")
        )
    assert (info.value.status, info.value.error) == (500, "internal_error")
    assert "corrupt" not in info.value.reason  # details go to the log, not to the client
    assert (await certclient.fetch_trust_bundle(signer.endpoint())).fingerprints
