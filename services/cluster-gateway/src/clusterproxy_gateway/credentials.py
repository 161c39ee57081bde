"""The gateway's two certificates.

- **Serving** (what the aggregator verifies): ``--tls-cert``/``--tls-key``, or, without them, a CA and
  a serving certificate made at start for ``--serving-name`` (default ``cluster-gateway.<namespace>.svc``),
  whose CA the gateway writes into ``spec.caBundle`` of ``--apiservice`` itself. Nothing to create by
  hand, and a restarted pod registers its new CA.
- **Hub client** (what the proxy-server's client port wants): ``--proxy-cert``/``--proxy-key`` files;
  with ``--signer`` the gateway gets them from the cert-signer with a single-use bootstrap token
  (``cluster-proxy-cert-signer token create --client cluster-gateway``) when they hold no valid
  certificate, then renews them at 80 % of their lifetime and follows the trust bundle in ``--proxy-ca``
  (the SDK reads the files at each dial).
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from clusterproxy_protocol import (
    CertFiles,
    CertRenewer,
    ConfigError,
    SignerEndpoint,
    SignerRequestError,
    client_csr,
    ensure_bootstrapped,
    server_csr,
)

__all__ = [
    "SelfSigned",
    "make_self_signed",
    "prepare_client_certificate",
    "prepare_serving_certificate",
    "register_ca_bundle",
]

SERVING_LIFETIME = dt.timedelta(days=365)


@dataclass(frozen=True)
class SelfSigned:
    cert: Path
    key: Path
    ca_pem: bytes


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_self_signed(directory: Path, names: list[str]) -> SelfSigned:
    """A CA of this process and a serving certificate it signs for ``names`` (DNS names or IPs)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, f"cluster-gateway-ca@{int(now.timestamp())}")]
    )
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + SERVING_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + SERVING_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / "serving.crt", directory / "serving.key"
    key_path.touch(mode=0o600)
    key_path.write_bytes(_pem_key(key))
    cert_path.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    return SelfSigned(cert_path, key_path, ca.public_bytes(serialization.Encoding.PEM))


def register_ca_bundle(api: Any, apiservice: str, ca_pem: bytes) -> None:
    """Write the serving CA into the APIService (blocking: run it in a thread)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        client.ApiregistrationV1Api(api).patch_api_service(
            apiservice,
            {"spec": {"caBundle": base64.b64encode(ca_pem).decode(), "insecureSkipTLSVerify": False}},
        )
    except ApiException as exc:
        if exc.status == 404:
            raise ConfigError(
                f"APIService {apiservice} does not exist on the hub: apply deploy/kustomize/overlays/hub-gateway "
                "(or pass --apiservice with the name of yours)"
            ) from None
        if exc.status == 403:
            raise ConfigError(
                f"the gateway may not patch APIService {apiservice} (403): grant its ServiceAccount patch on it "
                "(deploy/kustomize/base/cluster-gateway/rbac.yaml)"
            ) from None
        raise


async def prepare_client_certificate(
    signer: str, files: CertFiles, token: str | None, bootstrap_ca: Path | None, client_name: str
) -> CertRenewer:
    """Bootstrap ``files`` from the signer when they hold no valid certificate; the renewer to run."""
    return await _prepare(
        signer,
        files,
        token,
        bootstrap_ca,
        lambda key: client_csr(key, client_name),
        f"cluster-proxy-cert-signer token create --client {client_name}",
    )


async def prepare_serving_certificate(
    signer: str, files: CertFiles, token: str | None, bootstrap_ca: Path | None, name: str, hosts: list[str]
) -> CertRenewer:
    """The service proxy's serving certificate (CN ``name``, SANs ``hosts``) from the signer with a
    server token bound to them, as the proxy-server gets its own; the renewer to run."""
    hint = "cluster-proxy-cert-signer token create --server " + name + "".join(f" --host {h}" for h in hosts)
    return await _prepare(signer, files, token, bootstrap_ca, lambda key: server_csr(key, name, hosts), hint)


async def _prepare(
    signer: str,
    files: CertFiles,
    token: str | None,
    bootstrap_ca: Path | None,
    make_csr: Callable[[Any], str],
    hint: str,
) -> CertRenewer:
    if not files.ca.exists():
        if bootstrap_ca is None or not bootstrap_ca.is_file():
            raise ConfigError(
                f"no trust bundle at {files.ca} to verify the cert-signer with: pass --bootstrap-ca (the ca.crt "
                "of `cluster-proxy-cert-signer trust-bundle`) or put the bundle there"
            )
        files.ca.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(bootstrap_ca, files.ca)
    endpoint = SignerEndpoint.parse(signer, files.ca)
    try:
        await ensure_bootstrapped(endpoint, files, token, make_csr)
    except SignerRequestError as exc:
        raise ConfigError(
            f"the cert-signer at {endpoint.url} refused the bootstrap token: {exc} (create a new one: {hint})"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot reach the cert-signer at {endpoint.url}: {exc}") from None
    return CertRenewer(endpoint, files)
