"""The cert-signer process on the Kubernetes Secrets store (``serve --store kubernetes:NS/PREFIX``)
against a real kube-apiserver, running as a ServiceAccount that holds only the documented Role
(``kubestore.RBAC_YAML``; its token from TokenRequest, as a pod of it would present):

- a token made with the CLI turns into a certificate, which renews and reports; ``status`` sees it;
- a proxy-server and an agent bootstrapped from two signers sharing the store, and a hub client, go
  through a full CA rotation (start, activate, retire, none forced) under checked traffic;
- two signers racing on one store: many concurrent bootstraps, several per token across both signers,
  while the CA is activated and the old one retired: each token gives exactly one certificate, and
  no request that started after a step was committed got a certificate of a CA that step retired
  from signing;
- a ServiceAccount without the Role, a missing namespace, an API server that does not answer: the
  signer stops at start with the reason and what to do.

``-s`` prints the counts and timings."""

from __future__ import annotations

import datetime as dt
import json
import statistics
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
from cryptography import x509

from clusterproxy_castore.kubestore import KubernetesSecretStore, rbac_yaml
from clusterproxy_castore.models import Authorities, Binding
from clusterproxy_castore.rotation import activate_pending, retire_previous, start_rotation, status
from clusterproxy_castore.tokens import create_token
from clusterproxy_cli.commands import SIGNER, executable
from clusterproxy_protocol import certclient
from clusterproxy_protocol.certclient import CertFiles, SignerRequestError
from tests.support.certs import HUB_CLIENT, SERVER_HOSTS, ClientParty, SignedHub, SignerProcess, count_events
from tests.support.kube_identities import (
    create_namespace,
    delete_namespace,
    service_account_kubeconfig,
    store_secrets,
    token_kubeconfig,
)
from tests.support.kubeapi import KubeCluster, KubeClusters, free_port
from tests.support.procs import Process
from tests.support.soak import print_report
from tests.support.traffic import Traffic, serve_bye_echo, serve_sized
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SIGNER_SA = "cluster-proxy-cert-signer"
# the race's signers answer every request: the test is about the store, not the signer's rate limits
NO_RATE_LIMITS = (
    "--ip-burst",
    "100000",
    "--ip-rate",
    "100000",
    "--token-burst",
    "100",
    "--token-rate",
    "100",
)


@dataclass
class KubeEnv:
    """A namespace on the hub and the signer's ServiceAccount, bound to exactly ``RBAC_YAML``."""

    hub: KubeCluster
    namespace: str
    kubeconfig: Path  # the signer's ServiceAccount
    directory: Path
    prefixes: Iterator[int] = field(default_factory=lambda: iter(range(1, 1000)))

    def new_prefix(self) -> str:
        return f"ca{next(self.prefixes)}"

    def spec(self, prefix: str) -> str:
        return f"kubernetes:{self.namespace}/{prefix}"

    def store(self, prefix: str) -> KubernetesSecretStore:
        return KubernetesSecretStore(namespace=self.namespace, prefix=prefix, kubeconfig=self.kubeconfig)

    async def cli(self, prefix: str, *args: str, kubeconfig: Path | None = None) -> tuple[int, str, str]:
        """``cluster-proxy-cert-signer ARGS --store kubernetes:NS/PREFIX --kubeconfig K``."""
        argv = [
            executable(SIGNER),
            *args,
            "--store",
            self.spec(prefix),
            "--kubeconfig",
            str(kubeconfig or self.kubeconfig),
        ]
        done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
        return done.returncode, done.stdout.decode(), done.stderr.decode()


@pytest.fixture(scope="module")
def env(kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeEnv]:
    hub = kube_clusters["hub"]
    directory = tmp_path_factory.mktemp("signer-kube")
    namespace = create_namespace(hub, "cert-signer")
    kubeconfig = service_account_kubeconfig(
        hub, namespace, SIGNER_SA, directory / "signer.kubeconfig", role=rbac_yaml(namespace, SIGNER_SA)
    )
    yield KubeEnv(hub, namespace, kubeconfig, directory)
    delete_namespace(hub, namespace)


