"""The signing logic without HTTP: tokens (single use, expiry, binding), renewal rules, trust reports."""

from __future__ import annotations

import datetime as dt
import threading
from pathlib import Path

import pytest
from cryptography import x509

from clusterproxy_castore.filestore import FileStore
from clusterproxy_castore.models import Binding
from clusterproxy_castore.rotation import ensure_ca
from clusterproxy_castore.tokens import create_token
from clusterproxy_certsigner.core import SignerCore, parse_presenting, parse_trusted
from clusterproxy_certsigner.errors import BadRequest, Conflict, Forbidden, Gone, SignerError, Unauthorized
from clusterproxy_protocol import certclient
from clusterproxy_protocol.pki import DevCA, agent_identity_from_cert


class Clock:
    def __init__(self) -> None:
        self.now = dt.datetime.now(dt.UTC).replace(microsecond=0)

    def __call__(self) -> dt.datetime:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def core(tmp_path: Path, clock: Clock) -> SignerCore:
    store = FileStore(tmp_path / "store")
    ensure_ca(store, now=clock())
    return SignerCore(store, cert_ttl=dt.timedelta(hours=1), clock=clock)


def _token(
    core: SignerCore, binding: Binding, clock: Clock, ttl: dt.timedelta = dt.timedelta(minutes=10)
) -> str:
    return create_token(core.store, binding, ttl, now=clock()).token


def _agent(core: SignerCore, clock: Clock, cluster: str = "cluster1", agent: str = "agent-1"):
    key = certclient.generate_key()
    token = _token(core, Binding(kind="agent", cluster=cluster), clock)
    result = core.bootstrap(token, certclient.agent_csr(key, cluster, agent))
    return key, x509.load_pem_x509_certificate(result.record.cert_pem.encode()), result


def test_bootstrap_issues_an_agent_certificate_bound_to_the_cluster(core: SignerCore, clock: Clock) -> None:
    _, cert, result = _agent(core, clock)
    assert agent_identity_from_cert(cert) == ("cluster1", "agent-1")
    body = result.body()
    assert body["identity"]["cluster"] == "cluster1" and body["serial"] == format(cert.serial_number, "x")
    active = core.store.read_authorities().active
    assert active is not None and cert.issuer == active.cert.subject
    assert body["ca_bundle_pem"] == active.cert_pem
    record = core.store.get_issued(body["serial"])
    assert record is not None and record.via == "bootstrap" and record.token_id is not None


def test_a_token_works_once(core: SignerCore, clock: Clock) -> None:
    token = _token(core, Binding(kind="agent", cluster="cluster1"), clock)
    csr = certclient.agent_csr(certclient.generate_key(), "cluster1", "agent-1")
    first = core.bootstrap(token, csr)
    with pytest.raises(Conflict) as info:
        core.bootstrap(token, certclient.agent_csr(certclient.generate_key(), "cluster1", "agent-2"))
    assert info.value.status == 409 and info.value.error == "token_used"
    assert first.record.serial in info.value.reason


def test_expired_token_is_gone(core: SignerCore, clock: Clock) -> None:
    token = _token(core, Binding(kind="agent", cluster="cluster1"), clock, ttl=dt.timedelta(minutes=1))
    clock.now += dt.timedelta(minutes=1)
    with pytest.raises(Gone) as info:
        core.bootstrap(token, certclient.agent_csr(certclient.generate_key(), "cluster1", "a"))
    assert info.value.status == 410 and info.value.error == "token_expired"


def test_unknown_or_wrong_secret_is_unauthorized(core: SignerCore, clock: Clock) -> None:
    token = _token(core, Binding(kind="agent", cluster="cluster1"), clock)
    csr = certclient.agent_csr(certclient.generate_key(), "cluster1", "a")
    forged = token[:-1] + ("A" if token[-1] != "A" else "B")
    for bad in (forged, "000000000000." + "x" * 43, "garbage", None, 42):
        with pytest.raises(Unauthorized) as info:
            core.bootstrap(bad, csr)
        assert info.value.status == 401
    assert core.bootstrap(token, csr).record.identity.cluster == "cluster1"  # the real one still works


