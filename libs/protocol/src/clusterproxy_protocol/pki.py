"""A small development certificate authority (ECDSA P-256, SHA-256).

Used by local mode and the tests until the cert-signer service owns the CA; everything sits behind
the few functions below so that swap stays local. Files are PEM, written atomically (temporary file,
then ``os.replace``), private keys with mode 0600.

Identity conventions (shared with the cert-signer and the proxy-server's authorization). Every
certificate carries exactly one **role** (:class:`CertRole`): one ``cluster-proxy:`` URI SAN names
it, and the extended key usage must agree (:func:`certificate_role` checks both):

- server certificates: SAN DNS names / IP addresses and the URI ``cluster-proxy://hub/server``,
  EKU serverAuth (the signer adds clientAuth: a server renews over mTLS with its own certificate);
- client certificates (hub users): subject CN (and optionally O), the URI
  ``cluster-proxy://hub/client``, EKU clientAuth;
- agent certificates: subject ``CN=<agent_id>, O=cluster-proxy-agents``, EKU clientAuth, and the URI
  SAN ``cluster-proxy://cluster/<cluster>/agent/<agent_id>``, which names the role and binds the
  agent to its cluster (see :func:`agent_identity_from_cert`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import enum
import ipaddress
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from clusterproxy_protocol.files import write_atomic

from .config import ConfigError

__all__ = [
    "AGENT_ORGANIZATION",
    "AGENT_URI_SCHEME",
    "CLIENT_ROLE_URI",
    "SERVER_ROLE_URI",
    "CertRole",
    "DevCA",
    "PemPair",
    "RoleCheck",
    "agent_identity_from_cert",
    "agent_uri",
    "certificate_role",
    "key_pem",
    "key_usage",
    "new_ca",
    "peer_identity",
    "role_of_uri",
]

AGENT_ORGANIZATION = "cluster-proxy-agents"
AGENT_URI_SCHEME = "cluster-proxy"
_AGENT_URI = re.compile(r"^cluster-proxy://cluster/([^/]+)/agent/([^/]+)$")
# Cluster names are Kubernetes object names; agent ids are pod names, host names or UUIDs.
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")
_CLOCK_SKEW = dt.timedelta(minutes=5)
SERVER_ROLE_URI = "cluster-proxy://hub/server"
CLIENT_ROLE_URI = "cluster-proxy://hub/client"


class CertRole(enum.StrEnum):
    """What a certificate may be used as; each port accepts one (see :func:`certificate_role`)."""

    SERVER = "server"  # the proxy-server (and the cert-signer's own HTTPS certificate)
    AGENT = "agent"  # a proxy-agent of one cluster
    CLIENT = "client"  # a hub client: curl, kubectl, the SDK, port-forward


# The EKUs each role must carry, and the only ones it may carry. A server also carries clientAuth
# because it renews over mTLS with its own certificate and OpenSSL checks a client certificate's EKU.
_ROLE_EKUS: dict[CertRole, tuple[x509.ObjectIdentifier, frozenset[x509.ObjectIdentifier]]] = {
    CertRole.SERVER: (
        ExtendedKeyUsageOID.SERVER_AUTH,
        frozenset({ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}),
    ),
    CertRole.AGENT: (ExtendedKeyUsageOID.CLIENT_AUTH, frozenset({ExtendedKeyUsageOID.CLIENT_AUTH})),
    CertRole.CLIENT: (ExtendedKeyUsageOID.CLIENT_AUTH, frozenset({ExtendedKeyUsageOID.CLIENT_AUTH})),
}
_ROLE_EKU_TEXT = {
    CertRole.SERVER: "a server certificate has serverAuth and may have clientAuth, nothing else",
    CertRole.AGENT: "an agent certificate has clientAuth only",
    CertRole.CLIENT: "a client certificate has clientAuth only",
}
_EKU_NAMES = {ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth", ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth"}


@dataclass(frozen=True)
class PemPair:
    """Paths of a PEM certificate and its PEM private key."""

    cert: Path
    key: Path


def agent_uri(cluster: str, agent_id: str) -> str:
    """The URI SAN that binds an agent certificate to its cluster."""
    for what, value in (("cluster name", cluster), ("agent id", agent_id)):
        if not _NAME.match(value):
            raise ValueError(
                f"invalid {what} {value!r}: use letters, digits, '.', '_' and '-' "
                "(starting and ending with a letter or digit, at most 253 characters)"
            )
    return f"{AGENT_URI_SCHEME}://cluster/{cluster}/agent/{agent_id}"


def agent_identity_from_cert(cert: x509.Certificate) -> tuple[str, str] | None:
    """``(cluster, agent_id)`` from an agent certificate's URI SAN, or None when it has none.

    A certificate with several agent URIs is ambiguous and yields None too.
    """
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    found = []
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        match = _AGENT_URI.match(uri)
        if match and _NAME.match(match.group(1)) and _NAME.match(match.group(2)):
            found.append((match.group(1), match.group(2)))
    return found[0] if len(found) == 1 else None


def _is_role_uri(uri: str) -> bool:
    return uri[: len(AGENT_URI_SCHEME) + 1].lower() == f"{AGENT_URI_SCHEME}:"


def role_of_uri(uri: str) -> CertRole | None:
    """The role a ``cluster-proxy:`` URI names, or None when it is not a well-formed role URI."""
    if uri == SERVER_ROLE_URI:
        return CertRole.SERVER
    if uri == CLIENT_ROLE_URI:
        return CertRole.CLIENT
    match = _AGENT_URI.match(uri)
    if match and _NAME.match(match.group(1)) and _NAME.match(match.group(2)):
        return CertRole.AGENT
    return None


@dataclass(frozen=True)
class RoleCheck:
    """A certificate's role, or None with ``problem`` saying why it has no usable one."""

    role: CertRole | None
    problem: str | None = None

    @property
    def found(self) -> str:
        """The role as logs name it: ``server``, ``agent``, ``client`` or ``none``."""
        return self.role.value if self.role is not None else "none"


