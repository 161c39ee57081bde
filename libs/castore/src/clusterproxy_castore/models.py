"""The records the signer keeps in its store, and their JSON form.

- :class:`AuthorityRecord`: one CA (certificate, state, timestamps). The private key is *not* part of
  the record; it stays inside the store (:meth:`CertStore.load_ca_key`).
- :class:`Binding`: what a requester may become (a token's promise, or the identity of a certificate
  being renewed); :class:`Identity`: what a certificate was issued for.
- :class:`TokenRecord`: a bootstrap token, kept as the SHA-256 of its secret only.
- :class:`IssuedRecord`: every certificate the signer issued, with what its holder last reported:
  the CAs it trusts and the leaves it presents (the CA rotation's "every party trusts the new CA" and
  "every party presents a new-CA leaf" checks).
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from cryptography import x509
from cryptography.hazmat.primitives import serialization

__all__ = [
    "CA_STATES",
    "KINDS",
    "Authorities",
    "AuthorityRecord",
    "Binding",
    "CAState",
    "Identity",
    "IssuedRecord",
    "Kind",
    "TokenRecord",
    "fingerprint",
    "format_time",
    "parse_time",
]

CAState = Literal["pending", "active", "previous", "retired"]
CA_STATES: tuple[CAState, ...] = ("pending", "active", "previous", "retired")
Kind = Literal["agent", "server", "client"]
KINDS: tuple[Kind, ...] = ("agent", "server", "client")


def fingerprint(cert: x509.Certificate) -> str:
    """``sha256:<hex>`` of the certificate's DER encoding (what parties report they trust)."""
    return "sha256:" + hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def format_time(value: dt.datetime | None) -> str | None:
    return None if value is None else value.astimezone(dt.UTC).isoformat(timespec="seconds")


def parse_time(value: object) -> dt.datetime | None:
    if value is None:
        return None
    parsed = dt.datetime.fromisoformat(str(value))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def _required_time(value: object) -> dt.datetime:
    parsed = parse_time(value)
    if parsed is None:
        raise ValueError("missing timestamp")
    return parsed


# --- CAs -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuthorityRecord:
    """One CA. States: ``pending`` (trusted, not signing yet), ``active`` (trusted, signs every new
    certificate; exactly one), ``previous`` (trusted while leaves move off it), ``retired`` (trusted by
    nobody; its key is deleted)."""

    id: str
    state: CAState
    cert_pem: str
    created_at: dt.datetime
    activated_at: dt.datetime | None = None
    retired_at: dt.datetime | None = None

    @property
    def cert(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem.encode())

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert)

    @property
    def trusted(self) -> bool:
        return self.state != "retired"

    def to_json(self) -> dict[str, Any]:
        """The index entry (the certificate and key live in their own files/keys)."""
        return {
            "id": self.id,
            "state": self.state,
            "created_at": format_time(self.created_at),
            "activated_at": format_time(self.activated_at),
            "retired_at": format_time(self.retired_at),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], cert_pem: str) -> AuthorityRecord:
        state = str(data["state"])
        if state not in CA_STATES:
            raise ValueError(f"unknown CA state {state!r}")
        return cls(
            id=str(data["id"]),
            state=state,
            cert_pem=cert_pem,
            created_at=_required_time(data["created_at"]),
            activated_at=parse_time(data.get("activated_at")),
            retired_at=parse_time(data.get("retired_at")),
        )


@dataclass(frozen=True)
class Authorities:
    """Every CA the store knows, oldest first, and an opaque version for compare-and-swap writes."""

    records: tuple[AuthorityRecord, ...] = ()
    version: str = ""

    def by_state(self, state: CAState) -> AuthorityRecord | None:
        found = [r for r in self.records if r.state == state]
        return found[-1] if found else None

    @property
    def active(self) -> AuthorityRecord | None:
        return self.by_state("active")

    @property
    def pending(self) -> AuthorityRecord | None:
        return self.by_state("pending")

    @property
    def previous(self) -> AuthorityRecord | None:
        return self.by_state("previous")

    @property
    def rotating(self) -> bool:
        """A CA rotation is under way: a new CA is pending, or the previous one is still trusted."""
        return self.pending is not None or self.previous is not None

    def get(self, ca_id: str) -> AuthorityRecord | None:
        return next((r for r in self.records if r.id == ca_id), None)

    def bundle(self) -> list[AuthorityRecord]:
        """The trust bundle: every CA that is not retired; active first, then pending, then previous."""
        order = {"active": 0, "pending": 1, "previous": 2}
        return sorted((r for r in self.records if r.trusted), key=lambda r: order[r.state])

    def bundle_pem(self) -> str:
        return "".join(r.cert_pem for r in self.bundle())

    def bundle_fingerprints(self) -> list[str]:
        return [r.fingerprint for r in self.bundle()]


