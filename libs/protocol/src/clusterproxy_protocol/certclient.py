"""Client side of the cert-signer API: bootstrap with a token, renew over mTLS, fetch the trust bundle.

The API (HTTPS, HTTP/1.1, JSON; errors are ``{"error": code, "reason": sentence}``)::

    POST /v1/bootstrap     {"token", "csr_pem"}                 -> Issued
    POST /v1/renew  (mTLS) {"csr_pem", "trusted": [fp, ...]}    -> Issued
    GET  /v1/trust-bundle  (mTLS optional; headers cluster-proxy-trusted: fp,fp and
                           cluster-proxy-presenting: serial,.. report what the caller's TLS
                           contexts trust and present)          -> {"ca_bundle_pem", "cas": [...],
                                                                    "refresh_after"?: seconds}

``refresh_after`` is there while a CA rotation is under way: fetch the bundle again within that many
seconds (sooner than the usual trust refresh), so that the rotation's next step reaches every party
within seconds.

Keys are generated here (ECDSA P-256) and never leave the process except into the key file (mode
0600). Files are replaced atomically; see :func:`write_credentials` for the order.

Typical use (an agent's first start)::

    endpoint = SignerEndpoint.parse("https://signer.hub:8443", ca=Path("ca.crt"))
    files = CertFiles(cert=Path("agent.crt"), key=Path("agent.key"), ca=Path("ca.crt"))
    await bootstrap_files(endpoint, token, files, agent_csr_request("cluster1", "agent-1"))
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import json
import math
import os
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from . import http1client, tls
from .config import ConfigError, parse_hostport
from .errors import describe_exception
from .files import write_atomic, write_temp
from .forward_proxy_trio import ForwardProxy, open_tcp_or_proxy
from .pki import AGENT_ORGANIZATION, agent_uri
from .wire import PRESENTING_HEADER, TRUSTED_HEADER, format_authority

__all__ = [
    "CertFiles",
    "Issued",
    "SignerEndpoint",
    "SignerRequestError",
    "TrustBundle",
    "agent_csr",
    "bootstrap",
    "bootstrap_files",
    "bundle_fingerprints",
    "client_csr",
    "csr_like",
    "ensure_bootstrapped",
    "fetch_trust_bundle",
    "generate_key",
    "renew",
    "server_csr",
    "usable_credentials",
    "write_bundle",
    "write_credentials",
]

ALPN = "http/1.1"
MAX_RESPONSE = 1 << 20


# --- values --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SignerEndpoint:
    """Where the signer listens and how to verify it: ``ca`` is the trust bundle (a file, read at each
    request, so an updated bundle applies at once). ``proxy``: the forward proxy to reach it through."""

    host: str
    port: int
    ca: Path
    server_name: str | None = None
    timeout: float = 30.0
    proxy: ForwardProxy | None = None

    @classmethod
    def parse(
        cls,
        url: str,
        ca: Path,
        *,
        server_name: str | None = None,
        timeout: float = 30.0,
        proxy: ForwardProxy | None = None,
    ) -> SignerEndpoint:
        """``https://host:port``, ``host:port`` or ``[v6]:port``."""
        text = url.strip()
        if text.startswith("https://"):
            text = text[len("https://") :].split("/", 1)[0]
        elif "://" in text:
            raise ConfigError(f"invalid signer URL {url!r}: the signer speaks HTTPS (https://HOST:PORT)")
        host, port = parse_hostport(text)
        return cls(host, port, Path(ca), server_name, timeout, proxy)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}:{self.port}"


@dataclass(frozen=True)
class CertFiles:
    """The PEM files of one party: its certificate, its private key, its trust bundle."""

    cert: Path
    key: Path
    ca: Path


