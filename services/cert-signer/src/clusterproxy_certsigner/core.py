"""The signing logic, without I/O of its own: bootstrap with a token, renew with the current
certificate, serve the trust bundle (and record what each party reports: the CAs it trusts and the
leaves it presents).

Synchronous (the store may block): the HTTPS front end calls it from a worker thread. Every refusal
is a :class:`~clusterproxy_certsigner.errors.SignerError` with a status and a clear reason.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes

from clusterproxy_castore.models import (
    Authorities,
    AuthorityRecord,
    Identity,
    IssuedRecord,
    TokenRecord,
    format_time,
)
from clusterproxy_castore.store import CertStore, NotFound, StoreConflict
from clusterproxy_castore.tokens import MalformedToken, parse_token, secret_matches

from .crypto import CAKey, issue_leaf, public_key_sha256
from .csr import match_csr, parse_csr
from .errors import BadRequest, Conflict, Gone, SignerError, Unauthorized

__all__ = [
    "DEFAULT_CERT_TTL",
    "DEFAULT_ROTATION_REFRESH",
    "IssueResult",
    "SignerCore",
    "parse_presenting",
    "parse_trusted",
    "utc_now",
]

DEFAULT_CERT_TTL = dt.timedelta(hours=24)
# While a rotation is under way, parties are asked to fetch the trust bundle this often (seconds), so
# that each step reaches them within seconds instead of within their usual trust refresh.
DEFAULT_ROTATION_REFRESH = 5.0
TRUST_REPORT_REFRESH = dt.timedelta(minutes=5)
PRUNE_AFTER = dt.timedelta(days=7)
MAX_TRUSTED = 16
MAX_PRESENTING = 4
_FINGERPRINT = re.compile(r"^sha256:[0-9a-f]{64}$")
_SERIAL = re.compile(r"^[0-9a-f]{1,40}$")


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _serial(cert: x509.Certificate) -> str:
    return format(cert.serial_number, "x")


def _pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def parse_trusted(value: object) -> tuple[str, ...] | None:
    """The CA fingerprints a party reports it trusts (``["sha256:<hex>", ...]``), or None if absent."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or len(value) > MAX_TRUSTED:
        raise BadRequest(f"trusted must be a list of at most {MAX_TRUSTED} CA fingerprints")
    for item in value:
        if not isinstance(item, str) or not _FINGERPRINT.match(item):
            raise BadRequest(f"trusted: {item!r} is not a CA fingerprint like sha256:<64 hex digits>")
    return tuple(dict.fromkeys(value))