class KubeSignerProcess(SignerProcess):
    """``cluster-proxy-cert-signer serve`` on a Kubernetes store, as the signer's ServiceAccount."""

    def __init__(
        self,
        env: KubeEnv,
        prefix: str,
        log_dir: Path,
        *extra: str,
        name: str = "cert-signer",
        kubeconfig: Path | None = None,
    ) -> None:
        super().__init__(log_dir / name, log_dir, *extra, store_poll="1s")
        self.env = env
        self.prefix = prefix
        self.name = name
        self.kubeconfig = kubeconfig or env.kubeconfig

    def argv(self) -> list[str]:
        return [
            executable(SIGNER),
            "serve",
            "--store",
            self.env.spec(self.prefix),
            "--kubeconfig",
            str(self.kubeconfig),
            "--listen",
            "127.0.0.1:0",
            *[arg for host in SERVER_HOSTS for arg in ("--tls-host", host)],
            "--store-poll",
            str(self.store_poll),
            "--log-format",
            "json",
            *self.extra,
        ]

    async def start(self) -> KubeSignerProcess:
        self.process = Process(self.name, self.argv(), self.log_dir)
        started = await self.process.wait_event("signer_started")
        assert started["store"] == self.env.spec(self.prefix)
        self.port = int(str(started["listen"]).rsplit(":", 1)[1])
        return self

    @property
    def store(self) -> KubernetesSecretStore:  # type: ignore[override]
        return self.env.store(self.prefix)


def ca_of(cert: x509.Certificate, authorities: Authorities) -> str:
    """The id of the CA that signed ``cert`` (CA subjects are unique)."""
    found = [r.id for r in authorities.records if r.cert.subject == cert.issuer]
    assert len(found) == 1, cert.issuer
    return found[0]


async def in_thread(fn: Any, *args: Any) -> Any:
    return await trio.to_thread.run_sync(fn, *args)


# --- bootstrap, renewal, status ------------------------------------------------------------------------


async def test_a_token_from_the_cli_becomes_a_certificate_that_renews(env: KubeEnv, tmp_path: Path) -> None:
    prefix = env.new_prefix()
    signer = await KubeSignerProcess(env, prefix, tmp_path).start()
    try:
        code, out, err = await env.cli(prefix, "token", "create", "--client", "alice", "--json")
        assert code == 0, err
        token = json.loads(out)["token"]
        token_id = json.loads(out)["id"]

        files = signer.party(tmp_path / "alice")
        endpoint = signer.endpoint(files.ca)
        issued = await certclient.bootstrap_files(
            endpoint, token, files, lambda key: certclient.client_csr(key, "alice")
        )
        store = env.store(prefix)
        authorities = await in_thread(store.read_authorities)
        assert authorities.active is not None and ca_of(issued.cert, authorities) == authorities.active.id
        serial = issued.serial.lstrip("0")
        record = await in_thread(store.get_issued, serial)
        assert record is not None and record.identity.key == "client:alice" and record.token_id == token_id
        used = await in_thread(store.get_token, token_id)
        assert used is not None and used.used_serial == serial
        names = {s["metadata"]["name"] for s in store_secrets(env.hub, env.namespace, prefix)}
        assert {f"{prefix}-authorities", f"{prefix}-token-{token_id}", f"{prefix}-issued-{serial}"} <= names

        with pytest.raises(SignerRequestError) as reused:
            await certclient.bootstrap(
                endpoint, token, certclient.client_csr(certclient.generate_key(), "alice")
            )
        assert reused.value.status == 409 and reused.value.error == "token_used"

        key = certclient.generate_key()
        renewed = await certclient.renew(endpoint, files.cert, files.key, certclient.client_csr(key, "alice"))
        certclient.write_credentials(files, key, renewed)
        new_serial = renewed.serial.lstrip("0")
        old = await in_thread(store.get_issued, serial)
        assert old is not None and old.successor == new_serial
        await certclient.fetch_trust_bundle(
            endpoint,
            cert=files.cert,
            key=files.key,
            trusted=authorities.bundle_fingerprints(),
            presenting=[new_serial],
        )
        code, out, err = await env.cli(prefix, "status", "--json")
        assert code == 0, err
        parties = json.loads(out)["parties"]
        assert [(p["identity"], p["serial"], p["presents_active_ca"]) for p in parties] == [
            ("client:alice", new_serial, True)
        ]
        assert json.loads(out)["store"] == env.spec(prefix)
        assert Counter(signer.issued()) == Counter({"bootstrap": 1, "renew": 1})
    finally:
        signer.stop()


# --- a full CA rotation under traffic, two signers on one store ----------------------------------------


