"""The addon-manager's machinery without an API server: "is it up to date" (compare), condition
merging, the work queue's guarantees, the availability verdict, and the bootstrap tokens and CA on
a real cert-signer store (the files backend: the same CertStore contract as the Secrets one)."""

from __future__ import annotations

import datetime as dt
import ssl
from pathlib import Path

import pytest
import trio

from clusterproxy_addon_manager.availability import AdminTLS, Availability, poll_once
from clusterproxy_addon_manager.compare import contains
from clusterproxy_addon_manager.conditions import Condition, merge_conditions, same_conditions
from clusterproxy_addon_manager.identity import Credentials, agent_binding, import_custom_ca, server_binding
from clusterproxy_addon_manager.workqueue import WorkQueue
from clusterproxy_castore.filestore import FileStore
from clusterproxy_certsigner.core import SignerCore
from clusterproxy_protocol import certclient

# --- compare -------------------------------------------------------------------------------------------


def test_contains_ignores_server_defaults_but_not_changes() -> None:
    desired = {"spec": {"replicas": 2, "template": {"containers": [{"name": "a", "args": ["--x=1"]}]}}}
    actual = {
        "metadata": {"resourceVersion": "9"},
        "spec": {
            "replicas": 2,
            "strategy": {"type": "RollingUpdate"},
            "template": {
                "containers": [{"name": "a", "args": ["--x=1"], "terminationMessagePath": "/dev/x"}]
            },
        },
    }
    assert contains(actual, desired)
    assert not contains(actual, {"spec": {"replicas": 3}})
    assert not contains(
        actual, {"spec": {"template": {"containers": [{"name": "a", "args": ["--x=1", "--y"]}]}}}
    )
    assert not contains({"a": 1}, {"a": True})  # a bool is not the integer 1
    assert not contains({"a": [1, 2]}, {"a": [1]})  # lists are whole
    assert not contains({}, {"a": None})


# --- conditions ----------------------------------------------------------------------------------------

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
T1 = T0 + dt.timedelta(minutes=5)


