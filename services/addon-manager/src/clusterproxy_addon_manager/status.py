"""The status the manager reports, and its writes: the ManagedProxyConfiguration's conditions and
the ManagedClusterAddOns' (``ManifestApplied``, ``Available``, the agent's namespace and
``healthCheck.mode: Customized``), each written only when one of them changed; and the conditions
read from what the manager sees (a Deployment's replicas, the signer's records of the
proxy-server's certificate, the work agent's ``Applied`` on a ManifestWork, the availability
poll)."""

from __future__ import annotations

import base64
import copy
import json
from typing import TYPE_CHECKING, Any

from clusterproxy_castore.models import IssuedRecord

from .availability import ClusterAvailability
from .conditions import Condition, merge_conditions, same_conditions
from .config import ProxyConfig
from .hub_informers import HubInformers
from .kube import DEPLOYMENT, MANAGED_CLUSTER_ADDON, MANAGED_PROXY_CONFIGURATION, Conflict
from .metadata import generation_of
from .render import ADDON_NAME, SERVER_CERT_NAME

if TYPE_CHECKING:
    from .controller import Controller

__all__ = [
    "HEALTH_CHECK_MODE",
    "available",
    "deployment_condition",
    "manifest_applied",
    "server_certificate",
    "set_addon_status",
    "set_mpc_status",
]


#: The ManagedClusterAddOn's ``status.healthCheck.mode``. OCM's registration agent judges an addon
#: whose mode is anything else (``Lease``, or unset) by a Lease named after the addon in its install
#: namespace on the managed cluster, and writes ``Available`` from it every 30 s; with ``Customized``
#: it leaves ``Available`` to the addon's manager, as the addon-framework does for its health probers
#: None, Work and DeploymentAvailability. Ours says whether a tunnel is up, which no lease can
#: (docs/addon-manager.md, "Who judges the addon's health").
HEALTH_CHECK_MODE = "Customized"


def set_mpc_status(ctl: Controller, cfg: ProxyConfig, conditions: list[Condition]) -> None:
    for _ in range(3):
        mpc = ctl.fresh(ctl.mpcs, MANAGED_PROXY_CONFIGURATION, cfg.name)
        if mpc is None:
            return
        status = mpc.get("status") or {}
        merged = merge_conditions(
            status.get("conditions"), conditions, now=ctl.now(), observed_generation=cfg.generation
        )
        if (
            same_conditions(merged, status.get("conditions"))
            and status.get("observedGeneration") == cfg.generation
        ):
            return
        body = copy.deepcopy(mpc)
        body["status"] = {**status, "conditions": merged, "observedGeneration": cfg.generation}
        try:
            written = ctl.kube.replace_status(MANAGED_PROXY_CONFIGURATION, body)
        except Conflict:
            ctl.remember(MANAGED_PROXY_CONFIGURATION, ctl.kube.get(MANAGED_PROXY_CONFIGURATION, cfg.name))
            continue
        ctl.remember(MANAGED_PROXY_CONFIGURATION, written)
        ctl.metrics.writes.labels("ManagedProxyConfiguration", "status").inc()
        ctl.log.info(
            "status_updated",
            kind="ManagedProxyConfiguration",
            name=cfg.name,
            conditions={c.type: c.status for c in conditions},
        )
        return
    raise Conflict("the ManagedProxyConfiguration kept changing while its status was written")


def set_addon_status(
    ctl: Controller, addon: dict[str, Any], conditions: list[Condition], namespace: str | None
) -> None:
    name = addon["metadata"]["namespace"]
    for _ in range(3):
        status = addon.get("status") or {}
        merged = merge_conditions(status.get("conditions"), conditions, now=ctl.now())
        same_namespace = namespace is None or status.get("namespace") == namespace
        health_check = status.get("healthCheck") or {}
        same_mode = health_check.get("mode") == HEALTH_CHECK_MODE
        if same_conditions(merged, status.get("conditions")) and same_namespace and same_mode:
            return
        body = copy.deepcopy(addon)
        body["status"] = {
            **status,
            "conditions": merged,
            "healthCheck": {**health_check, "mode": HEALTH_CHECK_MODE},
        }
        if namespace is not None:
            body["status"]["namespace"] = namespace
        try:
            written = ctl.kube.replace_status(MANAGED_CLUSTER_ADDON, body)
        except Conflict:
            addon = ctl.kube.get(MANAGED_CLUSTER_ADDON, ADDON_NAME, name)
            ctl.remember(MANAGED_CLUSTER_ADDON, addon)
            continue
        ctl.remember(MANAGED_CLUSTER_ADDON, written)
        ctl.metrics.writes.labels("ManagedClusterAddOn", "status").inc()
        ctl.log.info(
            "status_updated",
            kind="ManagedClusterAddOn",
            cluster=name,
            conditions={c.type: c.status for c in conditions},
        )
        return
    raise Conflict(f"the ManagedClusterAddOn of {name} kept changing while its status was written")


def server_certificate(ctl: Controller, hub: HubInformers) -> IssuedRecord | None:
    """The newest live proxy-server certificate the signer issued, from the store's records of
    non-agent certificates (watched: a server bootstrapping is seen at once)."""
    now = ctl.now()
    live = []
    for secret in hub.issued.items():
        raw = (secret.get("data") or {}).get("record.json")
        try:
            record = IssuedRecord.from_json(json.loads(base64.b64decode(raw or "")))
        except (ValueError, KeyError, TypeError):
            continue
        if record.identity.kind == "server" and record.identity.name == SERVER_CERT_NAME and record.live(now):
            live.append(record)
    return max(live, key=lambda r: r.issued_at, default=None)


def deployment_condition(
    ctl: Controller, hub: HubInformers, cfg: ProxyConfig, kind: str, name: str
) -> Condition:
    deployment = ctl.fresh(hub.deployments, DEPLOYMENT, name, cfg.namespace) or {}
    status = deployment.get("status") or {}
    wanted = (deployment.get("spec") or {}).get("replicas", 1)
    ready = status.get("readyReplicas") or 0
    return Condition(
        kind,
        "True",
        "Deployed",
        f"Deployment {cfg.namespace}/{name} is up to date; {ready}/{wanted} replica(s) ready",
    )


def available(ctl: Controller, cluster: str) -> Condition:
    if ctl.availability is None:
        state = ClusterAvailability("Unknown", "NotPolledYet", "the proxy-servers have not been asked yet")
    else:
        state = ctl.availability.of(cluster)
    return Condition("Available", state.status, state.reason, state.message)


def manifest_applied(work: dict[str, Any]) -> Condition:
    """ManifestApplied from the work agent's ``Applied`` condition on the ManifestWork."""
    where = f"ManifestWork {work['metadata'].get('namespace')}/{work['metadata'].get('name')}"
    generation = generation_of(work)
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