async def test_a_ca_rotation_on_the_secrets_store_drops_nothing(
    env: KubeEnv, tmp_path: Path, nursery: trio.Nursery
) -> None:
    prefix = env.new_prefix()
    signer_a = await KubeSignerProcess(env, prefix, tmp_path, "--cert-ttl", "1h", name="signer-a").start()
    signer_b = await KubeSignerProcess(env, prefix, tmp_path, "--cert-ttl", "1h", name="signer-b").start()
    hub = SignedHub(None, tmp_path, signer=signer_a)  # type: ignore[arg-type]
    store = env.store(prefix)
    timings: dict[str, float] = {}
    try:
        client = await ClientParty.bootstrap(
            signer_a, tmp_path / "client", "rotation-client", trust_refresh=1.0
        )  # type: ignore[arg-type]
        await client.start_renewer(nursery)
        # The hub reads its admin API with this renewing client: a certificate of its own that never
        # followed the trust bundle would hold the rotation at "not every party trusts it".
        hub.files[HUB_CLIENT] = client.files
        await hub.start_server(trust_refresh="1s")
        hub.signer = signer_b  # the agent bootstraps and renews with the other signer
        agent = hub.start_agent("cluster1", "agent-a", trust_refresh="1s")
        hub.signer = signer_a
        await hub.wait_agent("cluster1", "agent-a")
        traffic = Traffic(
            hub.client_port,
            "cluster1",
            await serve_sized(nursery),
            await serve_bye_echo(nursery),
            client.h2,
            client.h1,
        )
        parties: dict[str, CertFiles] = {
            "proxy-server": hub.files["proxy-server"],
            "proxy-agent": hub.files["agent-cluster1-agent-a"],
            "client": client.files,
        }

        def st() -> dict[str, Any]:
            return status(store, now=dt.datetime.now(dt.UTC))

        async def step(name: str) -> float:
            """``rotate-ca NAME`` (never forced) as a process; when it was started (trio time)."""
            begun = trio.current_time()
            code, out, err = await env.cli(prefix, "rotate-ca", name)
            assert code == 0, err + out
            timings[f"rotate-ca {name}: the command"] = round(trio.current_time() - begun, 1)
            return begun

        async def until(condition: Any, what: str, since: float) -> None:
            await wait_until(condition, timeout=60, what=what, interval=0.3)
            timings[what] = round(trio.current_time() - since, 1)

        def ready() -> Any:
            return in_thread(lambda: st()["ready_for_next_step"])

        stop = trio.Event()
        async with trio.open_nursery() as flows:
            await flows.start(traffic.long_stream, "h2", stop)
            await flows.start(traffic.long_stream, "http1", stop)
            flows.start_soon(traffic.loop, stop)
            old_id = (await in_thread(store.read_authorities)).active.id  # type: ignore[union-attr]

            # each step timed from the start of its command, which takes about a second itself
            await until(ready, "start -> every party trusts the new CA", await step("start"))
            begun = await step("activate")
            new_ca = (await in_thread(store.read_authorities)).active
            assert new_ca is not None and new_ca.id != old_id
            new_id, new_fp = new_ca.id, new_ca.fingerprint
            await until(ready, "activate -> every party presents a new-CA leaf", begun)
            await until(
                lambda: all(
                    certclient.bundle_fingerprints(f.ca.read_bytes()) == (new_fp,) for f in parties.values()
                ),
                "retire -> every bundle without the old CA",
                await step("retire"),
            )
            transfers_after_retire = sum(traffic.ok.values())
            await wait_until(
                lambda: sum(traffic.ok.values()) >= transfers_after_retire + 4,
                timeout=30,
                what="transfers after retire",
            )
            stop.set()

        final = await in_thread(st)
        authorities = await in_thread(store.read_authorities)
        secret = {s["metadata"]["name"]: s for s in store_secrets(env.hub, env.namespace, prefix)}[
            f"{prefix}-authorities"
        ]
        report = {
            "rotation_steps_s": timings,
            "transfers_ok": dict(traffic.ok),
            "bytes_checked": traffic.bytes_moved,
            "long_lived_exchanges": dict(traffic.long_exchanges),
            "failed_streams": traffic.failed,
            "renewals": {
                "proxy-server": count_events(hub.server, "cert_renewed"),  # type: ignore[arg-type]
                "proxy-agent": count_events(agent, "cert_renewed"),
                "client": client.renewer.renewals,
            },
            "signer_issued": {"signer-a": dict(signer_a.issued()), "signer-b": dict(signer_b.issued())},
            "agent_reconnects": count_events(agent, "tunnel_disconnected"),
        }
        print_report(
            "CA rotation on the Kubernetes Secrets store (two signers, 1 h leaves, 1 s trust refresh)", report
        )

        assert traffic.failures == [] and traffic.long_streams_closed_cleanly == 2
        assert report["agent_reconnects"] == 0 and count_events(agent, "tunnel_connected") == 1
        assert final["phase"] == "stable" and {p["ca_id"] for p in final["parties"]} == {new_id}
        assert [(r.id, r.state) for r in authorities.records] == [(old_id, "retired"), (new_id, "active")]
        assert f"{old_id}.key" not in secret["data"] and f"{new_id}.key" in secret["data"]
        # each signer re-issued its own serving certificate from the new CA, replacing its first one
        own = [r for r in await in_thread(store.list_issued) if r.via == "self"]
        live = [r for r in own if r.live(dt.datetime.now(dt.UTC))]
        assert len(own) == 4 and [r.ca_id for r in live] == [new_id, new_id], own
        assert {r.predecessor for r in live} == {r.serial for r in own if r.ca_id == old_id}
        assert all(n == 1 for n in report["renewals"].values()), report["renewals"]  # early, once each
    finally:
        hub.stop()
        signer_b.stop()


