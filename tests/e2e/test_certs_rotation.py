"""CA rotation end to end while traffic flows, with ``cluster-proxy certs`` commands against the store
of a running signer process: start (the new CA enters every bundle) -> every party reports trust ->
activate (parties renew early, onto the new CA, and report presenting it) -> retire (the old CA
leaves every bundle; a straggler still on it is held back until ``--force`` and then cut off). Zero
failed streams; the long-lived streams opened before the rotation survive it; the tunnel never
reconnects. And with day-long leaves: start -> retire in seconds with a 2 s trust refresh, and within
5 minutes (about 1.5 in practice) with every default a user keeps (a 60 s trust refresh, the signer's
5 s hint during the rotation), with zero failed handshakes on fresh connections opened every 100 ms
throughout."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
from cryptography import x509

from clusterproxy_castore.filestore import FileStore
from clusterproxy_castore.rotation import status
from clusterproxy_certsigner.core import SignerCore
from clusterproxy_protocol import certclient
from clusterproxy_protocol.certclient import CertFiles
from clusterproxy_protocol.framing import PREFACE as H2_PREFACE
from clusterproxy_protocol.reloader import ReloadingContext
from clusterproxy_protocol.tls import client_context
from tests.support.certs import count_events
from tests.support.clients import h1_connect
from tests.support.procs import BIN
from tests.support.soak import Run, print_report, traffic_run
from tests.support.traffic import Traffic
from tests.support.waiting import wait_until

CERT_TTL = "30s"  # leaves renew about every 25 s: the "move the leaves" step takes about that long
TRUST_REFRESH = "2s"

pytestmark = [pytest.mark.slow, pytest.mark.clock_bound, pytest.mark.timeout(420)]


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
    """Wait for ``condition`` (polled every 0.2 s: `status` reads the whole store); the seconds it took."""
    start = trio.current_time()
    await wait_until(condition, timeout=timeout, what=what, interval=0.2)
    return trio.current_time() - start


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

        # 2. activate: the new CA signs; each party renews early, after its next trust refresh
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
        await until(lambda: [w["identity"] for w in st()["waiting_for"]] == ["client:straggler"],
                    "only the straggler to hold back retire", 30)  # fmt: skip
        assert [p["identity"] for p in st()["parties"] if p["ca_id"] == old_id] == ["client:straggler"]
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

        await wait_until(straggler_refused, timeout=20, what="the straggler to be refused", interval=0.2)
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


@dataclass
class FreshConnections:
    """A fresh TLS connection to the client port every ``interval`` (each started on time, whatever
    the previous one is doing), each a full round trip: CONNECT through the tunnel to the echo
    target, one message echoed, a clean close. The proxy-server verifies the probe's certificate and
    the probe verifies the server's, both with the trust of the moment."""

    name: str
    traffic: Traffic
    context: Callable[[], ssl.SSLContext]  # read at each connection
    interval: float = 0.1
    attempts: int = 0
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    server_issuers: list[tuple[float, str]] = field(default_factory=list)  # (start, issuer) per success

    async def run(self, stop: trio.Event) -> None:
        async with trio.open_nursery() as nursery:
            while not stop.is_set():
                started = trio.current_time()
                nursery.start_soon(self._once, started)
                with trio.move_on_at(started + self.interval):
                    await stop.wait()

    async def _once(self, started: float) -> None:
        self.attempts += 1
        self.starts.append(started)
        message = f"{self.name} {self.attempts} BYE\n".encode()
        try:
            with trio.fail_after(10):
                reply = await h1_connect(
                    self.traffic.client_port,
                    self.context(),
                    self.traffic.echo.address,
                    {"cluster-proxy-cluster": self.traffic.cluster},
                )
                if reply.status != 200 or reply.stream is None:
                    raise AssertionError(f"CONNECT refused: {reply.head!r} {reply.body!r}")
                der = reply.stream.getpeercert(binary_form=True)
                async with reply.stream:
                    await reply.stream.send_all(message)
                    echoed = b""
                    while len(echoed) < len(message):
                        chunk = await reply.stream.receive_some(len(message) - len(echoed))
                        if not chunk:
                            raise AssertionError(f"the echo ended after {echoed!r}")
                        echoed += chunk
                    if echoed != message or await reply.stream.receive_some(1) != b"":
                        raise AssertionError("echo mismatch or no clean end")
        except Exception as exc:  # every failure is counted and kept, never raised
            self.failures.append(f"{self.name} at {started:.2f}: {type(exc).__name__}: {exc}")
            return
        self.ok += 1
        issuer = x509.load_der_x509_certificate(der).issuer.rfc4514_string()
        self.server_issuers.append((started, issuer))

    def largest_gap(self) -> float:
        return max((b - a for a, b in itertools.pairwise(self.starts)), default=0.0)


