"""The reloader's pieces without a network: renewal schedule, backoff, and ReloadingContext semantics
(in place for a renewed certificate or an added CA, a new context when a CA leaves the bundle)."""

from __future__ import annotations

import datetime as dt
import random
import shutil
import ssl
from pathlib import Path

import pytest
import trio
import trio.testing
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from clusterproxy_protocol import certclient
from clusterproxy_protocol.config import ConfigError
from clusterproxy_protocol.pki import DevCA
from clusterproxy_protocol.reloader import ReloadingContext
from clusterproxy_protocol.renewer import (
    MIN_REFRESH_AFTER,
    RenewalPolicy,
    backoff_delay,
    early_renewal_delay,
    renewal_time,
    trust_refresh_interval,
)


def _cert(not_before: dt.datetime, hours: int) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "t")])
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(not_before)
        .not_valid_after(not_before + dt.timedelta(hours=hours))
        .sign(key, hashes.SHA256())
    )


def test_renewal_time_is_80_percent_minus_jitter() -> None:
    start = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    cert = _cert(start, 100)
    policy = RenewalPolicy(fraction=0.8, jitter=0.05)
    assert renewal_time(cert, policy, 0.0) == start + dt.timedelta(hours=80)
    assert renewal_time(cert, policy, 0.999999) > start + dt.timedelta(hours=75)
    times = {renewal_time(cert, policy, random.Random(i).random()) for i in range(20)}
    assert len(times) > 1 and all(
        start + dt.timedelta(hours=75) <= t <= start + dt.timedelta(hours=80) for t in times
    )


def test_backoff_grows_is_capped_and_jittered() -> None:
    policy = RenewalPolicy(retry_initial=1.0, retry_max=60.0)
    assert [backoff_delay(n, policy, 1.0) for n in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert backoff_delay(3, policy, 0.0) == 4.0  # half of 8
    assert backoff_delay(10_000, policy, 0.5) == 45.0  # no overflow for huge attempt counts


def test_policy_validation() -> None:
    for kwargs in ({"fraction": 1.0}, {"fraction": 0.5, "jitter": 0.5}, {"retry_initial": 0}, {"retry_max": 0.5},
                   {"trust_refresh": -1}, {"early_jitter": 1.5}, {"early_jitter": -0.1}):  # fmt: skip
        with pytest.raises(ValueError):
            RenewalPolicy(**kwargs)


def test_early_renewal_comes_within_a_jittered_fraction_of_the_trust_refresh() -> None:
    policy = RenewalPolicy(trust_refresh=300.0, early_jitter=0.5)
    assert early_renewal_delay(300.0, policy, 0.0) == 0.0
    assert early_renewal_delay(300.0, policy, 0.5) == 75.0
    delays = [early_renewal_delay(300.0, policy, random.Random(i).random()) for i in range(200)]
    assert all(0 <= d < 150 for d in delays) and max(delays) - min(delays) > 100  # spread out
    # during a rotation the interval is the signer's hint: the fleet moves within seconds
    assert early_renewal_delay(5.0, policy, 0.999) < 2.5


def test_the_trust_refresh_follows_the_signers_hint_only_when_sooner() -> None:
    policy = RenewalPolicy()
    assert policy.trust_refresh == 60.0
    assert trust_refresh_interval(policy, None) == 60.0
    assert trust_refresh_interval(policy, 5.0) == 5.0
    assert trust_refresh_interval(policy, 600.0) == 60.0
    assert trust_refresh_interval(policy, 0.001) == MIN_REFRESH_AFTER  # a hint cannot make us hammer
    assert trust_refresh_interval(RenewalPolicy(trust_refresh=2.0), 5.0) == 2.0
    assert trust_refresh_interval(RenewalPolicy(trust_refresh=0), 5.0) == 0  # off stays off


def test_a_refresh_hint_the_party_cannot_read_is_ignored_not_fatal(tmp_path: Path) -> None:
    pem = DevCA.create_or_load(tmp_path, name="ca-hint").ca_path.read_text()
    read = certclient.TrustBundle.from_json
    assert read({"ca_bundle_pem": pem, "cas": []}).refresh_after is None
    assert read({"ca_bundle_pem": pem, "refresh_after": 5}).refresh_after == 5.0
    for unreadable in ("5", -1, 0, float("nan"), float("inf"), True, None, [5]):
        bundle = read({"ca_bundle_pem": pem, "refresh_after": unreadable})
        assert bundle.refresh_after is None and len(bundle.fingerprints) == 1
    with pytest.raises(certclient.SignerRequestError, match="malformed"):
        read(["not", "an", "object"])


class Pki:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca1 = DevCA.create_or_load(root / "ca1", name="ca-one")
        self.ca2 = DevCA.create_or_load(root / "ca2", name="ca-two")
        self.bundle = root / "bundle.crt"
        self.server = self.ca1.issue_server("server", ["localhost"], root / "live", stem="server")

    def set_bundle(self, *cas: DevCA) -> None:
        self.bundle.write_bytes(b"".join(ca.ca_path.read_bytes() for ca in cas))


async def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> trio.SSLStream:
    a, b = trio.testing.memory_stream_pair()
    server = trio.SSLStream(b, server_ctx, server_side=True)
    client = trio.SSLStream(a, client_ctx, server_hostname="localhost")
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server.do_handshake)
                nursery.start_soon(client.do_handshake)
            async with (
                trio.open_nursery() as nursery
            ):  # TLS 1.3: the server's verdict on the client comes now
                nursery.start_soon(client.send_all, b"x")
                nursery.start_soon(server.receive_some, 1)
    except* trio.BrokenResourceError:
        raise Refused from None
    return client


