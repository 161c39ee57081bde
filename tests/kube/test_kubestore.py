"""The cert-signer's Kubernetes Secrets store against a real kube-apiserver: the store contract (the
same tests the files backend passes), run as a ServiceAccount holding only the documented Role; the
layout (names, types, labels, a retired CA's key gone from its Secret); a 409 from the API server
between a read and a write; paged lists; and a clear error for each way a user gets it wrong: a
missing namespace, an identity without the Role (or with part of it), bad credentials, an API server
that does not answer; and the signer serving from it keeps its own key only while it runs."""

from __future__ import annotations

import base64
import datetime as dt
import json
import secrets
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from clusterproxy_castore.kubestore import RBAC_VERBS, KubernetesSecretStore, StoreForbidden, rbac_yaml
from clusterproxy_castore.models import Binding, TokenRecord
from clusterproxy_castore.rotation import activate_pending, ensure_ca, retire_previous, start_rotation
from clusterproxy_castore.store import StoreConflict, StoreError
from clusterproxy_castore.tokens import new_token
from tests.support.kube_identities import (
    create_namespace,
    delete_namespace,
    service_account_kubeconfig,
    store_bytes,
    store_secrets,
    token_kubeconfig,
)
from tests.support.kubeapi import KubeCluster, KubeClusters, free_port
from tests.support.procs import BIN, Process
from tests.support.store_contract import NOW, Backend, StoreContract, issued_record

pytestmark = pytest.mark.slow

SIGNER_SA = "cluster-proxy-cert-signer"


class Namespace:
    """A namespace on the hub with the signer's ServiceAccount bound to exactly :data:`RBAC_YAML`."""

    def __init__(self, hub: KubeCluster, directory: Path) -> None:
        self.hub = hub
        self.name = create_namespace(hub, "cert-store")
        self.signer_kubeconfig = service_account_kubeconfig(
            hub, self.name, SIGNER_SA, directory / "signer.kubeconfig", role=rbac_yaml(self.name, SIGNER_SA)
        )

    def store(self, prefix: str, **kwargs: Any) -> KubernetesSecretStore:
        """The store as the signer's ServiceAccount (unless ``kubeconfig`` says otherwise)."""
        return KubernetesSecretStore(
            namespace=self.name,
            prefix=prefix,
            kubeconfig=kwargs.pop("kubeconfig", self.signer_kubeconfig),
            **kwargs,
        )


@pytest.fixture(scope="module")
def ns(kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Namespace]:
    namespace = Namespace(kube_clusters["hub"], tmp_path_factory.mktemp("kubestore"))
    yield namespace
    delete_namespace(namespace.hub, namespace.name)


def _prefix() -> str:
    return f"t{secrets.token_hex(4)}"


class TestKubernetesSecretStore(StoreContract):
    """The store contract (tests/support/store_contract.py), each test on a fresh prefix, as the
    signer's ServiceAccount: the documented Role is all the store needs."""

    @pytest.fixture
    def backend(self, ns: Namespace) -> Backend:
        prefix = _prefix()
        return Backend(
            open=lambda: ns.store(prefix), stored_bytes=lambda: store_bytes(ns.hub, ns.name, prefix)
        )


def _data(secret: dict[str, Any], key: str) -> bytes:
    return base64.b64decode(secret["data"][key])


