"""Managed service accounts: the controller of ``ManagedServiceAccount``
(``authentication.open-cluster-management.io/v1beta1``) on the hub (docs/managed-serviceaccount.md).

For each ManagedServiceAccount in a cluster's namespace on the hub:

- the ServiceAccount of its name exists in that managed cluster and a TokenRequest token of it is made
  **there**, by the cluster's proxy-agent, asked **through the tunnel** (the agent's control endpoint,
  :mod:`clusterproxy_protocol.agent_control`, which the proxy-server opens only for the hub clients of
  its ``--control-client`` allow-list: this process's client certificate);
- the token and the managed cluster's kube-apiserver CA land in the hub Secret of the MSA's name in
  the same namespace (keys ``token``, ``ca.crt``), written by server-side apply;
- ``status.tokenSecretRef`` (name, lastRefreshTimestamp), ``status.expirationTimestamp`` and the
  conditions ``TokenReported`` and ``SecretCreated`` say what was done, or why not;
- with ``spec.rotation.enabled`` (the default) the token is renewed at ``renew_fraction`` (80 %) of its
  life; the old token stays valid until it expires, so nothing that still holds it fails meanwhile;
- deleting the MSA (a finalizer holds it) deletes the ServiceAccount in the managed cluster, which
  invalidates every token of it at once, and the hub Secret.

It lives in the cluster-gateway because that process already holds the hub client certificate the
proxy-server's control allow-list names, and the gateway is the first consumer of the tokens.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from clusterproxy_protocol import (
    CONTROL_HOST,
    CONTROL_PORT,
    ConnectRefused,
    NoAgentConnected,
    TunnelError,
    UnknownCluster,
    get_logger,
    http1client,
    serviceaccount_path,
)

from .proxy import StreamOpener

__all__ = [
    "FINALIZER",
    "GROUP",
    "PLURAL",
    "VERSION",
    "ManagedServiceAccounts",
    "TokenFetchError",
    "fetch_token",
    "parse_go_duration",
    "renewal_due",
]

GROUP, VERSION, PLURAL = "authentication.open-cluster-management.io", "v1beta1", "managedserviceaccounts"
FINALIZER = "authentication.open-cluster-management.io/managed-serviceaccount"
FIELD_MANAGER = "cluster-gateway"
DEFAULT_VALIDITY = 8640 * 3600.0  # the CRD's default, 8640h
MIN_VALIDITY = 600.0  # TokenRequest's minimum
CONTROL_TIMEOUT = 30.0
MAX_ANSWER = 256 * 1024
RETRY_AFTER_FAILURE = 5.0
ADDON_NAME = "cluster-proxy"  # the ManagedClusterAddOn whose agent holds the tunnel
SECRET_LABEL = "authentication.open-cluster-management.io/is-managed-serviceaccount"

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_go_duration(text: str) -> float:
    """Seconds of a Go duration (``8640h0m0s``, ``10m``); ValueError naming the text otherwise."""
    text = text.strip()
    position, total = 0, 0.0
    for match in _DURATION_PART.finditer(text):
        if match.start() != position:
            break
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        position = match.end()
    if not text or position != len(text):
        raise ValueError(f"{text!r} is not a duration like 10m, 24h or 8640h0m0s")
    return total


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def _format_time(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: Any) -> dt.datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def renewal_due(msa: dict[str, Any], renew_fraction: float) -> dt.datetime | None:
    """When the MSA's token must be (re)made: now-or-earlier for a missing, failed, outdated or expired
    token; the renewal time for a rotated one; None for a token that is never renewed."""
    status = msa.get("status") or {}
    reference = status.get("tokenSecretRef") or {}
    refreshed = _parse_time(reference.get("lastRefreshTimestamp"))
    expires = _parse_time(status.get("expirationTimestamp"))
    reported = _condition(msa, "TokenReported")
    generation = (msa.get("metadata") or {}).get("generation")
    epoch = dt.datetime.fromtimestamp(0, dt.UTC)
    if (
        refreshed is None
        or expires is None
        or reported is None
        or reported.get("status") != "True"
        or (generation is not None and reported.get("observedGeneration") != generation)
    ):
        return epoch
    rotation = (msa.get("spec") or {}).get("rotation") or {}
    if rotation.get("enabled", True) is False:
        return None
    return refreshed + (expires - refreshed) * renew_fraction


def _condition(msa: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for condition in (msa.get("status") or {}).get("conditions") or []:
        if isinstance(condition, dict) and condition.get("type") == kind:
            return condition
    return None


class TokenFetchError(Exception):
    """The token could not be had; ``reason`` is the condition's reason, the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