def _eku_names(usages: Sequence[x509.ObjectIdentifier]) -> str:
    return ", ".join(_EKU_NAMES.get(oid, oid.dotted_string) for oid in usages) or "none"


def certificate_role(cert: x509.Certificate) -> RoleCheck:
    """The one role ``cert`` carries: exactly one ``cluster-proxy:`` URI SAN naming it, and an
    extended key usage that has the role's usage and nothing a role may not have (an agent or
    client certificate with serverAuth has no role). Anything else has no role."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier) if _is_role_uri(u)]
    except x509.ExtensionNotFound:
        uris = []
    if not uris:
        return RoleCheck(None, "the certificate has no cluster-proxy role URI SAN")
    if len(uris) > 1:
        return RoleCheck(None, f"the certificate names {len(uris)} roles ({', '.join(uris)}); one is allowed")
    role = role_of_uri(uris[0])
    if role is None:
        return RoleCheck(None, f"{uris[0]!r} is not a cluster-proxy role URI")
    try:
        usages = list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        return RoleCheck(None, f"the {role} role URI comes without an extended key usage")
    required, allowed = _ROLE_EKUS[role]
    if required not in usages or not set(usages) <= allowed:
        return RoleCheck(
            None,
            f"the {role} role URI comes with extended key usage {_eku_names(usages)}; {_ROLE_EKU_TEXT[role]}",
        )
    return RoleCheck(role)


def role_refusal(check: RoleCheck, port: str, accepted: CertRole) -> str | None:
    """Why a certificate with ``check``'s role is refused on ``port``, or None when it is accepted."""
    if check.role is accepted:
        return None
    found = f"role {check.role}" if check.role is not None else f"no role ({check.problem})"
    return f"a certificate with {found} is refused on the {port} port, which accepts {accepted} certificates only"


