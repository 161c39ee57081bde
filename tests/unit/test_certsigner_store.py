"""The store interface: the files backend (its layout and modes, and the store contract shared with
the Kubernetes backend: compare-and-swap, hashed tokens, atomic updates), choosing a backend, and
the Kubernetes backend's configuration errors (its contract runs on a real API server in tests/kube)."""

from __future__ import annotations

import datetime as dt
import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from clusterproxy_castore.filestore import FileStore
from clusterproxy_castore.kubestore import KubernetesSecretStore
from clusterproxy_castore.models import Binding
from clusterproxy_castore.rotation import ensure_ca
from clusterproxy_castore.store import open_store, parse_store
from clusterproxy_castore.tokens import new_token
from clusterproxy_protocol.config import InvalidValue
from tests.support.store_contract import Backend, StoreContract, issued_record

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


def test_token_and_record_files_and_modes(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    created = new_token(Binding(kind="agent", cluster="c1"), ttl=dt.timedelta(minutes=10), now=NOW)
    store.create_token(created.record)
    store.put_issued(issued_record("a0"))
    assert _mode(tmp_path / "tokens" / f"{created.record.id}.json") == 0o600
    assert _mode(tmp_path / "issued" / "a0.json") == 0o644
    current = ensure_ca(store, now=NOW)
    assert current.active is not None
    key_file = tmp_path / "ca" / f"{current.active.id}.key"
    store.write_authorities([replace(current.active, state="retired")], expected_version=current.version)
    assert not key_file.exists() and key_file.with_suffix(".crt").exists()


def test_ids_cannot_reach_files_outside_the_store(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    (tmp_path / "secret.json").write_text("{}")
    assert store.get_token("../secret") is None
    assert store.get_issued("../../secret") is None


class TestFileStore(StoreContract):
    """The store contract (tests/support/store_contract.py) on the files backend."""

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        root = tmp_path / "store"
        return Backend(
            open=lambda: FileStore(root),
            stored_bytes=lambda: b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file()),
        )


def test_parse_and_open_store(tmp_path: Path) -> None:
    assert parse_store(str(tmp_path)) == ("files", str(tmp_path))
    assert parse_store(f"file://{tmp_path}") == ("files", str(tmp_path))
    assert parse_store("kubernetes:hub") == ("kubernetes", "hub/cluster-proxy-ca")
    assert parse_store("k8s:hub/my-ca") == ("kubernetes", "hub/my-ca")
    with pytest.raises(InvalidValue):
        parse_store("kubernetes:")
    for bad in ("kubernetes:Hub", "kubernetes:hub/my_ca", "kubernetes:hub/-ca", f"kubernetes:{'a' * 64}"):
        with pytest.raises(InvalidValue, match="lower-case letters"):
            parse_store(bad)
    assert isinstance(open_store(str(tmp_path / "s")), FileStore)
    kube = open_store("kubernetes:hub/pki")
    assert isinstance(kube, KubernetesSecretStore)
    assert (kube.namespace, kube.prefix, kube.description) == ("hub", "pki", "kubernetes:hub/pki")


def test_store_root_permissions_are_tightened(tmp_path: Path) -> None:
    root = tmp_path / "loose"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    FileStore(root)
    assert _mode(root) == 0o700
