"""What the gateway reads on the hub: ManagedClusters with the addon (the ClusterGateway objects), each
cluster's token Secret, and the aggregator's requestheader settings.

Every read is a blocking ``kubernetes`` client call, run in a worker thread by the caller
(``trio.to_thread``). Reads are cached for ``ttl`` seconds: a ``kubectl`` session sends a burst of
requests (discovery, then the call), and each would otherwise cost three hub round trips before the
first byte goes to the managed cluster.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

__all__ = [
    "ADDON_NAME",
    "IDENTITY_ANNOTATION",
    "IDENTITY_CALLER",
    "IDENTITY_MODES",
    "IDENTITY_SERVICE_ACCOUNT",
    "ClusterEntry",
    "ClusterToken",
    "HubInventory",
    "RequestHeaderConfig",
    "TokenNotReady",
]

ADDON_NAME = "cluster-proxy"
CLUSTER_GROUP, CLUSTER_VERSION = "cluster.open-cluster-management.io", "v1"
ADDON_GROUP, ADDON_VERSION = "addon.open-cluster-management.io", "v1alpha1"
AUTHENTICATION_CONFIGMAP = ("kube-system", "extension-apiserver-authentication")
DEFAULT_SERVER_NAME = "kubernetes.default.svc"  # on every kube-apiserver's serving certificate
# Per cluster, whose identity the managed cluster sees (docs/cluster-gateway.md, "Whose identity"):
# the cluster's service account (seed 004, the default) or the hub caller's, impersonated.
IDENTITY_ANNOTATION = "cluster-gateway.open-cluster-management.io/identity"
IDENTITY_SERVICE_ACCOUNT, IDENTITY_CALLER = "service-account", "caller"
IDENTITY_MODES = (IDENTITY_SERVICE_ACCOUNT, IDENTITY_CALLER)

T = TypeVar("T")


@dataclass(frozen=True)
class ClusterEntry:
    """One ManagedCluster that has the addon: what a ClusterGateway is derived from."""

    name: str
    uid: str
    created: str  # the ManagedCluster's creationTimestamp
    resource_version: int  # the newer of the ManagedCluster's and the addon's
    addon_available: bool
    addon_reason: str
    # the ManagedCluster's IDENTITY_ANNOTATION as written (IDENTITY_SERVICE_ACCOUNT when absent); a
    # value outside IDENTITY_MODES is kept so that a request can be refused naming it
    identity: str = IDENTITY_SERVICE_ACCOUNT


@dataclass(frozen=True)
class ClusterToken:
    """What the gateway presents to a managed cluster's kube-apiserver: a bearer token of that cluster,
    the CA that signs its serving certificate, and the name that certificate must carry."""

    token: str
    ca_pem: bytes
    server_name: str


class TokenNotReady(Exception):
    """The cluster's token Secret is missing or incomplete; the message says which and what to do."""