async def _control_call(
    tunnel: StreamOpener, cluster: str, method: str, path: str, body: dict[str, Any] | None
) -> tuple[int, dict[str, Any]]:
    """One HTTP/1.1 request to ``cluster``'s agent control endpoint through the proxy-server."""
    try:
        stream = await tunnel.connect(cluster, CONTROL_HOST, CONTROL_PORT)
    except (UnknownCluster, NoAgentConnected) as exc:
        raise TokenFetchError(
            "NoTunnel",
            f"no tunnel to cluster {cluster!r}: no proxy-agent of it is connected to the proxy-server "
            f"({exc.reason or exc}); the token is asked again when it is",
        ) from None
    except ConnectRefused as exc:
        hint = ""
        if exc.status == 403:
            hint = (
                " (the proxy-server lets only the hub clients of its --control-client allow-list reach the agents' "
                "control endpoint: name this gateway's client certificate there)"
            )
        elif exc.status == 404:
            hint = " (an agent older than the control endpoint? upgrade it)"
        raise TokenFetchError(
            "ControlRefused", f"the tunnel refused the control request: {exc}{hint}"
        ) from None
    except TunnelError as exc:
        raise TokenFetchError(
            "ProxyServerUnreachable", f"the proxy-server cannot be reached: {exc}"
        ) from None
    payload = json.dumps(body).encode() if body is not None else b""
    try:
        with trio.fail_after(CONTROL_TIMEOUT):
            response = await http1client.request(
                stream,
                method,
                path,
                CONTROL_HOST,
                payload,
                headers=[("Content-Type", "application/json")],
                max_body=MAX_ANSWER,
            )
    except (
        trio.TooSlowError,
        trio.BrokenResourceError,
        trio.ClosedResourceError,
        http1client.HTTPClientError,
    ) as exc:
        raise TokenFetchError(
            "AgentFailed", f"the agent of cluster {cluster!r} did not answer the control request: {exc!r}"
        ) from None
    finally:
        await trio.aclose_forcefully(stream)
    status, answer = response.status, response.body
    try:
        decoded = json.loads(bytes(answer)) if answer else {}
    except ValueError:
        decoded = {"message": bytes(answer[:300]).decode("utf-8", "replace")}
    return status, decoded if isinstance(decoded, dict) else {}


async def fetch_token(tunnel: StreamOpener, cluster: str, name: str, seconds: int) -> dict[str, Any]:
    """``{"token", "expirationTimestamp", "caBundle", "namespace", ...}`` made in ``cluster`` by its agent."""
    status, answer = await _control_call(
        tunnel, cluster, "POST", serviceaccount_path(name, token=True), {"expirationSeconds": seconds}
    )
    if status != 200 or not answer.get("token"):
        raise TokenFetchError(
            "TokenReportFailed",
            f"the agent of cluster {cluster!r} could not make the token ({status}): {answer.get('message', answer)}",
        )
    return answer


async def delete_serviceaccount(tunnel: StreamOpener, cluster: str, name: str) -> bool:
    status, answer = await _control_call(tunnel, cluster, "DELETE", serviceaccount_path(name), None)
    if status != 200:
        raise TokenFetchError(
            "DeleteFailed",
            f"the agent of cluster {cluster!r} could not delete ServiceAccount {name!r} ({status}): "
            f"{answer.get('message', answer)}",
        )
    return bool(answer.get("deleted"))


@dataclass
class _Failure:
    at: float  # trio clock of the last failure
    message: str


