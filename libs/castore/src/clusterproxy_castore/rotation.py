"""The CA's life: create it, rotate it with overlap, and report where a rotation stands.

A rotation has three steps, each a separate command so that an operator (or automation) checks the
status in between (docs/certificates.md has the procedure):

1. :func:`start_rotation`: a new CA enters the trust bundle as ``pending``. It signs nothing yet.
   Parties pick the new bundle up (trust refresh, or their next renewal) and report what they trust.
2. :func:`activate_pending`: once every live party trusts the new CA, it becomes ``active`` (signs
   every new certificate) and the old one ``previous`` (still trusted). Parties see the change at
   their next trust refresh and renew early, onto the new CA.
3. :func:`retire_previous`: once every live party *presents* a leaf of the new CA (it reports what
   its TLS contexts loaded, not just what the signer issued), it is ``retired``: it leaves the bundle
   and its key is deleted.

Steps 2 and 3 refuse (:class:`RotationBlocked`, naming the parties in the way) unless ``force``.
"""

from __future__ import annotations

import datetime as dt
import secrets
from dataclasses import replace
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from clusterproxy_protocol import new_ca

from .models import Authorities, AuthorityRecord, CAState, IssuedRecord, fingerprint, format_time
from .store import CertStore, StoreConflict

__all__ = [
    "DEFAULT_CA_DAYS",
    "RotationBlocked",
    "RotationError",
    "activate_pending",
    "ensure_ca",
    "live_parties",
    "retire_previous",
    "start_rotation",
    "status",
]

DEFAULT_CA_DAYS = 1825
ROTATE_WARNING = dt.timedelta(days=365)
RENEW_FRACTION = 0.8


class RotationError(Exception):
    """The step does not apply to the current state (e.g. activate without a pending CA)."""


class RotationBlocked(RotationError):
    """The step's precondition does not hold yet; ``parties`` are the records in the way and
    ``reasons`` says, by serial, why each one is."""

    def __init__(
        self, reason: str, parties: list[IssuedRecord], reasons: dict[str, str] | None = None
    ) -> None:
        super().__init__(reason)
        self.parties = parties
        self.reasons = reasons or {}


def _new_record(
    now: dt.datetime, days: int, state: CAState
) -> tuple[AuthorityRecord, ec.EllipticCurvePrivateKey]:
    stamp = now.strftime("%Y%m%d-%H%M%S")
    # a unique subject: OpenSSL looks issuers up by subject name, and CAs may overlap in the bundle
    cert, key = new_ca(f"cluster-proxy-ca-{stamp}-{secrets.token_hex(3)}", now=now, days=days)
    record = AuthorityRecord(
        id=fingerprint(cert).removeprefix("sha256:")[:16],
        state=state,
        cert_pem=cert.public_bytes(serialization.Encoding.PEM).decode(),
        created_at=now,
        activated_at=now if state == "active" else None,
    )
    return record, key


def ensure_ca(store: CertStore, *, now: dt.datetime, days: int = DEFAULT_CA_DAYS) -> Authorities:
    """The store's CAs, creating the first (active) CA when there is none. Safe against a concurrent
    creator: the loser of the compare-and-swap uses the winner's CA."""
    for _ in range(5):
        current = store.read_authorities()
        if current.active is not None:
            return current
        if current.records:
            raise RotationError(
                f"the store {store.description} has CAs but none is active: "
                + ", ".join(f"{r.id} ({r.state})" for r in current.records)
            )
        record, key = _new_record(now, days, "active")
        try:
            return store.write_authorities(
                [record], expected_version=current.version, new_keys={record.id: key}
            )
        except StoreConflict:
            continue
    raise RotationError("could not create the CA: the store kept changing")


#: A live certificate whose holder has not reported for this long is taken for gone, not waited for:
#: a pod restarted without its files bootstraps a new certificate and leaves the old one valid for up
#: to a day. Parties report at every trust refresh (1 min by default; every few seconds during a
#: rotation, by the signer's hint), a signer at every store poll; keep it above the longest of those.
SILENT_AFTER = dt.timedelta(minutes=15)


def _heard(r: IssuedRecord, now: dt.datetime, silent_after: dt.timedelta) -> bool:
    return now - r.last_heard() < silent_after


def live_parties(
    store: CertStore, now: dt.datetime, silent_after: dt.timedelta = SILENT_AFTER
) -> list[IssuedRecord]:
    """The holders of every valid, not-yet-renewed certificate heard from lately, except the signer's own."""
    return [
        r for r in store.list_issued() if r.live(now) and r.via != "self" and _heard(r, now, silent_after)
    ]


