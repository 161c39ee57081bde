"""The Kubernetes Secrets backend of :class:`~clusterproxy_castore.store.CertStore` (Kubernetes mode).

``--store kubernetes:NAMESPACE[/PREFIX]`` (PREFIX defaults to ``cluster-proxy-ca``). Everything lives in
Secrets of one namespace, each labelled ``app.kubernetes.io/part-of=cluster-proxy``,
``app.kubernetes.io/managed-by=cluster-proxy-cert-signer``, ``cluster-proxy.io/store=<prefix>`` and
``cluster-proxy.io/kind=<kind>``:

``<prefix>-authorities`` (type ``Opaque``, kind ``authorities``)
    ``authorities.json`` (``{"authorities": [{id, state, timestamps}, ...]}``, as the files backend's
    index) and per CA ``<id>.crt`` and ``<id>.key`` (the key is dropped from ``data`` when the CA is
    retired). One Secret, so a CA change is one write: :meth:`write_authorities` replaces it with the
    ``metadata.resourceVersion`` it was read at (:attr:`Authorities.version`); a 409 from the API
    server is :class:`~clusterproxy_castore.store.StoreConflict`. Absent: no CA yet, version ``""``.
``<prefix>-token-<id>`` (type ``cluster-proxy.io/bootstrap-token``, kind ``token``)
    ``record.json``: :meth:`TokenRecord.to_json` (the secret's SHA-256 only, never the token).
``<prefix>-issued-<serial>`` (type ``cluster-proxy.io/issued-certificate``, kind ``issued``)
    ``record.json``: :meth:`IssuedRecord.to_json` (public data). Annotated with the identity
    (``cluster-proxy.io/identity``) and expiry (``cluster-proxy.io/not-after``) for ``kubectl``;
    labelled ``cluster-proxy.io/cluster`` for agents.

``update_token`` / ``update_issued``: get, change, replace with the ``resourceVersion`` read; a 409
re-reads and calls ``change`` again (up to :attr:`KubernetesSecretStore.max_attempts` times), so two
signers consuming one token get one winner: the loser's ``change`` sees the token used and raises.
Creations are ``create`` (409 AlreadyExists is :class:`StoreConflict`). A write whose answer was lost
(the connection broke after the request went out) is settled by reading the object back: if it holds
what we wrote, the write happened. Lists are paged (``limit``/``continue``) and filtered by label.

Every read is a plain GET (a quorum read from etcd): a signer never signs from a CA list older than
the last committed rotation step, however many signers share the store.

Configuration: :func:`clusterproxy_protocol.kubeconfig.load_configuration` (the ``kubeconfig``
argument, ``$KUBECONFIG``, the pod's ServiceAccount, whose token is re-read as it rotates,
``~/.kube/config``). Nothing is contacted until the first call. :meth:`check` (run by ``serve`` at
start) tries each verb the signer needs without changing anything (dry-run create, update and delete
of a Secret that does not exist) and names what is missing. RBAC: :mod:`clusterproxy_castore.rbac`
(secrets get, list, create, update, delete in the namespace; nothing cluster-scoped), re-exported here.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from clusterproxy_protocol import ConfigError, key_pem, load_configuration

from .models import Authorities, AuthorityRecord, IssuedRecord, TokenRecord
from .rbac import RBAC_VERBS, RBAC_YAML, rbac_yaml
from .store import CertStore, NotFound, StoreConflict, StoreError

__all__ = ["RBAC_VERBS", "RBAC_YAML", "KubernetesSecretStore", "StoreForbidden", "rbac_yaml"]

PART_OF = "app.kubernetes.io/part-of"
MANAGED_BY = "app.kubernetes.io/managed-by"
STORE_LABEL = "cluster-proxy.io/store"
KIND_LABEL = "cluster-proxy.io/kind"
CLUSTER_LABEL = "cluster-proxy.io/cluster"
IDENTITY_ANNOTATION = "cluster-proxy.io/identity"
NOT_AFTER_ANNOTATION = "cluster-proxy.io/not-after"
TOKEN_TYPE = "cluster-proxy.io/bootstrap-token"
ISSUED_TYPE = "cluster-proxy.io/issued-certificate"
RECORD_KEY = "record.json"
INDEX_KEY = "authorities.json"

_ID = re.compile(r"^[0-9a-f]{1,64}$")
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_ABSENT = ("", "0")  # versions that mean "no CA list stored yet"

T = TypeVar("T", TokenRecord, IssuedRecord)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(value: str) -> bytes:
    return base64.b64decode(value)


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


class _Lost(Exception):
    """A write's answer never arrived: it may or may not have happened."""