class Refused(Exception):
    pass


def _serial(stream: trio.SSLStream) -> int:
    return x509.load_der_x509_certificate(stream.getpeercert(binary_form=True)).serial_number


async def test_reload_swaps_the_certificate_in_place(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    pki.set_bundle(pki.ca1)
    reloading = ReloadingContext.server(pki.server.cert, pki.server.key, pki.bundle, alpn=[])
    before = reloading.context
    client = pki.ca1.issue_client("c", tmp_path / "c")
    client_ctx = ssl.create_default_context(cafile=str(pki.bundle))
    client_ctx.load_cert_chain(client.cert, client.key)
    first = await _handshake(reloading(), client_ctx)
    pki.ca1.issue_server("server", ["localhost"], tmp_path / "live", stem="server")
    assert reloading.reload() == "reloaded"
    assert reloading.context is before and reloading.generation == 1
    second = await _handshake(reloading(), client_ctx)
    assert _serial(second) != _serial(first)
    assert _serial(second) == x509.load_pem_x509_certificate(pki.server.cert.read_bytes()).serial_number


async def test_added_ca_in_place_removed_ca_rebuilds(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    pki.set_bundle(pki.ca1)
    reloading = ReloadingContext.server(pki.server.cert, pki.server.key, pki.bundle, alpn=[])
    original = reloading.context
    newcomer = pki.ca2.issue_client("newcomer", tmp_path / "n")
    client_ctx = ssl.create_default_context(cafile=str(pki.ca1.ca_path))
    client_ctx.load_cert_chain(newcomer.cert, newcomer.key)
    with pytest.raises(Refused):
        await _handshake(reloading(), client_ctx)

    pki.set_bundle(pki.ca1, pki.ca2)
    assert reloading.reload() == "reloaded"
    assert reloading.context is original and len(reloading.trusted) == 2
    await _handshake(reloading(), client_ctx)

    oldtimer = pki.ca1.issue_client("oldtimer", tmp_path / "o")
    old_ctx = ssl.create_default_context(cafile=str(pki.ca1.ca_path))
    old_ctx.load_cert_chain(oldtimer.cert, oldtimer.key)
    pki.ca2.issue_server("server", ["localhost"], tmp_path / "live", stem="server")
    pki.set_bundle(pki.ca2)
    assert reloading.reload() == "rebuilt"
    assert reloading.context is not original and reloading.rebuilds == 1
    client_ctx2 = ssl.create_default_context(cafile=str(pki.ca2.ca_path))
    client_ctx2.load_cert_chain(newcomer.cert, newcomer.key)
    await _handshake(reloading(), client_ctx2)
    old_ctx.load_verify_locations(cafile=str(pki.ca2.ca_path))
    with pytest.raises(Refused):  # CA one is forgotten: its client is refused
        await _handshake(reloading(), old_ctx)


async def test_the_context_knows_which_certificate_it_presents(tmp_path: Path) -> None:
    """``presenting`` is the serial of the certificate loaded, in place or by a rebuild; a failed
    reload keeps the old one (that is what a party reports to the signer)."""

    def on_disk() -> str:
        return format(x509.load_pem_x509_certificate(pki.server.cert.read_bytes()).serial_number, "x")

    pki = Pki(tmp_path)
    pki.set_bundle(pki.ca1, pki.ca2)
    reloading = ReloadingContext.server(pki.server.cert, pki.server.key, pki.bundle, alpn=[])
    first = on_disk()
    assert reloading.presenting == first
    pki.ca1.issue_server("server", ["localhost"], tmp_path / "live", stem="server")
    assert reloading.presenting == first  # written is not loaded
    assert reloading.reload() == "reloaded" and reloading.presenting == on_disk() != first
    second = on_disk()
    client = pki.ca1.issue_client("c", tmp_path / "c")
    client_ctx = ssl.create_default_context(cafile=str(pki.bundle))
    client_ctx.load_cert_chain(client.cert, client.key)
    assert format(_serial(await _handshake(reloading(), client_ctx)), "x") == second
    pki.ca2.issue_server("server", ["localhost"], tmp_path / "live", stem="server")
    pki.set_bundle(pki.ca2)
    assert reloading.reload() == "rebuilt" and reloading.presenting == on_disk() != second
    third = on_disk()
    other = pki.ca2.issue_server("other", ["localhost"], tmp_path / "other")
    pki.ca2.issue_server("server", ["localhost"], tmp_path / "live", stem="server")
    shutil.copy(other.key, pki.server.key)
    with pytest.raises(ConfigError):
        reloading.reload()
    assert reloading.presenting == third
    no_cert = ReloadingContext.client(None, None, pki.bundle, alpn=[])
    assert no_cert.presenting is None


async def test_a_bad_file_keeps_the_old_context(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    pki.set_bundle(pki.ca1)
    reloading = ReloadingContext.server(pki.server.cert, pki.server.key, pki.bundle, alpn=[])
    ctx = reloading.context
    saved = tmp_path / "saved.key"
    shutil.copy(pki.server.key, saved)
    other = pki.ca1.issue_server("other", ["localhost"], tmp_path / "other")
    shutil.copy(other.key, pki.server.key)  # key no longer matches the certificate
    with pytest.raises(ConfigError, match="does not match"):
        reloading.reload()
    pki.bundle.write_text("garbage")
    with pytest.raises(ConfigError, match="no valid PEM"):
        reloading.reload()
    assert reloading.context is ctx and reloading.generation == 0
