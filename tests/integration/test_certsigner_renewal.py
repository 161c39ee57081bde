"""Renewal and CA rotation end to end, over real HTTPS and TLS on loopback: parties bootstrap from a
running signer, renew at 80% of their lifetime, follow a full CA rotation, and never drop a live
connection."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import trio
from cryptography import x509

from clusterproxy_castore.rotation import RotationBlocked, status
from clusterproxy_certsigner.cli_commands import rotate_ca
from clusterproxy_certsigner.core import SignerCore
from clusterproxy_certsigner.testing import EchoClient, RunningSigner, serve_tls_echo, start_signer
from clusterproxy_protocol import certclient
from clusterproxy_protocol.certclient import CertFiles
from clusterproxy_protocol.config import ConfigError
from clusterproxy_protocol.reloader import ReloadingContext
from clusterproxy_protocol.renewer import CertRenewer, RenewalPolicy, renewal_time
from clusterproxy_protocol.tls import client_context
from tests.support.waiting import wait_until

# hour-long leaves (only the rotation moves them); trust refreshes every 0.1 s need a bucket that
# size, and the signer follows the store within 0.2 s
ROTATION_SIGNER = {
    "cert_ttl": dt.timedelta(hours=1),
    "store_poll": 0.2,
    "cert_burst": 100.0,
    "cert_rate": 50.0,
}


def _files(directory: Path, bundle: Path) -> CertFiles:
    directory.mkdir(parents=True, exist_ok=True)
    ca = directory / "ca.crt"
    ca.write_bytes(bundle.read_bytes())
    return CertFiles(cert=directory / "tls.crt", key=directory / "tls.key", ca=ca)


async def _server_party(signer: RunningSigner, directory: Path) -> CertFiles:
    files = _files(directory, signer.bundle)
    await certclient.bootstrap_files(
        signer.endpoint(),
        signer.server_token("proxy-server", ("localhost",)),
        files,
        lambda k: certclient.server_csr(k, "proxy-server", ["localhost"]),
    )
    return files


async def _agent_party(signer: RunningSigner, directory: Path, cluster: str = "cluster1") -> CertFiles:
    files = _files(directory, signer.bundle)
    await certclient.bootstrap_files(
        signer.endpoint(),
        signer.agent_token(cluster),
        files,
        lambda k: certclient.agent_csr(k, cluster, "agent-1"),
    )
    return files


def _serial(files: CertFiles) -> int:
    return x509.load_pem_x509_certificate(files.cert.read_bytes()).serial_number


async def test_renewer_renews_at_80_percent_and_hot_reloads(nursery: trio.Nursery, tmp_path: Path) -> None:
    signer = await start_signer(nursery, tmp_path / "signer", cert_ttl=dt.timedelta(seconds=4))
    server = await _server_party(signer, tmp_path / "server")
    first = x509.load_pem_x509_certificate(server.cert.read_bytes())
    reloading = ReloadingContext.server(server.cert, server.key, server.ca, alpn=[])
    port = await serve_tls_echo(nursery, reloading)

    # a long-lived client certificate straight from the store, so that it outlives the test
    long_core = SignerCore(signer.store, cert_ttl=dt.timedelta(hours=1))
    client_key = certclient.generate_key()
    issued = long_core.bootstrap(signer.client_token("tester"), certclient.client_csr(client_key, "tester"))
    client = _files(tmp_path / "client", signer.bundle)
    certclient.write_credentials(client, client_key, certclient.Issued.from_json(issued.body()))
    client_ctx = client_context(client.cert, client.key, client.ca, alpn=[])
    live = await EchoClient.connect(port, client_ctx)
    assert live.peer.serial_number == first.serial_number

    policy = RenewalPolicy(jitter=0.0, trust_refresh=0)
    renewed_at: list[dt.datetime] = []
    renewer = CertRenewer(
        signer.endpoint(server.ca),
        server,
        [reloading],
        policy,
        on_renewed=lambda _: renewed_at.append(dt.datetime.now(dt.UTC)),
    )
    await nursery.start(renewer.run)
    with trio.fail_after(20):
        await renewer.wait_renewed()

    # on time: not before 80% of the lifetime, well before the end
    assert renewed_at[0] >= renewal_time(first, policy, 0.0)
    assert renewed_at[0] < first.not_valid_after_utc
    second = _serial(server)
    assert second != first.serial_number
    assert reloading.context is not None and reloading.rebuilds == 0
    fresh = await EchoClient.connect(port, client_ctx)
    assert fresh.peer.serial_number == second
    assert await live.echo(b"alive") == b"alive" and live.peer.serial_number == first.serial_number
    record = signer.store.get_issued(format(first.serial_number, "x"))
    assert record is not None and record.successor == format(second, "x")
    await fresh.aclose()
    await live.aclose()


async def _until(predicate, what: str, timeout: float = 20.0) -> None:
    """Wait for ``predicate()`` (polling the store's view, with a deadline)."""
    await wait_until(predicate, timeout=timeout, what=what, interval=0.05)


async def test_full_ca_rotation_without_dropping_a_tunnel(nursery: trio.Nursery, tmp_path: Path) -> None:
    signer = await start_signer(nursery, tmp_path / "signer", **ROTATION_SIGNER)
    store = signer.store
    old_ca = store.read_authorities().active
    assert old_ca is not None
    server = await _server_party(signer, tmp_path / "server")
    agent = await _agent_party(signer, tmp_path / "agent")

    # the hub side serves on a reloading context; the agent dials with one
    server_tls = ReloadingContext.server(server.cert, server.key, server.ca, alpn=[])
    agent_tls = ReloadingContext.client(agent.cert, agent.key, agent.ca, alpn=[])
    port = await serve_tls_echo(nursery, server_tls)
    policy = RenewalPolicy(jitter=0.0, trust_refresh=0.1)
    renewers = [
        CertRenewer(signer.endpoint(server.ca), server, [server_tls], policy),
        CertRenewer(signer.endpoint(agent.ca), agent, [agent_tls], policy),
    ]
    for renewer in renewers:
        await nursery.start(renewer.run)
    tunnel = await EchoClient.connect(port, agent_tls())  # established before the rotation; must survive
    old_agent_key = (agent.cert.read_bytes(), agent.key.read_bytes())

    # step 1: the new CA enters every bundle, then every party reports it trusts it
    assert "step 1/3" in rotate_ca(store, "start")
    new_ca = store.read_authorities().pending
    assert new_ca is not None
    await _until(
        lambda: status(store, now=dt.datetime.now(dt.UTC))["ready_for_next_step"],
        "every party to trust the new CA",
    )
    for files in (server, agent):
        assert new_ca.fingerprint in certclient.bundle_fingerprints(files.ca.read_bytes())
    assert new_ca.fingerprint in server_tls.trusted and new_ca.fingerprint in agent_tls.trusted
    assert await tunnel.echo(b"after step 1") == b"after step 1"

    # step 2: sign with the new CA; the signer moves its own certificate; every party sees the
    # activation at its next trust refresh and renews early (its hour-long leaf is far from 80%)
    assert all(r.renewals == 0 for r in renewers)
    assert "step 2/3" in rotate_ca(store, "activate")
    await signer.service.refresh()

    def presenting_new_leaves() -> bool:
        # The store counts a party as moved once its new leaf is issued; the party itself installs it
        # a moment later (files, then its context): wait for both, not just the store's view.
        for files, ctx in ((server, server_tls), (agent, agent_tls)):
            leaf = x509.load_pem_x509_certificate(files.cert.read_bytes())
            if leaf.issuer != new_ca.cert.subject or ctx.presenting != format(leaf.serial_number, "x"):
                return False
        return (
            all(r.renewals for r in renewers)
            and status(store, now=dt.datetime.now(dt.UTC))["ready_for_next_step"]
        )

    await _until(presenting_new_leaves, "every party to present a leaf of the new CA")
    assert [(r.renewals, r.early_renewals) for r in renewers] == [(1, 1), (1, 1)]
    for files, ctx in ((server, server_tls), (agent, agent_tls)):
        leaf = x509.load_pem_x509_certificate(files.cert.read_bytes())
        assert leaf.issuer == new_ca.cert.subject and ctx.presenting == format(leaf.serial_number, "x")
    moved = await EchoClient.connect(port, agent_tls())
    assert moved.peer.issuer == new_ca.cert.subject
    assert await tunnel.echo(b"after step 2") == b"after step 2"
    st = status(store, now=dt.datetime.now(dt.UTC))
    assert st["phase"] == "moving-leaves" and all(p["presents_active_ca"] for p in st["parties"])

    # step 3: retire the old CA; bundles shrink, contexts are rebuilt; the old tunnel lives on
    assert "step 3/3" in rotate_ca(store, "retire")
    await signer.service.refresh()
    await _until(
        lambda: all(
            certclient.bundle_fingerprints(f.ca.read_bytes()) == (new_ca.fingerprint,)
            for f in (server, agent)
        ),
        "the parties to drop the old CA",
    )
    await _until(lambda: server_tls.rebuilds == 1 and agent_tls.rebuilds == 1, "the contexts to be rebuilt")
    assert await tunnel.echo(b"after step 3") == b"after step 3"
    assert tunnel.peer.issuer == old_ca.cert.subject  # still the pre-rotation session
    again = await EchoClient.connect(port, agent_tls())
    assert await again.echo(b"new") == b"new"

    # a certificate from the retired CA is refused everywhere now
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "tls.crt").write_bytes(old_agent_key[0])
    (stale / "tls.key").write_bytes(old_agent_key[1])
    stale_ctx = client_context(stale / "tls.crt", stale / "tls.key", agent.ca, alpn=[])
    try:
        await EchoClient.connect(port, stale_ctx)
        raise AssertionError("a certificate of the retired CA was accepted")
    except trio.BrokenResourceError:
        pass
    assert not (store.root / "ca" / f"{old_ca.id}.key").exists()
    bundle = await certclient.fetch_trust_bundle(signer.endpoint(agent.ca))
    assert bundle.fingerprints == (new_ca.fingerprint,)
    for client in (tunnel, moved, again):
        await client.aclose()