def _san_strings(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    out: list[str] = []
    for name in san:
        if isinstance(name, x509.DNSName):
            out.append(f"DNS:{name.value}")
        elif isinstance(name, x509.IPAddress):
            out.append(f"IP:{name.value}")
        elif isinstance(name, x509.UniformResourceIdentifier):
            out.append(f"URI:{name.value}")
        elif isinstance(name, x509.RFC822Name):
            out.append(f"email:{name.value}")
        else:
            out.append(f"{type(name).__name__}:{name.value!r}")
    return out


def peer_identity(peer_cert: bytes | x509.Certificate) -> dict[str, object]:
    """A summary of a peer certificate (e.g. ``SSLObject.getpeercert(binary_form=True)``, or parsed).

    Keys: ``subject`` (RFC 4514 string), ``common_name`` (str or None), ``organizations`` (list),
    ``sans`` (``["DNS:host", "IP:1.2.3.4", "URI:..."]``), ``agent`` (``{"cluster", "agent_id"}`` for an
    agent certificate, else None) and ``role`` (``server``, ``agent``, ``client`` or ``none``: see
    :func:`certificate_role`).
    """
    cert = peer_cert if isinstance(peer_cert, x509.Certificate) else x509.load_der_x509_certificate(peer_cert)
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    orgs = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    agent = agent_identity_from_cert(cert)
    return {
        "subject": cert.subject.rfc4514_string(),
        "common_name": str(cns[0].value) if cns else None,
        "organizations": [str(o.value) for o in orgs],
        "sans": _san_strings(cert),
        "agent": {"cluster": agent[0], "agent_id": agent[1]} if agent else None,
        "role": certificate_role(cert).found,
    }


# --- files ---------------------------------------------------------------------------------------------


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """A private key as unencrypted PKCS#8 PEM (files mode 0600 and store Secrets hold it so)."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _stem(text: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "cert"
    return stem[:200]


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on ``directory`` so that concurrent processes create one CA, not two."""
    import fcntl

    with open(directory / ".ca.lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# --- the CA --------------------------------------------------------------------------------------------


def key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    """The key usage of every certificate made here: signatures, plus certificate and CRL signing for
    a CA (TLS 1.3 needs nothing else of an ECDSA leaf)."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def new_ca(name: str, *, now: dt.datetime, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA: ECDSA P-256, SHA-256, ``pathLen=0`` (it signs leaves only), valid from
    5 minutes before ``now`` (clock skew) for ``days``. The one builder of a CA: the development CA
    (:class:`DevCA`) and the cert-signer's CAs (``clusterproxy_castore.rotation``) are both made here."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, name[:64]),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "cluster-proxy"),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


class DevCA:
    """A file-backed development CA: ``ca.crt`` and ``ca.key`` in one directory."""

    def __init__(self, directory: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.directory = directory
        self.cert = cert
        self._key = key

    @classmethod
    def create_or_load(
        cls, directory: Path, name: str = "cluster-proxy-dev-ca", *, days: int = 3650
    ) -> DevCA:
        """Load the CA in ``directory``, or create it there (``ca.crt``, ``ca.key`` mode 0600)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with _locked(directory):
            cert_path, key_path = directory / "ca.crt", directory / "ca.key"
            if cert_path.exists() or key_path.exists():
                return cls._load(directory, cert_path, key_path)
            cert, key = new_ca(name, now=_now(), days=days)
            # Key first: a present ca.crt always has its key next to it.
            write_atomic(key_path, key_pem(key), 0o600)
            write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
            return cls(directory, cert, key)

    @classmethod
    def _load(cls, directory: Path, cert_path: Path, key_path: Path) -> DevCA:
        for path in (cert_path, key_path):
            if not path.exists():
                raise ConfigError(
                    f"incomplete CA in {directory}: {path} is missing (remove the directory to start over)"
                )
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load CA certificate {cert_path}: {exc}") from exc
        try:
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"cannot load CA key {key_path}: {exc}") from exc
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ConfigError(f"CA key {key_path} is not an EC key")
        if key.public_key() != cert.public_key():
            raise ConfigError(f"CA key {key_path} does not match CA certificate {cert_path}")
        return cls(directory, cert, key)

    @property
    def ca_path(self) -> Path:
        """The CA certificate (the trust bundle to give servers, agents and clients)."""
        return self.directory / "ca.crt"

    # -- leaves ------------------------------------------------------------------------------------------

    def issue_custom(
        self,
        subject: x509.Name,
        sans: list[x509.GeneralName],
        eku: list[x509.ObjectIdentifier],
        directory: Path,
        stem: str,
        *,
        days: int = 365,
    ) -> PemPair:
        """A leaf with exactly these names and usages, no role added (the ``issue_*`` methods add it):
        for tests that need a certificate the role check must refuse (none, two, or one that its EKU
        contradicts)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        not_after = min(now + dt.timedelta(days=days), self.cert.not_valid_after_utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(key_usage(cert_sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(eku), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        directory = Path(directory)
        pair = PemPair(cert=directory / f"{stem}.crt", key=directory / f"{stem}.key")
        write_atomic(pair.key, key_pem(key), 0o600)
        write_atomic(pair.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return pair

    def issue_server(
        self, name: str, hosts: list[str], directory: Path, *, days: int = 365, stem: str | None = None
    ) -> PemPair:
        """A server certificate for ``hosts`` (DNS names and IP addresses; ``[::1]`` brackets allowed).

        Written to ``<directory>/<stem>.crt`` / ``.key``; ``stem`` defaults to ``name``.
        """
        if not hosts:
            raise ValueError(f"server certificate {name!r} needs at least one host name or IP address")
        sans: list[x509.GeneralName] = []
        for host in hosts:
            h = host.strip()
            if h.startswith("[") and h.endswith("]"):
                h = h[1:-1]
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                if not h or not h.isascii() or any(c.isspace() or c in "/:@[]" for c in h):
                    raise ValueError(f"invalid host {host!r} for server certificate {name!r}") from None
                sans.append(x509.DNSName(h.lower()))
        sans.append(x509.UniformResourceIdentifier(SERVER_ROLE_URI))
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64])])
        return self.issue_custom(
            subject, sans, [ExtendedKeyUsageOID.SERVER_AUTH], directory, stem or _stem(name), days=days
        )

    def issue_client(
        self,
        common_name: str | None,
        directory: Path,
        *,
        organization: str | None = None,
        uris: Sequence[str] = (),
        days: int = 365,
        stem: str | None = None,
    ) -> PemPair:
        """A client certificate for a hub user: ``CN=common_name`` (``O=organization``), the client
        role URI, EKU clientAuth. ``uris`` adds URI SANs for the client policy to match (e.g. SPIFFE
        ids); a certificate named by them alone may leave out the common name."""
        if common_name is None and not uris:
            raise ValueError("a client certificate needs a common name or a URI")
        if common_name is not None and not 0 < len(common_name) <= 64:
            raise ValueError(f"invalid client common name {common_name!r}: 1-64 characters")
        for uri in uris:
            if _is_role_uri(uri):
                raise ValueError(f"{uri!r}: the role URI is added by the CA, not given")
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)] if common_name else []
        if organization:
            attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
        sans.append(x509.UniformResourceIdentifier(CLIENT_ROLE_URI))
        return self.issue_custom(
            x509.Name(attrs),
            sans,
            [ExtendedKeyUsageOID.CLIENT_AUTH],
            directory,
            stem or _stem(common_name or uris[0]),
            days=days,
        )

    def issue_agent(
        self, cluster: str, agent_id: str, directory: Path, *, days: int = 365, stem: str | None = None
    ) -> PemPair:
        """An agent certificate bound to ``cluster`` (URI SAN, see :func:`agent_identity_from_cert`).

        ``stem`` defaults to ``agent-<cluster>-<agent_id>``.
        """
        uri = agent_uri(cluster, agent_id)
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.COMMON_NAME, agent_id[:64]),
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, AGENT_ORGANIZATION),
            ]
        )
        return self.issue_custom(
            subject,
            [x509.UniformResourceIdentifier(uri)],
            [ExtendedKeyUsageOID.CLIENT_AUTH],
            directory,
            stem or _stem(f"agent-{cluster}-{agent_id}"),
            days=days,
        )
