"""A throw-away PKI for one benchmark run (one CA, short-lived leaves; ECDSA P-256 unless told).

Kept inside bench/ on purpose: the benchmarks must not depend on the code they measure.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


# The role URI SANs our proxy-server requires (its client port takes client certificates only, the
# agent port agent certificates only, and our agents check the hub's); upstream ignores them.
SERVER_ROLE_URI = "cluster-proxy://hub/server"
CLIENT_ROLE_URI = "cluster-proxy://hub/client"


# The key types a PKI can be issued with (every key of it, the CA's too): the bench's own is "p256".
KEY_TYPES = {
    "p256": lambda: ec.generate_private_key(ec.SECP256R1()),
    "ed25519": ed25519.Ed25519PrivateKey.generate,
    "rsa2048": lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
}


def _digest(signer: CertificateIssuerPrivateKeyTypes) -> hashes.SHA256 | None:
    return None if isinstance(signer, ed25519.Ed25519PrivateKey) else hashes.SHA256()  # Ed25519 hashes itself


def agent_uri(cluster: str, agent_id: str) -> str:
    """The URI SAN our proxy-server reads an agent's identity from."""
    return f"cluster-proxy://cluster/{cluster}/agent/{agent_id}"


class BenchPKI:
    """Issues certificates into `folder`: ca.crt, server.{crt,key}, client.{crt,key}, agents."""

    def __init__(self, folder: Path, days: int = 2, key: str = "p256") -> None:
        if key not in KEY_TYPES:
            raise ValueError(f"unknown key type {key!r}; known: {', '.join(KEY_TYPES)}")
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lifetime = dt.timedelta(days=days)
        self._new_key = KEY_TYPES[key]
        self._ca_key = self._new_key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cluster-proxy bench CA")])
        now = dt.datetime.now(dt.UTC)
        self._ca_cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + self._lifetime)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._ca_key.public_key()), critical=False
            )
            .sign(self._ca_key, _digest(self._ca_key))
        )
        self.ca = folder / "ca.crt"
        self.ca.write_bytes(self._ca_cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        name: str,
        common_name: str,
        *,
        server: bool = False,
        client: bool = False,
        dns: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
        uris: tuple[str, ...] = (),
    ) -> CertFiles:
        key = self._new_key()
        now = dt.datetime.now(dt.UTC)
        usages = []
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + self._lifetime)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._ca_key.public_key()), critical=False
            )
        )
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        sans += [x509.UniformResourceIdentifier(u) for u in uris]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._ca_key, _digest(self._ca_key))
        files = CertFiles(self.folder / f"{name}.crt", self.folder / f"{name}.key")
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        files.key.chmod(0o600)
        return files

    def server(self) -> CertFiles:
        return self.issue(
            "server",
            "cluster-proxy-bench-server",
            server=True,
            dns=("localhost",),
            ips=("127.0.0.1",),
            uris=(SERVER_ROLE_URI,),
        )

    def client(self) -> CertFiles:
        return self.issue("client", "bench-client", client=True, uris=(CLIENT_ROLE_URI,))

    def agent(self, cluster: str, agent_id: str) -> CertFiles:
        return self.issue(
            f"agent-{cluster}-{agent_id}",
            f"{cluster}/{agent_id}",
            client=True,
            uris=(agent_uri(cluster, agent_id),),
        )