def test_refusals_do_not_burn_the_token(core: SignerCore, clock: Clock) -> None:
    token = _token(core, Binding(kind="agent", cluster="cluster1"), clock)
    with pytest.raises(Forbidden, match="cluster2"):
        core.bootstrap(token, certclient.agent_csr(certclient.generate_key(), "cluster2", "a"))
    with pytest.raises(BadRequest):
        core.bootstrap(token, "not a csr")
    with pytest.raises(BadRequest):
        core.bootstrap(token, None)
    assert core.bootstrap(token, certclient.agent_csr(certclient.generate_key(), "cluster1", "a"))


def test_concurrent_bootstraps_with_one_token_issue_one_certificate(core: SignerCore, clock: Clock) -> None:
    token = _token(core, Binding(kind="agent", cluster="cluster1"), clock)
    outcomes: list[object] = []
    barrier = threading.Barrier(6)

    def attempt(i: int) -> None:
        csr = certclient.agent_csr(certclient.generate_key(), "cluster1", f"agent-{i}")
        barrier.wait()
        try:
            outcomes.append(core.bootstrap(token, csr))
        except SignerError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    issued = [o for o in outcomes if not isinstance(o, SignerError)]
    assert len(issued) == 1
    assert all(isinstance(o, Conflict) for o in outcomes if isinstance(o, SignerError))
    assert len(core.store.list_issued()) == 1


def test_renewal_keeps_the_identity_and_needs_a_new_key(core: SignerCore, clock: Clock) -> None:
    key, cert, first = _agent(core, clock)
    with pytest.raises(Unauthorized, match="mTLS"):
        core.renew(None, certclient.csr_like(cert, certclient.generate_key()))
    with pytest.raises(BadRequest) as info:
        core.renew(cert, certclient.csr_like(cert, key))
    assert info.value.error == "key_reuse"
    with pytest.raises(Forbidden):
        core.renew(cert, certclient.agent_csr(certclient.generate_key(), "cluster1", "someone-else"))
    new_key = certclient.generate_key()
    renewed = core.renew(cert, certclient.csr_like(cert, new_key), ("sha256:" + "a" * 64,))
    new_cert = x509.load_pem_x509_certificate(renewed.record.cert_pem.encode())
    assert agent_identity_from_cert(new_cert) == ("cluster1", "agent-1")
    assert new_cert.serial_number != cert.serial_number
    assert new_cert.public_key() == new_key.public_key()
    old = core.store.get_issued(first.record.serial)
    assert old is not None and old.successor == renewed.record.serial
    assert renewed.record.predecessor == first.record.serial
    assert renewed.record.trusted == ("sha256:" + "a" * 64,)


def test_a_retried_renewal_gets_the_same_certificate_and_a_second_renewal_is_refused(
    core: SignerCore, clock: Clock
) -> None:
    _, cert, _ = _agent(core, clock)
    new_key = certclient.generate_key()
    first = core.renew(cert, certclient.csr_like(cert, new_key))
    again = core.renew(cert, certclient.csr_like(cert, new_key))  # the answer was lost: retry
    assert again.record.serial == first.record.serial
    renewed = x509.load_pem_x509_certificate(first.record.cert_pem.encode())
    core.trust_bundle(renewed, None, (first.record.serial,))  # its holder uses it
    with pytest.raises(Conflict) as info:
        core.renew(cert, certclient.csr_like(cert, certclient.generate_key()))
    assert info.value.error == "already_renewed"


def test_a_certificate_the_signer_did_not_issue_cannot_renew(
    core: SignerCore, clock: Clock, tmp_path: Path
) -> None:
    foreign = DevCA.create_or_load(tmp_path / "dev").issue_agent("cluster1", "agent-1", tmp_path / "leaf")
    cert = x509.load_pem_x509_certificate(foreign.cert.read_bytes())
    with pytest.raises(Unauthorized) as info:
        core.renew(cert, certclient.csr_like(cert, certclient.generate_key()))
    assert info.value.error == "unknown_certificate"


def test_server_renewal_may_drop_hosts_but_not_add_them(core: SignerCore, clock: Clock) -> None:
    binding = Binding(kind="server", name="proxy-server", hosts=("localhost", "127.0.0.1"))
    token = _token(core, binding, clock)
    result = core.bootstrap(
        token, certclient.server_csr(certclient.generate_key(), "proxy-server", ["localhost", "127.0.0.1"])
    )
    cert = x509.load_pem_x509_certificate(result.record.cert_pem.encode())
    with pytest.raises(Forbidden, match="evil"):
        core.renew(
            cert,
            certclient.server_csr(certclient.generate_key(), "proxy-server", ["localhost", "evil.example"]),
        )
    renewed = core.renew(
        cert, certclient.server_csr(certclient.generate_key(), "proxy-server", ["localhost"])
    )
    assert renewed.record.identity.hosts == ("localhost",)


