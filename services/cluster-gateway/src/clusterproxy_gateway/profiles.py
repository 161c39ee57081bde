"""The Cluster Inventory API (sig-multicluster's ``ClusterProfile``, ``multicluster.x-k8s.io/v1alpha1``):
one ClusterProfile per ClusterGateway, whose ``status.accessProviders`` entry ``cluster-proxy`` holds the
gateway's per-cluster URL and the hub's CA.

A multicluster controller on the hub that consumes ClusterProfiles (MultiKueue, Argo CD, ...) builds a
client from that entry (``server``, ``certificate-authority-data``) plus its own hub credentials, and
reaches the managed cluster through the hub's aggregator and the tunnel without knowing either.

All profiles live in one namespace (``--cluster-profile-namespace``, default ``open-cluster-management``):
the API groups the profiles of one inventory by namespace (its clusterset label goes on the namespace),
and consumers watch one namespace and are granted read access there, not in every cluster namespace.
A profile the gateway created (label ``app.kubernetes.io/managed-by``) is deleted with its cluster; in a
profile someone else made for the same cluster (OCM's own registration controller makes them when its
ClusterProfile feature gate is on), only the ``cluster-proxy`` entry is added, kept current and removed.

Every call is a blocking ``kubernetes`` client call: :meth:`ProfilePublisher.sync_once` runs in a worker
thread, :meth:`ProfilePublisher.run` repeats it.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, cast

import trio

from clusterproxy_protocol import get_logger

from . import objects
from .inventory import HubInventory

__all__ = [
    "ACCESS_PROVIDER",
    "CLUSTER_MANAGER",
    "PROFILE_GROUP",
    "PROFILE_PLURAL",
    "PROFILE_VERSION",
    "ProfilePublisher",
    "ProfilesUnavailable",
    "SyncResult",
    "gateway_url",
]

PROFILE_GROUP, PROFILE_VERSION, PROFILE_PLURAL = "multicluster.x-k8s.io", "v1alpha1", "clusterprofiles"
CLUSTER_MANAGER = "open-cluster-management"
CLUSTER_MANAGER_LABEL = "x-k8s.io/cluster-manager"  # the API asks every cluster manager to set it
MANAGED_BY_LABEL, MANAGED_BY = "app.kubernetes.io/managed-by", "cluster-proxy-cluster-gateway"
ACCESS_PROVIDER = "cluster-proxy"
CRD_FILE = "deploy/kustomize/base/crds/multicluster.x-k8s.io_clusterprofiles.yaml"
RBAC_FILE = "deploy/kustomize/base/cluster-gateway/rbac.yaml"


def gateway_url(hub_url: str, cluster: str) -> str:
    """The seed's per-cluster server: the hub's URL with the proxy subresource's path."""
    return f"{hub_url.rstrip('/')}/apis/{objects.GROUP}/{objects.VERSION}/{objects.RESOURCE}/{cluster}/proxy"


class ProfilesUnavailable(Exception):
    """The hub does not serve the ClusterProfile API; the message says what to install."""


@dataclass
class SyncResult:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)


def _message(exc: Any) -> str:
    try:
        return str(json.loads(exc.body).get("message") or exc.body)
    except (ValueError, TypeError, AttributeError):
        return str(getattr(exc, "body", "") or exc)