@dataclass
class AgentPortHandshakes(FreshConnections):
    """A fresh TLS connection to the agent port with the agent's credentials every ``interval``: the
    proxy-server must accept the agent's certificate of the moment (its role and its CA) and start
    HTTP/2 toward it (its connection preface proves it); the probe then leaves without registering.
    (Agent certificates are refused on the client port: they carry the agent role.)"""

    agent_port: int = 0

    async def _once(self, started: float) -> None:
        self.attempts += 1
        self.starts.append(started)
        try:
            with trio.fail_after(10):
                tcp = await trio.open_tcp_stream("127.0.0.1", self.agent_port)
                stream = trio.SSLStream(tcp, self.context(), server_hostname="localhost")
                try:
                    await stream.do_handshake()
                    der = stream.getpeercert(binary_form=True)
                    received = b""
                    while len(received) < len(H2_PREFACE):
                        chunk = await stream.receive_some(len(H2_PREFACE) - len(received))
                        if not chunk:
                            raise AssertionError(f"the agent port closed after {received!r}")
                        received += chunk
                    if received != H2_PREFACE:
                        raise AssertionError(f"no HTTP/2 preface from the agent port: {received!r}")
                finally:
                    await trio.aclose_forcefully(stream)
        except Exception as exc:  # every failure is counted and kept, never raised
            self.failures.append(f"{self.name} at {started:.2f}: {type(exc).__name__}: {exc}")
            return
        self.ok += 1
        issuer = x509.load_der_x509_certificate(der).issuer.rfc4514_string()
        self.server_issuers.append((started, issuer))


@dataclass
class DayLongRotation:
    """What a rotation with day-long leaves measured: the steps' durations, the probes, the report."""

    timings: dict[str, float]
    probes: list[FreshConnections]
    report: dict