class ManagedServiceAccounts:
    """Looks at the hub every ``interval`` (and wakes for a due renewal), one MSA at a time."""

    def __init__(
        self,
        api: Any,
        tunnel: StreamOpener,
        *,
        interval: float = 2.0,
        renew_fraction: float = 0.8,
        clock: Callable[[], dt.datetime] = _now,
    ) -> None:
        self.api = api
        self.tunnel = tunnel
        self.interval = interval
        self.renew_fraction = renew_fraction
        self.clock = clock
        self.log = get_logger("cluster-gateway", component="managed-serviceaccounts")
        self._failures: dict[tuple[str, str], _Failure] = {}
        self._warned_missing_crd = False

    # -- the hub (blocking; run in threads) -----------------------------------------------------------

    def _custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self.api)

    def _core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api)

    def _list(self) -> list[dict[str, Any]] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            listed = self._custom().list_cluster_custom_object(GROUP, VERSION, PLURAL)
        except ApiException as exc:
            if exc.status == 404:
                if not self._warned_missing_crd:
                    self._warned_missing_crd = True
                    self.log.warning(
                        "managedserviceaccount_crd_missing",
                        hint="apply deploy/kustomize/base/crds (the hub overlay does): "
                        "managedserviceaccounts.authentication.open-cluster-management.io",
                    )
                return None
            raise
        self._warned_missing_crd = False
        return list(listed.get("items") or [])

    def _patch(self, namespace: str, name: str, body: Any) -> None:
        self._custom().patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, body)

    def _patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self._custom().patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}
        )

    def _apply_secret(self, msa: dict[str, Any], token: str, ca_bundle: str) -> None:
        meta = msa["metadata"]
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": meta["name"],
                "namespace": meta["namespace"],
                "labels": {SECRET_LABEL: "true"},
                # a cluster's garbage collector deletes it with the MSA even if this controller is gone
                "ownerReferences": [
                    {
                        "apiVersion": f"{GROUP}/{VERSION}",
                        "kind": "ManagedServiceAccount",
                        "name": meta["name"],
                        "uid": meta["uid"],
                    }
                ],
            },
            "type": "Opaque",
            "data": {
                "token": base64.b64encode(token.encode()).decode(),
                "ca.crt": base64.b64encode(ca_bundle.encode()).decode(),
            },
        }
        # Server-side apply: creates or replaces without reading the Secret first, so the gateway needs no
        # read access to the hub's Secrets beyond its own token's.
        self._core().patch_namespaced_secret(
            meta["name"],
            meta["namespace"],
            secret,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type="application/apply-patch+yaml",
        )

    def _delete_secret(self, namespace: str, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self._core().delete_namespaced_secret(name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    # -- the loop ------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.log.info(
            "managed_serviceaccounts_started", interval=self.interval, renew_fraction=self.renew_fraction
        )
        task_status.started()
        while True:
            wait = self.interval
            try:
                items = await trio.to_thread.run_sync(self._list)
            except Exception as exc:
                self.log.warning("managedserviceaccounts_list_failed", error=str(exc)[:300])
                items = None
            for msa in items or []:
                try:
                    next_in = await self.reconcile(msa)
                except Exception as exc:  # one MSA's trouble (a refused write) never stops the others
                    meta = msa.get("metadata") or {}
                    self.log.warning(
                        "managedserviceaccount_failed",
                        cluster=meta.get("namespace"),
                        name=meta.get("name"),
                        error=str(exc)[:500],
                    )
                    next_in = RETRY_AFTER_FAILURE
                wait = min(wait, max(next_in, 0.0))
            await trio.sleep(max(wait, 0.05))

    async def reconcile(self, msa: dict[str, Any]) -> float:
        """Bring one MSA to its desired state; seconds until it wants looking at again (inf: never)."""
        meta = msa.get("metadata") or {}
        cluster, name = meta.get("namespace", ""), meta.get("name", "")
        finalizers = list(meta.get("finalizers") or [])
        failure = self._failures.get((cluster, name))
        if failure is not None and trio.current_time() - failure.at < RETRY_AFTER_FAILURE:
            return RETRY_AFTER_FAILURE - (trio.current_time() - failure.at)
        if meta.get("deletionTimestamp"):
            if FINALIZER in finalizers:
                await self._finalize(msa, cluster, name, finalizers)
            return math.inf
        if FINALIZER not in finalizers:
            body = {
                "metadata": {
                    "finalizers": [*finalizers, FINALIZER],
                    "resourceVersion": meta.get("resourceVersion"),
                }
            }
            await trio.to_thread.run_sync(self._patch, cluster, name, body)
        now = self.clock()
        due = renewal_due(msa, self.renew_fraction)
        if due is None:
            return math.inf
        if due > now:
            return (due - now).total_seconds()
        await self._issue(msa, cluster, name)
        return 0.0

    def _validity(self, msa: dict[str, Any]) -> float:
        rotation = (msa.get("spec") or {}).get("rotation") or {}
        text = rotation.get("validity")
        if not text:
            return DEFAULT_VALIDITY
        return parse_go_duration(str(text))

    async def _issue(self, msa: dict[str, Any], cluster: str, name: str) -> None:
        generation = (msa.get("metadata") or {}).get("generation")
        status = dict(msa.get("status") or {})
        try:
            try:
                validity = self._validity(msa)
            except ValueError as exc:
                raise TokenFetchError("InvalidValidity", f"spec.rotation.validity: {exc}") from None
            if validity < MIN_VALIDITY:
                raise TokenFetchError(
                    "InvalidValidity",
                    f"spec.rotation.validity {validity:g}s is below TokenRequest's minimum of 10m: ask for 10m or more",
                )
            issued = await fetch_token(self.tunnel, cluster, name, int(validity))
        except TokenFetchError as exc:
            self._failures[(cluster, name)] = _Failure(trio.current_time(), str(exc))
            self.log.warning(
                "managedserviceaccount_token_failed",
                cluster=cluster,
                name=name,
                reason=exc.reason,
                error=str(exc),
            )
            status["conditions"] = _set_condition(
                status.get("conditions"),
                "TokenReported",
                "False",
                exc.reason,
                str(exc),
                generation,
                self.clock(),
            )
            await trio.to_thread.run_sync(self._patch_status, cluster, name, status)
            return
        self._failures.pop((cluster, name), None)
        await trio.to_thread.run_sync(self._apply_secret, msa, issued["token"], issued.get("caBundle") or "")
        now = self.clock()
        expires = _parse_time(issued.get("expirationTimestamp")) or now + dt.timedelta(seconds=validity)
        conditions = _set_condition(
            status.get("conditions"),
            "SecretCreated",
            "True",
            "SecretCreated",
            f"the token is in Secret {cluster}/{name} (keys token, ca.crt)",
            generation,
            now,
        )
        conditions = _set_condition(
            conditions,
            "TokenReported",
            "True",
            "TokenReported",
            f"a token of ServiceAccount {issued.get('namespace')}/{name} in cluster {cluster}, valid until "
            f"{_format_time(expires)}",
            generation,
            now,
        )
        status.update(
            tokenSecretRef={"name": name, "lastRefreshTimestamp": _format_time(now)},
            expirationTimestamp=_format_time(expires),
            conditions=conditions,
        )
        await trio.to_thread.run_sync(self._patch_status, cluster, name, status)
        self.log.info(
            "managedserviceaccount_token_issued",
            cluster=cluster,
            name=name,
            serviceaccount=f"{issued.get('namespace')}/{name}",
            expires=_format_time(expires),
        )

    async def _finalize(self, msa: dict[str, Any], cluster: str, name: str, finalizers: list[str]) -> None:
        meta = msa.get("metadata") or {}
        try:
            deleted = await delete_serviceaccount(self.tunnel, cluster, name)
        except TokenFetchError as exc:
            gone = await trio.to_thread.run_sync(self._agent_gone_for_good, cluster)
            if gone is None:
                self._failures[(cluster, name)] = _Failure(trio.current_time(), str(exc))
                self.log.warning(
                    "managedserviceaccount_delete_failed", cluster=cluster, name=name, error=str(exc)
                )
                return  # the finalizer stays; asked again after RETRY_AFTER_FAILURE
            # No agent will come back to delete it: holding the finalizer would only hold the hub's
            # uninstall (the CRD's deletion waits for every MSA). The addon's ManifestWork took the
            # ServiceAccount's grants with it; the ServiceAccount itself is left in its namespace.
            self.log.warning(
                "managedserviceaccount_released",
                cluster=cluster,
                name=name,
                reason=gone,
                serviceaccount_left=name,
                error=str(exc),
            )
            deleted = False
        await trio.to_thread.run_sync(self._delete_secret, cluster, name)
        remaining = [f for f in finalizers if f != FINALIZER]
        body = {"metadata": {"finalizers": remaining, "resourceVersion": meta.get("resourceVersion")}}
        await trio.to_thread.run_sync(self._patch, cluster, name, body)
        self._failures.pop((cluster, name), None)
        self.log.info(
            "managedserviceaccount_deleted", cluster=cluster, name=name, serviceaccount_deleted=deleted
        )

    def _agent_gone_for_good(self, cluster: str) -> str | None:
        """Why no agent of ``cluster`` will ever answer again (the cluster is gone, or its addon is
        gone or being deleted: disabled), or None when one may (the agent is only disconnected)."""
        from kubernetes.client.exceptions import ApiException

        custom = self._custom()
        try:
            custom.get_cluster_custom_object(
                "cluster.open-cluster-management.io", "v1", "managedclusters", cluster
            )
        except ApiException as exc:
            if exc.status == 404:
                return "the managed cluster is gone"
            return None
        try:
            addon = custom.get_namespaced_custom_object(
                "addon.open-cluster-management.io",
                "v1alpha1",
                cluster,
                "managedclusteraddons",
                ADDON_NAME,
            )
        except ApiException as exc:
            if exc.status == 404:
                return "the addon is disabled on the cluster"
            return None
        if (addon.get("metadata") or {}).get("deletionTimestamp"):
            return "the addon is being disabled on the cluster"
        return None


def _set_condition(
    conditions: Any,
    kind: str,
    status: str,
    reason: str,
    message: str,
    generation: int | None,
    now: dt.datetime,
) -> list[dict[str, Any]]:
    """The conditions with ``kind`` set; lastTransitionTime moves only when the status changes."""
    kept: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None
    for condition in conditions or []:
        if isinstance(condition, dict) and condition.get("type") == kind:
            previous = condition
        elif isinstance(condition, dict):
            kept.append(condition)
    transition = (
        previous["lastTransitionTime"]
        if previous is not None and previous.get("status") == status and previous.get("lastTransitionTime")
        else _format_time(now)
    )
    updated: dict[str, Any] = {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": transition,
    }
    if generation is not None:
        updated["observedGeneration"] = generation
    return [*kept, updated]