@dataclass(frozen=True)
class RequestHeaderConfig:
    """The aggregator's front-proxy settings (kube-apiserver's ``--requestheader-*`` flags)."""

    client_ca_pem: bytes
    allowed_names: tuple[str, ...]  # empty: any certificate the CA signed
    username_headers: tuple[str, ...] = ("X-Remote-User",)
    group_headers: tuple[str, ...] = ("X-Remote-Group",)
    extra_headers_prefixes: tuple[str, ...] = ("X-Remote-Extra-",)


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for condition in (obj.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return condition
    return None


def _rv(obj: dict[str, Any]) -> int:
    try:
        return int(obj["metadata"].get("resourceVersion") or 0)
    except ValueError:
        return 0


class _Cache:
    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        self._values: dict[Any, tuple[float, Any]] = {}

    def get(self, key: Any, load: Callable[[], T]) -> T:
        now = time.monotonic()
        with self._lock:
            hit = self._values.get(key)
        if hit is not None and now - hit[0] < self.ttl:
            return hit[1]
        value = load()
        with self._lock:
            self._values[key] = (now, value)
        return value

    def forget(self, key: Any) -> None:
        with self._lock:
            self._values.pop(key, None)


class HubInventory:
    """Blocking reads of the hub (call them from a worker thread)."""

    def __init__(self, api: Any, *, token_secret: str, ttl: float = 2.0) -> None:
        from kubernetes import client

        self.api = api
        self.token_secret = token_secret
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self._cache = _Cache(ttl)

    # ClusterGateway objects
    def clusters(self) -> tuple[list[ClusterEntry], int]:
        """Every ManagedCluster with the addon, sorted by name, and the newest resourceVersion seen."""
        return self._cache.get("clusters", self._load_clusters)

    def _load_clusters(self) -> tuple[list[ClusterEntry], int]:
        managed = cast(  # kubernetes declares custom objects `object`: they are JSON
            "dict[str, Any]",
            self.custom.list_cluster_custom_object(CLUSTER_GROUP, CLUSTER_VERSION, "managedclusters"),
        )
        addons = cast(
            "dict[str, Any]",
            self.custom.list_cluster_custom_object(
                ADDON_GROUP,
                ADDON_VERSION,
                "managedclusteraddons",
                field_selector=f"metadata.name={ADDON_NAME}",
            ),
        )
        by_namespace = {a["metadata"]["namespace"]: a for a in addons.get("items", [])}
        entries = []
        for cluster in managed.get("items", []):
            name = cluster["metadata"]["name"]
            addon = by_namespace.get(name)
            if addon is None or addon["metadata"].get("deletionTimestamp"):
                continue
            available = _condition(addon, "Available")
            entries.append(
                ClusterEntry(
                    name=name,
                    uid=cluster["metadata"].get("uid", ""),
                    created=cluster["metadata"].get("creationTimestamp", ""),
                    resource_version=max(_rv(cluster), _rv(addon)),
                    addon_available=bool(available and available.get("status") == "True"),
                    addon_reason=(available or {}).get("message")
                    or (available or {}).get("reason")
                    or "the addon reports no Available condition yet",
                    identity=(cluster["metadata"].get("annotations") or {})
                    .get(IDENTITY_ANNOTATION, "")
                    .strip()
                    or IDENTITY_SERVICE_ACCOUNT,
                )
            )
        entries.sort(key=lambda e: e.name)
        newest = max(
            [_rv({"metadata": managed.get("metadata", {})}), _rv({"metadata": addons.get("metadata", {})})]
        )
        return entries, newest

    def cluster(self, name: str) -> ClusterEntry | None:
        return next((e for e in self.clusters()[0] if e.name == name), None)

    # credentials
    def token(self, cluster: str, secret: str | None = None) -> ClusterToken:
        """The cluster's token from the hub Secret ``<cluster>/<secret>`` (default ``token_secret``; keys
        ``token`` and ``ca.crt``, optional ``tls-server-name``); raises TokenNotReady naming what is
        missing."""
        name = secret or self.token_secret
        return self._cache.get(("token", name, cluster), lambda: self._load_token(cluster, name))

    def forget_token(self, cluster: str, secret: str | None = None) -> None:
        self._cache.forget(("token", secret or self.token_secret, cluster))

    def _load_token(self, cluster: str, name: str) -> ClusterToken:
        from kubernetes.client.exceptions import ApiException

        where = f"Secret {cluster}/{name} on the hub"
        try:
            secret = self.core.read_namespaced_secret(name, cluster)
        except ApiException as exc:
            if exc.status == 404:
                raise TokenNotReady(
                    f"the token of cluster {cluster!r} is not projected yet: {where} does not exist "
                    f"(it holds a service-account token of the managed cluster in key 'token' and its "
                    f"API server's CA in 'ca.crt'; see docs/cluster-gateway.md)"
                ) from None
            if exc.status == 403:
                raise TokenNotReady(
                    f"the gateway may not read {where} (403): grant its ServiceAccount get on secrets "
                    f"(deploy/kustomize/base/cluster-gateway/rbac.yaml)"
                ) from None
            raise
        data = secret.data or {}
        missing = [key for key in ("token", "ca.crt") if not data.get(key)]
        if missing:
            raise TokenNotReady(
                f"the token of cluster {cluster!r} is not projected yet: {where} has no "
                f"{' or '.join(repr(k) for k in missing)}"
            )
        server_name = data.get("tls-server-name")
        return ClusterToken(
            token=base64.b64decode(data["token"]).decode().strip(),
            ca_pem=base64.b64decode(data["ca.crt"]),
            server_name=base64.b64decode(server_name).decode().strip()
            if server_name
            else DEFAULT_SERVER_NAME,
        )

    # the aggregator's identity
    def requestheader_config(self) -> RequestHeaderConfig:
        """kube-apiserver publishes its ``--requestheader-*`` settings in the ConfigMap
        ``kube-system/extension-apiserver-authentication`` for aggregated API servers to read."""
        namespace, name = AUTHENTICATION_CONFIGMAP
        config = self.core.read_namespaced_config_map(name, namespace)
        data = config.data or {}
        ca = data.get("requestheader-client-ca-file")
        if not ca:
            raise ValueError(
                f"ConfigMap {namespace}/{name} has no requestheader-client-ca-file: the hub kube-apiserver "
                f"runs without --requestheader-client-ca-file, so it cannot front an aggregated API server"
            )

        def listed(key: str, default: tuple[str, ...]) -> tuple[str, ...]:
            raw = data.get(key)
            return tuple(json.loads(raw)) if raw else default

        return RequestHeaderConfig(
            client_ca_pem=ca.encode(),
            allowed_names=listed("requestheader-allowed-names", ()),
            username_headers=listed("requestheader-username-headers", ("X-Remote-User",)),
            group_headers=listed("requestheader-group-headers", ("X-Remote-Group",)),
            extra_headers_prefixes=listed("requestheader-extra-headers-prefix", ("X-Remote-Extra-",)),
        )