async def rotate_day_long_leaves(
    tmp_path: Path,
    nursery: trio.Nursery,
    title: str,
    *,
    trust_refresh: str | None,
    client_trust_refresh: float | None,
    signer_store_poll: str | None,
) -> DayLongRotation:
    """24 h leaves: start -> activate -> retire as soon as `status` allows each step, while traffic
    flows and two probes open a fresh connection every 100 ms (with the hub client's live context and
    with the agent's credentials). Checks what holds whatever the trust refresh: every party renews
    early exactly once, `retire` is accepted without --force, no probe fails, nothing is dropped."""
    timings: dict[str, float] = {}
    async with traffic_run(
        tmp_path,
        nursery,
        cert_ttl="24h",
        trust_refresh=trust_refresh,
        client_trust_refresh=client_trust_refresh,
        signer_store_poll=signer_store_poll,
    ) as run:
        store_dir = run.signer.store_dir
        store = FileStore(store_dir)

        def st() -> dict:
            return status(store, now=dt.datetime.now(dt.UTC))

        agent_files = run.hub.files["agent-cluster1-agent-a"]
        parties = [run.hub.files["proxy-server"], agent_files, run.client.files]
        probes = [
            FreshConnections("client", run.traffic, run.client.h1),
            AgentPortHandshakes(
                "agent-credentials",
                run.traffic,
                lambda: client_context(agent_files.cert, agent_files.key, agent_files.ca, alpn=["h2"]),
                agent_port=run.hub.agent_port,
            ),
        ]
        old_ca = store.read_authorities().active
        assert old_ca is not None
        stop_probes = trio.Event()
        async with trio.open_nursery() as probing:
            for probe in probes:
                probing.start_soon(probe.run, stop_probes)
            await until(lambda: all(p.ok >= 10 for p in probes), "the probes to get going", 30)
            assert _renewals(run) == [0, 0, 0]  # day-long leaves: nobody renews on its own

            started = trio.current_time()
            _, out, _ = await certs(store_dir, "rotate-ca", "start")
            print(out)
            new_ca = store.read_authorities().pending
            assert new_ca is not None
            await until(lambda: st()["ready_for_next_step"], "every party to trust the new CA", 180)
            timings["start -> every party and the signer trust the new CA"] = trio.current_time() - started
            activating = trio.current_time()
            _, out, _ = await certs(store_dir, "rotate-ca", "activate")
            print(out)
            await until(lambda: st()["ready_for_next_step"], "every party to present a new-CA leaf", 120)
            timings["activate -> every party presents a new-CA leaf"] = trio.current_time() - activating
            all_presenting = trio.current_time()
            assert all(p["presents_active_ca"] for p in st()["parties"])
            _, out, _ = await certs(store_dir, "status")
            print(out)
            _, out, _ = await certs(store_dir, "rotate-ca", "retire")  # no --force
            print(out)
            retired = trio.current_time()
            timings["start -> retire accepted"] = retired - started
            await until(
                lambda: all(
                    certclient.bundle_fingerprints(f.ca.read_bytes()) == (new_ca.fingerprint,)
                    for f in parties
                ),
                "every party to drop the old CA",
                120,
            )
            timings["retire -> every party dropped the old CA"] = trio.current_time() - retired
            mark = [p.attempts for p in probes]
            await until(
                lambda: all(p.attempts >= m + 20 for p, m in zip(probes, mark, strict=True)),
                "20 more fresh connections of each probe on the new CA alone",
                30,
            )
            stop_probes.set()
        renewals = _renewals(run)
        early = [
            count_events(run.server, "cert_early_renewal_scheduled"),
            count_events(run.agent, "cert_early_renewal_scheduled"),
            run.client.renewer.early_renewals,
        ]
        _, out, _ = await certs(store_dir, "status")
        print(out)

    report = run.final
    assert report is not None
    new_subject, old_subject = new_ca.cert.subject.rfc4514_string(), old_ca.cert.subject.rfc4514_string()
    report = {
        "rotation_steps_s": {k: round(v, 1) for k, v in timings.items()},
        "fresh_connections": {
            p.name: {
                "attempts": p.attempts,
                "ok": p.ok,
                "failed": len(p.failures),
                "largest_gap_between_starts_s": round(p.largest_gap(), 3),
                "met_old_ca_server_leaf": sum(1 for _, i in p.server_issuers if i == old_subject),
                "met_new_ca_server_leaf": sum(1 for _, i in p.server_issuers if i == new_subject),
            }
            for p in probes
        },
        "renewals_during_rotation": dict(
            zip(("proxy-server", "proxy-agent", "client"), renewals, strict=True)
        ),
        "early_renewals": dict(zip(("proxy-server", "proxy-agent", "client"), early, strict=True)),
        **report,
    }
    print_report(title, report)

    for probe in probes:
        assert probe.failures == [], probe.failures[:10]
        assert probe.ok == probe.attempts
        # on schedule throughout: about one every 100 ms, never a gap of a second
        assert probe.largest_gap() < 1.0, probe.largest_gap()
        duration = probe.starts[-1] - probe.starts[0]
        assert probe.attempts >= 0.8 * duration / probe.interval, (probe.attempts, duration)
        # once every party reported presenting a new-CA leaf, no fresh handshake met an old one
        late = [issuer for at, issuer in probe.server_issuers if at > all_presenting]
        assert late and set(late) == {new_subject}
        assert any(issuer == old_subject for _, issuer in probe.server_issuers)  # before: the old one
    assert renewals == [1, 1, 1] and early == [1, 1, 1]
    assert report["failures"] == []
    assert set(report["failed_streams"].values()) == {0}, report["failed_streams"]
    assert report["long_lived_closed_cleanly"] == 2
    assert report["reconnects"]["agent_tunnel_connected"] == 1
    assert report["reconnects"]["agent_tunnel_disconnected"] == 0
    assert report["reconnects"]["server_agent_disconnected"] == 0
    assert set(report["renewal_failures"].values()) == {0}
    return DayLongRotation(timings, probes, report)


async def test_rotation_with_day_long_leaves_takes_seconds_and_fails_no_handshake(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """24 h leaves, trust refresh 2 s: start -> activate -> retire in seconds. Parties renew early
    after the activation (not at 80% of a day), report the leaf they loaded, and `retire` is accepted
    without --force once every one presents a new-CA leaf. Fresh connections every 100 ms never fail:
    before, during and after the rotation, until every party dropped the old CA."""
    rotation = await rotate_day_long_leaves(
        tmp_path,
        nursery,
        f"CA rotation with 24 h leaves under traffic (trust refresh {TRUST_REFRESH})",
        trust_refresh=TRUST_REFRESH,
        client_trust_refresh=2.0,
        signer_store_poll="1s",
    )
    assert rotation.timings["start -> retire accepted"] < 60


@pytest.mark.timeout(600)
async def test_rotation_at_the_default_trust_refresh_completes_within_five_minutes(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """The issue's must-show, with every default a user keeps: 24 h leaves, no --trust-refresh for
    the proxy-server and the agent, the hub client's RenewalPolicy() as is, the signer's own
    --store-poll and --rotation-refresh. start -> retire within 5 minutes under continuous traffic,
    0 failed handshakes on fresh connections every 100 ms throughout. A party notices `start` within
    its minute-long trust refresh; from then on the signer's hint has it fetch every 5 s until the
    rotation is over."""
    rotation = await rotate_day_long_leaves(
        tmp_path,
        nursery,
        "CA rotation with 24 h leaves under traffic, every default (trust refresh 60 s, hint 5 s)",
        trust_refresh=None,
        client_trust_refresh=None,
        signer_store_poll=None,
    )
    assert rotation.timings["start -> retire accepted"] < 300
