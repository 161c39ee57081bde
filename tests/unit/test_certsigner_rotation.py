"""CA rotation with overlap: pending -> active -> previous -> retired, each step guarded by the parties'
state, and the status that tells an operator where things stand."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509

from clusterproxy_certsigner.cli_commands import create_token, format_status, rotate_ca
from clusterproxy_certsigner.core import SignerCore
from clusterproxy_certsigner.filestore import FileStore
from clusterproxy_certsigner.models import Binding
from clusterproxy_certsigner.rotation import (
    RotationBlocked,
    RotationError,
    activate_pending,
    ensure_ca,
    retire_previous,
    start_rotation,
    status,
)
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

    @staticmethod
    def _load(result) -> x509.Certificate:
        return x509.load_pem_x509_certificate(result.record.cert_pem.encode())

    def refresh_trust(self) -> None:
        bundle = self.core.trust_bundle()
        fps = tuple(c["fingerprint"] for c in bundle["cas"])
        self.core.trust_bundle(self.cert, fps)

    def renew(self) -> None:
        self.cert = self._load(
            self.core.renew(self.cert, certclient.csr_like(self.cert, certclient.generate_key()))
        )


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

    # 3. leaves move at renewal; retirement waits for the last one
    parties[0].renew()
    assert parties[0].cert.issuer == current.active.cert.subject
    with pytest.raises(RotationBlocked) as info:
        retire_previous(store, now=now)
    assert len(info.value.parties) == 2
    assert status(store, now=now)["phase"] == "moving-leaves"
    for p in parties[1:]:
        p.renew()
    retire_previous(store, now=now)
    current = store.read_authorities()
    assert [r.id for r in current.bundle()] == [new.id]
    assert current.get(old.id).state == "retired"
    assert not (Path(store.root) / "ca" / f"{old.id}.key").exists()
    assert status(store, now=now)["phase"] == "stable"


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
