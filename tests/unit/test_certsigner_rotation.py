"""CA rotation with overlap: pending -> active -> previous -> retired, each step guarded by the parties'
state, and the status that tells an operator where things stand."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509

from clusterproxy_castore.filestore import FileStore
from clusterproxy_castore.models import Binding
from clusterproxy_castore.rotation import (
    RotationBlocked,
    RotationError,
    activate_pending,
    ensure_ca,
    retire_previous,
    start_rotation,
    status,
)
from clusterproxy_castore.tokens import create_token
from clusterproxy_certsigner.cli_commands import format_status, rotate_ca
from clusterproxy_certsigner.core import SignerCore
from clusterproxy_protocol import certclient


class Party:
    """A holder of a certificate, driven by hand: bootstrap, report trust, renew."""

    def __init__(self, core: SignerCore, cluster: str, now: dt.datetime) -> None:
        self.core = core
        key = certclient.generate_key()
        token = create_token(
            core.store, Binding(kind="agent", cluster=cluster), dt.timedelta(minutes=5), now=now
        )
        self.cert = self._load(core.bootstrap(token.token, certclient.agent_csr(key, cluster, "agent")))
        self.loaded = self.cert  # what its TLS contexts present

    @staticmethod
    def _load(result) -> x509.Certificate:
        return x509.load_pem_x509_certificate(result.record.cert_pem.encode())

    def refresh_trust(self) -> None:
        bundle = self.core.trust_bundle()
        fps = tuple(c["fingerprint"] for c in bundle["cas"])
        self.core.trust_bundle(self.cert, fps)

    def renew(self) -> None:
        """Get a new certificate (written to its files, not loaded into its contexts yet)."""
        self.cert = self._load(
            self.core.renew(self.cert, certclient.csr_like(self.cert, certclient.generate_key()))
        )

    def load(self) -> None:
        """Load the newest certificate into its contexts and report what it presents now."""
        self.loaded = self.cert
        self.report_presenting()

    @property
    def cert_serial(self) -> str:
        return format(self.cert.serial_number, "x")

    def report_presenting(self) -> None:
        self.core.trust_bundle(self.cert, None, (format(self.loaded.serial_number, "x"),))


@pytest.fixture
def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


@pytest.fixture
def core(tmp_path: Path, now: dt.datetime) -> SignerCore:
    store = FileStore(tmp_path / "store")
    ensure_ca(store, now=now)
    return SignerCore(store, cert_ttl=dt.timedelta(hours=1), clock=lambda: now)


def test_full_rotation_with_overlap(core: SignerCore, now: dt.datetime) -> None:
    store = core.store
    old = store.read_authorities().active
    assert old is not None
    parties = [Party(core, "cluster1", now), Party(core, "cluster2", now)]
    assert status(store, now=now)["phase"] == "stable"

    # 1. the new CA joins the bundle but signs nothing
    new = start_rotation(store, now=now)
    current = store.read_authorities()
    assert [r.id for r in current.bundle()] == [old.id, new.id]
    assert current.active == old and current.pending is not None and current.pending.id == new.id
    late = Party(core, "cluster3", now)
    assert late.cert.issuer == old.cert.subject
    parties.append(late)

    # 2. activation waits for every party to trust the new CA
    with pytest.raises(RotationBlocked) as info:
        activate_pending(store, now=now)
    assert len(info.value.parties) == 3
    st = status(store, now=now)
    assert st["phase"] == "new-ca-pending" and not st["ready_for_next_step"]
    assert {p["trusts_pending"] for p in st["parties"]} == {None}
    for p in parties[:2]:
        p.refresh_trust()
    with pytest.raises(RotationBlocked) as info:
        activate_pending(store, now=now)
    assert [r.identity.cluster for r in info.value.parties] == ["cluster3"]
    parties[2].refresh_trust()
    st = status(store, now=now)
    assert st["ready_for_next_step"] and "activate" in st["next_step"]
    activate_pending(store, now=now)
    current = store.read_authorities()
    assert current.active is not None and current.active.id == new.id
    assert current.previous is not None and current.previous.id == old.id
    assert [r.id for r in current.bundle()] == [new.id, old.id]

    # 3. leaves move at renewal; retirement waits until every party presents a new-CA leaf
    parties[0].renew()
    parties[0].load()
    assert parties[0].cert.issuer == current.active.cert.subject
    with pytest.raises(RotationBlocked) as info:
        retire_previous(store, now=now)
    assert len(info.value.parties) == 2
    assert status(store, now=now)["phase"] == "moving-leaves"
    for p in parties[1:]:
        p.renew()
    # issued is not enough: a party counts once it reports that it loaded the new leaf
    with pytest.raises(RotationBlocked) as info:
        retire_previous(store, now=now)
    assert sorted(r.identity.cluster for r in info.value.parties) == ["cluster2", "cluster3"]
    assert all("not reported presenting it" in reason for reason in info.value.reasons.values())
    for p in parties[1:]:
        p.load()
    retire_previous(store, now=now)
    current = store.read_authorities()
    assert [r.id for r in current.bundle()] == [new.id]
    assert current.get(old.id).state == "retired"
    assert not (Path(store.root) / "ca" / f"{old.id}.key").exists()
    assert status(store, now=now)["phase"] == "stable"


def test_the_trust_bundle_asks_for_sooner_refreshes_while_a_rotation_is_under_way(
    core: SignerCore, now: dt.datetime
) -> None:
    store = core.store
    party = Party(core, "cluster1", now)
    assert "refresh_after" not in core.trust_bundle()
    start_rotation(store, now=now)  # pending
    assert core.trust_bundle()["refresh_after"] == 5.0
    party.refresh_trust()
    activate_pending(store, now=now)  # previous still trusted
    answer = core.trust_bundle(party.cert, None, (party.cert_serial,))
    assert answer["refresh_after"] == 5.0
    assert certclient.TrustBundle.from_json(answer).refresh_after == 5.0  # what the parties read
    party.renew()
    party.load()
    retire_previous(store, now=now)  # over: the parties' own interval again
    assert "refresh_after" not in core.trust_bundle()
    start_rotation(store, now=now)
    assert "refresh_after" not in SignerCore(store, rotation_refresh=0).trust_bundle()
    assert SignerCore(store, rotation_refresh=2.5).trust_bundle()["refresh_after"] == 2.5


def _activated(core: SignerCore, now: dt.datetime, *parties: Party) -> None:
    start_rotation(core.store, now=now)
    for p in parties:
        p.refresh_trust()
    activate_pending(core.store, now=now)


def test_a_party_whose_contexts_still_present_the_old_leaf_holds_back_retire(
    core: SignerCore, now: dt.datetime
) -> None:
    party = Party(core, "cluster1", now)
    _activated(core, now, party)
    old_serial = format(party.loaded.serial_number, "x")
    party.renew()
    party.report_presenting()  # e.g. the reload failed: its contexts still hold the old leaf
    with pytest.raises(RotationBlocked) as info:
        retire_previous(core.store, now=now)
    (reason,) = info.value.reasons.values()
    assert f"presents {old_serial[:12]}" in reason and "previous CA" in reason
    st = status(core.store, now=now)
    assert not st["ready_for_next_step"] and "agent:cluster1/agent" in st["next_step"]
    (row,) = st["parties"]
    assert row["presents_active_ca"] is False and row["presenting"][0]["serial"] == old_serial
    assert "PRESENTS" in format_status(st)
    party.load()
    st = status(core.store, now=now)
    assert st["ready_for_next_step"] and st["parties"][0]["presents_active_ca"] is True
    retire_previous(core.store, now=now)


def test_a_renewal_before_the_report_of_a_failed_load_still_holds_back_retire(
    core: SignerCore, now: dt.datetime
) -> None:
    """Its last report said it presents the old leaf; a newer leaf it has not reported on changes
    nothing about what its contexts may still hold."""
    party = Party(core, "cluster1", now)
    _activated(core, now, party)
    old_serial = format(party.loaded.serial_number, "x")
    party.renew()
    party.report_presenting()  # the reload failed: still the old leaf
    party.renew()  # renewed again before it reports anything with the newest one
    with pytest.raises(RotationBlocked) as info:
        retire_previous(core.store, now=now)
    (reason,) = info.value.reasons.values()
    assert "has not reported presenting" in reason and f"presents {old_serial[:12]}" in reason
    party.load()
    retire_previous(core.store, now=now)


def test_a_party_bootstrapped_on_the_new_ca_does_not_hold_back_retire(
    core: SignerCore, now: dt.datetime
) -> None:
    """It can only present its new-CA leaf: there is no old one it might still hold."""
    _activated(core, now)
    Party(core, "cluster1", now)
    assert status(core.store, now=now)["ready_for_next_step"]
    retire_previous(core.store, now=now)


def test_a_party_that_lost_its_renewal_answer_renews_again_and_unblocks_retire(
    core: SignerCore, now: dt.datetime
) -> None:
    party = Party(core, "cluster1", now)
    party.report_presenting()
    _activated(core, now, party)
    old = party.cert
    party.renew()
    party.cert = old  # it crashed before writing the answer: back on the old files
    with pytest.raises(RotationBlocked):
        retire_previous(core.store, now=now)
    party.renew()  # its next attempt, with a new key
    party.load()
    retire_previous(core.store, now=now)


def test_the_signers_own_certificate_on_the_previous_ca_holds_back_retire(
    core: SignerCore, now: dt.datetime
) -> None:
    """The signer is a party too: activate waits until its context trusts the new CA, retire until
    it serves with a certificate of the new CA (it reports both at each store poll)."""

    def signer_reports(serial: str) -> None:
        cert = x509.load_pem_x509_certificate(core.store.get_issued(serial).cert_pem.encode())
        core.trust_bundle(cert, tuple(core.store.read_authorities().bundle_fingerprints()), (serial,))

    own = core.issue_self(certclient.generate_key().public_key(), "cert-signer", ("localhost",)).record
    signer_reports(own.serial)
    start_rotation(core.store, now=now)
    with pytest.raises(RotationBlocked) as info:
        activate_pending(core.store, now=now)
    assert "the signer has not loaded the new CA" in info.value.reasons[own.serial]
    signer_reports(own.serial)  # its next store poll
    activate_pending(core.store, now=now)
    with pytest.raises(RotationBlocked) as info:
        retire_previous(core.store, now=now)
    assert "the signer" in info.value.reasons[own.serial]
    assert "server:cert-signer" in status(core.store, now=now)["next_step"]
    renewed = core.issue_self(  # its next store poll re-issues it...
        certclient.generate_key().public_key(), "cert-signer", ("localhost",), predecessor=own.serial
    ).record
    with pytest.raises(RotationBlocked):  # ...which counts once it serves with it
        retire_previous(core.store, now=now)
    signer_reports(renewed.serial)
    retire_previous(core.store, now=now)


def test_steps_out_of_order_are_refused(core: SignerCore, now: dt.datetime) -> None:
    with pytest.raises(RotationError, match="no CA is pending"):
        activate_pending(core.store, now=now)
    with pytest.raises(RotationError, match="no previous CA"):
        retire_previous(core.store, now=now)
    start_rotation(core.store, now=now)
    with pytest.raises(RotationError, match="already under way"):
        start_rotation(core.store, now=now)
    activate_pending(core.store, now=now)  # no parties: nothing to wait for
    with pytest.raises(RotationError, match="not finished"):
        start_rotation(core.store, now=now)


def test_force_skips_the_safety_checks(core: SignerCore, now: dt.datetime) -> None:
    Party(core, "cluster1", now)
    start_rotation(core.store, now=now)
    with pytest.raises(RotationBlocked):
        activate_pending(core.store, now=now)
    activate_pending(core.store, now=now, force=True)
    with pytest.raises(RotationBlocked):
        retire_previous(core.store, now=now)
    retire_previous(core.store, now=now, force=True)
    assert len(core.store.read_authorities().bundle()) == 1


def test_rotate_ca_runs_the_next_step(core: SignerCore, now: dt.datetime) -> None:
    assert "step 1/3" in rotate_ca(core.store, now=now)
    assert "step 2/3" in rotate_ca(core.store, now=now)
    assert "step 3/3" in rotate_ca(core.store, now=now)
    assert "step 1/3" in rotate_ca(core.store, "start", now=now)
    with pytest.raises(RotationError, match="unknown rotation step"):
        rotate_ca(core.store, "jump", now=now)


def test_status_report_and_warning(core: SignerCore, now: dt.datetime, tmp_path: Path) -> None:
    Party(core, "cluster1", now)
    start_rotation(core.store, now=now)
    text = format_status(status(core.store, now=now))
    assert "new-ca-pending" in text and "agent:cluster1/agent" in text and "TRUSTS NEW CA" in text
    assert "unknown" in text
    short = FileStore(tmp_path / "short")
    ensure_ca(short, now=now, days=100)
    assert any("expires" in w for w in status(short, now=now)["warnings"])
    assert status(FileStore(tmp_path / "empty"), now=now)["phase"] == "no-ca"


def test_a_holder_gone_silent_is_not_waited_for(tmp_path: Path, now: dt.datetime) -> None:
    """A pod restarted without its files bootstraps again and leaves its old certificate valid: once
    its holder has been silent for --silent-after, rotation no longer waits for it (status names it)."""
    clock = [now]
    store = FileStore(tmp_path / "store")
    ensure_ca(store, now=now)
    core = SignerCore(store, cert_ttl=dt.timedelta(hours=1), clock=lambda: clock[0])
    gone = Party(core, "cluster1", now)  # its pod is deleted; the replacement bootstraps anew
    clock[0] = now + dt.timedelta(minutes=1)
    alive = Party(core, "cluster1", clock[0])
    start_rotation(store, now=clock[0])
    alive.refresh_trust()

    clock[0] = now + dt.timedelta(minutes=14)  # not silent long enough: still waited for
    alive.refresh_trust()
    with pytest.raises(RotationBlocked) as info:
        activate_pending(store, now=clock[0])
    assert [r.serial for r in info.value.parties] == [format(gone.cert.serial_number, "x")]

    clock[0] = now + dt.timedelta(minutes=16)
    alive.refresh_trust()
    st = status(store, now=clock[0])
    assert st["ready_for_next_step"], st["next_step"]
    assert [s["serial"] for s in st["silent"]] == [format(gone.cert.serial_number, "x")]
    assert any("silent for over 15 min" in w for w in st["warnings"])
    assert "silent (not heard from lately" in format_status(st)
    # a shorter limit is the operator's call; a longer one waits again
    with pytest.raises(RotationBlocked):
        activate_pending(store, now=clock[0], silent_after=dt.timedelta(minutes=20))
    activate_pending(store, now=clock[0])
    assert store.read_authorities().previous is not None

    # moving leaves: the silent holder of an old-CA leaf does not hold back retire either
    alive.renew()
    alive.load()
    retire_previous(store, now=clock[0])
    assert store.read_authorities().previous is None
