"""What the manager watches in the hub namespace of the proxy-servers: its own Services, Deployments
and Secrets, and the signer's store (tokens, the CA list, the records of hub certificates). Their
changes go to the controller's handlers (which keys to look at again); a namespace change replaces
them all (:meth:`.controller.Controller.hub_informers`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .informer import Informer
from .kube import DEPLOYMENT, SECRET, SERVICE
from .render import MANAGED_BY

if TYPE_CHECKING:
    from .controller import Controller

__all__ = ["MANAGED_BY_SELECTOR", "STORE_KIND_LABEL", "HubInformers"]

MANAGED_BY_SELECTOR = f"app.kubernetes.io/managed-by={MANAGED_BY}"
STORE_KIND_LABEL = "cluster-proxy.io/kind"


class HubInformers:
    """What the manager watches in the hub namespace of the proxy-servers."""

    def __init__(self, controller: Controller, namespace: str) -> None:
        kube, timeout = controller.kube, controller.options.watch_timeout
        self.namespace = namespace
        self.services = Informer(
            kube,
            SERVICE,
            controller.on_hub_service,
            namespace=namespace,
            label_selector=MANAGED_BY_SELECTOR,
            watch_timeout=timeout,
        )
        self.deployments = Informer(
            kube,
            DEPLOYMENT,
            controller.on_hub_object,
            namespace=namespace,
            label_selector=MANAGED_BY_SELECTOR,
            watch_timeout=timeout,
        )
        self.secrets = Informer(
            kube,
            SECRET,
            controller.on_hub_object,
            namespace=namespace,
            label_selector=MANAGED_BY_SELECTOR,
            watch_timeout=timeout,
        )
        # the signer's store: tokens (a used one is replaced at once) and the CA list (a rotation
        # changes every bundle the manager hands out)
        self.store = Informer(
            kube,
            SECRET,
            controller.on_store_secret,
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
            controller.on_hub_object,
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