def test_the_layout_is_the_documented_one(ns: Namespace) -> None:
    prefix = _prefix()
    store = ns.store(prefix)
    first = ensure_ca(store, now=NOW).active
    assert first is not None
    created = new_token(Binding(kind="agent", cluster="cluster1"), ttl=dt.timedelta(minutes=5), now=NOW)
    store.create_token(created.record)
    store.put_issued(issued_record("c0ffee"))

    by_name = {s["metadata"]["name"]: s for s in store_secrets(ns.hub, ns.name, prefix)}
    assert set(by_name) == {
        f"{prefix}-authorities",
        f"{prefix}-token-{created.record.id}",
        f"{prefix}-issued-c0ffee",
    }
    common = {
        "app.kubernetes.io/part-of": "cluster-proxy",
        "app.kubernetes.io/managed-by": "cluster-proxy-cert-signer",
        "cluster-proxy.io/store": prefix,
    }
    authorities = by_name[f"{prefix}-authorities"]
    assert authorities["type"] == "Opaque"
    assert authorities["metadata"]["labels"] == {**common, "cluster-proxy.io/kind": "authorities"}
    assert set(authorities["data"]) == {"authorities.json", f"{first.id}.crt", f"{first.id}.key"}
    index = json.loads(_data(authorities, "authorities.json"))
    assert [(a["id"], a["state"]) for a in index["authorities"]] == [(first.id, "active")]
    assert store.read_authorities().version == authorities["metadata"]["resourceVersion"]

    token = by_name[f"{prefix}-token-{created.record.id}"]
    assert token["type"] == "cluster-proxy.io/bootstrap-token"
    assert token["metadata"]["labels"] == {**common, "cluster-proxy.io/kind": "token"}
    assert TokenRecord.from_json(json.loads(_data(token, "record.json"))) == created.record

    issued = by_name[f"{prefix}-issued-c0ffee"]
    assert issued["type"] == "cluster-proxy.io/issued-certificate"
    assert issued["metadata"]["labels"] == {
        **common,
        "cluster-proxy.io/kind": "issued",
        "cluster-proxy.io/cluster": "cluster1",
    }
    assert issued["metadata"]["annotations"]["cluster-proxy.io/identity"] == "agent:cluster1/agent-a"

    # kubectl finds them by label; a rotation keeps one Secret, and a retired CA's key leaves it
    listed = ns.hub.kubectl(
        "get",
        "secrets",
        "-n",
        ns.name,
        "-l",
        f"cluster-proxy.io/store={prefix},cluster-proxy.io/kind=issued",
        "-o",
        "name",
    )
    assert listed.returncode == 0 and listed.stdout.split() == [f"secret/{prefix}-issued-c0ffee"]
    second = start_rotation(store, now=NOW)
    activate_pending(store, now=NOW, force=True)
    retire_previous(store, now=NOW, force=True)
    authorities = {s["metadata"]["name"]: s for s in store_secrets(ns.hub, ns.name, prefix)}[
        f"{prefix}-authorities"
    ]
    assert set(authorities["data"]) == {
        "authorities.json",
        f"{first.id}.crt",
        f"{second.id}.crt",
        f"{second.id}.key",
    }


