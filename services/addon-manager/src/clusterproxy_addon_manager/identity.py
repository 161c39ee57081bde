"""Identities for the parties the manager deploys: the CA bundle and bootstrap tokens, through the
CA store the cert-signer signs from (:mod:`clusterproxy_castore`, the same Secrets the signer reads:
``kubernetes:<namespace>/<prefix>``).

The design (docs/addon-manager.md, "Identities"): every party gets its certificate from the signer
itself, with a single-use, short-lived bootstrap token, and renews it on its own. The manager keeps
**one usable token per group of parties** (the proxy-servers; each cluster's agents; each hub client
of ``--hub-client``) in the Secret
those pods read at start. A token is replaced when it was used (a pod bootstrapped with it), expires
within a quarter of its lifetime, or no longer matches what the group may ask for (the server's host
names changed). So a pod that starts late, or again after losing its emptyDir, finds a usable token.

The current token is read back from what the manager wrote (the Secret, the ManifestWork), never
kept in memory: a restarted manager reuses it instead of minting another.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from dataclasses import dataclass

from clusterproxy_castore.models import Binding, TokenRecord
from clusterproxy_castore.rotation import ensure_ca
from clusterproxy_castore.store import CertStore, StoreError
from clusterproxy_castore.tokens import MAX_TOKEN_TTL, create_token, secret_matches

__all__ = [
    "DESCRIPTION_PREFIX",
    "Credentials",
    "MintedToken",
    "agent_binding",
    "client_binding",
    "server_binding",
]

#: every token the manager mints says so in its description: ``addon-manager <group>``
DESCRIPTION_PREFIX = "addon-manager "


def agent_binding(cluster: str) -> Binding:
    """Any agent id of ``cluster``: each replica bootstraps as its own pod name."""
    return Binding(kind="agent", cluster=cluster)


def server_binding(name: str, hosts: list[str]) -> Binding:
    return Binding(kind="server", name=name, hosts=tuple(sorted(hosts)))


def client_binding(name: str) -> Binding:
    """A hub client (the health-collector, the cluster-gateway): a client certificate with CN ``name``,
    as ``cluster-proxy-cert-signer token create --client NAME`` binds it."""
    return Binding(kind="client", name=name)


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class MintedToken:
    token: str
    minted: bool  # False: the current one is still usable
    reason: str  # why a new one was minted ("" when not)


class Credentials:
    """The stores of the signer(s), one per hub namespace; thread-safe."""

    def __init__(
        self,
        open_store: Callable[[str], CertStore],
        *,
        token_ttl: dt.timedelta = MAX_TOKEN_TTL,
        now: Callable[[], dt.datetime] = _utc_now,
    ) -> None:
        if not dt.timedelta(minutes=1) <= token_ttl <= MAX_TOKEN_TTL:
            raise ValueError(f"token lifetime {token_ttl} must be between 1 minute and {MAX_TOKEN_TTL}")
        self._open_store = open_store
        self._stores: dict[str, CertStore] = {}
        self._lock = threading.Lock()
        self.token_ttl = token_ttl
        self.now = now

    def store(self, namespace: str) -> CertStore:
        with self._lock:
            if namespace not in self._stores:
                self._stores[namespace] = self._open_store(namespace)
            return self._stores[namespace]

    def trust_bundle(self, namespace: str) -> str:
        """The CA bundle (PEM) parties must trust; creates the CA when the store has none, exactly as
        the signer's first start would (a compare-and-swap: a racing signer's CA wins or ours does)."""
        return ensure_ca(self.store(namespace), now=self.now()).bundle_pem()

    def _usable(
        self, current: str | None, binding: Binding, store: CertStore
    ) -> tuple[TokenRecord | None, str]:
        if not current or "." not in current:
            return None, "no token yet"
        token_id, secret = current.split(".", 1)
        record = store.get_token(token_id)
        if record is None:
            return None, f"token {token_id} is not in the store"
        if not secret_matches(secret, record):
            return None, f"token {token_id} does not match its record"
        if record.used_at is not None:
            return None, f"token {token_id} was used"
        if record.binding != binding:
            return None, f"token {token_id} is for {record.binding.describe()}, now {binding.describe()}"
        left = record.expires_at - self.now()
        if left < self.token_ttl / 4:
            return None, f"token {token_id} expires in {max(left.total_seconds(), 0):.0f}s"
        return record, ""

    def ensure_token(self, namespace: str, group: str, binding: Binding, current: str | None) -> MintedToken:
        """``current`` when it is still usable for ``binding``, else a new token (the only copy of
        its secret is the return value: the caller writes it where the pods read it)."""
        store = self.store(namespace)
        record, why = self._usable(current, binding, store)
        if record is not None and current is not None:
            return MintedToken(current, False, "")
        created = create_token(
            store, binding, self.token_ttl, description=DESCRIPTION_PREFIX + group, now=self.now()
        )
        return MintedToken(created.token, True, why)

    def forget_token(self, namespace: str, current: str | None) -> bool:
        """Delete an unused token whose parties are gone (the addon was removed); True if deleted."""
        if not current or "." not in current:
            return False
        store = self.store(namespace)
        token_id = current.split(".", 1)[0]
        try:
            record = store.get_token(token_id)
            if record is None or record.used_at is not None:
                return False
            store.delete_token(token_id)
        except StoreError:
            return False
        return True

    def prune_tokens(self, namespace: str, keep: set[str], *, grace: dt.timedelta) -> list[str]:
        """Delete unused tokens this manager minted that no Secret holds any more (``keep``: the ids
        in use), older than ``grace`` (a token minted just now may not be written yet). Returns the
        ids deleted."""
        store = self.store(namespace)
        now = self.now()
        deleted = []
        for record in store.list_tokens():
            if (
                record.description.startswith(DESCRIPTION_PREFIX)
                and record.used_at is None
                and record.id not in keep
                and now - record.created_at > grace
            ):
                store.delete_token(record.id)
                deleted.append(record.id)
        return deleted


def import_custom_ca(store: CertStore, cert_pem: str, key_pem: str, *, now: dt.datetime) -> str:
    """Make the CA in ``cert_pem``/``key_pem`` (a ``kubernetes.io/tls`` Secret's data) the store's
    active CA, when the store has none yet. Returns its id. Raises ValueError with the reason when the
    pair is not a usable CA, or the store already has another CA (a store's CA changes only by a
    rotation: ``cluster-proxy-cert-signer rotate-ca``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from clusterproxy_castore.models import AuthorityRecord, fingerprint

    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
        key = serialization.load_pem_private_key(key_pem.encode(), password=None)
    except ValueError as exc:
        raise ValueError(f"tls.crt/tls.key are not a PEM certificate and key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ValueError("the CA key must be ECDSA P-256 (the signer's key policy, docs/certificates.md)")
    if cert.public_key() != key.public_key():
        raise ValueError("tls.key is not the key of tls.crt")
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is None or not constraints.ca:
        raise ValueError("tls.crt is not a CA certificate (basicConstraints CA:TRUE is missing)")
    if cert.not_valid_after_utc <= now:
        raise ValueError(f"the CA expired at {cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z")
    ca_id = fingerprint(cert).removeprefix("sha256:")[:16]
    current = store.read_authorities()
    if current.active is not None:
        if current.active.id == ca_id:
            return ca_id
        raise ValueError(
            f"the store already has the active CA {current.active.id}; a Custom CA is only imported into an "
            "empty store (change CAs with `cluster-proxy-cert-signer rotate-ca`)"
        )
    record = AuthorityRecord(
        id=ca_id,
        state="active",
        cert_pem=cert.public_bytes(serialization.Encoding.PEM).decode(),
        created_at=now,
        activated_at=now,
    )
    store.write_authorities([record], expected_version=current.version, new_keys={ca_id: key})
    return ca_id
