"""The store interface: where the CAs, the bootstrap tokens and every issued certificate live.

Two backends implement it: :class:`~clusterproxy_castore.filestore.FileStore` (local and compose
modes) and :class:`~clusterproxy_castore.kubestore.KubernetesSecretStore` (Kubernetes mode).

Contract, for every backend:

- Methods are synchronous and may block (disk or network); the signer calls them from a worker
  thread. Several processes may share one store (the signer and the ``token``/``rotate-ca``
  commands), so every read-modify-write is atomic: :meth:`write_authorities` is a compare-and-swap on
  :attr:`Authorities.version`, and the ``update_*`` methods apply a function to the current record
  under the backend's concurrency control (a file lock; a Kubernetes ``resourceVersion``), retrying
  on a conflict. The function may raise to abort; it may be called more than once.
- CA private keys never leave the store except as key objects handed to the signing code in the same
  process (:meth:`load_ca_key`). No method returns key bytes.
- Files: private keys mode 0600, everything else 0644, directories 0700, writes atomic.
"""

from __future__ import annotations

import abc
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from clusterproxy_protocol import ConfigError, InvalidValue

from .models import Authorities, AuthorityRecord, IssuedRecord, TokenRecord

__all__ = [
    "CertStore",
    "NotFound",
    "StoreConflict",
    "StoreError",
    "open_store",
    "parse_store",
]


class StoreError(Exception):
    """The store cannot be read or written (a corrupt file, an unreachable API server)."""


class StoreConflict(StoreError):
    """Someone else changed the data between our read and our write (compare-and-swap failed)."""


class NotFound(StoreError, KeyError):
    """No such record."""


class CertStore(abc.ABC):
    """Abstract store. See the module docstring for the contract."""

    #: a short human description for logs and ``status`` (``files:/path``, ``kubernetes:ns/prefix``)
    description: str = ""

    def check(self) -> None:
        """Make sure the store can be used now (the signer calls it at start); :class:`StoreError`
        saying what to fix. The files backend needs no check: its constructor made the folders."""
        return None

    # -- CAs ---------------------------------------------------------------------------------------------

    @abc.abstractmethod
    def read_authorities(self) -> Authorities:
        """Every CA (certificates and states, oldest first) with the version to write against."""

    @abc.abstractmethod
    def write_authorities(
        self,
        records: list[AuthorityRecord],
        *,
        expected_version: str,
        new_keys: Mapping[str, ec.EllipticCurvePrivateKey] | None = None,
    ) -> Authorities:
        """Replace the CA list if the stored version is still ``expected_version`` (else
        :class:`StoreConflict`). ``new_keys`` (CA id -> key) are stored first; the keys of CAs whose
        state becomes ``retired`` are deleted. Returns the new :class:`Authorities`."""

    @abc.abstractmethod
    def load_ca_key(self, ca_id: str) -> ec.EllipticCurvePrivateKey:
        """The private key of a non-retired CA (in-process only). :class:`NotFound` when missing."""

    # -- bootstrap tokens --------------------------------------------------------------------------------

    @abc.abstractmethod
    def create_token(self, record: TokenRecord) -> None:
        """Store a new token; :class:`StoreConflict` when its id exists."""

    @abc.abstractmethod
    def get_token(self, token_id: str) -> TokenRecord | None: ...

    @abc.abstractmethod
    def update_token(self, token_id: str, change: Callable[[TokenRecord], TokenRecord]) -> TokenRecord:
        """Atomically replace a token by ``change(current)``; :class:`NotFound` when missing."""

    @abc.abstractmethod
    def list_tokens(self) -> list[TokenRecord]: ...

    @abc.abstractmethod
    def delete_token(self, token_id: str) -> None:
        """Remove a token (no error when missing)."""

    # -- issued certificates -----------------------------------------------------------------------------

    @abc.abstractmethod
    def put_issued(self, record: IssuedRecord) -> None:
        """Store a newly issued certificate; :class:`StoreConflict` when its serial exists."""

    @abc.abstractmethod
    def get_issued(self, serial: str) -> IssuedRecord | None: ...

    @abc.abstractmethod
    def update_issued(self, serial: str, change: Callable[[IssuedRecord], IssuedRecord]) -> IssuedRecord:
        """Atomically replace a record by ``change(current)``; :class:`NotFound` when missing."""

    @abc.abstractmethod
    def list_issued(self) -> list[IssuedRecord]: ...

    @abc.abstractmethod
    def delete_issued(self, serial: str) -> None:
        """Remove a record (no error when missing)."""


# --- choosing a backend --------------------------------------------------------------------------------


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def parse_store(text: str) -> tuple[str, str]:
    """A store location: ``DIR`` or ``file:DIR`` (files), ``kubernetes:NAMESPACE[/PREFIX]`` (Secrets).

    Returns ``("files", dir)`` or ``("kubernetes", "namespace/prefix")``.
    """
    raw = text
    text = text.strip()
    if text.startswith(("kubernetes:", "k8s:")):
        rest = text.split(":", 1)[1].strip("/")
        namespace, _, prefix = rest.partition("/")
        prefix = prefix or "cluster-proxy-ca"
        if not namespace:
            raise InvalidValue(f"invalid store {raw!r}: expected kubernetes:NAMESPACE[/PREFIX]")
        for what, value in (("namespace", namespace), ("prefix", prefix)):
            if not _DNS_LABEL.match(value):
                raise InvalidValue(
                    f"invalid store {raw!r}: the {what} {value!r} must be 1-63 lower-case letters, digits "
                    "or '-', starting and ending with a letter or digit (kubernetes:NAMESPACE[/PREFIX])"
                )
        return "kubernetes", f"{namespace}/{prefix}"
    if text.startswith("file:"):
        text = text[len("file:") :]
        text = text[2:] if text.startswith("//") else text
    if not text:
        raise InvalidValue(f"invalid store {raw!r}: expected a directory, or kubernetes:NAMESPACE[/PREFIX]")
    return "files", text


def open_store(spec: str | tuple[str, str], *, kubeconfig: str | os.PathLike[str] | None = None) -> CertStore:
    """The store named by ``spec`` (see :func:`parse_store`); ``kubeconfig`` is for a Kubernetes store
    (default: ``$KUBECONFIG``, in-cluster, ``~/.kube/config``)."""
    backend, where = parse_store(spec) if isinstance(spec, str) else spec
    if backend == "files":
        from .filestore import FileStore

        return FileStore(Path(where).expanduser())
    if backend == "kubernetes":
        from .kubestore import KubernetesSecretStore

        namespace, _, prefix = where.partition("/")
        return KubernetesSecretStore(namespace=namespace, prefix=prefix, kubeconfig=kubeconfig)
    raise ConfigError(f"unknown store backend {backend!r}")
