"""Certificate signing requests: parse, check the key and the proof of possession, and match the names
against a :class:`~clusterproxy_castore.models.Binding`.

The CSR only *asks*: the certificate is built from the :class:`Identity` returned here, never from the
CSR's extensions (so a CSR cannot smuggle ``CA:TRUE``, extra SANs or other key usages). The role is
the binding's kind: a CSR may repeat its role URI (a renewal's CSR copies the certificate's names),
never name another role.
"""

from __future__ import annotations

import ipaddress
import re

from cryptography import x509
from cryptography.x509.oid import NameOID

from clusterproxy_castore.models import Binding, Identity
from clusterproxy_protocol import AGENT_ORGANIZATION, CertRole, role_of_uri

from .crypto import check_public_key
from .errors import Forbidden, InvalidCSR

__all__ = ["MAX_CSR_PEM", "match_csr", "normalize_host", "parse_csr"]

MAX_CSR_PEM = 16 << 10
_AGENT_URI = re.compile(r"^cluster-proxy://cluster/([^/]+)/agent/([^/]+)$")
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")
_HOST = re.compile(
    r"^(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$"
)


def normalize_host(host: str) -> str:
    """A DNS name (lower case) or an IP address (canonical form); ``[::1]`` brackets allowed."""
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    try:
        return str(ipaddress.ip_address(h))
    except ValueError:
        pass
    h = h.lower().rstrip(".")
    if not _HOST.match(h):
        raise ValueError(f"invalid host {host!r}: expected a DNS name or an IP address (no wildcards)")
    return h


def parse_csr(pem: str | bytes) -> x509.CertificateSigningRequest:
    """A CSR with a valid signature (proof of possession) and an accepted key, else :class:`InvalidCSR`."""
    data = pem.encode() if isinstance(pem, str) else pem
    if len(data) > MAX_CSR_PEM:
        raise InvalidCSR(f"CSR is {len(data)} bytes; at most {MAX_CSR_PEM} are accepted")
    try:
        csr = x509.load_pem_x509_csr(data)
    except ValueError as exc:
        raise InvalidCSR(f"csr_pem is not a PEM certificate signing request: {exc}") from None
    try:
        public_key = csr.public_key()
    except (ValueError, TypeError) as exc:
        raise InvalidCSR(f"CSR public key is unreadable: {exc}") from None
    problem = check_public_key(public_key)
    if problem is not None:
        raise InvalidCSR(problem, error="unsupported_key")
    try:
        valid = csr.is_signature_valid
    except Exception as exc:  # unsupported signature algorithms raise from the backend
        raise InvalidCSR(f"CSR signature cannot be checked: {exc}") from None
    if not valid:
        raise InvalidCSR("CSR signature does not verify: it was not signed by the key it carries")
    return csr


def _attrs(csr: x509.CertificateSigningRequest, oid: x509.ObjectIdentifier) -> list[str]:
    return [str(a.value) for a in csr.subject.get_attributes_for_oid(oid)]


def _sans(csr: x509.CertificateSigningRequest) -> list[x509.GeneralName]:
    try:
        ext = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    except ValueError as exc:  # duplicate or malformed extensions
        raise InvalidCSR(f"CSR extensions are malformed: {exc}") from None
    return list(ext.value)


def _single(values: list[str], what: str) -> str | None:
    if len(values) > 1:
        raise InvalidCSR(f"CSR subject has {len(values)} {what} attributes; at most one is allowed")
    return values[0] if values else None


def match_csr(csr: x509.CertificateSigningRequest, binding: Binding) -> Identity:
    """The identity to issue, when every name the CSR asks for is allowed by ``binding``.

    Raises :class:`Forbidden` naming the first name that does not match, :class:`InvalidCSR` for a
    CSR that is malformed for its kind.
    """
    cn = _single(_attrs(csr, NameOID.COMMON_NAME), "CN")
    org = _single(_attrs(csr, NameOID.ORGANIZATION_NAME), "O")
    sans = _without_own_role_uri(_sans(csr), binding)
    if binding.kind == "agent":
        return _match_agent(cn, org, sans, binding)
    if binding.kind == "server":
        return _match_server(cn, sans, binding)
    return _match_client(cn, org, sans, binding)


