"""The files backend of :class:`~clusterproxy_castore.store.CertStore` (local and compose modes).

Layout (the root and every folder mode 0700)::

    ROOT/.lock                        flock: one writer at a time, across processes and threads
    ROOT/authorities.json             {"version": N, "authorities": [{id, state, timestamps}, ...]}
    ROOT/ca/<id>.crt                  CA certificate (0644)
    ROOT/ca/<id>.key                  CA private key (0600; deleted when the CA is retired)
    ROOT/tokens/<id>.json             bootstrap token: SHA-256 of the secret, binding, expiry (0600)
    ROOT/issued/<serial>.json         every issued certificate, with its holder's reported trust (0644)

Every write goes to a temporary file in the same folder and is renamed into place, so a reader sees the
old or the new content, never half of one. ``authorities.json`` is the commit point of a CA change: new
CA files are written before it, retired keys deleted after it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from clusterproxy_protocol import key_pem, write_atomic

from .models import Authorities, AuthorityRecord, IssuedRecord, TokenRecord
from .store import CertStore, NotFound, StoreConflict, StoreError

__all__ = ["FileStore"]

_ID = re.compile(r"^[0-9a-f]{1,64}$")


def _check_id(value: str, what: str) -> str:
    if not _ID.match(value):
        raise NotFound(f"invalid {what} {value!r}")
    return value


class FileStore(CertStore):
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.description = f"files:{self.root}"
        for folder in (self.root, self.root / "ca", self.root / "tokens", self.root / "issued"):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _read_json(self, path: Path) -> Any:
        try:
            return json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise StoreError(f"cannot read {path}: {exc}") from None

    def _write_json(self, path: Path, value: Any, mode: int) -> None:
        write_atomic(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode(), mode)

    # -- CAs ---------------------------------------------------------------------------------------------

    def _read_authorities(self) -> Authorities:
        index = self._read_json(self.root / "authorities.json")
        if index is None:
            return Authorities((), "0")
        records = []
        try:
            for entry in index["authorities"]:
                ca_id = _check_id(str(entry["id"]), "CA id")
                cert_path = self.root / "ca" / f"{ca_id}.crt"
                records.append(AuthorityRecord.from_json(entry, cert_path.read_text()))
            version = str(int(index["version"]))
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"corrupt CA index {self.root / 'authorities.json'}: {exc}") from None
        return Authorities(tuple(records), version)

    def read_authorities(self) -> Authorities:
        return self._read_authorities()

    def write_authorities(
        self,
        records: list[AuthorityRecord],
        *,
        expected_version: str,
        new_keys: Mapping[str, ec.EllipticCurvePrivateKey] | None = None,
    ) -> Authorities:
        with self._locked():
            current = self._read_authorities()
            if current.version != expected_version:
                raise StoreConflict(
                    f"the CA list changed meanwhile (version {current.version}, expected {expected_version})"
                )
            ca_dir = self.root / "ca"
            for ca_id, key in (new_keys or {}).items():
                write_atomic(ca_dir / f"{_check_id(ca_id, 'CA id')}.key", key_pem(key), 0o600)
            for record in records:
                cert_path = ca_dir / f"{_check_id(record.id, 'CA id')}.crt"
                if not cert_path.exists() or cert_path.read_text() != record.cert_pem:
                    write_atomic(cert_path, record.cert_pem.encode(), 0o644)
            version = str(int(current.version) + 1)
            self._write_json(
                self.root / "authorities.json",
                {"version": int(version), "authorities": [r.to_json() for r in records]},
                0o644,
            )
            for record in records:
                if record.state == "retired":
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(ca_dir / f"{record.id}.key")
            return Authorities(tuple(records), version)

    def load_ca_key(self, ca_id: str) -> ec.EllipticCurvePrivateKey:
        path = self.root / "ca" / f"{_check_id(ca_id, 'CA id')}.key"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise NotFound(f"CA key {path} is missing") from None
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise StoreError(f"cannot load CA key {path}: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise StoreError(f"CA key {path} is not an EC key")
        return key

    # -- tokens ------------------------------------------------------------------------------------------

    def _token_path(self, token_id: str) -> Path:
        return self.root / "tokens" / f"{_check_id(token_id, 'token id')}.json"

    def _read_token(self, path: Path) -> TokenRecord | None:
        data = self._read_json(path)
        if data is None:
            return None
        try:
            return TokenRecord.from_json(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"corrupt token record {path}: {exc}") from None

    def create_token(self, record: TokenRecord) -> None:
        path = self._token_path(record.id)
        with self._locked():
            if path.exists():
                raise StoreConflict(f"token {record.id} exists")
            self._write_json(path, record.to_json(), 0o600)

    def get_token(self, token_id: str) -> TokenRecord | None:
        try:
            path = self._token_path(token_id)
        except NotFound:
            return None
        return self._read_token(path)

    def update_token(self, token_id: str, change: Callable[[TokenRecord], TokenRecord]) -> TokenRecord:
        path = self._token_path(token_id)
        with self._locked():
            current = self._read_token(path)
            if current is None:
                raise NotFound(f"no token {token_id}")
            new = change(current)
            self._write_json(path, new.to_json(), 0o600)
            return new

    def list_tokens(self) -> list[TokenRecord]:
        out = []
        for path in sorted((self.root / "tokens").glob("*.json")):
            record = self._read_token(path)
            if record is not None:
                out.append(record)
        return out

    def delete_token(self, token_id: str) -> None:
        with self._locked(), contextlib.suppress(FileNotFoundError, NotFound):
            os.unlink(self._token_path(token_id))

    # -- issued ------------------------------------------------------------------------------------------

    def _issued_path(self, serial: str) -> Path:
        return self.root / "issued" / f"{_check_id(serial, 'serial')}.json"

    def _read_issued(self, path: Path) -> IssuedRecord | None:
        data = self._read_json(path)
        if data is None:
            return None
        try:
            return IssuedRecord.from_json(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"corrupt issued-certificate record {path}: {exc}") from None

    def put_issued(self, record: IssuedRecord) -> None:
        path = self._issued_path(record.serial)
        with self._locked():
            if path.exists():
                raise StoreConflict(f"certificate serial {record.serial} exists")
            self._write_json(path, record.to_json(), 0o644)

    def get_issued(self, serial: str) -> IssuedRecord | None:
        try:
            path = self._issued_path(serial)
        except NotFound:
            return None
        return self._read_issued(path)

    def update_issued(self, serial: str, change: Callable[[IssuedRecord], IssuedRecord]) -> IssuedRecord:
        path = self._issued_path(serial)
        with self._locked():
            current = self._read_issued(path)
            if current is None:
                raise NotFound(f"no issued certificate with serial {serial}")
            new = change(current)
            self._write_json(path, new.to_json(), 0o644)
            return new

    def list_issued(self) -> list[IssuedRecord]:
        out = []
        for path in sorted((self.root / "issued").glob("*.json")):
            record = self._read_issued(path)
            if record is not None:
                out.append(record)
        return out

    def delete_issued(self, serial: str) -> None:
        with self._locked(), contextlib.suppress(FileNotFoundError, NotFound):
            os.unlink(self._issued_path(serial))