# --- two signers racing --------------------------------------------------------------------------------


@dataclass
class Attempt:
    token: int
    signer: str
    started: float
    ended: float = 0.0
    issuer: str | None = None
    ca_id: str | None = None
    serial: str | None = None
    refusal: str | None = None


async def test_two_signers_racing_never_sign_with_a_stale_ca_nor_spend_a_token_twice(
    env: KubeEnv, tmp_path: Path
) -> None:
    tokens_count, attempts_per_token = 90, 4  # each token: 2 concurrent attempts on each signer
    prefix = env.new_prefix()
    signers = {
        name: await KubeSignerProcess(env, prefix, tmp_path, *NO_RATE_LIMITS, name=name).start()
        for name in ("signer-a", "signer-b")
    }
    store = env.store(prefix)
    try:
        first = await in_thread(store.read_authorities)
        tokens = await in_thread(
            lambda: [
                create_token(store, Binding(kind="client", name=f"racer-{i}"), dt.timedelta(minutes=10)).token
                for i in range(tokens_count)
            ]
        )
        new_ca = await in_thread(lambda: start_rotation(store, now=dt.datetime.now(dt.UTC)))
        bundle = tmp_path / "bundle.crt"  # both CAs: the signers move their own certificates mid-run
        certclient.write_bundle(bundle, (await in_thread(store.read_authorities)).bundle_pem())
        endpoints = {name: s.endpoint(bundle) for name, s in signers.items()}
        attempts: list[Attempt] = []
        certificates = {"n": 0}
        steps: dict[str, float] = {}
        slots = trio.CapacityLimiter(24)

        async def attempt(token_index: int, signer: str) -> None:
            async with slots:
                record = Attempt(token_index, signer, trio.current_time())
                attempts.append(record)
                name = f"racer-{token_index}"
                try:
                    issued = await certclient.bootstrap(
                        endpoints[signer],
                        tokens[token_index],
                        certclient.client_csr(certclient.generate_key(), name),
                    )
                    record.serial = issued.serial.lstrip("0")
                    record.issuer = issued.cert.issuer.rfc4514_string()
                    certificates["n"] += 1
                except SignerRequestError as exc:
                    record.refusal = f"{exc.status} {exc.error}"
                record.ended = trio.current_time()

        async def rotate() -> None:
            # the steps as `rotate-ca` takes them, forced: throwaway racers never report their trust
            await wait_until(lambda: certificates["n"] >= tokens_count // 3, timeout=120, what="a third")
            steps["activate called"] = trio.current_time()
            await in_thread(lambda: activate_pending(store, now=dt.datetime.now(dt.UTC), force=True))
            steps["activated"] = trio.current_time()
            await wait_until(lambda: certificates["n"] >= 2 * tokens_count // 3, timeout=120, what="2/3")
            await in_thread(lambda: retire_previous(store, now=dt.datetime.now(dt.UTC), force=True))
            steps["retired"] = trio.current_time()

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rotate)
            for i in range(tokens_count):
                for j in range(attempts_per_token):
                    nursery.start_soon(attempt, i, "signer-a" if j % 2 == 0 else "signer-b")
        elapsed = trio.current_time() - started

        by_subject = {
            r.cert.subject.rfc4514_string(): r.id for r in (await in_thread(store.read_authorities)).records
        }
        old_id, new_id = first.active.id, new_ca.id  # type: ignore[union-attr]
        for a in attempts:
            a.ca_id = None if a.issuer is None else by_subject.get(a.issuer, a.issuer)
        wins = [a for a in attempts if a.serial is not None]
        after_activate = [a for a in wins if a.started > steps["activated"]]
        after_retire = [a for a in wins if a.started > steps["retired"]]
        overlapping = [
            a for a in wins if a.started <= steps["activated"] and a.ended >= steps["activate called"]
        ]
        report = {
            "attempts": len(attempts),
            "seconds": round(elapsed, 1),
            "certificates": len(wins),
            "refusals": dict(Counter(a.refusal for a in attempts if a.refusal)),
            "certificates_by_signer": dict(Counter(a.signer for a in wins)),
            "certificate_answer_ms": {
                "median": round(1000 * statistics.median(a.ended - a.started for a in wins)),
                "max": round(1000 * max(a.ended - a.started for a in wins)),
            },
            "certificates_by_ca": {
                "old": sum(a.ca_id == old_id for a in wins),
                "new": sum(a.ca_id == new_id for a in wins),
            },
            "started_after_activate": len(after_activate),
            "of_those_from_the_old_ca": sum(a.ca_id != new_id for a in after_activate),
            "started_after_retire": len(after_retire),
            "in_flight_while_activate_ran": {
                "count": len(overlapping),
                "old_ca": sum(a.ca_id == old_id for a in overlapping),
                "new_ca": sum(a.ca_id == new_id for a in overlapping),
            },
        }
        print_report(
            f"two signers racing on one Secrets store ({tokens_count} tokens x {attempts_per_token} attempts)",
            report,
        )

        # each token: exactly one certificate, every other attempt told the token is used
        assert Counter(a.token for a in wins) == Counter(range(tokens_count))
        assert report["refusals"] == {"409 token_used": tokens_count * (attempts_per_token - 1)}
        # no request that started after a step was committed got a certificate of a CA that step ended
        assert report["of_those_from_the_old_ca"] == 0 and len(after_activate) > 0
        assert after_retire and all(a.ca_id == new_id for a in after_retire)
        assert all(a.ca_id in (old_id, new_id) for a in wins)
        assert set(report["certificates_by_signer"]) == {"signer-a", "signer-b"}
        # the store agrees: one record per certificate, each token used by the certificate it gave
        records = [r for r in await in_thread(store.list_issued) if r.via == "bootstrap"]
        assert sorted(r.serial for r in records) == sorted(a.serial for a in wins)  # type: ignore[type-var]
        used = {t.id: t.used_serial for t in await in_thread(store.list_tokens)}
        assert sorted(used.values()) == sorted(a.serial for a in wins)  # type: ignore[type-var]
    finally:
        for signer in signers.values():
            signer.stop()


# --- clear errors at start -----------------------------------------------------------------------------


async def _fails_at_start(signer: KubeSignerProcess) -> str:
    """Run ``signer``, which must exit 1 at start; the error of its one ``signer_failed`` line."""
    process = signer.process = Process(signer.name, signer.argv(), signer.log_dir)
    code = await process.wait_exit(timeout=30)
    assert code == 1, process.tail()
    events = [e for e in process.events() if e.get("event") == "signer_failed"]
    assert len(events) == 1, process.tail()
    return str(events[0]["error"])


async def test_the_signer_stops_at_start_with_what_to_fix(env: KubeEnv, tmp_path: Path) -> None:
    bare = service_account_kubeconfig(
        env.hub, env.namespace, "signer-without-role", tmp_path / "bare.kubeconfig"
    )
    error = await _fails_at_start(
        KubeSignerProcess(env, env.new_prefix(), tmp_path, name="no-role", kubeconfig=bare)
    )
    assert (
        f"refuses the cert-signer get, list, create, update, delete on secrets in namespace {env.namespace!r}"
        in error
    )
    assert f"system:serviceaccount:{env.namespace}:signer-without-role" in error and "RBAC_YAML" in error
    code, _, err = await env.cli(env.new_prefix(), "status", kubeconfig=bare)
    assert code == 1 and "refused to get secrets" in err and "403 Forbidden" in err

    class Elsewhere(KubeSignerProcess):
        def argv(self) -> list[str]:
            argv = super().argv()
            argv[argv.index("--store") + 1] = "kubernetes:no-such-namespace"
            return argv

    error = await _fails_at_start(
        Elsewhere(env, "x", tmp_path, name="no-namespace", kubeconfig=env.hub.kubeconfig)
    )
    assert (
        "the namespace 'no-such-namespace' of the store kubernetes:no-such-namespace/cluster-proxy-ca does not exist"
        in error
    )
    assert "kubectl create namespace no-such-namespace" in error

    port = free_port()
    down = token_kubeconfig(
        env.hub, tmp_path / "down.kubeconfig", "x", "x", server=f"https://127.0.0.1:{port}"
    )
    error = await _fails_at_start(
        KubeSignerProcess(env, env.new_prefix(), tmp_path, name="unreachable", kubeconfig=down)
    )
    assert f"cannot reach the Kubernetes API server at https://127.0.0.1:{port}" in error
