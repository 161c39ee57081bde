"""The service proxy's allow-list: which in-cluster Services
``/<cluster>/api/v1/namespaces/<ns>/services/[<scheme>:]<svc>:<port>/proxy-service/...`` may reach.

Default deny: a ConfigMap on the hub that the hub admin writes (``--service-proxy-allowlist
NAMESPACE/NAME``, default ``<gateway namespace>/cluster-proxy-service-proxy-allowlist``), each data key a
YAML list of entries, upstream's format (pkg/userserver/service_allowlist.go) plus ``clusters``::

    data:
      monitoring: |
        - namespace: monitoring      # required
          service: prometheus        # required
          port: "9090"               # optional: any port when absent
          protocol: https            # optional: http or https, any when absent
          clusters: [cluster1]       # optional: every cluster when absent

No ConfigMap, an empty one, or no matching entry: the request is refused (403) naming the list. A key
whose value does not parse (or has an entry without namespace or service, or an unknown field) grants
nothing, and the refusal names that key and what is wrong with it: a typo never widens access.
Read through the gateway's hub client and cached for ``ttl`` seconds (the ClusterGateway reads' TTL).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import yaml

__all__ = ["DEFAULT_ALLOWLIST", "AllowList", "Entry", "ServiceTarget", "parse_entries"]

DEFAULT_ALLOWLIST = "cluster-proxy-service-proxy-allowlist"
FIELDS = frozenset({"namespace", "service", "port", "protocol", "clusters"})


@dataclass(frozen=True)
class ServiceTarget:
    cluster: str
    namespace: str
    service: str
    port: str
    protocol: str  # http or https


@dataclass(frozen=True)
class Entry:
    namespace: str
    service: str
    port: str = ""
    protocol: str = ""
    clusters: tuple[str, ...] = ()

    def matches(self, target: ServiceTarget) -> bool:
        return (
            self.namespace == target.namespace
            and self.service == target.service
            and (not self.port or self.port == target.port)
            and (not self.protocol or self.protocol == target.protocol)
            and (not self.clusters or target.cluster in self.clusters)
        )


def parse_entries(key: str, raw: str) -> list[Entry]:
    """One data key's entries; ValueError naming the key and the fault."""
    try:
        loaded = yaml.safe_load(raw) if raw.strip() else []
    except yaml.YAMLError as exc:
        raise ValueError(f"key {key!r} is not YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(loaded, list):
        raise ValueError(f"key {key!r} is not a YAML list of entries")
    entries = []
    for index, item in enumerate(loaded):
        if not isinstance(item, dict):
            raise ValueError(f"key {key!r}, entry {index}: not a mapping")
        unknown = sorted(set(map(str, item)) - FIELDS)
        if unknown:
            raise ValueError(
                f"key {key!r}, entry {index}: unknown field(s) {unknown} (known: {sorted(FIELDS)})"
            )
        if not item.get("namespace") or not item.get("service"):
            raise ValueError(f"key {key!r}, entry {index}: namespace and service are required")
        protocol = str(item.get("protocol") or "")
        if protocol not in ("", "http", "https"):
            raise ValueError(f"key {key!r}, entry {index}: protocol {protocol!r} is not http or https")
        clusters = item.get("clusters") or []
        if not isinstance(clusters, list):
            raise ValueError(f"key {key!r}, entry {index}: clusters is not a list")
        entries.append(
            Entry(
                namespace=str(item["namespace"]),
                service=str(item["service"]),
                port=str(item.get("port") or ""),
                protocol=protocol,
                clusters=tuple(str(c) for c in clusters),
            )
        )
    return entries


@dataclass(frozen=True)
class _Loaded:
    entries: tuple[Entry, ...]
    faults: tuple[str, ...]
    missing: str  # why there is no list at all ("" when there is one)


class AllowList:
    """Blocking reads of the ConfigMap (call :meth:`decide` from a worker thread)."""

    def __init__(self, api: Any, where: str, *, ttl: float = 2.0) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api) if api is not None else None
        self.where = where  # NAMESPACE/NAME, or "" when none is configured
        self.ttl = ttl
        self._lock = threading.Lock()
        self._loaded: tuple[float, _Loaded] | None = None

    def _load(self) -> _Loaded:
        from kubernetes.client.exceptions import ApiException

        if not self.where or self.core is None:
            return _Loaded((), (), "no allow-list is configured (the gateway's --service-proxy-allowlist)")
        namespace, _, name = self.where.partition("/")
        try:
            config = self.core.read_namespaced_config_map(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return _Loaded((), (), f"ConfigMap {self.where} does not exist on the hub")
            return _Loaded((), (), f"ConfigMap {self.where} could not be read ({exc.status} {exc.reason})")
        entries: list[Entry] = []
        faults: list[str] = []
        for key, raw in sorted((config.data or {}).items()):
            try:
                entries += parse_entries(key, raw or "")
            except ValueError as exc:
                faults.append(str(exc))
        return _Loaded(tuple(entries), tuple(faults), "")

    def current(self) -> _Loaded:
        now = time.monotonic()
        with self._lock:
            hit = self._loaded
        if hit is not None and now - hit[0] < self.ttl:
            return hit[1]
        loaded = self._load()
        with self._lock:
            self._loaded = (now, loaded)
        return loaded

    def decide(self, target: ServiceTarget) -> str | None:
        """None when ``target`` is allowed, else the reason it is not, naming the list."""
        loaded = self.current()
        if any(entry.matches(target) for entry in loaded.entries):
            return None
        wanted = f"{target.protocol}:{target.service}:{target.port} in namespace {target.namespace!r}"
        if loaded.missing:
            return f"service {wanted} of cluster {target.cluster!r} is not allowed: {loaded.missing}, so no service is"
        reason = (
            f"service {wanted} of cluster {target.cluster!r} is not in the service proxy's allow-list "
            f"(ConfigMap {self.where} on the hub; an entry with namespace {target.namespace!r} and service "
            f"{target.service!r} allows it)"
        )
        if loaded.faults:
            reason += "; ignored: " + "; ".join(loaded.faults)
        return reason