@dataclass(frozen=True)
class Issued:
    cert_pem: str
    ca_bundle_pem: str
    serial: str
    not_after: dt.datetime
    identity: dict[str, Any]

    @property
    def cert(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem.encode())

    @classmethod
    def from_json(cls, data: Any) -> Issued:
        try:
            issued = cls(
                cert_pem=str(data["cert_pem"]),
                ca_bundle_pem=str(data["ca_bundle_pem"]),
                serial=str(data["serial"]),
                not_after=dt.datetime.fromisoformat(str(data["not_after"])),
                identity=dict(data.get("identity") or {}),
            )
            issued.cert  # noqa: B018 - validate
            bundle_fingerprints(issued.ca_bundle_pem)
        except (KeyError, TypeError, ValueError) as exc:
            raise SignerRequestError(0, "bad_response", f"the signer's answer is malformed: {exc}") from None
        return issued


@dataclass(frozen=True)
class TrustBundle:
    pem: str
    fingerprints: tuple[str, ...]
    cas: list[dict[str, Any]]
    # seconds within which to fetch again: the signer says so while a CA rotation is under way
    refresh_after: float | None = None

    @classmethod
    def from_json(cls, data: Any) -> TrustBundle:
        try:
            pem = str(data["ca_bundle_pem"])
            return cls(
                pem,
                bundle_fingerprints(pem),
                list(data.get("cas") or []),
                _refresh_after(data.get("refresh_after")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SignerRequestError(200, "bad_response", f"the trust bundle is malformed: {exc}") from None


def _refresh_after(value: object) -> float | None:
    """The signer's refresh hint in seconds; None when absent or not a positive number (a hint the
    caller cannot read only costs it the speed-up, never the bundle)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


class SignerRequestError(Exception):
    """A refused or failed request. ``status`` is the HTTP status, 0 when no answer came back."""

    def __init__(self, status: int, error: str, reason: str) -> None:
        super().__init__(f"{reason} ({error}, HTTP {status})" if status else f"{reason} ({error})")
        self.status = status
        self.error = error
        self.reason = reason

    @property
    def retryable(self) -> bool:
        """Worth retrying later: no answer, a timeout, rate limiting, a server-side failure."""
        return self.status == 0 or self.status in (408, 429) or self.status >= 500


# --- keys, CSRs, fingerprints --------------------------------------------------------------------------


def generate_key() -> ec.EllipticCurvePrivateKey:
    """A new ECDSA P-256 private key (the algorithm the signer's CA uses too)."""
    return ec.generate_private_key(ec.SECP256R1())


def _csr(
    key: Any, subject: Sequence[x509.NameAttribute[str | bytes]], sans: Sequence[x509.GeneralName]
) -> str:
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name(subject))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode()


def agent_csr(key: Any, cluster: str, agent_id: str) -> str:
    """CSR for an agent: ``CN=<agent id>, O=cluster-proxy-agents`` and the agent URI SAN."""
    uri = agent_uri(cluster, agent_id)
    return _csr(
        key,
        [
            x509.NameAttribute(NameOID.COMMON_NAME, agent_id[:64]),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, AGENT_ORGANIZATION),
        ],
        [x509.UniformResourceIdentifier(uri)],
    )


def server_csr(key: Any, name: str, hosts: Sequence[str]) -> str:
    """CSR for a server: ``CN=<name>`` and DNS / IP SANs for ``hosts``."""
    sans: list[x509.GeneralName] = []
    for host in hosts:
        h = host.strip().removeprefix("[").removesuffix("]")
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h.lower()))
    return _csr(key, [x509.NameAttribute(NameOID.COMMON_NAME, name[:64])], sans)


def client_csr(key: Any, name: str, organization: str | None = None) -> str:
    """CSR for a hub client: ``CN=<name>`` (``O=<organization>``)."""
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return _csr(key, attrs, [])


def csr_like(cert: x509.Certificate, key: Any) -> str:
    """A CSR for ``key`` asking for exactly the subject and SANs of ``cert`` (what renewal needs)."""
    try:
        sans = list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        sans = []
    return _csr(key, list(cert.subject), sans)