def signer_certificates(
    store: CertStore, now: dt.datetime, silent_after: dt.timedelta = SILENT_AFTER
) -> list[IssuedRecord]:
    """The certificates the signer serves with (one per signer process; each replaces the one before):
    it reports what its TLS context trusts and presents like any party, at every store poll."""
    return [
        r for r in store.list_issued() if r.live(now) and r.via == "self" and _heard(r, now, silent_after)
    ]


def silent_parties(
    store: CertStore, now: dt.datetime, silent_after: dt.timedelta = SILENT_AFTER
) -> list[IssuedRecord]:
    """Valid, not-yet-renewed certificates (the signer's own included) not heard from for
    ``silent_after``: shown by status, never waited for by activate and retire."""
    return [r for r in store.list_issued() if r.live(now) and not _heard(r, now, silent_after)]


def _write(store: CertStore, current: Authorities, records: list[AuthorityRecord], **kw: Any) -> Authorities:
    try:
        return store.write_authorities(records, expected_version=current.version, **kw)
    except StoreConflict as exc:
        raise RotationError(f"{exc}; run the command again") from None


def start_rotation(store: CertStore, *, now: dt.datetime, days: int = DEFAULT_CA_DAYS) -> AuthorityRecord:
    """Step 1: add a new, ``pending`` CA to the trust bundle."""
    current = store.read_authorities()
    if current.active is None:
        raise RotationError("there is no active CA to rotate from (start the signer or run `init` first)")
    if current.pending is not None:
        raise RotationError(
            f"a rotation is already under way: CA {current.pending.id} is pending; "
            "next step: rotate-ca activate"
        )
    if current.previous is not None:
        raise RotationError(
            f"the last rotation is not finished: CA {current.previous.id} is still trusted as previous; "
            "next step: rotate-ca retire"
        )
    record, key = _new_record(now, days, "pending")
    _write(store, current, [*current.records, record], new_keys={record.id: key})
    return record


def activate_blockers(
    store: CertStore, current: Authorities, now: dt.datetime, silent_after: dt.timedelta = SILENT_AFTER
) -> list[tuple[IssuedRecord, str]]:
    """Every live party (and signer) whose TLS contexts do not trust the pending CA yet, with why."""
    pending = current.pending
    assert pending is not None
    fp = pending.fingerprint
    found = [
        (p, "it has not reported what it trusts" if p.trusted is None else "it does not trust the new CA yet")
        for p in live_parties(store, now, silent_after)
        if p.trusted is None or fp not in p.trusted
    ]
    found += [
        (r, "the signer has not loaded the new CA yet (it does within --store-poll)")
        for r in signer_certificates(store, now, silent_after)
        if r.trusted is None or fp not in r.trusted
    ]
    return found


def activate_pending(
    store: CertStore, *, now: dt.datetime, force: bool = False, silent_after: dt.timedelta = SILENT_AFTER
) -> AuthorityRecord:
    """Step 2: the pending CA signs from now on; the active one becomes ``previous`` (still trusted)."""
    current = store.read_authorities()
    pending, active = current.pending, current.active
    if pending is None:
        raise RotationError("no CA is pending: start a rotation first (rotate-ca start)")
    blockers = activate_blockers(store, current, now, silent_after)
    if blockers and not force:
        raise RotationBlocked(
            f"{len(blockers)} part{'y does' if len(blockers) == 1 else 'ies do'} not trust the new CA "
            f"{pending.id} yet; wait for their trust refresh (see status), or use --force to accept "
            "that they fail to verify peers with new certificates",
            [p for p, _ in blockers],
            {p.serial: reason for p, reason in blockers},
        )
    records = []
    for r in current.records:
        if active is not None and r.id == active.id:
            r = replace(r, state="previous")
        elif r.id == pending.id:
            r = replace(r, state="active", activated_at=now)
        records.append(r)
    _write(store, current, records)
    return replace(pending, state="active", activated_at=now)


def _short(serial: str) -> str:
    return serial[:12]


MAX_UNREPORTED_RENEWALS = 8


def _presenting_blocker(
    p: IssuedRecord,
    serials: tuple[str, ...],
    previous: AuthorityRecord,
    active: AuthorityRecord,
    store: CertStore,
) -> str | None:
    """Why the reported ``serials`` (what ``p``'s holder presents) are not all new-CA leaves of its own."""
    if not serials:
        return "it reports presenting no certificate it can name"
    for serial in serials:
        record = p if serial == p.serial else store.get_issued(serial)
        if record is None or record.identity.key != p.identity.key:
            return f"it presents {_short(serial)}, a certificate the signer cannot match to it"
        if record.ca_id != active.id:
            which = "previous" if record.ca_id == previous.id else "another"
            return (
                f"it presents {_short(serial)}, from the {which} CA: its TLS contexts have not loaded "
                f"{_short(p.serial)} yet"
            )
    return None