# --- identities ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """What a certificate is issued for.

    - ``agent``: ``name`` is the agent id, ``cluster`` its cluster (URI SAN, CN=agent id);
    - ``server``: ``name`` is the CN, ``hosts`` the DNS names / IP addresses (SANs);
    - ``client``: ``name`` is the CN, ``organization`` the optional O.
    """

    kind: Kind
    name: str
    cluster: str | None = None
    hosts: tuple[str, ...] = ()
    organization: str | None = None

    @property
    def key(self) -> str:
        """A stable, readable id: ``agent:cluster1/agent-a``, ``server:proxy-server``, ``client:alice``."""
        if self.kind == "agent":
            return f"agent:{self.cluster}/{self.name}"
        return f"{self.kind}:{self.name}"

    def binding(self) -> Binding:
        """The binding a renewal of this identity must satisfy: exactly these names (hosts: a subset)."""
        return Binding(
            kind=self.kind,
            cluster=self.cluster,
            agent_id=self.name if self.kind == "agent" else None,
            name=None if self.kind == "agent" else self.name,
            hosts=self.hosts,
            organization=self.organization,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "cluster": self.cluster,
            "hosts": list(self.hosts),
            "organization": self.organization,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Identity:
        kind = str(data["kind"])
        if kind not in KINDS:
            raise ValueError(f"unknown identity kind {kind!r}")
        return cls(
            kind=kind,
            name=str(data["name"]),
            cluster=data.get("cluster"),
            hosts=tuple(data.get("hosts") or ()),
            organization=data.get("organization"),
        )


@dataclass(frozen=True)
class Binding:
    """What a CSR may ask for.

    - ``agent``: ``cluster`` (required); ``agent_id`` when the token is for one agent id only;
    - ``server``: ``name`` (the CN) and ``hosts``: the CSR's SANs must be a non-empty subset;
    - ``client``: ``name`` (the CN) and optionally ``organization``.
    """

    kind: Kind
    cluster: str | None = None
    agent_id: str | None = None
    name: str | None = None
    hosts: tuple[str, ...] = ()
    organization: str | None = None

    def describe(self) -> str:
        if self.kind == "agent":
            who = f"agent {self.agent_id!r}" if self.agent_id else "any agent id"
            return f"agent of cluster {self.cluster!r} ({who})"
        if self.kind == "server":
            return f"server {self.name!r} for {', '.join(self.hosts)}"
        org = f" (O={self.organization})" if self.organization else ""
        return f"client {self.name!r}{org}"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "cluster": self.cluster,
            "agent_id": self.agent_id,
            "name": self.name,
            "hosts": list(self.hosts),
            "organization": self.organization,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Binding:
        kind = str(data["kind"])
        if kind not in KINDS:
            raise ValueError(f"unknown binding kind {kind!r}")
        return cls(
            kind=kind,
            cluster=data.get("cluster"),
            agent_id=data.get("agent_id"),
            name=data.get("name"),
            hosts=tuple(data.get("hosts") or ()),
            organization=data.get("organization"),
        )


# --- tokens --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenRecord:
    """A bootstrap token. Only ``secret_sha256`` is kept: the token itself is shown once, at creation."""

    id: str
    secret_sha256: str
    binding: Binding
    created_at: dt.datetime
    expires_at: dt.datetime
    used_at: dt.datetime | None = None
    used_serial: str | None = None
    description: str = ""

    def expired(self, now: dt.datetime) -> bool:
        return now >= self.expires_at

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "secret_sha256": self.secret_sha256,
            "binding": self.binding.to_json(),
            "created_at": format_time(self.created_at),
            "expires_at": format_time(self.expires_at),
            "used_at": format_time(self.used_at),
            "used_serial": self.used_serial,
            "description": self.description,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TokenRecord:
        return cls(
            id=str(data["id"]),
            secret_sha256=str(data["secret_sha256"]),
            binding=Binding.from_json(data["binding"]),
            created_at=_required_time(data["created_at"]),
            expires_at=_required_time(data["expires_at"]),
            used_at=parse_time(data.get("used_at")),
            used_serial=data.get("used_serial"),
            description=str(data.get("description") or ""),
        )


# --- issued certificates -------------------------------------------------------------------------------


@dataclass(frozen=True)
class IssuedRecord:
    """A certificate the signer issued (public data only: the holder's key never reaches the signer).

    ``via``: ``bootstrap`` (a token), ``renew`` (mTLS with ``predecessor``) or ``self`` (the signer's
    own serving certificate). ``successor`` is set once the certificate has been renewed. ``trusted``:
    the CA fingerprints its holder last reported trusting (at ``trust_reported_at``; a renewal carries
    them over). ``presenting``: the serials of the leaves its holder's TLS contexts present, as last
    reported with this certificate (at ``seen_at``); None: never reported. ``superseded_by`` is set
    when the predecessor renewed again because this certificate never reached its holder.
    """

    serial: str  # lower-case hex
    identity: Identity
    ca_id: str
    cert_pem: str
    not_before: dt.datetime
    not_after: dt.datetime
    issued_at: dt.datetime
    via: Literal["bootstrap", "renew", "self"]
    public_key_sha256: str
    token_id: str | None = None
    predecessor: str | None = None
    successor: str | None = None
    trusted: tuple[str, ...] | None = None
    trust_reported_at: dt.datetime | None = None
    presenting: tuple[str, ...] | None = None
    seen_at: dt.datetime | None = None
    superseded_by: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def live(self, now: dt.datetime) -> bool:
        """Still valid and not replaced by a renewal: its holder counts as a party of the PKI."""
        return self.successor is None and self.superseded_by is None and self.not_after > now

    def last_heard(self) -> dt.datetime:
        """When its holder last reported (trust or what it presents), or its issuance if it never did."""
        return max(t for t in (self.issued_at, self.trust_reported_at, self.seen_at) if t is not None)

    @property
    def superseded(self) -> bool:
        return self.superseded_by is not None

    @property
    def reached_holder(self) -> bool:
        """Its holder has authenticated with it (a report or a renewal): it did receive it."""
        return self.seen_at is not None or self.successor is not None

    def with_report(
        self, trusted: tuple[str, ...] | None, presenting: tuple[str, ...] | None, now: dt.datetime
    ) -> IssuedRecord:
        """What its holder reported now; a part left out (None) keeps its last value."""
        return replace(
            self,
            trusted=self.trusted if trusted is None else trusted,
            trust_reported_at=self.trust_reported_at if trusted is None else now,
            presenting=self.presenting if presenting is None else presenting,
            seen_at=now,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "serial": self.serial,
            "identity": self.identity.to_json(),
            "ca_id": self.ca_id,
            "cert_pem": self.cert_pem,
            "not_before": format_time(self.not_before),
            "not_after": format_time(self.not_after),
            "issued_at": format_time(self.issued_at),
            "via": self.via,
            "public_key_sha256": self.public_key_sha256,
            "token_id": self.token_id,
            "predecessor": self.predecessor,
            "successor": self.successor,
            "trusted": None if self.trusted is None else list(self.trusted),
            "trust_reported_at": format_time(self.trust_reported_at),
            "presenting": None if self.presenting is None else list(self.presenting),
            "seen_at": format_time(self.seen_at),
            "superseded_by": self.superseded_by,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> IssuedRecord:
        via = str(data["via"])
        if via not in ("bootstrap", "renew", "self"):
            raise ValueError(f"unknown issuance {via!r}")
        trusted = data.get("trusted")
        presenting = data.get("presenting")
        return cls(
            serial=str(data["serial"]),
            identity=Identity.from_json(data["identity"]),
            ca_id=str(data["ca_id"]),
            cert_pem=str(data["cert_pem"]),
            not_before=_required_time(data["not_before"]),
            not_after=_required_time(data["not_after"]),
            issued_at=_required_time(data["issued_at"]),
            via=cast(Literal["bootstrap", "renew", "self"], via),
            public_key_sha256=str(data["public_key_sha256"]),
            token_id=data.get("token_id"),
            predecessor=data.get("predecessor"),
            successor=data.get("successor"),
            trusted=None if trusted is None else tuple(str(t) for t in trusted),
            trust_reported_at=parse_time(data.get("trust_reported_at")),
            presenting=None if presenting is None else tuple(str(p) for p in presenting),
            seen_at=parse_time(data.get("seen_at")),
            superseded_by=data.get("superseded_by"),
            extra=dict(data.get("extra") or {}),
        )