def _without_own_role_uri(sans: list[x509.GeneralName], binding: Binding) -> list[x509.GeneralName]:
    """``sans`` less the server or client role URI the binding's kind has (the signer adds it); a
    role URI of another kind is refused. An agent's role URI is its agent URI, left to be matched."""
    kept: list[x509.GeneralName] = []
    for name in sans:
        role = role_of_uri(name.value) if isinstance(name, x509.UniformResourceIdentifier) else None
        if role is not None and role != CertRole(binding.kind):
            raise Forbidden(
                f"the CSR asks for the {role} role ({name.value}) but the credential is for a "
                f"{binding.kind}: a certificate's role is fixed by its token and kept by every renewal",
                error="role_mismatch",
            )
        if role is None or role is CertRole.AGENT:
            kept.append(name)
    return kept


def _match_agent(cn: str | None, org: str | None, sans: list[x509.GeneralName], b: Binding) -> Identity:
    uris = [n.value for n in sans if isinstance(n, x509.UniformResourceIdentifier)]
    others = [n for n in sans if not isinstance(n, x509.UniformResourceIdentifier)]
    if len(uris) != 1 or others:
        raise InvalidCSR(
            "an agent CSR needs exactly one SAN, the URI cluster-proxy://cluster/<cluster>/agent/<agent-id>"
        )
    match = _AGENT_URI.match(uris[0])
    if not match or not _NAME.match(match.group(1)) or not _NAME.match(match.group(2)):
        raise InvalidCSR(
            f"agent URI {uris[0]!r} is not cluster-proxy://cluster/<cluster>/agent/<agent-id> "
            "(names: letters, digits, '.', '_' and '-')"
        )
    cluster, agent_id = match.group(1), match.group(2)
    if cluster != b.cluster:
        raise Forbidden(
            f"the CSR asks for cluster {cluster!r} but the credential is bound to cluster {b.cluster!r}",
            error="cluster_mismatch",
        )
    if b.agent_id is not None and agent_id != b.agent_id:
        raise Forbidden(
            f"the CSR asks for agent id {agent_id!r} but the credential is bound to agent id {b.agent_id!r}",
            error="agent_mismatch",
        )
    if cn is not None and cn != agent_id[:64]:
        raise Forbidden(f"the CSR's CN {cn!r} must be the agent id {agent_id!r}", error="name_mismatch")
    if org is not None and org != AGENT_ORGANIZATION:
        raise Forbidden(f"the CSR's O {org!r} must be {AGENT_ORGANIZATION!r}", error="name_mismatch")
    return Identity(kind="agent", name=agent_id, cluster=cluster)


def _match_server(cn: str | None, sans: list[x509.GeneralName], b: Binding) -> Identity:
    assert b.name is not None
    if cn is not None and cn != b.name[:64]:
        raise Forbidden(f"the CSR's CN {cn!r} must be {b.name!r}", error="name_mismatch")
    hosts: list[str] = []
    for name in sans:
        if isinstance(name, x509.IPAddress):
            hosts.append(str(name.value))
        elif isinstance(name, x509.DNSName):
            try:
                hosts.append(normalize_host(name.value))
            except ValueError as exc:
                raise InvalidCSR(str(exc)) from None
        else:
            raise InvalidCSR(f"a server CSR may carry DNS and IP SANs only, not {type(name).__name__}")
    if not hosts:
        raise InvalidCSR("a server CSR needs at least one DNS or IP SAN")
    allowed = set(b.hosts)
    for host in hosts:
        if host not in allowed:
            raise Forbidden(
                f"the CSR asks for host {host!r}, which the credential does not allow "
                f"(allowed: {', '.join(b.hosts) or 'none'})",
                error="host_mismatch",
            )
    return Identity(kind="server", name=b.name, hosts=tuple(dict.fromkeys(hosts)))


def _match_client(cn: str | None, org: str | None, sans: list[x509.GeneralName], b: Binding) -> Identity:
    assert b.name is not None
    if sans:
        raise InvalidCSR("a client CSR carries no SANs; the identity is the subject CN (and O)")
    if cn != b.name:
        raise Forbidden(
            f"the CSR's CN {cn!r} must be {b.name!r}, the name the credential is bound to",
            error="name_mismatch",
        )
    if org is not None and org != b.organization:
        raise Forbidden(
            f"the CSR asks for O={org!r}, which the credential does not allow", error="name_mismatch"
        )
    return Identity(kind="client", name=b.name, organization=b.organization)
