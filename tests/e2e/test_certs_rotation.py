"""CA rotation end to end while traffic flows, with ``cluster-proxy certs`` commands against the store
of a running signer process: start (the new CA enters every bundle) -> every party reports trust ->
activate (leaves move at their renewal) -> retire (the old CA leaves every bundle; a straggler still
on it is held back until ``--force`` and then cut off). Zero failed streams; the long-lived streams
opened before the rotation survive it; the tunnel never reconnects."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from cryptography import x509

from clusterproxy_certsigner.core import SignerCore
from clusterproxy_certsigner.filestore import FileStore
from clusterproxy_certsigner.rotation import status
from clusterproxy_protocol import certclient
from clusterproxy_protocol.certclient import CertFiles
from clusterproxy_protocol.reloader import ReloadingContext
from tests.support.certs import count_events
from tests.support.procs import BIN
from tests.support.soak import Run, print_report, traffic_run
from tests.support.traffic import Traffic

CERT_TTL = "30s"  # leaves renew about every 25 s: the "move the leaves" step takes about that long
TRUST_REFRESH = "2s"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


async def certs(store: Path, *args: str, check: bool = True) -> tuple[int, str, str]:
    """``cluster-proxy certs ARGS --store STORE`` as a process; (status, stdout, stderr)."""
    result = await trio.run_process(
        [str(BIN / "cluster-proxy"), "certs", *args, "--store", str(store)],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    out, err = result.stdout.decode(), result.stderr.decode()
    if check:
        assert result.returncode == 0, f"certs {' '.join(args)}: {err}{out}"
    return result.returncode, out, err


async def until(condition: Callable[[], bool], what: str, timeout: float) -> float:
    """Wait for ``condition`` (polled, with a deadline); the seconds it took."""
    start = trio.current_time()
    with trio.move_on_after(timeout):
        while not condition():
            await trio.sleep(0.2)
        return trio.current_time() - start
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def issuer_id(path: Path, authorities: dict[str, x509.Certificate]) -> str | None:
    leaf = x509.load_pem_x509_certificate(path.read_bytes())
    for ca_id, ca in authorities.items():
        try:
            leaf.verify_directly_issued_by(ca)
            return ca_id
        except Exception:
            continue
    return None


async def straggler_party(run: Run, directory: Path) -> CertFiles:
    """A client that got an hour-long certificate from the (still active) old CA and reported that
    it trusts both CAs: it does not hold back `activate`, but it does hold back `retire`."""
    signer = run.signer
    files = signer.party(directory)
    key = certclient.generate_key()
    long_lived = SignerCore(signer.store, cert_ttl=dt.timedelta(hours=1))
    issued = long_lived.bootstrap(signer.client_token("straggler"), certclient.client_csr(key, "straggler"))
    certclient.write_credentials(files, key, certclient.Issued.from_json(issued.body()))
    await certclient.fetch_trust_bundle(
        signer.endpoint(files.ca),
        cert=files.cert,
        key=files.key,
        trusted=certclient.bundle_fingerprints(files.ca.read_bytes()),
    )
    return files


async def test_ca_rotation_under_traffic_drops_nothing(tmp_path: Path, nursery: trio.Nursery) -> None:
    timings: dict[str, float] = {}
    async with traffic_run(
        tmp_path, nursery, cert_ttl=CERT_TTL, trust_refresh=TRUST_REFRESH, client_trust_refresh=2.0
    ) as run:
        store_dir = run.signer.store_dir
        store = FileStore(store_dir)

        def st() -> dict:
            return status(store, now=dt.datetime.now(dt.UTC))

        parties = {
            "proxy-server": run.hub.files["proxy-server"],
            "proxy-agent": run.hub.files["agent-cluster1-agent-a"],
            "client": run.client.files,
        }
        old_id = st()["authorities"][0]["id"]
        assert st()["phase"] == "stable"

        # 1. start: the new CA enters every trust bundle; every party reports that it trusts it
        _, out, _ = await certs(store_dir, "rotate-ca", "start")
        print(out)
        pending = [a for a in st()["authorities"] if a["state"] == "pending"]
        assert len(pending) == 1
        new_id, new_fp = pending[0]["id"], pending[0]["fingerprint"]
        straggler = await straggler_party(run, tmp_path / "straggler")
        timings["every party trusts the new CA"] = await until(
            lambda: st()["ready_for_next_step"], "every party to trust the new CA", 60
        )
        _, out, _ = await certs(store_dir, "status")
        print(out)
        for files in parties.values():
            assert new_fp in certclient.bundle_fingerprints(files.ca.read_bytes())

        # 2. activate: the new CA signs; each leaf moves at its next renewal
        _, out, _ = await certs(store_dir, "rotate-ca", "activate")
        print(out)
        cas = {
            a["id"]: x509.load_pem_x509_certificate((store_dir / "ca" / f"{a['id']}.crt").read_bytes())
            for a in st()["authorities"]
        }
        timings["every leaf on the new CA"] = await until(
            lambda: all(issuer_id(f.cert, cas) == new_id for f in parties.values()),
            "every leaf to move to the new CA",
            90,
        )
        # the straggler still works (old CA, still trusted) and holds back `retire`
        straggling = straggler_traffic(run.traffic, straggler)
        await straggling.transfer("h2")
        await until(lambda: [p["identity"] for p in st()["parties"] if p["ca_id"] == old_id] == ["client:straggler"],
                    "only the straggler to be left on the old CA", 30)  # fmt: skip
        code, out, err = await certs(store_dir, "rotate-ca", "retire", check=False)
        print(err)
        assert code == 1 and "straggler" in err and "--force" in err

        # 3. retire (forced past the straggler): the old CA leaves every bundle, contexts are rebuilt
        refused_before = count_events(run.server, "tls_handshake_failed", port="client")
        _, out, _ = await certs(store_dir, "rotate-ca", "retire", "--force")
        print(out)
        timings["every bundle without the old CA"] = await until(
            lambda: all(
                certclient.bundle_fingerprints(f.ca.read_bytes()) == (new_fp,) for f in parties.values()
            ),
            "every party to drop the old CA",
            60,
        )
        assert not (store_dir / "ca" / f"{old_id}.key").exists()

        async def straggler_refused() -> bool:
            try:
                await straggling.transfer("h2")
            except Exception:
                return True
            return False

        with trio.fail_after(20):
            while not await straggler_refused():
                await trio.sleep(0.2)
        assert count_events(run.server, "tls_handshake_failed", port="client") > refused_before

        # renewal still works with the new CA alone: every party renews once more
        renewals = _renewals(run)
        timings["one more renewal each"] = await until(
            lambda: all(now > then for now, then in zip(_renewals(run), renewals, strict=True)),
            "every party to renew once more",
            60,
        )
        _, out, _ = await certs(store_dir, "status")
        print(out)
        assert st()["phase"] == "stable"
        assert {p["ca_id"] for p in st()["parties"] if p["identity"] != "client:straggler"} == {new_id}

    report = run.final
    assert report is not None
    report = {"rotation_steps_s": {k: round(v, 1) for k, v in timings.items()}, **report}
    print_report(f"CA rotation under traffic (leaf TTL {CERT_TTL}, trust refresh {TRUST_REFRESH})", report)

    assert report["failures"] == []
    assert set(report["failed_streams"].values()) == {0}, report["failed_streams"]
    assert report["long_lived_closed_cleanly"] == 2
    assert report["reconnects"] == {
        "agent_tunnel_connected": 1,
        "agent_tunnel_disconnected": 0,
        "agent_tunnel_reconnects_metric": 0.0,
        "server_agent_connected": 1,
        "server_agent_disconnected": 0,
    }
    # each party loaded the bundle twice: the new CA added, the old one dropped
    assert all(n >= 2 for n in report["trust_bundle_updates"].values()), report["trust_bundle_updates"]
    assert set(report["renewal_failures"].values()) == {0}
    assert run.new_handshakes_followed_renewals()
    assert json.dumps(report)  # printable as is


def _renewals(run: Run) -> list[int]:
    return [
        count_events(run.server, "cert_renewed"),
        count_events(run.agent, "cert_renewed"),
        run.client.renewer.renewals,
    ]


def straggler_traffic(traffic: Traffic, files: CertFiles) -> Traffic:
    """Transfers like ``traffic``'s, with the straggler's certificate (failures raise, not counted)."""
    h2 = ReloadingContext.client(files.cert, files.key, files.ca, alpn=["h2"])
    h1 = ReloadingContext.client(files.cert, files.key, files.ca, alpn=["http/1.1"])
    return Traffic(traffic.client_port, traffic.cluster, traffic.sized, traffic.echo, h2, h1)
