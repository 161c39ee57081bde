"""The Kubernetes Secrets backend of :class:`~clusterproxy_certsigner.store.CertStore`: **a stub**.

It is defined here, not implemented: it will be written and tested against a real kube-apiserver (no
fake). Every method raises :class:`NotImplementedError`. The layout it will use, in ``namespace``,
with every object labelled ``app.kubernetes.io/part-of=cluster-proxy`` and
``cluster-proxy.io/store=<prefix>``:

``<prefix>-authorities`` (type ``Opaque``, label ``cluster-proxy.io/kind=authorities``)
    ``authorities.json``: the same index as the files backend; ``<id>.crt`` / ``<id>.key`` per CA
    (keys removed from ``data`` when a CA is retired). One Secret, so a CA change is one update;
    :meth:`write_authorities`'s compare-and-swap is the Secret's ``metadata.resourceVersion``
    (:attr:`Authorities.version`), sent with the replace; a 409 from the API server becomes
    :class:`~clusterproxy_certsigner.store.StoreConflict`.
``<prefix>-token-<id>`` (type ``cluster-proxy.io/bootstrap-token``, label ``cluster-proxy.io/kind=token``)
    ``record.json``: :meth:`TokenRecord.to_json` (the secret's SHA-256 only). ``update_token`` is
    get, change, replace with ``resourceVersion``, retried on 409.
``<prefix>-issued-<serial>`` (type ``Opaque``, label ``cluster-proxy.io/kind=issued``)
    ``record.json``: :meth:`IssuedRecord.to_json`. Listed with the label selector; ``update_issued``
    as for tokens.

RBAC the signer's ServiceAccount needs, in ``namespace`` only: ``secrets``: get, list, create,
update, delete. Nothing cluster-scoped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from cryptography.hazmat.primitives.asymmetric import ec

from .models import Authorities, AuthorityRecord, IssuedRecord, TokenRecord
from .store import CertStore

__all__ = ["KubernetesSecretStore"]

_TODO = (
    "the Kubernetes Secrets store is not implemented yet (it will be built and tested against a real "
    "kube-apiserver); use a files store (--store DIR) for now"
)


class KubernetesSecretStore(CertStore):
    """Secrets in ``namespace`` named ``<prefix>-...``; ``api`` is a ``kubernetes.client.CoreV1Api``
    (or None to load the in-cluster / kubeconfig configuration when implemented)."""

    def __init__(self, *, namespace: str, prefix: str = "cluster-proxy-ca", api: Any = None) -> None:
        self.namespace = namespace
        self.prefix = prefix
        self.api = api
        self.description = f"kubernetes:{namespace}/{prefix}"

    def _todo(self) -> NoReturn:
        raise NotImplementedError(_TODO)

    def read_authorities(self) -> Authorities:
        self._todo()

    def write_authorities(
        self,
        records: list[AuthorityRecord],
        *,
        expected_version: str,
        new_keys: Mapping[str, ec.EllipticCurvePrivateKey] | None = None,
    ) -> Authorities:
        self._todo()

    def load_ca_key(self, ca_id: str) -> ec.EllipticCurvePrivateKey:
        self._todo()

    def create_token(self, record: TokenRecord) -> None:
        self._todo()

    def get_token(self, token_id: str) -> TokenRecord | None:
        self._todo()

    def update_token(self, token_id: str, change: Callable[[TokenRecord], TokenRecord]) -> TokenRecord:
        self._todo()

    def list_tokens(self) -> list[TokenRecord]:
        self._todo()

    def delete_token(self, token_id: str) -> None:
        self._todo()

    def put_issued(self, record: IssuedRecord) -> None:
        self._todo()

    def get_issued(self, serial: str) -> IssuedRecord | None:
        self._todo()

    def update_issued(self, serial: str, change: Callable[[IssuedRecord], IssuedRecord]) -> IssuedRecord:
        self._todo()

    def list_issued(self) -> list[IssuedRecord]:
        self._todo()

    def delete_issued(self, serial: str) -> None:
        self._todo()