def _retire_blocker(
    p: IssuedRecord, previous: AuthorityRecord, active: AuthorityRecord, store: CertStore, now: dt.datetime
) -> str | None:
    """Why the holder of ``p`` might still present a leaf of the previous CA; None if it cannot."""
    if p.ca_id == previous.id:
        return f"its certificate {_short(p.serial)} is from the previous CA"
    if p.presenting is not None:
        return _presenting_blocker(p, p.presenting, previous, active, store)
    # Never reported with p: its holder may still present what it held before p (back to its last
    # report, or to a leaf of the previous CA that is still valid).
    record = p
    for _ in range(MAX_UNREPORTED_RENEWALS):
        before = None if record.predecessor is None else store.get_issued(record.predecessor)
        if before is None or before.not_after <= now:
            return None  # bootstrapped on the new CA, or nothing older it could still present
        if before.ca_id == previous.id:
            return (
                f"it was renewed onto the new CA ({_short(p.serial)}) but has not reported presenting it;"
                f" its last report{_seen(before)} was with {_short(before.serial)} from the previous CA"
            )
        if before.presenting is not None:
            why = _presenting_blocker(before, before.presenting, previous, active, store)
            return (
                None if why is None else f"it has not reported presenting {_short(p.serial)}; before, {why}"
            )
        record = before
    return f"it has not reported presenting {_short(p.serial)} through {MAX_UNREPORTED_RENEWALS} renewals"


def _seen(record: IssuedRecord) -> str:
    return "" if record.seen_at is None else f" ({format_time(record.seen_at)})"


def retire_blockers(
    store: CertStore, current: Authorities, now: dt.datetime, silent_after: dt.timedelta = SILENT_AFTER
) -> list[tuple[IssuedRecord, str]]:
    """Every live party that may still present a leaf of the previous CA, with the reason."""
    previous, active = current.previous, current.active
    assert previous is not None and active is not None
    found = []
    for p in live_parties(store, now, silent_after):
        reason = _retire_blocker(p, previous, active, store, now)
        if reason is not None:
            found.append((p, reason))
    for own in signer_certificates(store, now, silent_after):
        reason = _retire_blocker(own, previous, active, store, now)
        if reason is not None:
            found.append((own, f"the signer (it re-issues its certificate within --store-poll): {reason}"))
    return found


def retire_previous(
    store: CertStore, *, now: dt.datetime, force: bool = False, silent_after: dt.timedelta = SILENT_AFTER
) -> AuthorityRecord:
    """Step 3: the previous CA leaves the trust bundle; its key is deleted."""
    current = store.read_authorities()
    previous = current.previous
    if previous is None:
        raise RotationError("no previous CA to retire (activate the pending CA first: rotate-ca activate)")
    blockers = retire_blockers(store, current, now, silent_after)
    if blockers and not force:
        n = len(blockers)
        raise RotationBlocked(
            f"{n} part{'y does' if n == 1 else 'ies do'} not present a certificate of the new CA yet "
            f"(they would fail handshakes once CA {previous.id} leaves the bundles); parties renew onto "
            "the new CA soon after their next trust refresh: wait (see status), or use --force to cut "
            "them off",
            [p for p, _ in blockers],
            {p.serial: reason for p, reason in blockers},
        )
    records = [
        replace(r, state="retired", retired_at=now) if r.id == previous.id else r for r in current.records
    ]
    _write(store, current, records)
    return replace(previous, state="retired", retired_at=now)


# --- status --------------------------------------------------------------------------------------------


def _renew_due(record: IssuedRecord) -> dt.datetime:
    return record.not_before + (record.not_after - record.not_before) * RENEW_FRACTION


def _presenting_json(p: IssuedRecord, store: CertStore) -> list[dict[str, Any]] | None:
    if p.presenting is None:
        return None
    found = []
    for serial in p.presenting:
        record = p if serial == p.serial else store.get_issued(serial)
        mine = record is not None and record.identity.key == p.identity.key
        found.append({"serial": serial, "ca_id": record.ca_id if record is not None and mine else None})
    return found