async def test_a_context_that_did_not_load_the_new_leaf_holds_back_retire(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """What counts is what the contexts present, not what was written: a context still on the old
    leaf is reported, holds back `retire`, and is reloaded at the next trust refresh."""
    signer = await start_signer(nursery, tmp_path / "signer", **ROTATION_SIGNER)
    store = signer.store
    agent = await _agent_party(signer, tmp_path / "agent")
    live = ReloadingContext.client(agent.cert, agent.key, agent.ca, alpn=[])
    # a context that reads its own copy of the certificate and key: the renewer's writes do not
    # reach it (its trust bundle is the party's)
    copy = _files(tmp_path / "copy", agent.ca)
    for name in ("cert", "key"):
        getattr(copy, name).write_bytes(getattr(agent, name).read_bytes())
    behind = ReloadingContext.client(copy.cert, copy.key, agent.ca, alpn=[])
    old_serial = behind.presenting
    assert old_serial == format(_serial(agent), "x")
    renewer = CertRenewer(
        signer.endpoint(agent.ca), agent, [live, behind], RenewalPolicy(jitter=0.0, trust_refresh=0.1)
    )
    await nursery.start(renewer.run)
    rotate_ca(store, "start")
    await _until(lambda: status(store, now=dt.datetime.now(dt.UTC))["ready_for_next_step"], "trust")
    rotate_ca(store, "activate")
    await _until(lambda: renewer.renewals == 1, "the early renewal")
    new_serial = format(_serial(agent), "x")
    assert renewer.presenting == (new_serial, old_serial)
    await _until(
        lambda: (
            status(store, now=dt.datetime.now(dt.UTC))["parties"][0]["presenting"] is not None
            and len(status(store, now=dt.datetime.now(dt.UTC))["parties"][0]["presenting"]) == 2
        ),
        "the report of both leaves",
    )
    (party,) = status(store, now=dt.datetime.now(dt.UTC))["parties"]
    assert party["serial"] == new_serial and party["presents_active_ca"] is False
    assert f"presents {old_serial[:12]}" in party["waiting_for"]
    with pytest.raises(RotationBlocked):
        rotate_ca(store, "retire")
    # the copy catches up; the next trust refresh reloads the context and reports it
    for name in ("cert", "key"):
        getattr(copy, name).write_bytes(getattr(agent, name).read_bytes())
    await _until(
        lambda: status(store, now=dt.datetime.now(dt.UTC))["ready_for_next_step"], "the context to catch up"
    )
    assert renewer.presenting == (new_serial,) and renewer.renewals == 1
    assert "step 3/3" in rotate_ca(store, "retire")


async def test_with_the_default_trust_refresh_the_signers_hint_carries_a_rotation_in_seconds(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A party with the default minute-long trust refresh learns of a rotation with the report after
    a renewal (its trust loop is asleep for the minute); from then on the signer's hint (1 s here)
    wakes that loop, and every step reaches the party within seconds, far sooner than the minute. Once
    the rotation is over the party is back on its own interval."""
    signer = await start_signer(nursery, tmp_path / "signer", **ROTATION_SIGNER, rotation_refresh=1.0)
    store = signer.store

    def st() -> dict:
        return status(store, now=dt.datetime.now(dt.UTC))

    agent = await _agent_party(signer, tmp_path / "agent")
    agent_tls = ReloadingContext.client(agent.cert, agent.key, agent.ca, alpn=[])
    renewer = CertRenewer(signer.endpoint(agent.ca), agent, [agent_tls], RenewalPolicy(jitter=0.0))
    assert renewer.trust_interval == 60.0
    await nursery.start(renewer.run)
    await wait_until(lambda: st()["parties"][0]["seen_at"] is not None, what="the first trust report")
    assert renewer.refresh_after is None and renewer.trust_interval == 60.0

    rotate_ca(store, "start")
    new_ca = store.read_authorities().pending
    assert new_ca is not None
    renewer.request_renewal()
    await wait_until(lambda: renewer.trust_interval == 1.0, what="the signer's hint", timeout=5)
    await wait_until(lambda: st()["ready_for_next_step"], what="the party to trust the new CA", timeout=5)

    rotate_ca(store, "activate")
    await signer.service.refresh()
    renewals = renewer.renewals
    # well under the 60 s trust refresh: the next fetch comes within the hinted second, the early
    # renewal within half of it
    await wait_until(lambda: st()["ready_for_next_step"], what="a new-CA leaf presented", timeout=5)
    assert renewer.renewals == renewals + 1
    assert agent_tls.presenting == format(_serial(agent), "x")

    rotate_ca(store, "retire")
    await signer.service.refresh()
    await wait_until(
        lambda: certclient.bundle_fingerprints(agent.ca.read_bytes()) == (new_ca.fingerprint,),
        what="the party to drop the old CA",
        timeout=5,
    )
    assert renewer.refresh_after is None and renewer.trust_interval == 60.0
    assert renewer.failures == 0


async def test_renewal_retries_with_backoff_until_it_succeeds(nursery: trio.Nursery, tmp_path: Path) -> None:
    signer = await start_signer(nursery, tmp_path / "signer", cert_burst=1, cert_rate=4.0)
    agent = await _agent_party(signer, tmp_path / "agent")
    before = _serial(agent)
    # the certificate's bucket is empty now: the first renewal attempt gets 429
    await certclient.fetch_trust_bundle(signer.endpoint(agent.ca), cert=agent.cert, key=agent.key)
    policy = RenewalPolicy(jitter=0.0, trust_refresh=0, retry_initial=0.01, retry_max=0.05)
    renewer = CertRenewer(signer.endpoint(agent.ca), agent, [], policy)
    await nursery.start(renewer.run)
    renewer.request_renewal()
    with trio.fail_after(20):
        await renewer.wait_renewed()
    assert renewer.failures >= 1 and renewer.renewals == 1
    assert _serial(agent) != before and renewer.last_error is None


async def test_ensure_bootstrapped_only_uses_the_token_when_needed(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    signer = await start_signer(nursery, tmp_path / "signer")
    files = _files(tmp_path / "agent", signer.bundle)
    token = signer.agent_token("cluster1")

    def make_csr(key):
        return certclient.agent_csr(key, "cluster1", "agent-1")

    first = await certclient.ensure_bootstrapped(signer.endpoint(), files, token, make_csr)
    assert first is not None and certclient.usable_credentials(files) is not None
    # a restart with the same (now used) token: nothing to do, no request made
    assert await certclient.ensure_bootstrapped(signer.endpoint(), files, token, make_csr) is None
    files.key.write_text("lost")
    with pytest.raises(ConfigError, match="no bootstrap token"):
        await certclient.ensure_bootstrapped(signer.endpoint(), files, None, make_csr)
    with pytest.raises(certclient.SignerRequestError) as info:
        await certclient.ensure_bootstrapped(signer.endpoint(), files, token, make_csr)
    assert info.value.error == "token_used"