def test_merge_keeps_transition_time_while_status_holds() -> None:
    first = merge_conditions(None, [Condition("Available", "True", "R", "m")], now=T0)
    assert first[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    same_status = merge_conditions(first, [Condition("Available", "True", "R2", "m2")], now=T1)
    assert same_status[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert same_status[0]["reason"] == "R2"
    flipped = merge_conditions(first, [Condition("Available", "False", "R", "m")], now=T1)
    assert flipped[0]["lastTransitionTime"] == "2026-01-01T00:05:00Z"


def test_merge_keeps_other_writers_conditions_and_detects_no_change() -> None:
    theirs = [
        {
            "type": "RegistrationApplied",
            "status": "True",
            "reason": "x",
            "message": "",
            "lastTransitionTime": "t",
        }
    ]
    merged = merge_conditions(theirs, [Condition("Available", "True", "R", "m")], now=T0)
    assert [c["type"] for c in merged] == ["RegistrationApplied", "Available"]
    again = merge_conditions(merged, [Condition("Available", "True", "R", "m")], now=T1)
    assert same_conditions(merged, again)  # a resync writes nothing
    assert not same_conditions(
        merged, merge_conditions(merged, [Condition("Available", "True", "R", "other")], now=T1)
    )


# --- work queue ----------------------------------------------------------------------------------------


async def test_queue_deduplicates_and_serializes_a_key() -> None:
    queue = WorkQueue(retry_initial=0.01, retry_max=0.05)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        for _ in range(10):
            queue.add("cluster/a")
        queue.add("cluster/b")
        assert len(queue) == 2
        first = await queue.get()
        assert first == "cluster/a"
        queue.add("cluster/a")  # while it is processed: not handed out twice
        assert await queue.get() == "cluster/b"
        assert len(queue) == 0
        queue.done("cluster/b")
        queue.done("cluster/a")  # ...but queued again afterwards
        assert await queue.get() == "cluster/a"
        delay = queue.done("cluster/a", failed=True)
        assert delay is not None and 0 < delay <= 0.01
        with trio.fail_after(1):
            assert await queue.get() == "cluster/a"  # the retry came back by itself
        queue.done("cluster/a", failed=True)
        assert queue.failures("cluster/a") == 2
        assert await queue.get() == "cluster/a"
        queue.done("cluster/a")
        assert queue.failures("cluster/a") == 0
        nursery.cancel_scope.cancel()


# --- availability --------------------------------------------------------------------------------------


def test_availability_verdicts() -> None:
    answers = {"https://a": {"cluster1": 1, "cluster2": 0}, "https://b": {"cluster1": 1}}
    tls = AdminTLS(ssl.create_default_context())

    def fetch(url: str, timeout: float, given: AdminTLS) -> dict[str, int]:
        assert given is tls
        if url not in answers:
            raise OSError("connection refused")
        return answers[url]

    both = poll_once(["https://a", "https://b"], tls, fetch=fetch)
    assert both.of("cluster1").status == "True" and "2 agent tunnel(s)" in both.of("cluster1").message
    assert both.of("cluster2").status == "False"
    assert both.of("cluster3").status == "False"
    partial = poll_once(["https://a", "https://down"], tls, fetch=fetch)
    assert partial.of("cluster2").status == "False" and "1 did not answer" in partial.of("cluster2").message
    none = poll_once(["https://down"], tls, fetch=fetch)
    assert none.of("cluster1").status == "Unknown" and none.of("cluster1").reason == "ProxyServerUnreachable"
    assert "connection refused" in none.of("cluster1").message
    assert Availability({}, 0, 0).of("cluster1").reason == "NoProxyServer"


def test_without_a_client_certificate_nobody_is_asked() -> None:
    """The inventory is served over mutual TLS only: without its certificate the manager asks no
    replica (a plain request would only be refused) and says why."""

    def fetch(url: str, timeout: float, tls: AdminTLS) -> dict[str, int]:
        raise AssertionError(f"{url} was asked")

    why = "the cert-signer at https://signer:8443 does not answer"
    verdict = poll_once(["https://a"], why, fetch=fetch).of("cluster1")
    assert (verdict.status, verdict.reason) == ("Unknown", "NoClientCertificate")
    assert why in verdict.message and "mutual TLS" in verdict.message
    assert poll_once([], why, fetch=fetch).of("cluster1").reason == "NoProxyServer"


# --- identities on a real store ------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = dt.datetime.now(dt.UTC)

    def __call__(self) -> dt.datetime:
        return self.now


@pytest.fixture
def credentials(tmp_path: Path) -> tuple[Credentials, Clock]:
    clock = Clock()
    return Credentials(lambda ns: FileStore(tmp_path / ns), token_ttl=dt.timedelta(hours=1), now=clock), clock


def test_token_reused_until_used_or_stale(credentials: tuple[Credentials, Clock]) -> None:
    creds, clock = credentials
    bundle = creds.trust_bundle("ns")
    assert bundle.startswith("-----BEGIN CERTIFICATE-----")
    assert creds.trust_bundle("ns") == bundle  # the CA is created once
    first = creds.ensure_token("ns", "cluster c1", agent_binding("c1"), None)
    assert first.minted and first.reason == "no token yet"
    again = creds.ensure_token("ns", "cluster c1", agent_binding("c1"), first.token)
    assert not again.minted and again.token == first.token

    # a pod bootstraps with it (the signer's own rules consume it)...
    core = SignerCore(creds.store("ns"), clock=clock)
    key = certclient.generate_key()
    core.bootstrap(first.token, certclient.agent_csr(key, "c1", "pod-a"))
    after_use = creds.ensure_token("ns", "cluster c1", agent_binding("c1"), first.token)
    assert after_use.minted and "was used" in after_use.reason

    # ...and a token near its end is replaced before a late pod could find it expired
    clock.now += dt.timedelta(minutes=46)
    stale = creds.ensure_token("ns", "cluster c1", agent_binding("c1"), after_use.token)
    assert stale.minted and "expires in" in stale.reason


def test_token_replaced_when_its_binding_changes(credentials: tuple[Credentials, Clock]) -> None:
    creds, _ = credentials
    creds.trust_bundle("ns")
    old = creds.ensure_token("ns", "proxy-server", server_binding("proxy-server", ["b", "a"]), None)
    same = creds.ensure_token("ns", "proxy-server", server_binding("proxy-server", ["a", "b"]), old.token)
    assert not same.minted  # host order does not matter
    more = creds.ensure_token(
        "ns", "proxy-server", server_binding("proxy-server", ["a", "b", "c"]), old.token
    )
    assert more.minted and "now server" in more.reason
    forged = old.token.split(".")[0] + "." + "B" * 43
    assert creds.ensure_token("ns", "proxy-server", server_binding("proxy-server", ["a", "b"]), forged).minted


def test_forget_and_prune(credentials: tuple[Credentials, Clock]) -> None:
    creds, clock = credentials
    creds.trust_bundle("ns")
    kept = creds.ensure_token("ns", "cluster c1", agent_binding("c1"), None)
    orphan = creds.ensure_token("ns", "cluster c2", agent_binding("c2"), None)
    gone = creds.ensure_token("ns", "cluster c3", agent_binding("c3"), None)
    assert creds.forget_token("ns", gone.token)
    assert creds.store("ns").get_token(gone.token.split(".")[0]) is None
    assert (
        creds.prune_tokens("ns", {kept.token.split(".")[0]}, grace=dt.timedelta(minutes=10)) == []
    )  # too young
    clock.now += dt.timedelta(minutes=11)
    assert creds.prune_tokens("ns", {kept.token.split(".")[0]}, grace=dt.timedelta(minutes=10)) == [
        orphan.token.split(".")[0]
    ]
    assert creds.store("ns").get_token(kept.token.split(".")[0]) is not None


def test_custom_ca_is_imported_into_an_empty_store_only(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    from clusterproxy_protocol.pki import new_ca

    now = dt.datetime.now(dt.UTC)
    cert, key = new_ca("corp-ca", now=now, days=30)
    cert_pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    store = FileStore(tmp_path / "custom")
    ca_id = import_custom_ca(store, cert_pem, key_pem, now=now)
    assert store.read_authorities().active is not None and store.read_authorities().active.id == ca_id
    assert import_custom_ca(store, cert_pem, key_pem, now=now) == ca_id  # idempotent
    other, other_key = new_ca("other", now=now, days=30)
    with pytest.raises(ValueError, match="already has the active CA"):
        import_custom_ca(
            store,
            other.public_bytes(serialization.Encoding.PEM).decode(),
            other_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ).decode(),
            now=now,
        )
    with pytest.raises(ValueError, match="not the key"):
        import_custom_ca(
            FileStore(tmp_path / "x"),
            cert_pem,
            other_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ).decode(),
            now=now,
        )