def test_trust_reports_are_recorded_for_known_certificates(core: SignerCore, clock: Clock) -> None:
    _, cert, result = _agent(core, clock)
    fp = core.store.read_authorities().bundle_fingerprints()
    body = core.trust_bundle(cert, tuple(fp))
    assert [c["fingerprint"] for c in body["cas"]] == fp
    record = core.store.get_issued(result.record.serial)
    assert record is not None and record.trusted == tuple(fp) and record.trust_reported_at == clock()
    assert core.trust_bundle(None, tuple(fp))["ca_bundle_pem"] == body["ca_bundle_pem"]


def test_what_a_party_presents_is_recorded_with_its_trust(core: SignerCore, clock: Clock) -> None:
    _, cert, result = _agent(core, clock)
    fp = tuple(core.store.read_authorities().bundle_fingerprints())
    serial = result.record.serial
    core.trust_bundle(cert, fp, (serial,))
    record = core.store.get_issued(serial)
    assert record is not None and record.presenting == (serial,) and record.seen_at == clock()
    # a report without the presenting part (an older party) keeps what was recorded
    clock.now += dt.timedelta(minutes=10)
    core.trust_bundle(cert, fp)
    record = core.store.get_issued(serial)
    assert record is not None and record.presenting == (serial,) and record.seen_at == clock()
    # an unchanged report within minutes is not written again; a changed one is, at once
    clock.now += dt.timedelta(seconds=5)
    core.trust_bundle(cert, fp, (serial,))
    assert core.store.get_issued(serial).seen_at == clock() - dt.timedelta(seconds=5)
    core.trust_bundle(cert, fp, (serial, "abc"))
    assert core.store.get_issued(serial).presenting == (serial, "abc")


def test_parse_presenting() -> None:
    assert parse_presenting(None) is None
    assert parse_presenting("") == ()
    assert parse_presenting("1F, 1f,2a") == ("1f", "2a")
    for bad in ("xyz", "1" * 41, ",".join(["1"] * 5), "-1"):
        with pytest.raises(BadRequest):
            parse_presenting(bad)


def test_a_renewal_whose_answer_never_reached_its_holder_can_be_redone(
    core: SignerCore, clock: Clock
) -> None:
    """The holder crashed after the signer issued a successor but before it wrote it (the key of the
    successor is lost): the predecessor may renew again as long as nobody ever reported using the
    successor, which stops counting as a party."""
    _, cert, result = _agent(core, clock)
    lost = core.renew(cert, certclient.csr_like(cert, certclient.generate_key())).record
    redone = core.renew(cert, certclient.csr_like(cert, certclient.generate_key())).record
    assert redone.serial != lost.serial and redone.predecessor == result.record.serial
    assert core.store.get_issued(result.record.serial).successor == redone.serial
    superseded = core.store.get_issued(lost.serial)
    assert superseded is not None and not superseded.live(clock()) and superseded.superseded
    # once the holder reported with the new certificate, the predecessor is done for good
    redone_cert = x509.load_pem_x509_certificate(redone.cert_pem.encode())
    core.trust_bundle(redone_cert, tuple(core.store.read_authorities().bundle_fingerprints()), ())
    with pytest.raises(Conflict) as info:
        core.renew(cert, certclient.csr_like(cert, certclient.generate_key()))
    assert info.value.error == "already_renewed"


def test_parse_trusted() -> None:
    fp = "sha256:" + "0" * 64
    assert parse_trusted(None) is None
    assert parse_trusted(f"{fp}, {fp}") == (fp,)
    assert parse_trusted([fp]) == (fp,)
    for bad in (["md5:00"], "x", [fp] * 17, {"a": 1}):
        with pytest.raises(BadRequest):
            parse_trusted(bad)


def test_prune_removes_long_expired_records(core: SignerCore, clock: Clock) -> None:
    _agent(core, clock)
    _token(core, Binding(kind="client", name="alice"), clock)
    assert core.prune() == 0
    clock.now += dt.timedelta(days=8)
    assert core.prune() == 3  # two tokens, one certificate
    assert core.store.list_issued() == [] and core.store.list_tokens() == []
