"""The contract every cert-signer store backend keeps (``clusterproxy_castore.store``), as tests.

A backend's test module subclasses :class:`StoreContract` as ``TestXxx`` and provides the ``backend``
fixture, a :class:`Backend`: ``open()`` gives a new store object over the same stored data (what
another signer process or the CLI would open), ``stored_bytes()`` every byte the backend holds (files,
Secret data), to look for what must never be stored. The files backend runs it in
``tests/unit/test_certsigner_store.py``, the Kubernetes Secrets backend against a real kube-apiserver in
``tests/kube/test_kubestore.py``.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

from clusterproxy_castore.models import Binding, Identity, IssuedRecord, TokenRecord
from clusterproxy_castore.rotation import ensure_ca, start_rotation
from clusterproxy_castore.store import CertStore, NotFound, StoreConflict
from clusterproxy_castore.tokens import hash_secret, new_token, parse_token, secret_matches
from clusterproxy_protocol.pki import key_pem

__all__ = ["NOW", "Backend", "StoreContract", "issued_record", "run_in_threads"]

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


@dataclass
class Backend:
    open: Callable[[], CertStore]
    stored_bytes: Callable[[], bytes]


def issued_record(serial: str, **changes: Any) -> IssuedRecord:
    """A plausible issued-certificate record (the store keeps records, it does not check them)."""
    record = IssuedRecord(
        serial=serial,
        identity=Identity(kind="agent", name="agent-a", cluster="cluster1"),
        ca_id="0123456789abcdef",
        cert_pem="-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
        not_before=NOW,
        not_after=NOW + dt.timedelta(hours=24),
        issued_at=NOW,
        via="bootstrap",
        public_key_sha256="ab" * 32,
        token_id="feed",
    )
    return replace(record, **changes)


def run_in_threads(count: int, work: Callable[[int], None]) -> list[BaseException]:
    """``work(i)`` in ``count`` threads released together; the exceptions they raised."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def _token(cluster: str = "c1") -> tuple[str, TokenRecord]:
    created = new_token(Binding(kind="agent", cluster=cluster), ttl=dt.timedelta(minutes=10), now=NOW)
    return created.token, created.record