def parse_presenting(value: object) -> tuple[str, ...] | None:
    """The serials (hex) of the leaves a party reports its TLS contexts present, or None if absent."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest("presenting must be a comma-separated list of certificate serials (hex)")
    serials = [v.strip().lower() for v in value.split(",") if v.strip()]
    if len(serials) > MAX_PRESENTING:
        raise BadRequest(f"presenting: at most {MAX_PRESENTING} certificate serials")
    for serial in serials:
        if not _SERIAL.match(serial):
            raise BadRequest(f"presenting: {serial!r} is not a certificate serial (1-40 hex digits)")
    return tuple(dict.fromkeys(serials))


@dataclass(frozen=True)
class IssueResult:
    record: IssuedRecord
    ca_bundle_pem: str

    def body(self) -> dict[str, Any]:
        r = self.record
        return {
            "cert_pem": r.cert_pem,
            "ca_bundle_pem": self.ca_bundle_pem,
            "serial": r.serial,
            "ca_id": r.ca_id,
            "not_before": format_time(r.not_before),
            "not_after": format_time(r.not_after),
            "identity": r.identity.to_json(),
        }


class SignerCore:
    def __init__(
        self,
        store: CertStore,
        *,
        cert_ttl: dt.timedelta = DEFAULT_CERT_TTL,
        clock: Callable[[], dt.datetime] = utc_now,
        rotation_refresh: float = DEFAULT_ROTATION_REFRESH,
    ) -> None:
        self.store = store
        self.cert_ttl = cert_ttl
        self.clock = clock
        self.rotation_refresh = rotation_refresh  # 0: no refresh hint
        self._keys: dict[str, CAKey] = {}

    # -- signing -----------------------------------------------------------------------------------------

    def _signing_ca(self) -> tuple[Authorities, AuthorityRecord, CAKey]:
        current = self.store.read_authorities()
        active = current.active
        if active is None:
            raise SignerError("the signer has no active CA", error="no_active_ca")
        key = self._keys.get(active.id)
        if key is None:
            key = self._keys[active.id] = self.store.load_ca_key(active.id)
        return current, active, key

    def _issue(
        self, identity: Identity, public_key: CertificatePublicKeyTypes, now: dt.datetime, **record: Any
    ) -> tuple[IssuedRecord, str]:
        current, active, key = self._signing_ca()
        ca_cert = active.cert
        if ca_cert.not_valid_after_utc <= now:
            raise SignerError(f"the active CA {active.id} has expired", error="ca_expired")
        cert = issue_leaf(ca_cert, key, public_key, identity, now=now, ttl=self.cert_ttl)
        issued = IssuedRecord(
            serial=_serial(cert),
            identity=identity,
            ca_id=active.id,
            cert_pem=_pem(cert),
            not_before=cert.not_valid_before_utc,
            not_after=cert.not_valid_after_utc,
            issued_at=now,
            public_key_sha256=public_key_sha256(public_key),
            **record,
        )
        return issued, current.bundle_pem()

    # -- bootstrap ---------------------------------------------------------------------------------------

    def check_token(self, token: object) -> TokenRecord:
        """The usable token record for ``token``, else 401 (unknown), 409 (used) or 410 (expired)."""
        try:
            token_id, secret = parse_token(token)
        except MalformedToken as exc:
            raise Unauthorized(str(exc), error="invalid_token") from None
        record = self.store.get_token(token_id)
        if record is None or not secret_matches(secret, record):
            raise Unauthorized(f"unknown bootstrap token {token_id}", error="invalid_token")
        _usable(record, self.clock())
        return record

    def bootstrap(self, token: object, csr_pem: object) -> IssueResult:
        """A certificate for the CSR, if the token is valid, unused and allows the CSR's names.

        Refusals (bad CSR, names not allowed) leave the token unused; it is consumed atomically with
        the issuance, so two concurrent requests with one token get one certificate between them.
        """
        record = self.check_token(token)
        if not isinstance(csr_pem, str):
            raise BadRequest("csr_pem (a PEM certificate signing request) is required")
        csr = parse_csr(csr_pem)
        identity = match_csr(csr, record.binding)
        now = self.clock()
        issued, bundle = self._issue(identity, csr.public_key(), now, via="bootstrap", token_id=record.id)

        def consume(current: TokenRecord) -> TokenRecord:
            _usable(current, now)
            return replace(current, used_at=now, used_serial=issued.serial)

        self.store.update_token(record.id, consume)
        self.store.put_issued(issued)
        return IssueResult(issued, bundle)

    # -- renewal -----------------------------------------------------------------------------------------

    def _known(self, peer: x509.Certificate) -> IssuedRecord:
        serial = _serial(peer)
        record = self.store.get_issued(serial)
        if record is None or record.cert_pem.strip() != _pem(peer).strip():
            raise Unauthorized(
                f"certificate serial {serial} was not issued by this signer (or its record was pruned); "
                "bootstrap again with a new token",
                error="unknown_certificate",
            )
        return record

    def renew(
        self, peer: x509.Certificate | None, csr_pem: object, trusted: tuple[str, ...] | None = None
    ) -> IssueResult:
        """A new certificate for the same identity as ``peer`` (the verified TLS client certificate).

        The CSR must carry a new key and ask for the same names (a server: a subset of its hosts).
        Each certificate is renewed once; a retry with the same new key gets the same answer, so a
        lost response does not strand the caller.
        """
        if peer is None:
            raise Unauthorized(
                "renewal needs the current certificate as the TLS client certificate (mTLS)",
                error="client_certificate_required",
            )
        if not isinstance(csr_pem, str):
            raise BadRequest("csr_pem (a PEM certificate signing request) is required")
        current = self._known(peer)
        csr = parse_csr(csr_pem)
        new_key = public_key_sha256(csr.public_key())
        lost: IssuedRecord | None = None
        if current.successor is not None:
            successor = self.store.get_issued(current.successor)
            if successor is not None and successor.public_key_sha256 == new_key:
                return IssueResult(successor, self.store.read_authorities().bundle_pem())
            if successor is None or successor.reached_holder:
                raise Conflict(
                    f"certificate {current.serial} was already renewed (serial {current.successor}); "
                    "use the renewed certificate",
                    error="already_renewed",
                )
            # Nobody ever used the successor: its holder lost the answer together with the new key
            # (a crash before writing it). Without a new certificate it would need a new token.
            lost = successor
        if new_key == current.public_key_sha256:
            raise BadRequest(
                "the CSR reuses the current certificate's key: renew with a new key", error="key_reuse"
            )
        identity = match_csr(csr, current.identity.binding())
        now = self.clock()
        issued, bundle = self._issue(
            identity,
            csr.public_key(),
            now,
            via="renew",
            predecessor=current.serial,
            trusted=trusted if trusted is not None else current.trusted,
            trust_reported_at=now if trusted is not None else current.trust_reported_at,
        )
        self.store.put_issued(issued)
        expected = None if lost is None else lost.serial

        def link(record: IssuedRecord) -> IssuedRecord:
            if record.successor != expected:
                raise Conflict(
                    f"certificate {record.serial} was renewed concurrently (serial {record.successor})",
                    error="already_renewed",
                )
            return replace(record, successor=issued.serial)

        try:
            self.store.update_issued(current.serial, link)
        except SignerError:
            self.store.delete_issued(issued.serial)
            raise
        if lost is not None:
            with contextlib.suppress(NotFound):
                self.store.update_issued(lost.serial, lambda r: replace(r, superseded_by=issued.serial))
        return IssueResult(issued, bundle)

    # -- trust bundle ------------------------------------------------------------------------------------

    def trust_bundle(
        self,
        peer: x509.Certificate | None = None,
        trusted: tuple[str, ...] | None = None,
        presenting: tuple[str, ...] | None = None,
    ) -> dict[str, Any]:
        """The trust bundle; a caller with a client certificate that reports ``trusted`` (the CAs its
        TLS contexts trust) and/or ``presenting`` (the serials of the leaves they present) has them
        recorded: that is how ``status`` knows who trusts a pending CA and who presents a leaf of the
        active one. While a rotation is under way the answer carries ``refresh_after``
        (``rotation_refresh`` seconds): fetch again that soon, the next step may come any moment."""
        current = self.store.read_authorities()
        if peer is not None and (trusted is not None or presenting is not None):
            self._record_report(peer, trusted, presenting)
        answer: dict[str, Any] = {
            "ca_bundle_pem": current.bundle_pem(),
            "cas": [
                {
                    "id": r.id,
                    "state": r.state,
                    "fingerprint": r.fingerprint,
                    "not_after": format_time(r.cert.not_valid_after_utc),
                }
                for r in current.bundle()
            ],
        }
        if current.rotating and self.rotation_refresh > 0:
            answer["refresh_after"] = self.rotation_refresh
        return answer

    def _record_report(
        self, peer: x509.Certificate, trusted: tuple[str, ...] | None, presenting: tuple[str, ...] | None
    ) -> None:
        record = self.store.get_issued(_serial(peer))
        if record is None or record.cert_pem.strip() != _pem(peer).strip():
            return
        now = self.clock()
        fresh = record.seen_at is not None and now - record.seen_at < TRUST_REPORT_REFRESH
        unchanged = (trusted is None or record.trusted == trusted) and (
            presenting is None or record.presenting == presenting
        )
        if unchanged and fresh:
            return
        try:
            self.store.update_issued(record.serial, lambda r: r.with_report(trusted, presenting, now))
        except (NotFound, StoreConflict):
            pass

    # -- the signer's own certificate and housekeeping ---------------------------------------------------

    def issue_self(
        self,
        public_key: CertificatePublicKeyTypes,
        name: str,
        hosts: Sequence[str],
        *,
        predecessor: str | None = None,
    ) -> IssueResult:
        """The signer's own serving certificate, replacing ``predecessor`` (the serial of the one it
        served with until now, if any). Not a party of ``status``; ``retire`` waits for it to be
        from the active CA."""
        identity = Identity(kind="server", name=name, hosts=tuple(hosts))
        issued, bundle = self._issue(identity, public_key, self.clock(), via="self", predecessor=predecessor)
        self.store.put_issued(issued)
        if predecessor is not None:
            with contextlib.suppress(NotFound):
                self.store.update_issued(predecessor, lambda r: replace(r, successor=issued.serial))
        return IssueResult(issued, bundle)

    def prune(self) -> int:
        """Delete tokens and certificate records that expired more than a week ago."""
        now = self.clock()
        removed = 0
        for token in self.store.list_tokens():
            if token.expires_at < now - PRUNE_AFTER:
                self.store.delete_token(token.id)
                removed += 1
        for record in self.store.list_issued():
            if record.not_after < now - PRUNE_AFTER:
                self.store.delete_issued(record.serial)
                removed += 1
        return removed


def _usable(record: TokenRecord, now: dt.datetime) -> None:
    if record.used_at is not None:
        raise Conflict(
            f"bootstrap token {record.id} was already used at {format_time(record.used_at)}"
            f"{f' (certificate serial {record.used_serial})' if record.used_serial else ''}; "
            "tokens are single-use: create a new one",
            error="token_used",
        )
    if record.expired(now):
        raise Gone(
            f"bootstrap token {record.id} expired at {format_time(record.expires_at)}; create a new one",
            error="token_expired",
        )
