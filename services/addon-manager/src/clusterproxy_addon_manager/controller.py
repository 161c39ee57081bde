"""The controller: what the manager watches, which keys a change queues, and each key handed to its
reconciler, level-triggered.

Three kinds of key, each reconciled from scratch every time (no memory of events), one module each:

``hub`` (:mod:`.reconcile_hub`)
    The ManagedProxyConfiguration -> the hub objects in its namespace, the CA and the proxy-servers'
    bootstrap token, the hub clients' bootstrap Secrets (``--hub-client``), and the MPC's status
    conditions.
``cma`` (:mod:`.reconcile_cma`)
    The ClusterManagementAddOn ``cluster-proxy`` pointing at the MPC.
``cluster/<name>`` (:mod:`.reconcile_cluster`)
    ManagedCluster ``<name>`` + ManagedClusterAddOn ``cluster-proxy`` in namespace ``<name>`` -> one
    ManifestWork ``addon-cluster-proxy-deploy`` there (or none: deleted when the addon or the cluster
    is gone), and the addon's conditions ``ManifestApplied`` and ``Available``.

Status writes are in :mod:`.status`, the CA bundle and token pruning in :mod:`.tokens`. Writes happen
only when the object on the server lacks what the manager wants (compare.contains), by server-side
apply with the field manager ``cluster-proxy-addon-manager``; status writes only when a condition
changed. The :class:`Controller` holds what every reconciler reads: the clients, the informers, and
the objects as the manager last wrote them.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from clusterproxy_protocol import get_logger

from .availability import AdminTarget, Availability
from .config import Endpoints, EntrypointWaiting, ProxyConfig, deploy_config_ref, parse_mpc, resolve_endpoints
from .hub_informers import MANAGED_BY_SELECTOR, STORE_KIND_LABEL, HubInformers
from .identity import Credentials
from .informer import Informer
from .kube import (
    ADDON_DEPLOYMENT_CONFIG,
    CLUSTER_MANAGEMENT_ADDON,
    MANAGED_CLUSTER,
    MANAGED_CLUSTER_ADDON,
    MANAGED_PROXY_CONFIGURATION,
    MANIFEST_WORK,
    SECRET,
    Kube,
    Resource,
)
from .metadata import generation_of, is_deleting, version_number
from .metrics import ManagerMetrics
from .reconcile_cluster import reconcile_cluster
from .reconcile_cma import create_default_configuration, reconcile_cma
from .reconcile_hub import reconcile_hub
from .render import ADDON_NAME, SIGNER_ENTRYPOINT_SERVICE, HubClient, admin_server_name, signer_url_in_hub
from .tokens import prune_tokens, token_group

__all__ = ["CMA_KEY", "HUB_KEY", "Controller", "ManagerOptions", "NotReady", "cluster_key"]

HUB_KEY = "hub"
CMA_KEY = "cma"


def cluster_key(name: str) -> str:
    return f"cluster/{name}"


class NotReady(Exception):
    """A reconcile needs something still loading (an informer syncing); retried shortly."""


@dataclass(frozen=True)
class ManagerOptions:
    namespace: str
    mpc_name: str
    store_prefix: str
    signer_image: str
    token_prune_grace: dt.timedelta = dt.timedelta(minutes=10)
    watch_timeout: int = 60
    hub_clients: tuple[HubClient, ...] = ()


def _spec_changed(old: dict[str, Any] | None, new: dict[str, Any] | None) -> bool:
    """Additions, deletions, spec (generation) or deletion-state changes: what the reconcilers read.
    Status-only updates (the manager's own status writes, OCM's heartbeats) are not."""
    if old is None or new is None:
        return True
    return generation_of(old) != generation_of(new) or is_deleting(old) != is_deleting(new)


def _ingress(obj: dict[str, Any] | None) -> Any:
    return (((obj or {}).get("status") or {}).get("loadBalancer") or {}).get("ingress")


class Controller:
    """The informers and what their changes queue, the dispatch of a key to its reconciler, and what
    every reconciler reads: the clients, the configuration, and the objects as the manager last wrote
    them. The runner (main.py) starts it, sets ``enqueue`` and calls ``reconcile`` from its workers."""

    def __init__(
        self,
        kube: Kube,
        options: ManagerOptions,
        credentials: Credentials,
        metrics: ManagerMetrics,
        *,
        now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self.kube = kube
        self.options = options
        self.credentials = credentials
        self.metrics = metrics
        self.now = now
        self.log = get_logger("clusterproxy_addon_manager")
        #: hands a key to the work queue; thread-safe (set by the runner)
        self.enqueue: Callable[[str], None] = lambda key: None
        self.availability: Availability | None = None
        timeout = options.watch_timeout
        self.mpcs = Informer(
            kube,
            MANAGED_PROXY_CONFIGURATION,
            self.on_mpc,
            field_selector=f"metadata.name={options.mpc_name}",
            watch_timeout=timeout,
        )
        self.cmas = Informer(
            kube,
            CLUSTER_MANAGEMENT_ADDON,
            self.on_cma,
            field_selector=f"metadata.name={ADDON_NAME}",
            watch_timeout=timeout,
        )
        self.clusters = Informer(kube, MANAGED_CLUSTER, self.on_cluster, watch_timeout=timeout)
        self.addons = Informer(
            kube,
            MANAGED_CLUSTER_ADDON,
            self.on_addon,
            field_selector=f"metadata.name={ADDON_NAME}",
            watch_timeout=timeout,
        )
        self.deploy_configs = Informer(
            kube, ADDON_DEPLOYMENT_CONFIG, self.on_deploy_config, watch_timeout=timeout
        )
        self.works = Informer(
            kube, MANIFEST_WORK, self.on_work, label_selector=MANAGED_BY_SELECTOR, watch_timeout=timeout
        )
        self.informers = (self.mpcs, self.cmas, self.clusters, self.addons, self.deploy_configs, self.works)
        self.hub: HubInformers | None = None
        self.retired_hub: HubInformers | None = None
        self._hub_lock = threading.Lock()
        # Objects as the manager last wrote them: newer than the informers' copy until the watch
        # event of that write arrives (a reconcile in between must not act on the old copy).
        self._written: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._written_lock = threading.Lock()

    # -- informers ----------------------------------------------------------------------------------

    def start(self) -> None:
        for informer in self.informers:
            informer.start()

    @property
    def synced(self) -> bool:
        return all(i.synced.is_set() for i in self.informers)

    def problems(self) -> list[str]:
        found = [i.problem for i in self.informers if i.problem]
        hub = self.hub
        if hub is not None:
            found += [i.problem for i in hub.all if i.problem]
        return found

    def hub_informers(self, namespace: str) -> HubInformers:
        """The informers of ``namespace`` (started on first use; a namespace change stops the old
        ones). NotReady until they hold a full copy."""
        with self._hub_lock:
            if self.hub is None or self.hub.namespace != namespace:
                if self.hub is not None:
                    self.log.info("hub_namespace_changed", old=self.hub.namespace, new=namespace)
                    self.hub.stop()
                    self.retired_hub = self.hub  # its objects are deleted by the next hub reconcile
                self.hub = HubInformers(self, namespace)
                self.hub.start()
            hub = self.hub
        if not hub.synced:
            raise NotReady(f"the informers of namespace {namespace} are still listing")
        return hub

    def start_hub_informers(self, timeout: float = 30.0) -> None:
        """Start the informers of the MPC's namespace and wait (blocking, bounded) for their copy."""
        cfg = self.config()
        namespace = cfg.namespace if cfg is not None else self.options.namespace
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.hub_informers(namespace)
                return
            except NotReady:
                time.sleep(0.02)

    def create_default_configuration(self) -> bool:
        """Once at the start: the MPC ``--mpc-name`` when none exists (:mod:`.reconcile_cma`)."""
        return create_default_configuration(self)

    def cluster_names(self) -> set[str]:
        names = {i["metadata"]["name"] for i in self.clusters.items()}
        names |= {i["metadata"]["namespace"] for i in self.addons.items()}
        names |= {i["metadata"]["namespace"] for i in self.works.items()}
        return names

    def all_keys(self) -> list[str]:
        return [HUB_KEY, CMA_KEY, *sorted(cluster_key(n) for n in self.cluster_names())]

    def enqueue_clusters(self, names: Iterable[str]) -> None:
        for name in names:
            self.enqueue(cluster_key(name))

    # event handlers (informer threads): which keys to look at again
    def on_mpc(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        self.enqueue(HUB_KEY)
        if _spec_changed(old, new):
            self.enqueue(CMA_KEY)
            self.enqueue_clusters(self.cluster_names())

    def on_cma(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        self.enqueue(CMA_KEY)
        if _spec_changed(old, new):
            self.enqueue_clusters(self.cluster_names())

    def on_cluster(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if _spec_changed(old, new):
            self.enqueue(cluster_key((new or old or {})["metadata"]["name"]))

    def on_addon(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if new is None:
            self.forget(MANAGED_CLUSTER_ADDON, old)
        if _spec_changed(old, new):
            self.enqueue(cluster_key((new or old or {})["metadata"]["namespace"]))

    def on_deploy_config(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if not _spec_changed(old, new):
            return
        obj = new or old or {}
        ref = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        cma = self.cmas.get(ADDON_NAME)
        for addon in self.addons.items():
            if deploy_config_ref(addon, cma) == ref:
                self.enqueue(cluster_key(addon["metadata"]["namespace"]))

    def on_work(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if new is None:
            self.forget(MANIFEST_WORK, old)
        self.enqueue(cluster_key((new or old or {})["metadata"]["namespace"]))

    def on_hub_object(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        self.enqueue(HUB_KEY)

    def on_hub_service(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        self.enqueue(HUB_KEY)
        if _ingress(old) != _ingress(new):
            self.enqueue_clusters(self.cluster_names())

    def on_store_secret(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        obj = new or old or {}
        kind = (obj.get("metadata", {}).get("labels") or {}).get(STORE_KIND_LABEL)
        if kind == "authorities":
            self.enqueue(HUB_KEY)
            self.enqueue_clusters(self.cluster_names())
            return
        group = token_group(obj)
        if group == "proxy-server" or (group and group.startswith("hub-client ")):
            self.enqueue(HUB_KEY)
        elif group and group.startswith("cluster "):
            self.enqueue(cluster_key(group.removeprefix("cluster ")))

    # -- reading with our own writes taken into account -------------------------------------------

    def remember(self, resource: Resource, obj: dict[str, Any]) -> None:
        metadata = obj.get("metadata") or {}
        with self._written_lock:
            self._written[(resource.plural, metadata.get("namespace", ""), metadata.get("name", ""))] = obj

    def forget(self, resource: Resource, obj: dict[str, Any] | None) -> None:
        metadata = (obj or {}).get("metadata") or {}
        with self._written_lock:
            self._written.pop(
                (resource.plural, metadata.get("namespace", ""), metadata.get("name", "")), None
            )

    def fresh(
        self, informer: Informer, resource: Resource, name: str, namespace: str = ""
    ) -> dict[str, Any] | None:
        cached = informer.get(name, namespace)
        with self._written_lock:
            written = self._written.get((resource.plural, namespace, name))
        if written is not None and (cached is None or version_number(cached) < version_number(written)):
            return written
        return cached

    # -- reconcile ----------------------------------------------------------------------------------

    def reconcile(self, key: str) -> None:
        """Blocking; called from a worker thread, one key at a time per key."""
        if not self.synced:
            raise NotReady("the informers are still listing")
        if key == HUB_KEY:
            reconcile_hub(self)
        elif key == CMA_KEY:
            reconcile_cma(self)
        elif key.startswith("cluster/"):
            reconcile_cluster(self, key.removeprefix("cluster/"))
        else:
            raise ValueError(f"unknown key {key!r}")

    # -- what every reconciler reads ----------------------------------------------------------------

    def config(self) -> ProxyConfig | None:
        mpc = self.mpcs.get(self.options.mpc_name)
        if mpc is None or is_deleting(mpc):
            return None
        return parse_mpc(mpc, default_namespace=self.options.namespace)

    def endpoints(self, cfg: ProxyConfig, hub: HubInformers) -> Endpoints | EntrypointWaiting:
        services = {s["metadata"]["name"]: s for s in hub.services.items()}
        return resolve_endpoints(cfg, services, signer_entrypoint_service=SIGNER_ENTRYPOINT_SERVICE)

    def read_hub_client_secret(self, hub: HubInformers, namespace: str, name: str) -> dict[str, Any] | None:
        """A hub client's Secret as it is now: from the informer in the proxy-server namespace, read
        from the API in another one (not watched: the resync and the store's token events bring the
        manager back to it)."""
        if namespace == hub.namespace:
            return self.fresh(hub.secrets, SECRET, name, namespace)
        return self.kube.get_or_none(SECRET, name, namespace)

    # periodic --------------------------------------------------------------------------------------

    def set_availability(self, availability: Availability) -> None:
        """A new poll: the clusters whose Available condition would change are reconciled."""
        before = self.availability
        self.availability = availability
        for addon in self.addons.items():
            cluster = addon["metadata"]["namespace"]
            if before is None or before.of(cluster) != availability.of(cluster):
                self.enqueue(cluster_key(cluster))

    def admin_target(self) -> AdminTarget:
        """The proxy-servers the availability poll asks (the configuration's defaults without one)."""
        cfg = self.config() or parse_mpc({}, default_namespace=self.options.namespace)
        return AdminTarget(cfg.namespace, cfg.admin_port, admin_server_name(cfg), signer_url_in_hub(cfg))

    def prune_tokens(self, also_keep: Iterable[str] = ()) -> list[str]:
        """Delete the unused tokens this manager minted (:func:`.tokens.prune_tokens`). Blocking."""
        return prune_tokens(self, also_keep)