def bundle_fingerprints(pem: str | bytes) -> tuple[str, ...]:
    """``sha256:<hex>`` of every certificate in a PEM bundle, in order. ValueError if there is none."""
    data = pem.encode() if isinstance(pem, str) else pem
    certs = x509.load_pem_x509_certificates(data)
    return tuple(
        "sha256:" + hashlib.sha256(c.public_bytes(serialization.Encoding.DER)).hexdigest() for c in certs
    )


# --- files ---------------------------------------------------------------------------------------------


def write_bundle(path: Path, pem: str) -> bool:
    """Replace the trust bundle at ``path`` atomically; False (nothing written) when it is unchanged."""
    bundle_fingerprints(pem)
    try:
        if Path(path).read_text() == pem:
            return False
    except OSError:
        pass
    write_atomic(Path(path), pem.encode(), 0o644)
    return True


def write_credentials(files: CertFiles, key: Any, issued: Issued) -> None:
    """Write the trust bundle, then the key (0600) and the certificate (0644).

    Both key and certificate are written to temporary files first and renamed one right after the
    other, so the pair on disk is mismatched between two renames at most: :func:`tls.load_cert_chain`
    in another process that meets the new key with the old certificate reads the pair again until
    the second rename is done, instead of failing or loading a mismatch.
    """
    if key.public_key() != issued.cert.public_key():
        raise ValueError("the issued certificate is not for this key")
    write_bundle(files.ca, issued.ca_bundle_pem)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    key_tmp = write_temp(Path(files.key), key_pem, 0o600)
    try:
        cert_tmp = write_temp(Path(files.cert), issued.cert_pem.encode(), 0o644)
    except BaseException:
        os.unlink(key_tmp)
        raise
    os.replace(key_tmp, files.key)
    os.replace(cert_tmp, files.cert)


# --- requests ------------------------------------------------------------------------------------------


def _context(endpoint: SignerEndpoint, cert: Path | None, key: Path | None) -> ssl.SSLContext:
    return tls.client_context(cert, key, endpoint.ca, alpn=[ALPN])


async def _exchange(
    endpoint: SignerEndpoint,
    ctx: ssl.SSLContext,
    method: str,
    path: str,
    body: bytes,
    headers: list[tuple[str, str]],
) -> tuple[int, bytes]:
    tcp = await open_tcp_or_proxy(endpoint.host, endpoint.port, endpoint.proxy)
    stream = trio.SSLStream(tcp, ctx, server_hostname=endpoint.server_name or endpoint.host)
    async with stream:
        host = format_authority(endpoint.host, endpoint.port)
        try:
            answer = await http1client.request(
                stream, method, path, host, body, headers=headers, max_body=MAX_RESPONSE
            )
        except http1client.ResponseTooLarge as exc:
            raise SignerRequestError(exc.status, "bad_response", "the signer's answer is too large") from None
        return answer.status, answer.body


async def request_json(
    endpoint: SignerEndpoint,
    method: str,
    path: str,
    payload: dict[str, Any] | None = None,
    *,
    cert: Path | None = None,
    key: Path | None = None,
    headers: Sequence[tuple[str, str]] = (),
) -> Any:
    """One request to the signer; the JSON answer of a 200, else :class:`SignerRequestError`."""
    ctx = _context(endpoint, cert, key)  # ConfigError for missing/bad files: not a network problem
    body = b"" if payload is None else json.dumps(payload).encode()
    extra = [*headers, ("accept", "application/json")]
    if payload is not None:
        extra.append(("content-type", "application/json"))
    try:
        with trio.fail_after(endpoint.timeout):
            status, data = await _exchange(endpoint, ctx, method, path, body, extra)
    except trio.TooSlowError:
        raise SignerRequestError(
            0, "timeout", f"no answer from {endpoint.url} within {endpoint.timeout:g}s"
        ) from None
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, http1client.HTTPClientError) as exc:
        raise SignerRequestError(0, "unreachable", f"{endpoint.url}: {describe_exception(exc)}") from None
    try:
        answer = json.loads(data) if data else None
    except ValueError:
        answer = None
    if status != 200:
        if isinstance(answer, dict) and "error" in answer:
            raise SignerRequestError(status, str(answer["error"]), str(answer.get("reason", "")))
        raise SignerRequestError(status, "http_error", f"{endpoint.url}{path}: HTTP {status}")
    if answer is None:
        raise SignerRequestError(status, "bad_response", f"{endpoint.url}{path}: the answer is not JSON")
    return answer