def _party_json(
    p: IssuedRecord, current: Authorities, store: CertStore, waiting_for: str | None
) -> dict[str, Any]:
    by_fp = {r.fingerprint: r.id for r in current.records}
    pending, active = current.pending, current.active
    presenting = _presenting_json(p, store)
    return {
        "identity": p.identity.key,
        "kind": p.identity.kind,
        "serial": p.serial,
        "ca_id": p.ca_id,
        "on_active_ca": active is not None and p.ca_id == active.id,
        "not_after": format_time(p.not_after),
        "renew_due": format_time(_renew_due(p)),
        "trusted_cas": None if p.trusted is None else [by_fp.get(fp, fp) for fp in p.trusted],
        "trusts_pending": None if pending is None or p.trusted is None else pending.fingerprint in p.trusted,
        "trust_reported_at": format_time(p.trust_reported_at),
        "presenting": presenting,
        "presents_active_ca": None
        if presenting is None or active is None
        else bool(presenting) and all(x["ca_id"] == active.id for x in presenting),
        "seen_at": format_time(p.seen_at),
        "waiting_for": waiting_for,
    }


def _phase(current: Authorities) -> str:
    if current.active is None:
        return "no-ca"
    if current.pending is not None:
        return "new-ca-pending"
    if current.previous is not None:
        return "moving-leaves"
    return "stable"


def _minutes(span: dt.timedelta) -> str:
    return f"{span.total_seconds() / 60:g} min"


def _names(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def status(
    store: CertStore, *, now: dt.datetime, silent_after: dt.timedelta = SILENT_AFTER
) -> dict[str, Any]:
    """Everything an operator needs to judge the PKI and the next rotation step, as JSON-able data."""
    current = store.read_authorities()
    parties = live_parties(store, now, silent_after)
    silent = silent_parties(store, now, silent_after)
    phase = _phase(current)
    warnings: list[str] = []
    blockers: list[tuple[IssuedRecord, str]] = []
    waiting: dict[str, str] = {}
    ready = False
    if phase == "no-ca":
        next_step = "create the CA: start the signer, or run `cluster-proxy-cert-signer init`"
    elif phase == "stable":
        assert current.active is not None
        expires = current.active.cert.not_valid_after_utc
        next_step = f"none; rotate (rotate-ca start) well before the CA expires at {format_time(expires)}"
        if expires - now < ROTATE_WARNING:
            warnings.append(f"the active CA expires at {format_time(expires)}: start a rotation now")
    elif phase == "new-ca-pending":
        blockers = activate_blockers(store, current, now, silent_after)
        waiting = {p.serial: reason for p, reason in blockers}
        ready = not blockers
        names = [p.identity.key for p, _ in blockers]
        next_step = (
            "every party trusts the new CA: run rotate-ca activate"
            if ready
            else f"wait: {len(blockers)} parties do not trust the new CA yet ({_names(names)})"
        )
    else:
        blockers = retire_blockers(store, current, now, silent_after)
        waiting = {p.serial: reason for p, reason in blockers}
        ready = not blockers
        names = [p.identity.key for p, _ in blockers]
        next_step = (
            "every party presents a certificate of the new CA: run rotate-ca retire"
            if ready
            else f"wait: {len(blockers)} parties do not present a certificate of the new CA yet "
            f"({_names(names)}); parties renew onto it soon after their next trust refresh"
        )
    if silent and phase in ("new-ca-pending", "moving-leaves"):
        warnings.append(
            f"{len(silent)} certificate holder(s) silent for over {_minutes(silent_after)} are not waited "
            f"for ({_names([r.identity.key for r in silent])}): taken for gone (a pod restarted without its "
            "files, a stopped process); one that comes back on the previous CA after retire must bootstrap again"
        )
    tokens = store.list_tokens()
    return {
        "now": format_time(now),
        "store": store.description,
        "phase": phase,
        "next_step": next_step,
        "ready_for_next_step": ready,
        "warnings": warnings,
        "authorities": [
            {
                "id": r.id,
                "state": r.state,
                "subject": r.cert.subject.rfc4514_string(),
                "fingerprint": r.fingerprint,
                "not_after": format_time(r.cert.not_valid_after_utc),
                "created_at": format_time(r.created_at),
                "activated_at": format_time(r.activated_at),
                "retired_at": format_time(r.retired_at),
            }
            for r in current.records
        ],
        "parties": [
            _party_json(p, current, store, waiting.get(p.serial))
            for p in sorted(parties, key=lambda p: p.identity.key)
        ],
        "waiting_for": [
            {"identity": p.identity.key, "serial": p.serial, "reason": reason} for p, reason in blockers
        ],
        "silent": [
            {
                "identity": r.identity.key,
                "serial": r.serial,
                "ca_id": r.ca_id,
                "last_heard": format_time(r.last_heard()),
            }
            for r in sorted(silent, key=lambda r: r.identity.key)
        ],
        "tokens": {
            "unused": sum(1 for t in tokens if t.used_at is None and not t.expired(now)),
            "used": sum(1 for t in tokens if t.used_at is not None),
            "expired": sum(1 for t in tokens if t.used_at is None and t.expired(now)),
        },
    }
