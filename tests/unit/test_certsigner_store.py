"""The store interface: the files backend (modes, atomic compare-and-swap, hashed tokens) and the
Kubernetes Secrets stub (defined, not implemented)."""

from __future__ import annotations

import datetime as dt
import os
import stat
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from clusterproxy_certsigner.filestore import FileStore
from clusterproxy_certsigner.kubestore import KubernetesSecretStore
from clusterproxy_certsigner.models import Binding
from clusterproxy_certsigner.rotation import ensure_ca, start_rotation
from clusterproxy_certsigner.store import CertStore, NotFound, StoreConflict, open_store, parse_store
from clusterproxy_certsigner.tokens import hash_secret, new_token, parse_token, secret_matches
from clusterproxy_protocol.config import InvalidValue

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_ca_files_and_modes(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    current = ensure_ca(store, now=NOW)
    active = current.active
    assert active is not None and active.state == "active"
    assert _mode(tmp_path / "store") == 0o700
    assert _mode(tmp_path / "store" / "ca") == 0o700
    assert _mode(tmp_path / "store" / "ca" / f"{active.id}.key") == 0o600
    assert _mode(tmp_path / "store" / "ca" / f"{active.id}.crt") == 0o644
    # loading again returns the same CA; a second store object over the same folder sees it
    assert ensure_ca(FileStore(tmp_path / "store"), now=NOW).active == active
    key = store.load_ca_key(active.id)
    assert key.public_key() == active.cert.public_key()
    assert "PRIVATE" not in repr(current)


def test_write_authorities_is_compare_and_swap(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    first = ensure_ca(store, now=NOW)
    stale_version = first.version
    start_rotation(store, now=NOW)  # bumps the version
    with pytest.raises(StoreConflict, match="changed meanwhile"):
        store.write_authorities(list(first.records), expected_version=stale_version)
    assert len(store.read_authorities().records) == 2


def test_retired_ca_key_is_deleted(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    current = ensure_ca(store, now=NOW)
    active = current.active
    assert active is not None
    store.write_authorities([replace(active, state="retired")], expected_version=current.version)
    assert not (tmp_path / "ca" / f"{active.id}.key").exists()
    assert (tmp_path / "ca" / f"{active.id}.crt").exists()
    with pytest.raises(NotFound):
        store.load_ca_key(active.id)


def test_tokens_are_stored_hashed_and_created_once(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    created = new_token(Binding(kind="agent", cluster="c1"), ttl=dt.timedelta(minutes=10), now=NOW)
    store.create_token(created.record)
    token_id, secret = parse_token(created.token)
    path = tmp_path / "tokens" / f"{token_id}.json"
    assert _mode(path) == 0o600
    on_disk = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert secret.encode() not in on_disk
    assert hash_secret(secret).encode() in on_disk
    loaded = store.get_token(token_id)
    assert loaded == created.record and secret_matches(secret, loaded)
    assert not secret_matches(secret[:-1] + ("A" if secret[-1] != "A" else "B"), loaded)
    with pytest.raises(StoreConflict):
        store.create_token(created.record)


def test_update_token_is_atomic_across_threads(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    created = new_token(Binding(kind="agent", cluster="c1"), ttl=dt.timedelta(minutes=10), now=NOW)
    store.create_token(created.record)
    winners: list[int] = []
    barrier = threading.Barrier(8)

    def consume(i: int) -> None:
        def change(record):
            if record.used_at is not None:
                raise RuntimeError("used")
            return replace(record, used_at=NOW, used_serial=str(i))

        barrier.wait()
        try:
            FileStore(tmp_path).update_token(created.record.id, change)
            winners.append(i)
        except RuntimeError:
            pass

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1
    assert store.get_token(created.record.id).used_serial == str(winners[0])


def test_ids_cannot_escape_the_store(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    (tmp_path / "secret.json").write_text("{}")
    assert store.get_token("../secret") is None
    assert store.get_issued("../../secret") is None
    with pytest.raises(NotFound):
        store.load_ca_key("../secret")
    with pytest.raises(NotFound):
        store.update_token("..", lambda r: r)


def test_parse_and_open_store(tmp_path: Path) -> None:
    assert parse_store(str(tmp_path)) == ("files", str(tmp_path))
    assert parse_store(f"file://{tmp_path}") == ("files", str(tmp_path))
    assert parse_store("kubernetes:hub") == ("kubernetes", "hub/cluster-proxy-ca")
    assert parse_store("k8s:hub/my-ca") == ("kubernetes", "hub/my-ca")
    with pytest.raises(InvalidValue):
        parse_store("kubernetes:")
    assert isinstance(open_store(str(tmp_path / "s")), FileStore)
    kube = open_store("kubernetes:hub/pki")
    assert isinstance(kube, KubernetesSecretStore)
    assert (kube.namespace, kube.prefix, kube.description) == ("hub", "pki", "kubernetes:hub/pki")


def test_kubernetes_store_is_a_declared_stub() -> None:
    store = KubernetesSecretStore(namespace="hub")
    assert isinstance(store, CertStore)
    calls = {
        "read_authorities": lambda: store.read_authorities(),
        "write_authorities": lambda: store.write_authorities([], expected_version="0"),
        "load_ca_key": lambda: store.load_ca_key("0"),
        "create_token": lambda: store.create_token(None),  # type: ignore[arg-type]
        "get_token": lambda: store.get_token("0"),
        "update_token": lambda: store.update_token("0", lambda r: r),
        "list_tokens": lambda: store.list_tokens(),
        "delete_token": lambda: store.delete_token("0"),
        "put_issued": lambda: store.put_issued(None),  # type: ignore[arg-type]
        "get_issued": lambda: store.get_issued("0"),
        "update_issued": lambda: store.update_issued("0", lambda r: r),
        "list_issued": lambda: store.list_issued(),
        "delete_issued": lambda: store.delete_issued("0"),
    }
    assert set(calls) == set(CertStore.__abstractmethods__)  # the stub covers the whole interface
    for call in calls.values():
        with pytest.raises(NotImplementedError, match="real kube-apiserver"):
            call()


def test_store_root_permissions_are_tightened(tmp_path: Path) -> None:
    root = tmp_path / "loose"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    FileStore(root)
    assert _mode(root) == 0o700
