"""The reconcilers: from what the informers hold to what should exist, level-triggered.

Three kinds of key, each reconciled from scratch every time (no memory of events):

``hub``
    The ManagedProxyConfiguration -> the hub objects (render_hub.hub_objects) in its namespace, the CA
    and the proxy-servers' bootstrap token, the hub clients' bootstrap Secrets (``--hub-client``),
    and the MPC's status conditions.
``cma``
    The ClusterManagementAddOn ``cluster-proxy`` pointing at the MPC.
``cluster/<name>``
    ManagedCluster ``<name>`` + ManagedClusterAddOn ``cluster-proxy`` in namespace ``<name>`` -> one
    ManifestWork ``addon-cluster-proxy-deploy`` there (or none: deleted when the addon or the cluster
    is gone), and the addon's conditions ``ManifestApplied`` and ``Available``.

Writes happen only when the object on the server lacks what the manager wants (compare.contains), by
server-side apply with the field manager ``cluster-proxy-addon-manager``; status writes only when a
condition changed.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from clusterproxy_certsigner.models import IssuedRecord
from clusterproxy_protocol.logs import get_logger

from . import render, render_agent, render_hub, render_registration, render_serviceaccounts
from .availability import AdminTarget, Availability, ClusterAvailability
from .compare import contains
from .conditions import Condition, merge_conditions, same_conditions
from .config import (
    Endpoints,
    EntrypointWaiting,
    ProxyConfig,
    ProxySettings,
    agent_namespace,
    deploy_config_ref,
    parse_deploy_config,
    parse_mpc,
    resolve_endpoints,
)
from .identity import (
    DESCRIPTION_PREFIX,
    Credentials,
    agent_binding,
    client_binding,
    import_custom_ca,
    server_binding,
)
from .informer import Informer
from .kube import (
    ADDON_DEPLOYMENT_CONFIG,
    CLUSTER_MANAGEMENT_ADDON,
    DEPLOYMENT,
    MANAGED_CLUSTER,
    MANAGED_CLUSTER_ADDON,
    MANAGED_PROXY_CONFIGURATION,
    MANIFEST_WORK,
    NETWORK_POLICY,
    ROLE,
    ROLE_BINDING,
    SECRET,
    SERVICE,
    SERVICE_ACCOUNT,
    Conflict,
    Kube,
    KubeError,
    Resource,
)
from .metrics import ManagerMetrics

# the cluster-gateway's ManagedServiceAccounts (docs/managed-serviceaccount.md)
MANAGED_SERVICE_ACCOUNT = Resource(
    "authentication.open-cluster-management.io",
    "v1beta1",
    "managedserviceaccounts",
    "ManagedServiceAccount",
    True,
    "deploy/kustomize/base/crds",
)

__all__ = ["CMA_KEY", "HUB_KEY", "Controller", "ManagerOptions", "NotReady", "cluster_key"]

HUB_KEY = "hub"
CMA_KEY = "cma"
MANAGED_BY_SELECTOR = f"app.kubernetes.io/managed-by={render.MANAGED_BY}"
STORE_KIND_LABEL = "cluster-proxy.io/kind"

RESOURCES_BY_KIND: dict[str, Resource] = {
    r.kind: r for r in (SERVICE_ACCOUNT, ROLE, ROLE_BINDING, SECRET, DEPLOYMENT, SERVICE, NETWORK_POLICY)
}


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
    hub_clients: tuple[render.HubClient, ...] = ()


def _generation(obj: dict[str, Any] | None) -> Any:
    return ((obj or {}).get("metadata") or {}).get("generation")


def _deleting(obj: dict[str, Any] | None) -> bool:
    return bool(((obj or {}).get("metadata") or {}).get("deletionTimestamp"))


def _version_number(obj: dict[str, Any] | None) -> int:
    try:
        return int(((obj or {}).get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


def _spec_changed(old: dict[str, Any] | None, new: dict[str, Any] | None) -> bool:
    """Additions, deletions, spec (generation) or deletion-state changes: what the reconcilers read.
    Status-only updates (the manager's own status writes, OCM's heartbeats) are not."""
    if old is None or new is None:
        return True
    return _generation(old) != _generation(new) or _deleting(old) != _deleting(new)


def _ingress(obj: dict[str, Any] | None) -> Any:
    return (((obj or {}).get("status") or {}).get("loadBalancer") or {}).get("ingress")


class HubInformers:
    """What the manager watches in the hub namespace of the proxy-servers."""

    def __init__(self, controller: Controller, namespace: str) -> None:
        kube, timeout = controller.kube, controller.options.watch_timeout
        self.namespace = namespace
        self.services = Informer(
            kube,
            SERVICE,
            controller._on_hub_service,
            namespace=namespace,
            label_selector=MANAGED_BY_SELECTOR,
            watch_timeout=timeout,
        )
        self.deployments = Informer(
            kube,
            DEPLOYMENT,
            controller._on_hub_object,
            namespace=namespace,
            label_selector=MANAGED_BY_SELECTOR,
            watch_timeout=timeout,
        )
        self.secrets = Informer(
            kube,
            SECRET,
            controller._on_hub_object,
            namespace=namespace,
            label_selector=MANAGED_BY_SELECTOR,
            watch_timeout=timeout,
        )
        # the signer's store: tokens (a used one is replaced at once) and the CA list (a rotation
        # changes every bundle the manager hands out)
        self.store = Informer(
            kube,
            SECRET,
            controller._on_store_secret,
            namespace=namespace,
            label_selector=f"cluster-proxy.io/store={controller.options.store_prefix},"
            f"{STORE_KIND_LABEL} in (token,authorities)",
            watch_timeout=timeout,
        )
        # the signer's records of non-agent certificates (agents' carry a cluster label): whether a
        # proxy-server holds a certificate, for ProxyServerSecretsSigned
        self.issued = Informer(
            kube,
            SECRET,
            controller._on_hub_object,
            namespace=namespace,
            label_selector=f"cluster-proxy.io/store={controller.options.store_prefix},"
            f"{STORE_KIND_LABEL}=issued,!cluster-proxy.io/cluster",
            watch_timeout=timeout,
        )
        self.all = (self.services, self.deployments, self.secrets, self.store, self.issued)

    def start(self) -> None:
        for informer in self.all:
            informer.start()

    def stop(self) -> None:
        for informer in self.all:
            informer.stop()

    @property
    def synced(self) -> bool:
        return all(i.synced.is_set() for i in self.all)

    def cached(self, kind: str) -> Informer | None:
        return {"Service": self.services, "Deployment": self.deployments, "Secret": self.secrets}.get(kind)


class Controller:
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
            self._on_mpc,
            field_selector=f"metadata.name={options.mpc_name}",
            watch_timeout=timeout,
        )
        self.cmas = Informer(
            kube,
            CLUSTER_MANAGEMENT_ADDON,
            self._on_cma,
            field_selector=f"metadata.name={render.ADDON_NAME}",
            watch_timeout=timeout,
        )
        self.clusters = Informer(kube, MANAGED_CLUSTER, self._on_cluster, watch_timeout=timeout)
        self.addons = Informer(
            kube,
            MANAGED_CLUSTER_ADDON,
            self._on_addon,
            field_selector=f"metadata.name={render.ADDON_NAME}",
            watch_timeout=timeout,
        )
        self.deploy_configs = Informer(
            kube, ADDON_DEPLOYMENT_CONFIG, self._on_deploy_config, watch_timeout=timeout
        )
        self.works = Informer(
            kube, MANIFEST_WORK, self._on_work, label_selector=MANAGED_BY_SELECTOR, watch_timeout=timeout
        )
        self.informers = (self.mpcs, self.cmas, self.clusters, self.addons, self.deploy_configs, self.works)
        self._hub: HubInformers | None = None
        self._retired_hub: HubInformers | None = None
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
        hub = self._hub
        if hub is not None:
            found += [i.problem for i in hub.all if i.problem]
        return found

    def hub_informers(self, namespace: str) -> HubInformers:
        """The informers of ``namespace`` (started on first use; a namespace change stops the old
        ones). NotReady until they hold a full copy."""
        with self._hub_lock:
            if self._hub is None or self._hub.namespace != namespace:
                if self._hub is not None:
                    self.log.info("hub_namespace_changed", old=self._hub.namespace, new=namespace)
                    self._hub.stop()
                    self._retired_hub = self._hub  # its objects are deleted by the next hub reconcile
                self._hub = HubInformers(self, namespace)
                self._hub.start()
            hub = self._hub
        if not hub.synced:
            raise NotReady(f"the informers of namespace {namespace} are still listing")
        return hub

    def start_hub_informers(self, timeout: float = 30.0) -> None:
        """Start the informers of the MPC's namespace and wait (blocking, bounded) for their copy."""
        cfg = self._config()
        namespace = cfg.namespace if cfg is not None else self.options.namespace
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.hub_informers(namespace)
                return
            except NotReady:
                time.sleep(0.02)

    def create_default_configuration(self) -> bool:
        """Create the MPC ``--mpc-name`` with an empty spec (the CRD's defaults fill it in) when the
        informers, having listed, hold none: once, at the start. Never overwrites: an MPC that exists
        is left as it is, and a 409 means another writer created it meanwhile. True when it created
        one. Blocking; the informers must be synced."""
        name = self.options.mpc_name
        if self.mpcs.get(name) is not None:
            return False
        try:
            created = self.kube.create(
                MANAGED_PROXY_CONFIGURATION, render_registration.default_configuration(name)
            )
        except Conflict:
            self.log.info("default_configuration_exists", name=name, reason="created by another writer")
            return False
        spec = created.get("spec") or {}
        self.log.info(
            "default_configuration_created",
            name=name,
            server_image=(spec.get("proxyServer") or {}).get("image"),
            agent_image=(spec.get("proxyAgent") or {}).get("image"),
        )
        return True

    def cluster_names(self) -> set[str]:
        names = {i["metadata"]["name"] for i in self.clusters.items()}
        names |= {i["metadata"]["namespace"] for i in self.addons.items()}
        names |= {i["metadata"]["namespace"] for i in self.works.items()}
        return names

    def all_keys(self) -> list[str]:
        return [HUB_KEY, CMA_KEY, *sorted(cluster_key(n) for n in self.cluster_names())]

    def _enqueue_clusters(self, names: Iterable[str]) -> None:
        for name in names:
            self.enqueue(cluster_key(name))

    # event handlers (informer threads): which keys to look at again
    def _on_mpc(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        self.enqueue(HUB_KEY)
        if _spec_changed(old, new):
            self.enqueue(CMA_KEY)
            self._enqueue_clusters(self.cluster_names())

    def _on_cma(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        self.enqueue(CMA_KEY)
        if _spec_changed(old, new):
            self._enqueue_clusters(self.cluster_names())

    def _on_cluster(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if _spec_changed(old, new):
            self.enqueue(cluster_key((new or old or {})["metadata"]["name"]))

    def _on_addon(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if new is None:
            self._forget(MANAGED_CLUSTER_ADDON, old)
        if _spec_changed(old, new):
            self.enqueue(cluster_key((new or old or {})["metadata"]["namespace"]))

    def _on_deploy_config(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if not _spec_changed(old, new):
            return
        obj = new or old or {}
        ref = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        cma = self.cmas.get(render.ADDON_NAME)
        for addon in self.addons.items():
            if deploy_config_ref(addon, cma) == ref:
                self.enqueue(cluster_key(addon["metadata"]["namespace"]))

    def _on_work(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if new is None:
            self._forget(MANIFEST_WORK, old)
        self.enqueue(cluster_key((new or old or {})["metadata"]["namespace"]))

    def _on_hub_object(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        self.enqueue(HUB_KEY)

    def _on_hub_service(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        self.enqueue(HUB_KEY)
        if _ingress(old) != _ingress(new):
            self._enqueue_clusters(self.cluster_names())

    def _on_store_secret(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        obj = new or old or {}
        kind = (obj.get("metadata", {}).get("labels") or {}).get(STORE_KIND_LABEL)
        if kind == "authorities":
            self.enqueue(HUB_KEY)
            self._enqueue_clusters(self.cluster_names())
            return
        group = _token_group(obj)
        if group == "proxy-server" or (group and group.startswith("hub-client ")):
            self.enqueue(HUB_KEY)
        elif group and group.startswith("cluster "):
            self.enqueue(cluster_key(group.removeprefix("cluster ")))

    # -- reading with our own writes taken into account -------------------------------------------

    def _remember(self, resource: Resource, obj: dict[str, Any]) -> None:
        metadata = obj.get("metadata") or {}
        with self._written_lock:
            self._written[(resource.plural, metadata.get("namespace", ""), metadata.get("name", ""))] = obj

    def _forget(self, resource: Resource, obj: dict[str, Any] | None) -> None:
        metadata = (obj or {}).get("metadata") or {}
        with self._written_lock:
            self._written.pop(
                (resource.plural, metadata.get("namespace", ""), metadata.get("name", "")), None
            )

    def _fresh(
        self, informer: Informer, resource: Resource, name: str, namespace: str = ""
    ) -> dict[str, Any] | None:
        cached = informer.get(name, namespace)
        with self._written_lock:
            written = self._written.get((resource.plural, namespace, name))
        if written is not None and (cached is None or _version_number(cached) < _version_number(written)):
            return written
        return cached

    # -- reconcile ----------------------------------------------------------------------------------

    def reconcile(self, key: str) -> None:
        """Blocking; called from a worker thread, one key at a time per key."""
        if not self.synced:
            raise NotReady("the informers are still listing")
        if key == HUB_KEY:
            self.reconcile_hub()
        elif key == CMA_KEY:
            self.reconcile_cma()
        elif key.startswith("cluster/"):
            self.reconcile_cluster(key.removeprefix("cluster/"))
        else:
            raise ValueError(f"unknown key {key!r}")

    def _config(self) -> ProxyConfig | None:
        mpc = self.mpcs.get(self.options.mpc_name)
        if mpc is None or _deleting(mpc):
            return None
        return parse_mpc(mpc, default_namespace=self.options.namespace)

    def _endpoints(self, cfg: ProxyConfig, hub: HubInformers) -> Endpoints | EntrypointWaiting:
        services = {s["metadata"]["name"]: s for s in hub.services.items()}
        return resolve_endpoints(cfg, services, signer_entrypoint_service=render.SIGNER_ENTRYPOINT_SERVICE)

    def _ensure(self, obj: dict[str, Any], hub: HubInformers | None = None) -> bool:
        """Apply ``obj`` unless the server already holds it; True when written."""
        resource = (
            RESOURCES_BY_KIND.get(obj["kind"])
            or {
                "ManifestWork": MANIFEST_WORK,
                "ClusterManagementAddOn": CLUSTER_MANAGEMENT_ADDON,
            }[obj["kind"]]
        )
        metadata = obj["metadata"]
        name, namespace = metadata["name"], metadata.get("namespace", "")
        informer = hub.cached(obj["kind"]) if hub is not None else None
        if informer is not None:
            current = self._fresh(informer, resource, name, namespace)
        else:
            current = self.kube.get_or_none(resource, name, namespace or None)
        if current is not None and contains(current, obj):
            return False
        written = self.kube.apply(resource, obj)
        self._remember(resource, written)
        self.metrics.writes.labels(resource.kind, "apply").inc()
        self.log.info(
            "object_applied",
            kind=obj["kind"],
            name=name,
            namespace=namespace or None,
            created=current is None,
        )
        return True

    def reconcile_cma(self) -> None:
        desired = render_registration.cluster_management_addon(self.options.mpc_name)
        current = self._fresh(self.cmas, CLUSTER_MANAGEMENT_ADDON, render.ADDON_NAME)
        if current is not None and contains(current, desired):
            return
        written = self.kube.apply(CLUSTER_MANAGEMENT_ADDON, desired)
        self._remember(CLUSTER_MANAGEMENT_ADDON, written)
        self.metrics.writes.labels("ClusterManagementAddOn", "apply").inc()
        self.log.info(
            "object_applied", kind="ClusterManagementAddOn", name=render.ADDON_NAME, created=current is None
        )

    # the hub ---------------------------------------------------------------------------------------

    def _trust_bundle(self, cfg: ProxyConfig) -> tuple[str, Condition | None]:
        """The CA bundle; for a Custom signer first import its CA into an empty store. The condition
        is set when the CA cannot be had (the reason, for the MPC status)."""
        if cfg.signer_type == "Custom":
            secret = self.kube.get_or_none(SECRET, cfg.custom_ca_secret, cfg.namespace)
            if secret is None:
                return "", Condition(
                    "ProxyServerSecretsSigned",
                    "False",
                    "CustomCAMissing",
                    f"Secret {cfg.namespace}/{cfg.custom_ca_secret} (spec.authentication.signer.custom."
                    "caSecretName) does not exist: create it with tls.crt and tls.key of an ECDSA P-256 CA",
                )
            data = secret.get("data") or {}
            try:
                cert_pem = base64.b64decode(data.get("tls.crt", "")).decode()
                key_pem = base64.b64decode(data.get("tls.key", "")).decode()
                import_custom_ca(self.credentials.store(cfg.namespace), cert_pem, key_pem, now=self.now())
            except ValueError as exc:
                return "", Condition(
                    "ProxyServerSecretsSigned",
                    "False",
                    "CustomCAInvalid",
                    f"Secret {cfg.namespace}/{cfg.custom_ca_secret}: {exc}",
                )
        return self.credentials.trust_bundle(cfg.namespace), None

    def _delete_hub_objects(self, hub: HubInformers, keep: set[tuple[str, str]] = frozenset()) -> int:  # type: ignore[assignment]
        """Delete the hub objects this manager made that are not in ``keep`` ((kind, name))."""
        deleted = 0
        for informer, resource in (
            (hub.deployments, DEPLOYMENT),
            (hub.services, SERVICE),
            (hub.secrets, SECRET),
        ):
            for obj in informer.items():
                name = obj["metadata"]["name"]
                if (resource.kind, name) in keep:
                    continue
                if self.kube.delete(resource, name, hub.namespace):
                    self.metrics.writes.labels(resource.kind, "delete").inc()
                    self.log.info("object_deleted", kind=resource.kind, name=name, namespace=hub.namespace)
                    deleted += 1
        if not keep:
            for resource, name in (
                (NETWORK_POLICY, render.SERVER_DEPLOYMENT),
                (NETWORK_POLICY, render.SIGNER_DEPLOYMENT),
                (ROLE_BINDING, render.SIGNER_SERVICE_ACCOUNT),
                (ROLE, render.SIGNER_SERVICE_ACCOUNT),
                (SERVICE_ACCOUNT, render.SIGNER_SERVICE_ACCOUNT),
                (SERVICE_ACCOUNT, render.SERVER_SERVICE_ACCOUNT),
            ):
                current = self.kube.get_or_none(resource, name, hub.namespace)
                labels = ((current or {}).get("metadata") or {}).get("labels") or {}
                if labels.get("app.kubernetes.io/managed-by") == render.MANAGED_BY:
                    self.kube.delete(resource, name, hub.namespace)
                    self.metrics.writes.labels(resource.kind, "delete").inc()
                    self.log.info("object_deleted", kind=resource.kind, name=name, namespace=hub.namespace)
                    deleted += 1
        return deleted

    def reconcile_hub(self) -> None:
        cfg = self._config()
        if cfg is None:
            # No configuration: nothing of the hub side should exist (a real cluster's garbage
            # collector does the same through the owner references; tests have none).
            hub = self.hub_informers(self._hub.namespace if self._hub else self.options.namespace)
            self._delete_hub_objects(hub)
            return
        hub = self.hub_informers(cfg.namespace)
        retired = self._retired_hub
        if retired is not None and retired.namespace != cfg.namespace:
            # spec.proxyServer.namespace changed: the old namespace's servers and signer go (their
            # CA store stays there; see docs/addon-manager.md on moving namespaces)
            self._delete_hub_objects(retired)
        self._retired_hub = None
        endpoints = self._endpoints(cfg, hub)
        ready_endpoints = endpoints if isinstance(endpoints, Endpoints) else None
        conditions: list[Condition] = []
        bundle, ca_problem = self._trust_bundle(cfg)
        if ca_problem is not None:
            conditions.append(ca_problem)
            self._set_mpc_status(cfg, conditions)
            return
        hosts = render.server_tls_hosts(cfg, ready_endpoints)
        current_token = render.token_from_secret(
            self._fresh(hub.secrets, SECRET, render.SERVER_BOOTSTRAP_SECRET, cfg.namespace)
        )
        token = self.credentials.ensure_token(
            cfg.namespace, "proxy-server", server_binding(render.SERVER_CERT_NAME, hosts), current_token
        )
        if token.minted:
            self.metrics.tokens_minted.labels("proxy-server").inc()
            self.log.info("token_minted", group="proxy-server", reason=token.reason)
        objects = render_hub.hub_objects(
            render_hub.HubInputs(
                cfg=cfg,
                endpoints=ready_endpoints,
                ca_bundle_pem=bundle,
                server_token=token.token,
                store_prefix=self.options.store_prefix,
                signer_image=self.options.signer_image,
            )
        )
        for obj in objects:
            self._ensure(obj, hub)
        client_secrets = self._reconcile_hub_clients(cfg, hub, bundle)
        keep = {(o["kind"], o["metadata"]["name"]) for o in objects}
        keep |= {("Secret", name) for namespace, name in client_secrets if namespace == cfg.namespace}
        self._delete_hub_objects(hub, keep=keep)

        conditions.append(
            self._deployment_condition(hub, cfg, "ProxyServerDeployed", render.SERVER_DEPLOYMENT)
        )
        conditions.append(
            self._deployment_condition(hub, cfg, "CertSignerDeployed", render.SIGNER_DEPLOYMENT)
        )
        if isinstance(endpoints, Endpoints):
            conditions.append(
                Condition(
                    "EntrypointReady",
                    "True",
                    "AddressKnown",
                    f"agents dial the proxy-servers at {endpoints.server_host}:{endpoints.server_port} and the "
                    f"cert-signer at {endpoints.signer_host}:{endpoints.signer_port} ({cfg.entrypoint.type})",
                )
            )
        else:
            conditions.append(Condition("EntrypointReady", "False", endpoints.reason, endpoints.message))
        signed = self._server_certificate(hub)
        if signed is not None:
            conditions.append(
                Condition(
                    "ProxyServerSecretsSigned",
                    "True",
                    "CertificateIssued",
                    f"the cert-signer issued the proxy-server certificate {signed.serial[:16]} (CA {signed.ca_id}, "
                    f"valid until {signed.not_after:%Y-%m-%dT%H:%M:%SZ}); servers renew it themselves",
                )
            )
        else:
            conditions.append(
                Condition(
                    "ProxyServerSecretsSigned",
                    "False",
                    "WaitingForProxyServer",
                    f"the CA is ready and Secret {cfg.namespace}/{render.SERVER_BOOTSTRAP_SECRET} holds a "
                    "bootstrap token; no proxy-server has traded it for a certificate yet",
                )
            )
        self._set_mpc_status(cfg, conditions)

    def _hub_client_secret(self, hub: HubInformers, namespace: str, name: str) -> dict[str, Any] | None:
        """A hub client's Secret as it is now: from the informer in the proxy-server namespace, read
        from the API in another one (not watched: the resync and the store's token events bring the
        manager back to it)."""
        if namespace == hub.namespace:
            return self._fresh(hub.secrets, SECRET, name, namespace)
        return self.kube.get_or_none(SECRET, name, namespace)

    def _reconcile_hub_clients(
        self, cfg: ProxyConfig, hub: HubInformers, bundle: str
    ) -> list[tuple[str, str]]:
        """One usable token per hub client in its Secret, with the CA bundle (docs/addon-manager.md,
        "Identities"): replaced when used, expiring or bound otherwise, as the proxy-servers' one.
        Returns the (namespace, name) of every Secret kept. A Secret in another namespace that cannot
        be written (no such namespace, no Role there) is logged with what to do, and does not stop the
        rest of the hub's reconcile; the resync tries it again."""
        kept = []
        for hub_client in self.options.hub_clients:
            namespace, name = hub_client.where(cfg.namespace)
            try:
                self._reconcile_hub_client(cfg, hub, bundle, hub_client)
            except KubeError as exc:
                if namespace == cfg.namespace:
                    raise
                self.log.warning(
                    "hub_client_secret_failed",
                    client=hub_client.name,
                    secret=f"{namespace}/{name}",
                    error=str(exc),
                    fix=f"create namespace {namespace} and bind the manager's Role there "
                    "(deploy/kustomize/base/addon-manager/rbac.yaml), or drop the namespace from --hub-client",
                )
                continue
            kept.append((namespace, name))
        return kept

    def _reconcile_hub_client(
        self, cfg: ProxyConfig, hub: HubInformers, bundle: str, hub_client: render.HubClient
    ) -> None:
        namespace, name = hub_client.where(cfg.namespace)
        current = self._hub_client_secret(hub, namespace, name)
        token = self.credentials.ensure_token(
            cfg.namespace,
            hub_client.group,
            server_binding(hub_client.name, list(hub_client.hosts))
            if hub_client.hosts
            else client_binding(hub_client.name),
            render.token_from_secret(current),
        )
        if token.minted:
            self.metrics.tokens_minted.labels("hub-client").inc()
            self.log.info(
                "token_minted", group=hub_client.group, secret=f"{namespace}/{name}", reason=token.reason
            )
        desired = render_hub.hub_client_secret(cfg, hub_client, ca_bundle_pem=bundle, token=token.token)
        if current is None or not contains(current, desired):
            written = self.kube.apply(SECRET, desired)
            self._remember(SECRET, written)
            self.metrics.writes.labels("Secret", "apply").inc()
            self.log.info(
                "object_applied", kind="Secret", name=name, namespace=namespace, created=current is None
            )

    def _server_certificate(self, hub: HubInformers) -> IssuedRecord | None:
        """The newest live proxy-server certificate the signer issued, from the store's records of
        non-agent certificates (watched: a server bootstrapping is seen at once)."""
        now = self.now()
        live = []
        for secret in hub.issued.items():
            raw = (secret.get("data") or {}).get("record.json")
            try:
                record = IssuedRecord.from_json(json.loads(base64.b64decode(raw or "")))
            except (ValueError, KeyError, TypeError):
                continue
            if (
                record.identity.kind == "server"
                and record.identity.name == render.SERVER_CERT_NAME
                and record.live(now)
            ):
                live.append(record)
        return max(live, key=lambda r: r.issued_at, default=None)

    def _deployment_condition(self, hub: HubInformers, cfg: ProxyConfig, kind: str, name: str) -> Condition:
        deployment = self._fresh(hub.deployments, DEPLOYMENT, name, cfg.namespace) or {}
        status = deployment.get("status") or {}
        wanted = (deployment.get("spec") or {}).get("replicas", 1)
        ready = status.get("readyReplicas") or 0
        return Condition(
            kind,
            "True",
            "Deployed",
            f"Deployment {cfg.namespace}/{name} is up to date; {ready}/{wanted} replica(s) ready",
        )

    def _set_mpc_status(self, cfg: ProxyConfig, conditions: list[Condition]) -> None:
        for _ in range(3):
            mpc = self._fresh(self.mpcs, MANAGED_PROXY_CONFIGURATION, cfg.name)
            if mpc is None:
                return
            status = mpc.get("status") or {}
            merged = merge_conditions(
                status.get("conditions"), conditions, now=self.now(), observed_generation=cfg.generation
            )
            if (
                same_conditions(merged, status.get("conditions"))
                and status.get("observedGeneration") == cfg.generation
            ):
                return
            body = copy.deepcopy(mpc)
            body["status"] = {**status, "conditions": merged, "observedGeneration": cfg.generation}
            try:
                written = self.kube.replace_status(MANAGED_PROXY_CONFIGURATION, body)
            except Conflict:
                self._remember(
                    MANAGED_PROXY_CONFIGURATION, self.kube.get(MANAGED_PROXY_CONFIGURATION, cfg.name)
                )
                continue
            self._remember(MANAGED_PROXY_CONFIGURATION, written)
            self.metrics.writes.labels("ManagedProxyConfiguration", "status").inc()
            self.log.info(
                "status_updated",
                kind="ManagedProxyConfiguration",
                name=cfg.name,
                conditions={c.type: c.status for c in conditions},
            )
            return
        raise Conflict("the ManagedProxyConfiguration kept changing while its status was written")

    # a managed cluster -----------------------------------------------------------------------------

    def reconcile_cluster(self, name: str) -> None:
        cluster = self.clusters.get(name)
        addon = self._fresh(self.addons, MANAGED_CLUSTER_ADDON, render.ADDON_NAME, name)
        work = self._fresh(self.works, MANIFEST_WORK, render.MANIFEST_WORK_NAME, name)
        cfg = self._config()
        if cluster is None or _deleting(cluster) or addon is None or _deleting(addon):
            if work is not None:
                self.kube.delete(MANIFEST_WORK, render.MANIFEST_WORK_NAME, name)
                self._forget(MANIFEST_WORK, work)
                self.metrics.writes.labels("ManifestWork", "delete").inc()
                why = "cluster" if cluster is None or _deleting(cluster) else "addon"
                self.log.info("work_deleted", cluster=name, reason=f"the {why} is gone")
                self._delete_gateway_serviceaccount(name)
                if cfg is not None and self.credentials.forget_token(
                    cfg.namespace, render.token_from_manifest_work(work)
                ):
                    self.log.info("token_deleted", group=f"cluster {name}", reason="the addon is gone")
            return
        if cfg is None:
            self._set_addon_status(
                addon,
                [
                    Condition(
                        "ManifestApplied",
                        "False",
                        "ConfigurationMissing",
                        f"ManagedProxyConfiguration {self.options.mpc_name!r} does not exist: the agent cannot be "
                        "configured (the existing ManifestWork, if any, is kept)",
                    )
                ],
                None,
            )
            return
        hub = self.hub_informers(cfg.namespace)
        endpoints = self._endpoints(cfg, hub)
        if isinstance(endpoints, EntrypointWaiting):
            self._set_addon_status(
                addon, [Condition("ManifestApplied", "False", endpoints.reason, endpoints.message)], None
            )
            return
        settings = ProxySettings()
        ref = deploy_config_ref(addon, self.cmas.get(render.ADDON_NAME))
        if ref is not None:
            deploy_config = self.deploy_configs.get(ref[1], ref[0])
            if deploy_config is None:
                self._set_addon_status(
                    addon,
                    [
                        Condition(
                            "ManifestApplied",
                            "False",
                            "DeployConfigMissing",
                            f"AddOnDeploymentConfig {ref[0]}/{ref[1]} (referenced by the addon or the "
                            "ClusterManagementAddOn) does not exist",
                        )
                    ],
                    None,
                )
                return
            settings = parse_deploy_config(deploy_config)
            for problem in settings.problems:
                self.log.warning(
                    "deploy_config_problem", cluster=name, config=f"{ref[0]}/{ref[1]}", problem=problem
                )
        agent_ns = agent_namespace(addon, settings)
        bundle, ca_problem = self._trust_bundle(cfg)
        if ca_problem is not None:
            self._set_addon_status(
                addon, [Condition("ManifestApplied", "False", ca_problem.reason, ca_problem.message)], None
            )
            return
        token = self.credentials.ensure_token(
            cfg.namespace, f"cluster {name}", agent_binding(name), render.token_from_manifest_work(work)
        )
        if token.minted:
            self.metrics.tokens_minted.labels("agent").inc()
            self.log.info("token_minted", group=f"cluster {name}", reason=token.reason)
        desired = render_agent.agent_manifest_work(
            render_agent.AgentInputs(
                cfg=cfg,
                cluster=name,
                namespace=agent_ns,
                endpoints=endpoints,
                ca_bundle_pem=bundle,
                token=token.token,
                proxy=settings,
                addon_uid=str(addon["metadata"].get("uid") or ""),
            )
        )
        if work is None or not contains(work, desired):
            written = self.kube.apply(MANIFEST_WORK, desired)
            self._remember(MANIFEST_WORK, written)
            self.metrics.writes.labels("ManifestWork", "apply").inc()
            self.log.info(
                "work_applied",
                cluster=name,
                work=f"{name}/{render.MANIFEST_WORK_NAME}",
                created=work is None,
                generation=_generation(written),
            )
            work = written
        self._ensure_gateway_serviceaccount(name, str(addon["metadata"].get("uid") or ""))
        self._set_addon_status(addon, [_manifest_applied(work), self._available(name)], agent_ns)

    def _ensure_gateway_serviceaccount(self, cluster: str, addon_uid: str) -> None:
        """The cluster-gateway's ManagedServiceAccounts (its own and its service proxy's) in the cluster's
        namespace, created when missing. A hub without their CRD (no gateway) or a refused write is
        logged, never the addon's failure."""
        for name in render.GATEWAY_SERVICEACCOUNTS:
            try:
                if self.kube.get_or_none(MANAGED_SERVICE_ACCOUNT, name, cluster) is None:
                    self.kube.create(
                        MANAGED_SERVICE_ACCOUNT,
                        render_serviceaccounts.gateway_managed_serviceaccount(cluster, addon_uid, name),
                    )
                    self.log.info("gateway_serviceaccount_created", cluster=cluster, name=name)
            except KubeError as exc:
                if exc.status != 409:
                    self.log.warning(
                        "gateway_serviceaccount_failed", cluster=cluster, name=name, error=str(exc)
                    )

    def _delete_gateway_serviceaccount(self, cluster: str) -> None:
        for name in render.GATEWAY_SERVICEACCOUNTS:
            try:
                self.kube.delete(MANAGED_SERVICE_ACCOUNT, name, cluster)
            except KubeError as exc:
                self.log.warning("gateway_serviceaccount_failed", cluster=cluster, name=name, error=str(exc))

    def _available(self, cluster: str) -> Condition:
        if self.availability is None:
            state = ClusterAvailability(
                "Unknown", "NotPolledYet", "the proxy-servers have not been asked yet"
            )
        else:
            state = self.availability.of(cluster)
        return Condition("Available", state.status, state.reason, state.message)

    def _set_addon_status(
        self, addon: dict[str, Any], conditions: list[Condition], namespace: str | None
    ) -> None:
        name = addon["metadata"]["namespace"]
        for _ in range(3):
            status = addon.get("status") or {}
            merged = merge_conditions(status.get("conditions"), conditions, now=self.now())
            same_namespace = namespace is None or status.get("namespace") == namespace
            if same_conditions(merged, status.get("conditions")) and same_namespace:
                return
            body = copy.deepcopy(addon)
            body["status"] = {**status, "conditions": merged}
            if namespace is not None:
                body["status"]["namespace"] = namespace
            try:
                written = self.kube.replace_status(MANAGED_CLUSTER_ADDON, body)
            except Conflict:
                addon = self.kube.get(MANAGED_CLUSTER_ADDON, render.ADDON_NAME, name)
                self._remember(MANAGED_CLUSTER_ADDON, addon)
                continue
            self._remember(MANAGED_CLUSTER_ADDON, written)
            self.metrics.writes.labels("ManagedClusterAddOn", "status").inc()
            self.log.info(
                "status_updated",
                kind="ManagedClusterAddOn",
                cluster=name,
                conditions={c.type: c.status for c in conditions},
            )
            return
        raise Conflict(f"the ManagedClusterAddOn of {name} kept changing while its status was written")

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
        cfg = self._config() or parse_mpc({}, default_namespace=self.options.namespace)
        return AdminTarget(
            cfg.namespace, cfg.admin_port, render.admin_server_name(cfg), render.signer_url_in_hub(cfg)
        )

    def prune_tokens(self, also_keep: Iterable[str] = ()) -> list[str]:
        """Delete unused tokens this manager minted that nothing holds any more (a crash between
        minting and writing, a superseded token). ``also_keep``: token ids held elsewhere (the
        manager's own, between its minting and its use). Blocking."""
        cfg = self._config()
        if cfg is None or self._hub is None or self._hub.namespace != cfg.namespace or not self._hub.synced:
            return []
        keep = set(also_keep)
        for work in self.works.items():
            token = render.token_from_manifest_work(work)
            if token:
                keep.add(token.split(".", 1)[0])
        server_token = render.token_from_secret(
            self._hub.secrets.get(render.SERVER_BOOTSTRAP_SECRET, cfg.namespace)
        )
        if server_token:
            keep.add(server_token.split(".", 1)[0])
        for hub_client in self.options.hub_clients:
            namespace, name = hub_client.where(cfg.namespace)
            try:
                client_token = render.token_from_secret(self._hub_client_secret(self._hub, namespace, name))
            except KubeError as exc:
                # a token nobody can see may still be the one a client's Secret holds: prune nothing
                self.log.warning("tokens_not_pruned", reason=f"cannot read Secret {namespace}/{name}: {exc}")
                return []
            if client_token:
                keep.add(client_token.split(".", 1)[0])
        deleted = self.credentials.prune_tokens(cfg.namespace, keep, grace=self.options.token_prune_grace)
        if deleted:
            self.log.info("tokens_pruned", count=len(deleted), ids=deleted)
        return deleted


def _token_group(secret: dict[str, Any]) -> str | None:
    """The group a token Secret of the signer's store was minted for (its description)."""
    raw = (secret.get("data") or {}).get("record.json")
    if not isinstance(raw, str):
        return None
    try:
        description = str(json.loads(base64.b64decode(raw)).get("description") or "")
    except (ValueError, AttributeError):
        return None
    return (
        description.removeprefix(DESCRIPTION_PREFIX) if description.startswith(DESCRIPTION_PREFIX) else None
    )


def _manifest_applied(work: dict[str, Any]) -> Condition:
    """ManifestApplied from the work agent's ``Applied`` condition on the ManifestWork."""
    where = f"ManifestWork {work['metadata'].get('namespace')}/{work['metadata'].get('name')}"
    generation = _generation(work)
    for condition in (work.get("status") or {}).get("conditions") or []:
        if condition.get("type") != "Applied":
            continue
        observed = condition.get("observedGeneration")
        if condition.get("status") == "True":
            if observed is not None and generation is not None and observed != generation:
                return Condition(
                    "ManifestApplied",
                    "Unknown",
                    "ManifestWorkApplying",
                    f"the work agent applied generation {observed} of {where}; generation {generation} is not "
                    "applied yet",
                )
            return Condition(
                "ManifestApplied", "True", "ManifestWorkApplied", f"the work agent applied {where}"
            )
        return Condition(
            "ManifestApplied",
            "False",
            "ManifestWorkApplyFailed",
            f"the work agent could not apply {where}: {condition.get('reason')}: {condition.get('message')}",
        )
    return Condition(
        "ManifestApplied",
        "Unknown",
        "WaitingForWorkAgent",
        f"{where} is written; the cluster's work agent has not reported applying it yet",
    )