class ProfilePublisher:
    def __init__(
        self,
        inventory: HubInventory,
        *,
        namespace: str,
        hub_url: str,
        hub_ca_pem: bytes | None,
        interval: float,
    ) -> None:
        from kubernetes import client

        self.inventory = inventory
        self.custom = client.CustomObjectsApi(inventory.api)
        self.namespace = namespace
        self.hub_url = hub_url.rstrip("/")
        self.hub_ca_pem = hub_ca_pem
        self.interval = interval
        self.log = get_logger("cluster-gateway")

    def access_provider(self, cluster: str) -> dict[str, Any]:
        """The entry of ``status.accessProviders``: a kubeconfig ``cluster`` (server, CA) for the gateway."""
        reach: dict[str, Any] = {"server": gateway_url(self.hub_url, cluster)}
        if self.hub_ca_pem:
            reach["certificate-authority-data"] = base64.b64encode(self.hub_ca_pem).decode()
        return {"name": ACCESS_PROVIDER, "cluster": reach}

    def _new_profile(self, cluster: str) -> dict[str, Any]:
        return {
            "apiVersion": f"{PROFILE_GROUP}/{PROFILE_VERSION}",
            "kind": "ClusterProfile",
            "metadata": {
                "name": cluster,
                "namespace": self.namespace,
                "labels": {CLUSTER_MANAGER_LABEL: CLUSTER_MANAGER, MANAGED_BY_LABEL: MANAGED_BY},
            },
            "spec": {"displayName": cluster, "clusterManager": {"name": CLUSTER_MANAGER}},
        }

    def _write_providers(self, profile: dict[str, Any], providers: list[dict[str, Any]]) -> None:
        profile.setdefault("status", {})["accessProviders"] = providers
        self.custom.replace_namespaced_custom_object_status(
            PROFILE_GROUP,
            PROFILE_VERSION,
            self.namespace,
            PROFILE_PLURAL,
            profile["metadata"]["name"],
            profile,
        )

    def sync_once(self) -> SyncResult:
        """Make the namespace's ClusterProfiles match the ClusterGateways; raises ApiException."""
        entries, _ = self.inventory.clusters()
        wanted = {entry.name for entry in entries}
        from kubernetes.client.exceptions import ApiException

        try:
            listed = cast(  # kubernetes declares custom objects `object`: they are JSON
                "dict[str, Any]",
                self.custom.list_namespaced_custom_object(
                    PROFILE_GROUP, PROFILE_VERSION, self.namespace, PROFILE_PLURAL
                ),
            )
        except ApiException as exc:
            if exc.status == 404:  # a list in a namespace that does not exist is empty, not 404
                raise ProfilesUnavailable(
                    f"the ClusterProfile API ({PROFILE_PLURAL}.{PROFILE_GROUP}) is not installed on the hub: "
                    f"kubectl apply -f {CRD_FILE} (or run the gateway with --cluster-profile-namespace='' "
                    "to publish none)"
                ) from None
            raise
        existing = {p["metadata"]["name"]: p for p in listed.get("items", [])}
        result = SyncResult()
        for name in sorted(wanted):
            profile = existing.get(name)
            if profile is None:
                profile = cast(
                    "dict[str, Any]",
                    self.custom.create_namespaced_custom_object(
                        PROFILE_GROUP,
                        PROFILE_VERSION,
                        self.namespace,
                        PROFILE_PLURAL,
                        self._new_profile(name),
                    ),
                )
                result.created.append(name)
            ours = self.access_provider(name)
            providers = (profile.get("status") or {}).get("accessProviders") or []
            if ours not in providers:
                kept = [p for p in providers if p.get("name") != ACCESS_PROVIDER]
                self._write_providers(profile, [*kept, ours])
                if name not in result.created:
                    result.updated.append(name)
        for name, profile in sorted(existing.items()):
            if name in wanted:
                continue
            labels = profile["metadata"].get("labels") or {}
            if labels.get(MANAGED_BY_LABEL) == MANAGED_BY:
                self.custom.delete_namespaced_custom_object(
                    PROFILE_GROUP, PROFILE_VERSION, self.namespace, PROFILE_PLURAL, name
                )
                result.deleted.append(name)
                continue
            providers = (profile.get("status") or {}).get("accessProviders") or []
            if any(p.get("name") == ACCESS_PROVIDER for p in providers):
                self._write_providers(profile, [p for p in providers if p.get("name") != ACCESS_PROVIDER])
                result.updated.append(name)
        return result

    def describe_failure(self, exc: Exception) -> str:
        """A failed round in words, with what to do."""
        if isinstance(exc, ProfilesUnavailable):
            return str(exc)
        status = getattr(exc, "status", None)
        if status is None:
            return f"{type(exc).__name__}: {exc}"
        message = _message(exc)
        if status == 404:
            return (
                f"{message}: the ClusterProfiles go to namespace {self.namespace!r} "
                f"(kubectl create namespace {self.namespace}, or pick another with --cluster-profile-namespace)"
            )
        if status == 403:
            return f"{message} (the gateway's RBAC on the hub: {RBAC_FILE})"
        return f"{status} {getattr(exc, 'reason', '')}: {message}"

    async def run(self) -> None:
        """Sync every ``interval``; a failed round is logged (once until the reason changes) and retried."""
        reported = ""
        while True:
            try:
                done = await trio.to_thread.run_sync(self.sync_once)
            except Exception as exc:
                reason = self.describe_failure(exc)
                if reason != reported:
                    self.log.warning("cluster_profiles_failed", namespace=self.namespace, reason=reason)
                    reported = reason
            else:
                if reported:
                    self.log.info("cluster_profiles_recovered", namespace=self.namespace)
                    reported = ""
                for event, names in (
                    ("cluster_profile_created", done.created),
                    ("cluster_profile_updated", done.updated),
                    ("cluster_profile_deleted", done.deleted),
                ):
                    for name in names:
                        self.log.info(event, cluster=name, namespace=self.namespace)
            await trio.sleep(self.interval)