class Interleaved(KubernetesSecretStore):
    """A store that lets another writer in once, right between its read and its replace, so that the
    real API server answers the replace with 409."""

    def __init__(self, other_write: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.other_write = other_write
        self.replaces = 0

    def _replace(self, body: dict[str, Any]) -> dict[str, Any]:
        self.replaces += 1
        if self.other_write is not None:
            other, self.other_write = self.other_write, None
            other()
        return super()._replace(body)


def test_a_409_between_read_and_write_is_a_conflict_or_a_retry(ns: Namespace) -> None:
    prefix = _prefix()
    plain = ns.store(prefix)
    current = ensure_ca(plain, now=NOW)

    # the CA list: a compare-and-swap, so the 409 is the caller's StoreConflict
    store = Interleaved(
        lambda: start_rotation(ns.store(prefix), now=NOW),
        namespace=ns.name,
        prefix=prefix,
        kubeconfig=ns.signer_kubeconfig,
    )
    with pytest.raises(StoreConflict, match="changed meanwhile"):
        store.write_authorities(list(current.records), expected_version=current.version)
    assert store.replaces == 1 and len(plain.read_authorities().records) == 2  # the other write stands

    # a record: get-change-replace, so the 409 re-reads and calls change again on the other's write
    created = new_token(Binding(kind="client", name="alice"), ttl=dt.timedelta(minutes=5), now=NOW)
    plain.create_token(created.record)

    def other() -> None:
        ns.store(prefix).update_token(created.record.id, lambda r: replace(r, description="other"))

    store = Interleaved(other, namespace=ns.name, prefix=prefix, kubeconfig=ns.signer_kubeconfig)
    seen: list[str] = []

    def change(record: TokenRecord) -> TokenRecord:
        seen.append(record.description)
        return replace(record, description=record.description + "+mine")

    result = store.update_token(created.record.id, change)
    assert seen == ["", "other"] and store.replaces == 2
    assert result.description == "other+mine" == plain.get_token(created.record.id).description  # type: ignore[union-attr]


def test_lists_are_paged(ns: Namespace) -> None:
    prefix = _prefix()
    store = ns.store(prefix)
    store.page_size = 3
    for serial in range(10):
        store.put_issued(issued_record(format(0xA00 + serial, "x")))
    assert [r.serial for r in store.list_issued()] == [format(0xA00 + s, "x") for s in range(10)]
    # another store's records (another prefix) are not listed
    ns.store(_prefix()).put_issued(issued_record("b00"))
    assert len(store.list_issued()) == 10


def test_check_passes_with_the_documented_role_and_names_every_missing_verb(
    ns: Namespace, tmp_path: Path
) -> None:
    ns.store(_prefix()).check()  # the signer's ServiceAccount, bound to RBAC_YAML

    bare = service_account_kubeconfig(ns.hub, ns.name, "no-role", tmp_path / "bare.kubeconfig")
    store = ns.store(_prefix(), kubeconfig=bare)
    with pytest.raises(StoreError) as refused:
        store.check()
    message = str(refused.value)
    assert f"refuses the cert-signer {', '.join(RBAC_VERBS)} on secrets in namespace {ns.name!r}" in message
    assert f"system:serviceaccount:{ns.name}:no-role" in message and "RBAC_YAML" in message
    with pytest.raises(StoreForbidden) as forbidden:
        store.read_authorities()
    assert forbidden.value.verb == "get" and "refused to get secrets" in str(forbidden.value)

    # a Role with only the read verbs: the writes are named
    reader = rbac_yaml(ns.name, "reader").replace("cluster-proxy-cert-signer", "cert-signer-reader")
    reader = reader.replace('verbs: ["get", "list", "create", "update", "delete"]', 'verbs: ["get", "list"]')
    partial = service_account_kubeconfig(
        ns.hub, ns.name, "reader", tmp_path / "reader.kubeconfig", role=reader
    )
    store = ns.store(_prefix(), kubeconfig=partial)
    with pytest.raises(
        StoreError,
        match=f"refuses the cert-signer create, update, delete on secrets in namespace {ns.name!r}",
    ):
        store.check()
    assert store.read_authorities().records == ()  # reading works
    with pytest.raises(StoreForbidden, match="refused to create"):
        ensure_ca(store, now=NOW)


def test_a_missing_namespace_is_named_with_what_to_do(ns: Namespace) -> None:
    store = KubernetesSecretStore(namespace="no-such-namespace", prefix="ca", kubeconfig=ns.hub.kubeconfig)
    expected = "the namespace 'no-such-namespace' of the store kubernetes:no-such-namespace/ca does not exist: create it"
    with pytest.raises(StoreError, match=expected):
        store.check()
    assert store.read_authorities().records == ()  # an absent Secret reads as an empty store
    with pytest.raises(StoreError, match=expected):
        ensure_ca(store, now=NOW)


def test_bad_credentials_and_an_unreachable_api_server_are_clear(ns: Namespace, tmp_path: Path) -> None:
    forged = token_kubeconfig(ns.hub, tmp_path / "forged.kubeconfig", "nobody", "not-a-token")
    with pytest.raises(StoreError, match=r"did not accept our credentials \(401 Unauthorized"):
        ns.store(_prefix(), kubeconfig=forged).read_authorities()

    port = free_port()  # nothing listens there
    down = token_kubeconfig(
        ns.hub, tmp_path / "down.kubeconfig", "nobody", "x", server=f"https://127.0.0.1:{port}"
    )
    started = time.monotonic()
    with pytest.raises(
        StoreError, match=f"cannot reach the Kubernetes API server at https://127.0.0.1:{port}"
    ):
        ns.store(_prefix(), kubeconfig=down).check()
    assert time.monotonic() - started < 10


async def test_the_signer_deletes_its_own_key_when_it_stops(ns: Namespace, tmp_path: Path) -> None:
    """With a Kubernetes store and no --tls-dir the signer's serving key lives in a private temporary
    folder, which it takes with it on SIGTERM: a key left in /tmp would outlive every signer restart."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    signer = Process(
        "cert-signer",
        [
            str(BIN / "cluster-proxy-cert-signer"),
            "serve",
            f"--store=kubernetes:{ns.name}/{_prefix()}",
            f"--kubeconfig={ns.signer_kubeconfig}",
            "--listen=127.0.0.1:0",
            "--log-format=json",
        ],
        tmp_path,
        env={"TMPDIR": str(scratch)},
    )
    try:
        await signer.wait_event("signer_started", timeout=60)
        [folder] = scratch.iterdir()
        assert folder.name.startswith("cert-signer-")
        assert folder.stat().st_mode & 0o777 == 0o700
        assert (folder / "signer.key").stat().st_size > 0
        signer.kill(signal.SIGTERM)
        assert await signer.wait_exit(timeout=30) == 0, signer.tail()
        assert list(scratch.iterdir()) == []
    finally:
        signer.stop()