async def bootstrap(endpoint: SignerEndpoint, token: str, csr_pem: str) -> Issued:
    """Trade a bootstrap token and a CSR for a certificate (no client certificate)."""
    answer = await request_json(endpoint, "POST", "/v1/bootstrap", {"token": token, "csr_pem": csr_pem})
    return Issued.from_json(answer)


async def renew(
    endpoint: SignerEndpoint,
    cert: Path,
    key: Path,
    csr_pem: str,
    *,
    trusted: Sequence[str] | None = None,
) -> Issued:
    """Renew: authenticate with the current ``cert``/``key`` (mTLS) and send a CSR for a new key."""
    payload: dict[str, Any] = {"csr_pem": csr_pem}
    if trusted is not None:
        payload["trusted"] = list(trusted)
    answer = await request_json(endpoint, "POST", "/v1/renew", payload, cert=cert, key=key)
    return Issued.from_json(answer)


async def fetch_trust_bundle(
    endpoint: SignerEndpoint,
    *,
    cert: Path | None = None,
    key: Path | None = None,
    trusted: Sequence[str] | None = None,
    presenting: Sequence[str] | None = None,
) -> TrustBundle:
    """The current trust bundle. With ``cert``/``key``, the signer records what this party reports:
    ``trusted``, the fingerprints of the CAs its TLS contexts trust (activating a new CA waits for
    every party to trust it), and ``presenting``, the serials (hex) of the leaves its contexts present
    (retiring the old CA waits for every party to present a leaf of the new one). While a rotation is
    under way the answer's :attr:`TrustBundle.refresh_after` asks for the next fetch sooner."""
    headers = []
    if cert is not None:
        if trusted is not None:
            headers.append((TRUSTED_HEADER, ",".join(trusted)))
        if presenting is not None:
            headers.append((PRESENTING_HEADER, ",".join(presenting)))
    answer = await request_json(endpoint, "GET", "/v1/trust-bundle", cert=cert, key=key, headers=headers)
    return TrustBundle.from_json(answer)


async def bootstrap_files(
    endpoint: SignerEndpoint,
    token: str,
    files: CertFiles,
    make_csr: Callable[[Any], str],
) -> Issued:
    """Generate a key, bootstrap with ``token``, write ``files``. ``make_csr(key)`` builds the CSR, e.g.
    ``lambda key: agent_csr(key, "cluster1", "agent-1")``."""
    key = generate_key()
    issued = await bootstrap(endpoint, token, make_csr(key))
    write_credentials(files, key, issued)
    return issued


def usable_credentials(files: CertFiles, *, now: dt.datetime | None = None) -> x509.Certificate | None:
    """The certificate in ``files`` when the pair is readable, matching and not expired, else None."""
    try:
        cert = x509.load_pem_x509_certificate(Path(files.cert).read_bytes())
        key = serialization.load_pem_private_key(Path(files.key).read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return None
    if key.public_key() != cert.public_key():
        return None
    if cert.not_valid_after_utc <= (now or dt.datetime.now(dt.UTC)):
        return None
    return cert


async def ensure_bootstrapped(
    endpoint: SignerEndpoint,
    files: CertFiles,
    token: str | None,
    make_csr: Callable[[Any], str],
) -> Issued | None:
    """Bootstrap only when needed: None when ``files`` already hold a valid certificate (a restart
    needs no new token), else :func:`bootstrap_files` with ``token`` (:class:`ConfigError` when there
    is none)."""
    if usable_credentials(files) is not None:
        return None
    if not token:
        raise ConfigError(
            f"no valid certificate in {files.cert} / {files.key} and no bootstrap token to get one "
            "(create one with `cluster-proxy-cert-signer token create`)"
        )
    return await bootstrap_files(endpoint, token, files, make_csr)