class StoreContract:
    """Subclass as ``TestXxx`` with a ``backend`` fixture returning a :class:`Backend`."""

    #: threads racing in the concurrency tests
    racers = 8

    def test_an_empty_store_has_nothing(self, backend: Backend) -> None:
        store = backend.open()
        current = store.read_authorities()
        assert current.records == () and current.active is None
        assert store.list_tokens() == [] and store.list_issued() == []
        assert store.get_token("abc") is None and store.get_issued("abc") is None
        with pytest.raises(NotFound):
            store.load_ca_key("abc")

    def test_the_first_ca_is_shared_and_its_key_stays_inside(self, backend: Backend) -> None:
        store = backend.open()
        current = ensure_ca(store, now=NOW)
        active = current.active
        assert active is not None and active.state == "active" and len(current.records) == 1
        assert current.version == store.read_authorities().version
        other = backend.open()
        assert ensure_ca(other, now=NOW).active == active  # loaded, not created again
        assert other.read_authorities().records == current.records
        key = other.load_ca_key(active.id)
        assert key.public_key() == active.cert.public_key()
        assert "PRIVATE" not in repr(current) and "PRIVATE" not in repr(other.read_authorities())

    def test_write_authorities_is_compare_and_swap(self, backend: Backend) -> None:
        store = backend.open()
        first = ensure_ca(store, now=NOW)
        start_rotation(backend.open(), now=NOW)  # another writer changes the list
        with pytest.raises(StoreConflict, match="changed meanwhile"):
            store.write_authorities(list(first.records), expected_version=first.version)
        after = store.read_authorities()
        assert len(after.records) == 2 and after.pending is not None
        # writing against the version just read succeeds, and returns the version to write against next
        changed = [*after.records[:-1], replace(after.records[-1], created_at=NOW + dt.timedelta(days=1))]
        written = store.write_authorities(changed, expected_version=after.version)
        assert written.version != after.version
        assert written.version == backend.open().read_authorities().version
        assert backend.open().read_authorities().records == tuple(changed)
        with pytest.raises(StoreConflict):
            store.write_authorities(list(after.records), expected_version=after.version)

    def test_racing_creators_make_exactly_one_first_ca(self, backend: Backend) -> None:
        winners: list[str] = []

        def create(i: int) -> None:
            active = ensure_ca(backend.open(), now=NOW).active
            assert active is not None
            winners.append(active.id)

        assert run_in_threads(self.racers, create) == []
        current = backend.open().read_authorities()
        assert len(current.records) == 1
        assert set(winners) == {current.records[0].id}

    def test_a_retired_ca_loses_its_key(self, backend: Backend) -> None:
        store = backend.open()
        current = ensure_ca(store, now=NOW)
        active = current.active
        assert active is not None
        key_bytes = key_pem(store.load_ca_key(active.id))
        assert key_bytes in backend.stored_bytes()
        store.write_authorities([replace(active, state="retired")], expected_version=current.version)
        with pytest.raises(NotFound):
            backend.open().load_ca_key(active.id)
        assert key_bytes not in backend.stored_bytes()
        after = backend.open().read_authorities()
        assert after.records[0].state == "retired" and after.records[0].cert_pem == active.cert_pem

    def test_new_keys_are_stored_with_their_ca(self, backend: Backend) -> None:
        store = backend.open()
        ensure_ca(store, now=NOW)
        pending = start_rotation(store, now=NOW)
        current = backend.open().read_authorities()
        assert [r.state for r in current.records] == ["active", "pending"]
        key = backend.open().load_ca_key(pending.id)
        assert key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ) == pending.cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def test_tokens_are_stored_hashed_and_created_once(self, backend: Backend) -> None:
        store = backend.open()
        token, record = _token()
        store.create_token(record)
        token_id, secret = parse_token(token)
        stored = backend.stored_bytes()
        assert secret.encode() not in stored and token.encode() not in stored
        assert hash_secret(secret).encode() in stored
        loaded = backend.open().get_token(token_id)
        assert loaded == record and loaded is not None and secret_matches(secret, loaded)
        with pytest.raises(StoreConflict):
            backend.open().create_token(record)
        assert [t.id for t in store.list_tokens()] == [token_id]
        store.delete_token(token_id)
        store.delete_token(token_id)  # no error when missing
        assert store.get_token(token_id) is None and store.list_tokens() == []

    def test_one_token_is_consumed_once_by_racing_stores(self, backend: Backend) -> None:
        _, record = _token()
        backend.open().create_token(record)
        winners: list[int] = []

        def consume(i: int) -> None:
            def change(current: TokenRecord) -> TokenRecord:
                if current.used_at is not None:
                    raise RuntimeError("used")
                return replace(current, used_at=NOW, used_serial=format(i, "x"))

            try:
                backend.open().update_token(record.id, change)
                winners.append(i)
            except RuntimeError:
                pass

        assert run_in_threads(self.racers, consume) == []
        assert len(winners) == 1
        stored = backend.open().get_token(record.id)
        assert stored is not None and stored.used_serial == format(winners[0], "x")

    def test_racing_updates_lose_no_change(self, backend: Backend) -> None:
        backend.open().put_issued(issued_record("a1"))
        rounds = 4

        def bump(i: int) -> None:
            store = backend.open()
            for _ in range(rounds):
                store.update_issued(
                    "a1", lambda r: replace(r, extra={**r.extra, "n": int(r.extra.get("n", 0)) + 1})
                )

        assert run_in_threads(self.racers, bump) == []
        stored = backend.open().get_issued("a1")
        assert stored is not None and stored.extra["n"] == self.racers * rounds

    def test_a_change_that_raises_leaves_the_record_as_it_was(self, backend: Backend) -> None:
        store = backend.open()
        _, record = _token()
        store.create_token(record)

        def refuse(current: TokenRecord) -> TokenRecord:
            raise LookupError("no")

        with pytest.raises(LookupError):
            store.update_token(record.id, refuse)
        assert backend.open().get_token(record.id) == record
        with pytest.raises(NotFound):
            store.update_token("abcdef", lambda r: r)
        with pytest.raises(NotFound):
            store.update_issued("abcdef", lambda r: r)

    def test_issued_records_round_trip(self, backend: Backend) -> None:
        store = backend.open()
        records = [issued_record(format(serial, "x")) for serial in (0x1F, 0xA0, 0xBEEF)]
        for record in records:
            store.put_issued(record)
        with pytest.raises(StoreConflict):
            backend.open().put_issued(records[0])
        other = backend.open()
        assert other.get_issued("a0") == records[1]
        assert sorted(r.serial for r in other.list_issued()) == sorted(r.serial for r in records)
        renewed = other.update_issued("a0", lambda r: replace(r, successor="beef"))
        assert renewed.successor == "beef" and store.get_issued("a0") == renewed
        reported = store.update_issued(
            "beef", lambda r: r.with_report(("sha256:" + "0" * 64,), ("beef",), NOW)
        )
        assert backend.open().get_issued("beef") == reported and reported.presenting == ("beef",)
        store.delete_issued("1f")
        store.delete_issued("1f")  # no error when missing
        assert store.get_issued("1f") is None
        assert sorted(r.serial for r in backend.open().list_issued()) == ["a0", "beef"]

    def test_ids_cannot_escape_the_store(self, backend: Backend) -> None:
        store = backend.open()
        assert store.get_token("../secret") is None
        assert store.get_issued("../../secret") is None
        assert store.get_token("ABC") is None and store.get_issued("x" * 65) is None
        with pytest.raises(NotFound):
            store.load_ca_key("../secret")
        with pytest.raises(NotFound):
            store.update_token("..", lambda r: r)
        store.delete_token("../x")  # refused quietly, as a missing id
        store.delete_issued("../x")