class StoreForbidden(StoreError):
    """The API server refused a verb (403): the signer's identity lacks RBAC."""

    def __init__(self, reason: str, *, verb: str, message: str) -> None:
        super().__init__(reason)
        self.verb = verb
        self.message = message


class KubernetesSecretStore(CertStore):
    """Secrets in ``namespace`` named ``<prefix>-...`` (see the module docstring).

    ``api`` is a ``kubernetes.client.CoreV1Api`` to use as is; without one the configuration is
    loaded at the first call (``kubeconfig``, ``$KUBECONFIG``, in-cluster, ``~/.kube/config``).
    """

    #: get-change-replace rounds before an update gives up with StoreConflict (each lost round means
    #: another writer succeeded, so this bounds how many writers may race on one record)
    max_attempts = 64
    #: items per page when listing
    page_size = 250
    #: (connect, read) timeout of each API request, seconds
    request_timeout: tuple[float, float] = (5.0, 30.0)

    def __init__(
        self,
        *,
        namespace: str,
        prefix: str = "cluster-proxy-ca",
        api: Any = None,
        kubeconfig: str | os.PathLike[str] | None = None,
    ) -> None:
        self.namespace = namespace
        self.prefix = prefix
        self.description = f"kubernetes:{namespace}/{prefix}"
        self._api = api
        self._kubeconfig = None if kubeconfig is None else Path(kubeconfig)
        self._server = "the Kubernetes API server"
        self._lock = threading.Lock()

    # -- connecting --------------------------------------------------------------------------------------

    @property
    def api(self) -> Any:
        """The ``CoreV1Api``, configured at first use."""
        with self._lock:
            if self._api is None:
                self._api = self._connect()
            return self._api

    def _connect(self) -> Any:
        from kubernetes import client

        try:
            configuration, source = load_configuration(
                self._kubeconfig, flag_env="CLUSTER_PROXY_CERT_SIGNER_KUBECONFIG"
            )
        except ConfigError as exc:
            raise StoreError(f"the store {self.description}: {exc}") from None
        configuration.retries = _no_read_retries()
        configuration.connection_pool_maxsize = 16
        self._server = f"the Kubernetes API server at {configuration.host} ({source})"
        return client.CoreV1Api(client.ApiClient(configuration))

    # -- talking to the API server -----------------------------------------------------------------------

    def _call(self, verb: str, name: str | None, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One API request; its JSON answer. Errors become StoreError with what to do; 404 is
        NotFound, 409 StoreConflict, a lost answer to a write :class:`_Lost`."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        try:
            response = fn(*args, _preload_content=False, _request_timeout=self.request_timeout, **kwargs)
            return json.loads(response.data or b"null")
        except ApiException as exc:
            raise self._api_error(verb, name, exc) from None
        except (urllib3.exceptions.ProtocolError, urllib3.exceptions.ReadTimeoutError) as exc:
            if verb in ("get", "list"):
                raise self._unreachable(exc) from None
            raise _Lost(str(exc)) from None
        except urllib3.exceptions.HTTPError as exc:
            raise self._unreachable(exc) from None

    def _unreachable(self, exc: Exception) -> StoreError:
        reason = getattr(exc, "reason", None) or exc
        return StoreError(
            f"cannot reach {self._server} for the store {self.description}: {reason}; is the API server "
            "running and is the address in the configuration right?"
        )

    def _api_error(self, verb: str, name: str | None, exc: Any) -> StoreError:
        status = int(exc.status or 0)
        message = _status_message(exc)
        what = f"secrets{'' if name is None else f' {name!r}'} in namespace {self.namespace!r}"
        if status == 404:
            if _status_kind(exc) == "namespaces":
                return StoreError(
                    f"the namespace {self.namespace!r} of the store {self.description} does not exist: "
                    f"create it (kubectl create namespace {self.namespace}) or name another in "
                    "--store kubernetes:NAMESPACE[/PREFIX]"
                )
            return NotFound(f"{what}: {message}")
        if status == 409:
            return StoreConflict(f"{what} changed meanwhile: {message}")
        if status == 403:
            return StoreForbidden(
                f"{self._server} refused to {verb} {what} (403 Forbidden: {message}). The cert-signer's "
                f"identity needs a Role in {self.namespace!r} allowing secrets: "
                f"{', '.join(RBAC_VERBS)}, bound to it (RoleBinding); kubestore.RBAC_YAML has both",
                verb=verb,
                message=message,
            )
        if status == 401:
            return StoreError(
                f"{self._server} did not accept our credentials (401 Unauthorized: {message}); the token or "
                "client certificate in the configuration is invalid or expired"
            )
        if status == 0:
            return StoreError(f"cannot reach {self._server} for the store {self.description}: {exc.reason}")
        return StoreError(f"{self._server} answered {status} to {verb} {what}: {message}")

    def _secret_name(self, kind: str, ident: str = "") -> str:
        return f"{self.prefix}-{kind}" + (f"-{ident}" if ident else "")

    def _labels(self, kind: str) -> dict[str, str]:
        return {
            PART_OF: "cluster-proxy",
            MANAGED_BY: "cluster-proxy-cert-signer",
            STORE_LABEL: self.prefix,
            KIND_LABEL: kind,
        }

    def _read(self, name: str) -> dict[str, Any] | None:
        try:
            return self._call("get", name, self.api.read_namespaced_secret, name, self.namespace)  # type: ignore[no-any-return]  # _call answers the API server's JSON: here a Secret
        except NotFound:
            return None

    def _create(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        try:
            return self._call("create", name, self.api.create_namespaced_secret, self.namespace, body)  # type: ignore[no-any-return]  # _call answers the API server's JSON: here a Secret
        except _Lost:
            stored = self._read(name)
            if stored is not None and stored.get("data") == body.get("data"):
                return stored
            raise self._unreachable(
                RuntimeError("the connection broke before the answer to a create")
            ) from None

    def _replace(self, body: dict[str, Any]) -> dict[str, Any]:
        """Replace with the body's resourceVersion: StoreConflict when it changed; NotFound when the
        Secret is gone; :class:`_Lost` when the answer never came (the caller reads back)."""
        name = body["metadata"]["name"]
        return self._call("update", name, self.api.replace_namespaced_secret, name, self.namespace, body)  # type: ignore[no-any-return]  # _call answers the API server's JSON: here a Secret

    def _delete(self, name: str) -> None:
        with contextlib.suppress(NotFound):
            try:
                self._call("delete", name, self.api.delete_namespaced_secret, name, self.namespace)
            except _Lost:
                pass  # a delete is idempotent: the next read tells

    def _list(self, kind: str) -> Iterator[dict[str, Any]]:
        selector = f"{STORE_LABEL}={self.prefix},{KIND_LABEL}={kind}"
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"label_selector": selector, "limit": self.page_size}
            if token:
                kwargs["_continue"] = token
            page = self._call("list", None, self.api.list_namespaced_secret, self.namespace, **kwargs)
            yield from page.get("items") or ()
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return

    def _data(self, secret: Mapping[str, Any], key: str) -> bytes | None:
        value = (secret.get("data") or {}).get(key)
        if value is None:
            return None
        try:
            return _unb64(value)
        except ValueError as exc:
            raise StoreError(f"corrupt Secret {secret['metadata']['name']!r}: {key}: {exc}") from None

    # -- CAs ---------------------------------------------------------------------------------------------

    def _parse_authorities(self, secret: Mapping[str, Any] | None) -> Authorities:
        if secret is None:
            return Authorities((), "")
        name = secret["metadata"]["name"]
        records = []
        try:
            index = json.loads(self._data(secret, INDEX_KEY) or b"")
            for entry in index["authorities"]:
                ca_id = str(entry["id"])
                if not _ID.match(ca_id):
                    raise ValueError(f"invalid CA id {ca_id!r}")
                cert = self._data(secret, f"{ca_id}.crt")
                if cert is None:
                    raise ValueError(f"no {ca_id}.crt")
                records.append(AuthorityRecord.from_json(entry, cert.decode()))
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(
                f"corrupt CA list in Secret {name!r} (namespace {self.namespace!r}): {exc}"
            ) from None
        return Authorities(tuple(records), str(secret["metadata"]["resourceVersion"]))

    def read_authorities(self) -> Authorities:
        return self._parse_authorities(self._read(self._secret_name("authorities")))

    def write_authorities(
        self,
        records: list[AuthorityRecord],
        *,
        expected_version: str,
        new_keys: Mapping[str, ec.EllipticCurvePrivateKey] | None = None,
    ) -> Authorities:
        name = self._secret_name("authorities")
        current = self._read(name)
        stored_version = "" if current is None else str(current["metadata"]["resourceVersion"])
        if stored_version != expected_version and not (current is None and expected_version in _ABSENT):
            raise StoreConflict(
                f"the CA list changed meanwhile (version {stored_version or 'none'}, expected "
                f"{expected_version or 'none'})"
            )
        old_data = dict((current or {}).get("data") or {})
        data: dict[str, str] = {INDEX_KEY: _b64(_json_bytes({"authorities": [r.to_json() for r in records]}))}
        for record in records:
            if not _ID.match(record.id):
                raise StoreError(f"invalid CA id {record.id!r}")
            data[f"{record.id}.crt"] = _b64(record.cert_pem.encode())
            key = (new_keys or {}).get(record.id)
            if record.state == "retired":
                continue
            if key is not None:
                data[f"{record.id}.key"] = _b64(key_pem(key))
            elif f"{record.id}.key" in old_data:
                data[f"{record.id}.key"] = old_data[f"{record.id}.key"]
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": self.namespace, "labels": self._labels("authorities")},
            "type": "Opaque",
            "data": data,
        }
        try:
            if current is None:
                written = self._create(body)
            else:
                body["metadata"]["resourceVersion"] = stored_version
                written = self._replace(body)
        except NotFound:
            raise StoreConflict("the CA list was deleted meanwhile") from None
        except StoreConflict:
            raise StoreConflict(
                f"the CA list changed meanwhile (someone wrote it after version {expected_version or 'none'})"
            ) from None
        except _Lost:
            written = self._read(name) or {}
            if written.get("data") != data:
                raise StoreError(
                    f"lost the answer of {self._server} while writing the CA list; run the command again"
                ) from None
        return Authorities(tuple(records), str(written["metadata"]["resourceVersion"]))

    def load_ca_key(self, ca_id: str) -> ec.EllipticCurvePrivateKey:
        if not _ID.match(ca_id):
            raise NotFound(f"invalid CA id {ca_id!r}")
        name = self._secret_name("authorities")
        secret = self._read(name)
        data = None if secret is None else self._data(secret, f"{ca_id}.key")
        if data is None:
            raise NotFound(f"CA key {ca_id} is missing from Secret {name!r} (namespace {self.namespace!r})")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise StoreError(f"cannot load CA key {ca_id} from Secret {name!r}: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise StoreError(f"CA key {ca_id} in Secret {name!r} is not an EC key")
        return key

    # -- records (tokens, issued certificates) -----------------------------------------------------------

    def _record_body(self, kind: str, ident: str, record: TokenRecord | IssuedRecord) -> dict[str, Any]:
        metadata: dict[str, Any] = {
            "name": self._secret_name(kind, ident),
            "namespace": self.namespace,
            "labels": self._labels(kind),
        }
        if isinstance(record, IssuedRecord):
            metadata["annotations"] = {
                IDENTITY_ANNOTATION: record.identity.key,
                NOT_AFTER_ANNOTATION: record.not_after.isoformat(),
            }
            cluster = record.identity.cluster
            if cluster and _LABEL_VALUE.match(cluster):
                metadata["labels"][CLUSTER_LABEL] = cluster
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": metadata,
            "type": TOKEN_TYPE if kind == "token" else ISSUED_TYPE,
            "data": {RECORD_KEY: _b64(_json_bytes(record.to_json()))},
        }

    def _parse_record(self, secret: Mapping[str, Any], parse: Callable[[Any], T]) -> T:
        name = secret["metadata"]["name"]
        try:
            return parse(json.loads(self._data(secret, RECORD_KEY) or b""))
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(
                f"corrupt record in Secret {name!r} (namespace {self.namespace!r}): {exc}"
            ) from None

    def _get_record(self, kind: str, ident: str, parse: Callable[[Any], T]) -> T | None:
        if not _ID.match(ident):
            return None
        secret = self._read(self._secret_name(kind, ident))
        return None if secret is None else self._parse_record(secret, parse)

    def _put_record(self, kind: str, ident: str, record: TokenRecord | IssuedRecord) -> None:
        if not _ID.match(ident):
            raise StoreError(f"invalid {kind} id {ident!r}")
        try:
            self._create(self._record_body(kind, ident, record))
        except StoreConflict:
            raise StoreConflict(f"{kind} {ident} exists") from None

    def _update_record(
        self, kind: str, ident: str, parse: Callable[[Any], T], change: Callable[[T], T], what: str
    ) -> T:
        if not _ID.match(ident):
            raise NotFound(f"invalid {what} {ident!r}")
        name = self._secret_name(kind, ident)
        for attempt in range(self.max_attempts):
            secret = self._read(name)
            if secret is None:
                raise NotFound(f"no {what} {ident}")
            current = self._parse_record(secret, parse)
            new = change(current)
            if new == current:
                return new
            body = self._record_body(kind, ident, new)
            body["metadata"]["resourceVersion"] = secret["metadata"]["resourceVersion"]
            try:
                self._replace(body)
                return new
            except NotFound:
                raise NotFound(f"no {what} {ident} (deleted meanwhile)") from None
            except StoreConflict:
                pass
            except _Lost:
                stored = self._read(name)
                if stored is not None and stored.get("data") == body["data"]:
                    return new
            # someone else wrote in between: back off a little (spreads racing writers) and redo
            time.sleep(random.uniform(0, min(0.05, 0.002 * (attempt + 1))))
        raise StoreConflict(f"{what} {ident} kept changing: gave up after {self.max_attempts} attempts")

    def _list_records(self, kind: str, parse: Callable[[Any], T]) -> list[T]:
        return [self._parse_record(secret, parse) for secret in self._list(kind)]

    # -- tokens ------------------------------------------------------------------------------------------

    def create_token(self, record: TokenRecord) -> None:
        self._put_record("token", record.id, record)

    def get_token(self, token_id: str) -> TokenRecord | None:
        return self._get_record("token", token_id, TokenRecord.from_json)

    def update_token(self, token_id: str, change: Callable[[TokenRecord], TokenRecord]) -> TokenRecord:
        return self._update_record("token", token_id, TokenRecord.from_json, change, "token")

    def list_tokens(self) -> list[TokenRecord]:
        return sorted(self._list_records("token", TokenRecord.from_json), key=lambda r: r.id)

    def delete_token(self, token_id: str) -> None:
        if _ID.match(token_id):
            self._delete(self._secret_name("token", token_id))

    # -- issued ------------------------------------------------------------------------------------------

    def put_issued(self, record: IssuedRecord) -> None:
        try:
            self._put_record("issued", record.serial, record)
        except StoreConflict:
            raise StoreConflict(f"certificate serial {record.serial} exists") from None

    def get_issued(self, serial: str) -> IssuedRecord | None:
        return self._get_record("issued", serial, IssuedRecord.from_json)

    def update_issued(self, serial: str, change: Callable[[IssuedRecord], IssuedRecord]) -> IssuedRecord:
        return self._update_record(
            "issued", serial, IssuedRecord.from_json, change, "issued certificate with serial"
        )

    def list_issued(self) -> list[IssuedRecord]:
        return sorted(self._list_records("issued", IssuedRecord.from_json), key=lambda r: r.serial)

    def delete_issued(self, serial: str) -> None:
        if _ID.match(serial):
            self._delete(self._secret_name("issued", serial))

    # -- checking access at start ------------------------------------------------------------------------

    def check(self) -> None:
        """Try every verb the store needs, changing nothing: a GET and a LIST, and a dry-run create,
        update and delete (the API server authorizes a dry run like the real request and stores
        nothing; update and delete aim at a Secret that does not exist, so an allowed one answers 404).
        StoreError naming every refused verb, a missing namespace or an unreachable API server."""
        probe = self._secret_name("access-check")
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": probe, "namespace": self.namespace, "labels": self._labels("access-check")},
            "type": "Opaque",
        }
        attempts: dict[str, Callable[[], object]] = {
            "get": lambda: self._read(self._secret_name("authorities")),
            "list": lambda: self._call(
                "list",
                None,
                self.api.list_namespaced_secret,
                self.namespace,
                label_selector=f"{STORE_LABEL}={self.prefix}",
                limit=1,
            ),
            "create": lambda: self._call(
                "create", probe, self.api.create_namespaced_secret, self.namespace, body, dry_run="All"
            ),
            "update": lambda: self._call(
                "update",
                probe,
                self.api.replace_namespaced_secret,
                probe,
                self.namespace,
                body,
                dry_run="All",
            ),
            "delete": lambda: self._call(
                "delete", probe, self.api.delete_namespaced_secret, probe, self.namespace, dry_run="All"
            ),
        }
        refused: list[str] = []
        detail = ""
        for verb, attempt in attempts.items():
            try:
                attempt()
            except (NotFound, StoreConflict, _Lost):
                pass  # allowed: the probe does not exist (update, delete) or exists (create)
            except StoreForbidden as exc:
                refused.append(verb)
                detail = detail or exc.message
        if refused:
            raise StoreError(
                f"{self._server} refuses the cert-signer {', '.join(refused)} on secrets in namespace "
                f"{self.namespace!r} (for example: {detail}). The store needs secrets: "
                f"{', '.join(RBAC_VERBS)} in that namespace: bind a Role with those verbs to the "
                "signer's ServiceAccount (kubestore.RBAC_YAML; deploy/kustomize has it)"
            )


def _no_read_retries() -> Any:
    """Retry connecting (nothing was sent yet), never a request that may have reached the server: a
    repeated write is decided by reading the object back, not by sending it again."""
    import urllib3

    return urllib3.util.Retry(total=2, connect=2, read=0, status=0, other=0, redirect=0, backoff_factor=0.2)


def _status_body(exc: Any) -> dict[str, Any]:
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _status_message(exc: Any) -> str:
    return str(_status_body(exc).get("message") or exc.reason or exc.status)


def _status_kind(exc: Any) -> str | None:
    details = _status_body(exc).get("details") or {}
    return details.get("kind") if isinstance(details, dict) else None
