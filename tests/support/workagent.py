"""The tests play OCM's work agent and the kubelet: no work agent, kubelet or scheduler runs beside the
test API servers (``tests.support.kubeapi``), so what the addon-manager writes would otherwise never run.

:class:`WorkAgent` is the work agent of one managed cluster. It reads the ``ManifestWork`` objects in
the cluster's namespace on the hub, applies every manifest of ``spec.workload.manifests`` to the managed
cluster's API server by server-side apply (field manager ``work-agent``, conflicts forced: the real
agent's default update strategy overwrites too) and writes the ManifestWork's status on the hub as the
real agent does: conditions ``Applied`` (``AppliedManifestWorkComplete`` / ``AppliedManifestWorkFailed``)
and ``Available`` (``ResourcesAvailable`` / ``ResourcesNotAvailable``) with the work's
``observedGeneration``, and ``resourceStatus.manifests`` (ordinal, group, version, kind, resource,
name, namespace, and each manifest's own ``Applied``/``Available``). A manifest the API server refuses
is reported there, never raised away. Call :meth:`WorkAgent.apply` once, or :meth:`WorkAgent.start` a
thread that applies each new generation within ``interval`` and, when a ManifestWork disappears,
deletes what it applied, except what the work's ``spec.deleteOption`` orphans (``Orphan``, or
``SelectivelyOrphan`` rules) (the real agent does that behind a finalizer on the ManifestWork; this stand-in
adds none, so nothing hangs when a test stops it).

:class:`Kubelet` runs the pod of a ``Deployment`` as local processes, as a kubelet would run it:

- init containers first, each to completion, then the containers; exactly their ``command`` and
  ``args`` (``$(VAR)`` expanded as the kubelet does, ``$$`` an escaped ``$``, an undefined reference
  kept as written) and their environment: ``env`` (``value``, ``valueFrom`` ``secretKeyRef``,
  ``configMapKeyRef``, ``fieldRef`` for the pod's name, namespace, uid, labels, annotations, node,
  service account and IPs), ``envFrom`` (Secrets and ConfigMaps, with ``prefix``), the service links
  of the Services in the pod's namespace (unless ``enableServiceLinks: false``) and
  ``KUBERNETES_SERVICE_HOST``/``PORT``, with the kubelet's precedence;
- ``secret``, ``configMap`` and ``emptyDir`` volumes materialized under the pod's directory (``items``,
  ``defaultMode``/``mode``, ``optional``, ``subPath`` mounts). A process cannot see a directory at a
  container's mount path, so **mount paths are rewritten to those directories in the command, args
  and environment values** (only path prefixes: ``/etc/x`` in ``--ca=/etc/x/ca.crt`` or in a shell
  line, never ``/etc/xy``), and nowhere else: a path a program uses without naming it there is not
  mapped;
- the pod's service-account identity: a TokenRequest token of its ServiceAccount (a ServiceAccount
  that does not exist is an error, as its admission would refuse the pod), honouring
  ``automountServiceAccountToken`` of the pod and of the ServiceAccount. **The one deviation from a
  pod:** a process cannot have the token, CA and namespace files at their fixed path
  ``/var/run/secrets/kubernetes.io/serviceaccount``, so they are written under the pod's directory
  (that path is mapped like a mount in command, args and env) and ``KUBECONFIG`` names a kubeconfig
  holding the same token, CA and API server; programs that read ``$KUBECONFIG`` before the in-cluster
  files (the kubernetes client, the cert-signer) get the pod's identity. The token (one hour, as a
  kubelet asks) is not refreshed;
- the pod network: pods share the machine's loopback (as with ``hostNetwork: true``), so two
  containers listening on one port collide; the tests choose free ports. Cluster DNS and kube-proxy
  are emulated **inside Python programs only** by a ``sitecustomize`` on ``PYTHONPATH``: a lookup of
  a Service's name (``NAME``, ``NAME.NS``, ``NAME.NS.svc``, ``NAME.NS.svc.cluster.local``, with the
  pod's search path and ``ndots:5``; ``kubernetes.default.svc`` included) answers its cluster IP, and a
  connection to a cluster IP and Service port goes to ``127.0.0.1`` and the port the Service forwards
  to (its ``targetPort``; a named one is looked up in the Deployments it selects; the ``kubernetes``
  Service's leads to the cluster's API server). A headless Service resolves to ``127.0.0.1``, an
  ExternalName one to its name; other names under ``cluster.local`` or ``.svc`` do not resolve, the
  rest resolve as usual. The table holds the Services that exist when a container of the kubelet last
  started (every running pod's is rewritten then: kube-proxy and cluster DNS follow Services as they
  change, here at those moments), read again by the process when it changed. Service
  links and ``KUBERNETES_SERVICE_HOST``/``PORT`` carry the cluster IPs and Service ports, as a pod
  sees them, so they lead to the API server (and the Services) through that kube-proxy;
- the program: a command without a ``/`` is the console script of that name in the virtualenv's
  ``bin`` (the project's programs, as its images hold them), else ``/usr/bin`` or ``/bin``; an absolute
  path is used as is. The image's own entrypoint is unknown: a container without ``command`` is an
  error. The image environment is ``PATH`` (those directories), ``HOME`` (a directory of the pod),
  ``HOSTNAME`` (the pod name; the process's host name stays the machine's, so programs that call
  ``gethostname()`` see that) and ``PYTHONUNBUFFERED=1``;
- logs go to ``<pod>/logs/<container>.log`` (appended across restarts); :meth:`Pod.stop` sends SIGTERM
  and waits up to ``terminationGracePeriodSeconds`` before SIGKILL; :meth:`Pod.restart` restarts the
  containers as the kubelet restarts a failed container: the same volumes (an ``emptyDir`` keeps its
  files; Secret and ConfigMap volumes are refreshed), init containers not run again, environment
  resolved again; :meth:`Pod.wait_ready` runs the readiness probe (``httpGet``, ``tcpSocket``, ``exec``)
  until it passes and then writes the Deployment's status (``replicas``, ``readyReplicas``,
  ``availableReplicas``, ``observedGeneration``), as the kubelet and the deployment controller would.

Anything else that would change what the process does is an error naming it, never skipped: another
volume type, ``subPathExpr``, a missing Secret, ConfigMap or key that is not ``optional``, a
``resourceFieldRef``, an unknown ``fieldRef``, ``lifecycle`` hooks, sidecar init containers, an
unknown program. Not emulated and not checked: ``securityContext`` (the processes run as the test's
user, the root filesystem is writable), resources, liveness and startup probes, scheduling fields,
restarts after a crash (a test restarts a container itself).
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import hashlib
import json
import os
import re
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support.kubeapi import KubeCluster, die_with_parent
from tests.support.procs import json_lines

__all__ = [
    "ADDON_NAME",
    "CLUSTER_DOMAIN",
    "FIELD_MANAGER",
    "AddonStack",
    "AppliedWork",
    "Container",
    "Kubelet",
    "Member",
    "Pod",
    "WorkAgent",
    "WorkAgentError",
    "expand",
    "install_mpc_crd",
    "poll_until",
    "rewrite_mount_paths",
]

FIELD_MANAGER = "work-agent"
CLUSTER_DOMAIN = "cluster.local"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_SECONDS = 3607  # what a kubelet asks for a projected token
BIN = Path(sys.executable).parent
SYSTEM_BIN = (Path("/usr/bin"), Path("/bin"))
POLL = 0.05
INIT_TIMEOUT = 60.0
DEFAULT_GRACE = 30.0
POD_NETWORK_ENV = "WORKAGENT_POD_NETWORK"

WORK_GROUP, WORK_VERSION, WORK_PLURAL = "work.open-cluster-management.io", "v1", "manifestworks"


class WorkAgentError(RuntimeError):
    """What the stand-in cannot do, or what a kubelet would refuse too; the message names it."""


def poll_until(condition: Callable[[], Any], *, timeout: float, what: str, interval: float = POLL) -> Any:
    """Call ``condition`` until it returns something truthy (returned); AssertionError after
    ``timeout`` seconds naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _api_error(exc: Exception) -> str:
    """The API server's message of a kubernetes client exception (its Status body), else the text."""
    body = getattr(exc, "body", None)
    if body:
        try:
            return str(json.loads(body).get("message") or body)
        except (ValueError, AttributeError):
            return str(body)
    return str(exc)


def _status_code(exc: Exception) -> int | None:
    return getattr(exc, "status", None)


# --- the work agent --------------------------------------------------------------------------------------


@dataclass
class ManifestResult:
    ordinal: int
    meta: dict[str, Any]
    error: str = ""
    available: bool = False


@dataclass(frozen=True)
class AppliedObject:
    api_version: str
    kind: str
    name: str
    namespace: str  # "" when cluster-scoped


def _orphaned(work: Mapping[str, Any], group: str, resource: str, name: str, namespace: str) -> bool:
    """Whether the work's ``spec.deleteOption`` leaves this object in place when the work goes (``Orphan``,
    or ``SelectivelyOrphan`` with a rule naming it), as OCM's work agent does: it is never deleted."""
    option = (work.get("spec") or {}).get("deleteOption") or {}
    policy = option.get("propagationPolicy")
    if policy == "Orphan":
        return True
    if policy != "SelectivelyOrphan":
        return False
    rules = (option.get("selectivelyOrphans") or {}).get("orphaningRules") or []
    return any(
        rule.get("group", "") == group
        and rule.get("resource") == resource
        and rule.get("name") == name
        and rule.get("namespace", "") == namespace
        for rule in rules
    )


@dataclass
class AppliedWork:
    """What one apply of a ManifestWork did."""

    name: str
    uid: str
    generation: int
    results: list[ManifestResult]
    applied_objects: list[AppliedObject] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(not r.error for r in self.results)

    def errors(self) -> list[str]:
        return [
            f"manifest {r.ordinal} ({r.meta.get('kind')} {r.meta.get('name')}): {r.error}"
            for r in self.results
            if r.error
        ]


def _merge_conditions(
    old: Iterable[Mapping[str, Any]] | None, new: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``new`` with each condition's lastTransitionTime kept from ``old`` when its status is unchanged."""
    before = {c.get("type"): c for c in old or []}
    merged = []
    for condition in new:
        previous = before.get(condition["type"])
        keep = previous is not None and previous.get("status") == condition["status"]
        stamp = previous.get("lastTransitionTime") if keep and previous else None
        merged.append({**condition, "lastTransitionTime": stamp or _now()})
    return merged


class WorkAgent:
    """OCM's work agent for one managed cluster (``cluster_name``: its ManagedCluster, whose namespace on
    the hub holds its ManifestWorks), applying to the ``managed`` API server."""

    def __init__(self, hub: KubeCluster, managed: KubeCluster, cluster_name: str) -> None:
        self.hub = hub
        self.managed = managed
        self.cluster_name = cluster_name
        self._hub_client = hub.api_client()
        self._managed_client = managed.api_client()
        self._dynamic: Any = None
        self._discovery: tempfile.TemporaryDirectory[str] | None = None
        self.applied: dict[str, AppliedWork] = {}  # by ManifestWork name
        self.last_error = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # API access
    def _custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self._hub_client)

    def _dyn(self) -> Any:
        from kubernetes.dynamic import DynamicClient

        if self._dynamic is None:
            # its own discovery cache: the default file is named after the server's address, which a
            # later API server on the same port would inherit
            self._discovery = tempfile.TemporaryDirectory(prefix="work-agent-discovery-")
            cache = Path(self._discovery.name) / "discovery.json"
            self._dynamic = DynamicClient(self._managed_client, cache_file=str(cache))
        return self._dynamic

    def _resource(self, api_version: str, kind: str) -> Any:
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        try:
            return self._dyn().resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError:
            self._dyn().resources.invalidate_cache()  # a CRD installed since discovery ran
            return self._dyn().resources.get(api_version=api_version, kind=kind)

    def works(self) -> list[dict[str, Any]]:
        """The ManifestWorks in the cluster's namespace on the hub."""
        answer = self._custom().list_namespaced_custom_object(
            WORK_GROUP, WORK_VERSION, self.cluster_name, WORK_PLURAL
        )
        return list(answer.get("items") or [])

    def get_work(self, name: str) -> dict[str, Any] | None:
        try:
            return self._custom().get_namespaced_custom_object(
                WORK_GROUP, WORK_VERSION, self.cluster_name, WORK_PLURAL, name
            )
        except Exception as exc:
            if _status_code(exc) == 404:
                return None
            raise

    # applying
    def apply(self, work: Mapping[str, Any] | str) -> AppliedWork:
        """Apply every manifest of ``work`` (the object, or its name: read from the hub) to the managed
        cluster in order, then write the work's status on the hub. Refusals are in the result and in
        the status; an unreadable work or an unwritable status raises."""
        if isinstance(work, str):
            found = self.get_work(work)
            if found is None:
                raise WorkAgentError(f"no ManifestWork {self.cluster_name}/{work} on the hub")
            work = found
        with self._lock:
            result = self._apply(work)
            previous = self.applied.get(result.name)
            if previous is not None and previous.uid == result.uid:
                # what an earlier generation applied and this one no longer holds goes, as with OCM
                self._delete(set(previous.applied_objects) - set(result.applied_objects))
            self._write_status(result)
            self.applied[result.name] = result
            return result

    def _apply(self, work: Mapping[str, Any]) -> AppliedWork:
        metadata = work["metadata"]
        manifests = ((work.get("spec") or {}).get("workload") or {}).get("manifests") or []
        result = AppliedWork(metadata["name"], metadata.get("uid", ""), metadata.get("generation", 0), [])
        for ordinal, manifest in enumerate(manifests):
            meta: dict[str, Any] = {"ordinal": ordinal}
            item = ManifestResult(ordinal, meta)
            result.results.append(item)
            try:
                api_version = manifest["apiVersion"]
                kind = manifest["kind"]
                name = manifest["metadata"]["name"]
            except (KeyError, TypeError) as exc:
                item.error = f"Failed to apply manifest: not an object with apiVersion, kind and name ({exc})"
                continue
            group, _, version = api_version.rpartition("/")
            meta.update(group=group, version=version, kind=kind, name=name)
            try:
                resource = self._resource(api_version, kind)
            except Exception as exc:
                item.error = (
                    f"Failed to apply manifest: the server doesn't have a resource type {kind!r} ({exc})"
                )
                continue
            namespace = (manifest["metadata"].get("namespace") or "default") if resource.namespaced else ""
            meta.update(resource=resource.name, namespace=namespace)
            try:
                self._dyn().server_side_apply(
                    resource,
                    body=copy.deepcopy(dict(manifest)),
                    name=name,
                    namespace=namespace or None,
                    field_manager=FIELD_MANAGER,
                    force_conflicts=True,
                )
            except Exception as exc:
                item.error = f"Failed to apply manifest: {_api_error(exc)}"
                continue
            if not _orphaned(work, group, resource.name, name, namespace):
                result.applied_objects.append(AppliedObject(api_version, kind, name, namespace))
            try:
                self._dyn().get(resource, name=name, namespace=namespace or None)
                item.available = True
            except Exception:
                item.available = False
        return result

    def _write_status(self, result: AppliedWork) -> None:
        generation = result.generation
        manifests = []
        for item in result.results:
            applied = (
                {
                    "type": "Applied",
                    "status": "False",
                    "reason": "AppliedManifestFailed",
                    "message": item.error,
                }
                if item.error
                else {
                    "type": "Applied",
                    "status": "True",
                    "reason": "AppliedManifestComplete",
                    "message": "Apply manifest complete",
                }
            )
            available = (
                {
                    "type": "Available",
                    "status": "True",
                    "reason": "ResourceAvailable",
                    "message": "Resource is available",
                }
                if item.available
                else {
                    "type": "Available",
                    "status": "False",
                    "reason": "ResourceNotAvailable",
                    "message": "Resource is not available",
                }
            )
            manifests.append({"resourceMeta": item.meta, "conditions": [applied, available]})
        missing = sum(1 for item in result.results if not item.available)
        total = len(result.results)
        conditions = [
            {
                "type": "Applied",
                "status": "True" if result.ok else "False",
                "reason": "AppliedManifestWorkComplete" if result.ok else "AppliedManifestWorkFailed",
                "message": "Apply manifest work complete" if result.ok else "Failed to apply manifest work",
                "observedGeneration": generation,
            },
            {
                "type": "Available",
                "status": "False" if missing else "True",
                "reason": "ResourcesNotAvailable" if missing else "ResourcesAvailable",
                "message": f"{missing} of {total} resources are not available"
                if missing
                else "All resources are available",
                "observedGeneration": generation,
            },
        ]
        for attempt in range(5):
            current = self.get_work(result.name)
            if current is None or current["metadata"].get("uid") != result.uid:
                return  # deleted (or replaced) meanwhile: nothing to report on
            status = current.get("status") or {}
            old_manifests = {
                m.get("resourceMeta", {}).get("ordinal"): m
                for m in (status.get("resourceStatus") or {}).get("manifests") or []
            }
            body = copy.deepcopy(current)
            body["status"] = {
                **status,
                "conditions": _merge_conditions(status.get("conditions"), conditions),
                "resourceStatus": {
                    "manifests": [
                        {
                            **m,
                            "conditions": _merge_conditions(
                                (old_manifests.get(m["resourceMeta"]["ordinal"]) or {}).get("conditions"),
                                m["conditions"],
                            ),
                        }
                        for m in manifests
                    ]
                },
            }
            try:
                self._custom().replace_namespaced_custom_object_status(
                    WORK_GROUP, WORK_VERSION, self.cluster_name, WORK_PLURAL, result.name, body
                )
                return
            except Exception as exc:
                if _status_code(exc) != 409 or attempt == 4:
                    raise

    def remove(self, name: str) -> int:
        """Delete what the last apply of ManifestWork ``name`` created (in reverse order; a Namespace
        stays Terminating on these API servers); returns how many objects were deleted."""
        with self._lock:
            applied = self.applied.pop(name, None)
            return 0 if applied is None else self._delete(applied.applied_objects)

    def _delete(self, objects: Iterable[AppliedObject]) -> int:
        deleted = 0
        for obj in reversed(list(objects)):
            try:
                resource = self._resource(obj.api_version, obj.kind)
                self._dyn().delete(resource, name=obj.name, namespace=obj.namespace or None)
                deleted += 1
            except Exception as exc:
                if _status_code(exc) != 404:
                    raise
        return deleted

    # the loop
    def sync_once(self) -> None:
        """Apply every ManifestWork whose generation is not applied yet; remove what vanished."""
        works = self.works()
        seen = set()
        for work in works:
            name = work["metadata"]["name"]
            seen.add(name)
            if work["metadata"].get("deletionTimestamp"):
                continue
            done = self.applied.get(name)
            if (
                done is not None
                and done.uid == work["metadata"].get("uid")
                and done.generation == work["metadata"].get("generation")
            ):
                continue
            self.apply(work)
        for name in set(self.applied) - seen:
            self.remove(name)

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
                self.last_error = ""
            except Exception as exc:  # the hub or the managed API server restarting: retry
                self.last_error = f"{type(exc).__name__}: {_api_error(exc)}"
            self._stop.wait(interval)

    def start(self, interval: float = 0.2) -> WorkAgent:
        """Apply in a thread, every ``interval`` seconds, until :meth:`stop`."""
        assert self._thread is None, "the work agent already runs"
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, args=(interval,), name=f"work-agent-{self.cluster_name}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None

    def close(self) -> None:
        self.stop()
        self._hub_client.close()
        self._managed_client.close()
        if self._discovery is not None:
            self._discovery.cleanup()

    def wait_applied(self, name: str, timeout: float = 30.0, *, generation: int | None = None) -> AppliedWork:
        """The started agent's apply of ManifestWork ``name`` (of ``generation``, if given)."""

        def done() -> AppliedWork | None:
            applied = self.applied.get(name)
            if applied is None or (generation is not None and applied.generation < generation):
                return None
            return applied

        try:
            return poll_until(done, timeout=timeout, what=f"ManifestWork {self.cluster_name}/{name} applied")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc} (last error of the work agent: {self.last_error or 'none'})"
            ) from None


# --- $(VAR) expansion and mount paths ---------------------------------------------------------------------


def expand(text: str, lookup: Callable[[str], str | None]) -> str:
    """The kubelet's ``$(VAR)`` expansion: ``$(NAME)`` becomes its value when ``lookup`` knows it and
    stays as written otherwise, ``$$`` is one ``$``, any other ``$`` is kept."""
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char != "$" or i + 1 >= len(text):
            out.append(char)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close < 0:
                out.append("$(")
                i += 2
                continue
            name = text[i + 2 : close]
            value = lookup(name)
            out.append(f"$({name})" if value is None else value)
            i = close + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


def rewrite_mount_paths(text: str, mounts: Mapping[str, Path]) -> str:
    """``text`` with every mount path (longest first) that starts a path replaced by its directory:
    ``/etc/x`` in ``--ca=/etc/x/ca.crt`` or ``cp /etc/x/a /b``, never in ``/etc/xy`` or ``/a/etc/x``."""
    for mount in sorted(mounts, key=len, reverse=True):
        target = str(mounts[mount])
        pattern = re.compile(r"(?<![\w./-])" + re.escape(mount.rstrip("/")) + r"(?![\w.-])")
        text = pattern.sub(lambda _m, t=target: t, text)
    return text


# --- the pod network (Python programs only) ---------------------------------------------------------------

SITECUSTOMIZE = '''"""The pod network of tests/support/workagent.py for this Python process: cluster DNS (the cluster's
Service names resolve to their cluster IPs) and kube-proxy (a connection to a cluster IP and Service
port goes to 127.0.0.1 and the port the Service forwards to)."""

import json as _json
import os as _os
import socket as _socket


def _install():
    path = _os.environ.get("%(env)s")
    if not path:
        return
    loaded = {"stamp": None, "table": None}

    def current():
        # the kubelet rewrites the table (by rename) when it starts a container: Services made since
        try:
            info = _os.stat(path)
            stamp = (info.st_ino, info.st_mtime_ns)
        except OSError:
            return loaded["table"]
        if stamp != loaded["stamp"]:
            with open(path) as handle:
                loaded["table"] = _json.load(handle)
            loaded["stamp"] = stamp
        return loaded["table"]

    current()
    real_getaddrinfo = _socket.getaddrinfo
    real_connect = _socket.socket.connect
    real_connect_ex = _socket.socket.connect_ex

    def lookup(host):
        table = current()
        names, search, domain = table["names"], table["search"], table["domain"]
        name = host.rstrip(".").lower()
        if host.endswith("."):
            candidates = [name]
        elif name.count(".") < 5:  # ndots:5, as in a pod's resolv.conf
            candidates = [name + "." + d for d in search] + [name]
        else:
            candidates = [name] + [name + "." + d for d in search]
        for candidate in candidates:
            if candidate in names:
                return names[candidate]
        if name == domain or name.endswith("." + domain) or name.endswith(".svc"):
            return ""
        return None

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        text = host.decode() if isinstance(host, bytes) else host
        if isinstance(text, str) and text and not flags & _socket.AI_NUMERICHOST:
            address = lookup(text)
            if address == "":
                raise _socket.gaierror(_socket.EAI_NONAME, "Name or service not known")
            if address is not None:
                return real_getaddrinfo(address, port, family, type, proto, flags)
        return real_getaddrinfo(host, port, family, type, proto, flags)

    def forwarded(sock, address):
        if sock.family == _socket.AF_INET and isinstance(address, tuple) and len(address) == 2:
            target = current()["forwards"].get(f"{address[0]}:{address[1]}")
            if target is not None:
                return ("127.0.0.1", target)
        return address

    def connect(self, address):
        return real_connect(self, forwarded(self, address))

    def connect_ex(self, address):
        return real_connect_ex(self, forwarded(self, address))

    _socket.getaddrinfo = getaddrinfo
    _socket.socket.connect = connect
    _socket.socket.connect_ex = connect_ex


_install()
'''.replace("%(env)s", POD_NETWORK_ENV)


@dataclass(frozen=True)
class ServiceAddress:
    """A Service as the emulated pod network serves it."""

    name: str
    namespace: str
    cluster_ip: str  # "" for ExternalName, "None" for a headless Service
    ports: tuple[tuple[str, int, int], ...]  # (port name, Service port, local port it leads to)
    cname: str = ""

    @property
    def headless(self) -> bool:
        return self.cluster_ip in ("", "None")


def _selects(selector: Mapping[str, str] | None, labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in (selector or {}).items())


def _target_port(port: Mapping[str, Any], backends: list[dict[str, Any]]) -> int:
    target = port.get("targetPort", port.get("port"))
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    for spec in backends:
        for container in spec.get("containers") or []:
            for declared in container.get("ports") or []:
                if declared.get("name") == target:
                    return int(declared["containerPort"])
    return int(port["port"])


def service_addresses(cluster: KubeCluster, api: Any) -> list[ServiceAddress]:
    """Every Service of ``cluster``; ``default/kubernetes`` leads to its API server."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    apps = client.AppsV1Api(api)
    found: list[ServiceAddress] = []
    templates: dict[str, list[tuple[dict[str, str], dict[str, Any]]]] = {}
    for service in api.sanitize_for_serialization(core.list_service_for_all_namespaces().items):
        meta, spec = service["metadata"], service.get("spec") or {}
        if spec.get("type") == "ExternalName":
            found.append(ServiceAddress(meta["name"], meta["namespace"], "", (), cname=spec["externalName"]))
            continue
        if (meta["namespace"], meta["name"]) == ("default", "kubernetes"):
            ports = tuple((str(p.get("name") or ""), int(p["port"]), cluster.port) for p in spec["ports"])
            found.append(ServiceAddress("kubernetes", "default", spec["clusterIP"], ports))
            continue
        if meta["namespace"] not in templates:
            deployments = api.sanitize_for_serialization(
                apps.list_namespaced_deployment(meta["namespace"]).items
            )
            templates[meta["namespace"]] = [
                (
                    (d["spec"]["template"].get("metadata") or {}).get("labels") or {},
                    d["spec"]["template"]["spec"],
                )
                for d in deployments
            ]
        backends = [
            pod for labels, pod in templates[meta["namespace"]] if _selects(spec.get("selector"), labels)
        ]
        ports = tuple(
            (str(p.get("name") or ""), int(p["port"]), _target_port(p, backends))
            for p in spec.get("ports") or []
        )
        found.append(ServiceAddress(meta["name"], meta["namespace"], str(spec.get("clusterIP") or ""), ports))
    if not any((s.namespace, s.name) == ("default", "kubernetes") for s in found):
        raise WorkAgentError(
            f"{cluster.name} has no Service default/kubernetes: its API server makes it at start"
        )
    return found


def network_table(services: Iterable[ServiceAddress], namespace: str) -> dict[str, Any]:
    """What the pod network's sitecustomize reads: names to addresses, cluster IP:port to local ports."""
    names: dict[str, str] = {}
    forwards: dict[str, int] = {}
    for service in services:
        fqdn = f"{service.name}.{service.namespace}.svc.{CLUSTER_DOMAIN}"
        if service.cname:
            names[fqdn] = service.cname
        elif service.headless:
            names[fqdn] = "127.0.0.1"  # the addresses of its pods
        else:
            names[fqdn] = service.cluster_ip
            for _, port, local in service.ports:
                forwards[f"{service.cluster_ip}:{port}"] = local
    return {
        "names": names,
        "forwards": forwards,
        "search": [f"{namespace}.svc.{CLUSTER_DOMAIN}", f"svc.{CLUSTER_DOMAIN}", CLUSTER_DOMAIN],
        "domain": CLUSTER_DOMAIN,
    }


def _link_name(service: str) -> str:
    return service.upper().replace("-", "_").replace(".", "_")


def service_link_env(services: Iterable[ServiceAddress], namespace: str, *, links: bool) -> dict[str, str]:
    """The docker-link variables a kubelet gives a pod: for the ``kubernetes`` Service always, for each
    Service of the pod's namespace with a cluster IP when ``links``; cluster IPs and Service ports, as a
    pod sees them."""
    env: dict[str, str] = {}
    for service in services:
        is_master = (service.namespace, service.name) == ("default", "kubernetes")
        if not is_master and (
            not links or service.namespace != namespace or service.cname or service.headless
        ):
            continue
        if not service.ports:
            continue
        prefix = _link_name(service.name)
        host = service.cluster_ip
        first = service.ports[0][1]
        env[f"{prefix}_SERVICE_HOST"] = host
        env[f"{prefix}_SERVICE_PORT"] = str(first)
        for port_name, port, _ in service.ports:
            if port_name:
                env[f"{prefix}_SERVICE_PORT_{_link_name(port_name)}"] = str(port)
        env[f"{prefix}_PORT"] = f"tcp://{host}:{first}"
        for _, port, _ in service.ports:
            base = f"{prefix}_PORT_{port}_TCP"
            env[base] = f"tcp://{host}:{port}"
            env[f"{base}_PROTO"] = "tcp"
            env[f"{base}_PORT"] = str(port)
            env[f"{base}_ADDR"] = host
    return env


# --- pods ---------------------------------------------------------------------------------------------------


def _decode(data: Mapping[str, str] | None) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (data or {}).items()}


def _program(command: str, bin_dir: Path) -> str:
    if "/" in command:
        if not os.access(command, os.X_OK):
            raise WorkAgentError(f"program {command} does not exist on this machine (or is not executable)")
        return command
    for directory in (bin_dir, *SYSTEM_BIN):
        candidate = directory / command
        if os.access(candidate, os.X_OK):
            return str(candidate)
    raise WorkAgentError(
        f"program {command!r} is neither a console script in {bin_dir} nor in /usr/bin or /bin: the stand-in "
        "runs the project's programs (scripts/bootstrap.sh installs them) and base system tools"
    )


class Container:
    """One container's process; its output (stdout and stderr) appended to ``log_path``."""

    def __init__(self, pod: Pod, spec: dict[str, Any]) -> None:
        self.pod = pod
        self.spec = spec
        self.name: str = spec["name"]
        self.log_path = pod.directory / "logs" / f"{self.name}.log"
        self.popen: subprocess.Popen[bytes] | None = None
        self.argv: list[str] = []
        self.env: dict[str, str] = {}
        self.starts = 0
        self._log_offset = 0

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"container {self.name} never started"
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def start(self) -> None:
        assert not self.running, f"container {self.name} already runs"
        self.argv, self.env, cwd = self.pod.resolve(self.spec)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._log_offset = log.tell()
            log.write(f"=== start {_now()}: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=cwd,
                preexec_fn=die_with_parent if threading.current_thread() is threading.main_thread() else None,
            )
        self.starts += 1

    def text(self, *, all_runs: bool = False) -> str:
        """The log of the current run (of every run with ``all_runs``)."""
        if not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as log:
            log.seek(0 if all_runs else self._log_offset)
            return log.read().decode(errors="replace")

    def events(self, event: str | None = None) -> list[dict[str, Any]]:
        """JSON log records of the current run (``event`` ones if given)."""
        return json_lines(self.text(), event)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.text(all_runs=True).splitlines()[-lines:])

    def wait_event(self, event: str, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        """The first ``event`` record of this run matching ``match``; AssertionError with the log if
        the process exits first or the deadline passes."""

        def found() -> dict[str, Any] | None:
            for record in self.events(event):
                if all(record.get(k) == v for k, v in match.items()):
                    return record
            if not self.running:
                raise AssertionError(
                    f"{self.pod.name}/{self.name} exited ({self.returncode}) before {event}:\n{self.tail()}"
                )
            return None

        try:
            return poll_until(found, timeout=timeout, what=f"{event} {match} in {self.pod.name}/{self.name}")
        except AssertionError as exc:
            if "exited" in str(exc):
                raise
            raise AssertionError(f"{exc}:\n{self.tail()}") from None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.running:
            assert self.popen is not None
            self.popen.send_signal(sig)

    def wait_exit(self, timeout: float = 15.0) -> int:
        assert self.popen is not None, f"container {self.name} never started"
        return self.popen.wait(timeout)

    def stop(self, grace: float) -> int | None:
        """SIGTERM, SIGKILL after ``grace`` seconds; the exit status."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


FIELD_PATHS = {
    "metadata.name",
    "metadata.namespace",
    "metadata.uid",
    "spec.nodeName",
    "spec.serviceAccountName",
    "status.hostIP",
    "status.hostIPs",
    "status.podIP",
    "status.podIPs",
}
UNSUPPORTED_POD_FIELDS = ("ephemeralContainers", "resourceClaims")
VOLUME_TYPES = ("secret", "configMap", "emptyDir")


class Pod:
    """One replica of a Deployment, run as processes (see the module's docstring for how)."""

    def __init__(self, kubelet: Kubelet, deployment: dict[str, Any]) -> None:
        self.kubelet = kubelet
        self.cluster = kubelet.cluster
        self.deployment = deployment
        meta = deployment["metadata"]
        self.deployment_name: str = meta["name"]
        self.namespace: str = meta["namespace"]
        template = deployment["spec"]["template"]
        self.labels: dict[str, str] = dict((template.get("metadata") or {}).get("labels") or {})
        self.annotations: dict[str, str] = dict((template.get("metadata") or {}).get("annotations") or {})
        self.spec: dict[str, Any] = template["spec"]
        digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
        self.name = f"{self.deployment_name}-{digest}-{secrets.token_hex(3)[:5]}"
        self.uid = str(uuid.uuid4())
        self.directory = kubelet.directory / self.namespace / self.name
        self.service_account: str = (
            self.spec.get("serviceAccountName") or self.spec.get("serviceAccount") or "default"
        )
        self.mounts_by_container: dict[str, dict[str, Path]] = {}
        self.kubeconfig: Path | None = None
        self.ready = False
        self._check_supported()
        self.init_containers = [Container(self, c) for c in self.spec.get("initContainers") or []]
        self.containers = {c["name"]: Container(self, c) for c in self.spec.get("containers") or []}
        if not self.containers:
            raise WorkAgentError(f"Deployment {self.namespace}/{self.deployment_name} has no containers")

    def __repr__(self) -> str:
        return f"Pod({self.cluster.name}:{self.namespace}/{self.name})"

    # what cannot be emulated
    def _check_supported(self) -> None:
        where = f"Deployment {self.namespace}/{self.deployment_name}"
        for key in UNSUPPORTED_POD_FIELDS:
            if self.spec.get(key):
                raise WorkAgentError(f"{where}: pod field {key} is not emulated")
        for volume in self.spec.get("volumes") or []:
            kinds = [k for k in volume if k != "name"]
            if not kinds or kinds[0] not in VOLUME_TYPES:
                raise WorkAgentError(
                    f"{where}: volume {volume.get('name')!r} of type {', '.join(kinds) or 'none'} is not emulated "
                    f"(only {', '.join(VOLUME_TYPES)})"
                )
        for container in [*(self.spec.get("initContainers") or []), *(self.spec.get("containers") or [])]:
            name = container.get("name")
            if container.get("lifecycle"):
                raise WorkAgentError(f"{where}: container {name}: lifecycle hooks are not emulated")
            if container.get("restartPolicy") == "Always":
                raise WorkAgentError(f"{where}: container {name}: sidecar init containers are not emulated")
            if not container.get("command"):
                raise WorkAgentError(
                    f"{where}: container {name} has no command: the image's entrypoint is not known to the "
                    "stand-in (the project's Deployments name their program)"
                )
            for mount in container.get("volumeMounts") or []:
                if mount.get("subPathExpr"):
                    raise WorkAgentError(f"{where}: container {name}: subPathExpr is not emulated")
            for env in container.get("env") or []:
                source = env.get("valueFrom") or {}
                if "resourceFieldRef" in source:
                    raise WorkAgentError(
                        f"{where}: container {name}: env {env['name']} from resourceFieldRef is not emulated"
                    )
                path = (source.get("fieldRef") or {}).get("fieldPath")
                if (
                    path is not None
                    and path not in FIELD_PATHS
                    and not re.fullmatch(r"metadata\.(labels|annotations)\['[^']+'\]", path)
                ):
                    raise WorkAgentError(
                        f"{where}: container {name}: env {env['name']} from fieldRef {path} is not emulated"
                    )

    # API access
    def _core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.kubelet.api)

    def _read(self, kind: str, name: str) -> dict[str, Any] | None:
        core = self._core()
        read = core.read_namespaced_secret if kind == "Secret" else core.read_namespaced_config_map
        try:
            obj = read(name, self.namespace)
        except Exception as exc:
            if _status_code(exc) == 404:
                return None
            raise
        return self.kubelet.api.sanitize_for_serialization(obj)

    def _data(self, kind: str, name: str, *, optional: bool, why: str) -> dict[str, bytes] | None:
        obj = self._read(kind, name)
        if obj is None:
            if optional:
                return None
            raise WorkAgentError(
                f"{self}: {kind} {self.namespace}/{name} not found ({why}): a kubelet would not start the "
                "container either (CreateContainerConfigError)"
            )
        if kind == "Secret":
            return _decode(obj.get("data"))
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        data.update(_decode(obj.get("binaryData")))
        return data

    # volumes and identity
    def _materialize_volumes(self, *, refresh_only: bool = False) -> dict[str, Path]:
        roots: dict[str, Path] = {}
        for volume in self.spec.get("volumes") or []:
            name = volume["name"]
            root = self.directory / "volumes" / name
            roots[name] = root
            if "emptyDir" in volume:
                if not refresh_only:
                    root.mkdir(parents=True, exist_ok=True)
                continue
            kind, source = (
                ("Secret", volume["secret"]) if "secret" in volume else ("ConfigMap", volume["configMap"])
            )
            object_name = source.get("secretName") if kind == "Secret" else source.get("name")
            data = self._data(kind, object_name, optional=bool(source.get("optional")), why=f"volume {name}")
            root.mkdir(parents=True, exist_ok=True)
            for old in root.rglob("*"):
                if old.is_file():
                    old.unlink()
            if data is None:
                continue
            mode = source.get("defaultMode", 0o644)
            items = source.get("items")
            chosen = (
                [(i["key"], i["path"], i.get("mode", mode)) for i in items]
                if items
                else [(key, key, mode) for key in data]
            )
            for key, path, item_mode in chosen:
                if key not in data:
                    if source.get("optional"):
                        continue
                    raise WorkAgentError(f"{self}: volume {name}: {kind} {object_name} has no key {key!r}")
                target = root / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data[key])
                target.chmod(item_mode)
        return roots

    def _identity(self) -> Path | None:
        """The service-account files and kubeconfig; None when no token is mounted."""
        core = self._core()
        try:
            account = self.kubelet.api.sanitize_for_serialization(
                core.read_namespaced_service_account(self.service_account, self.namespace)
            )
        except Exception as exc:
            if _status_code(exc) == 404:
                raise WorkAgentError(
                    f"{self}: ServiceAccount {self.namespace}/{self.service_account} not found: its admission "
                    "would refuse the pod"
                ) from None
            raise
        automount = self.spec.get("automountServiceAccountToken")
        if automount is None:
            automount = account.get("automountServiceAccountToken")
        if automount is False:
            return None
        answer = core.create_namespaced_service_account_token(
            self.service_account, self.namespace, {"spec": {"expirationSeconds": TOKEN_SECONDS}}
        )
        directory = self.directory / "serviceaccount"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "token").write_text(answer.status.token)
        (directory / "ca.crt").write_bytes(self.cluster.ca_path.read_bytes())
        (directory / "namespace").write_text(self.namespace)
        kubeconfig = directory / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": self.cluster.name,
                            "cluster": {
                                "server": self.cluster.url,
                                "certificate-authority": str(directory / "ca.crt"),
                            },
                        }
                    ],
                    "users": [
                        {"name": self.service_account, "user": {"tokenFile": str(directory / "token")}}
                    ],
                    "contexts": [
                        {
                            "name": "pod",
                            "context": {
                                "cluster": self.cluster.name,
                                "user": self.service_account,
                                "namespace": self.namespace,
                            },
                        }
                    ],
                    "current-context": "pod",
                },
                sort_keys=False,
            )
        )
        return directory

    def _mounts(
        self, container: Mapping[str, Any], roots: Mapping[str, Path], identity: Path | None
    ) -> dict[str, Path]:
        mounts: dict[str, Path] = {}
        if identity is not None:
            mounts[SERVICE_ACCOUNT_DIR] = identity
        for mount in container.get("volumeMounts") or []:
            if mount["name"] not in roots:
                raise WorkAgentError(
                    f"{self}: container {container['name']} mounts unknown volume {mount['name']!r}"
                )
            path = roots[mount["name"]]
            if mount.get("subPath"):
                path = path / mount["subPath"]
                if not path.exists():  # an emptyDir's sub-directory; a Secret's key is a file already
                    path.mkdir(parents=True)
            mounts[mount["mountPath"].rstrip("/") or "/"] = path
        return mounts

    # environment
    def _field(self, path: str) -> str:
        values = {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "metadata.uid": self.uid,
            "spec.nodeName": socket.gethostname(),
            "spec.serviceAccountName": self.service_account,
            "status.hostIP": "127.0.0.1",
            "status.hostIPs": "127.0.0.1",
            "status.podIP": "127.0.0.1",
            "status.podIPs": "127.0.0.1",
        }
        if path in values:
            return values[path]
        match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        assert match, path  # checked at construction
        source = self.labels if match.group(1) == "labels" else self.annotations
        return source.get(match.group(2), "")

    def _environment(self, container: Mapping[str, Any], services: list[ServiceAddress]) -> dict[str, str]:
        """The kubelet's order: envFrom, then env (``$(VAR)`` over what is defined so far and the
        service variables), then the service variables not defined otherwise."""
        name = container["name"]
        service_env = service_link_env(
            services, self.namespace, links=self.spec.get("enableServiceLinks", True)
        )
        env: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            kind, ref = (
                ("Secret", source["secretRef"])
                if "secretRef" in source
                else ("ConfigMap", source["configMapRef"])
            )
            data = self._data(kind, ref["name"], optional=bool(ref.get("optional")), why=f"envFrom of {name}")
            for key, value in (data or {}).items():
                env[prefix + key] = value.decode()

        def lookup(var: str) -> str | None:
            return env.get(var, service_env.get(var))

        for var in container.get("env") or []:
            source = var.get("valueFrom")
            if source is None:
                env[var["name"]] = expand(var.get("value", ""), lookup)
                continue
            if "fieldRef" in source:
                env[var["name"]] = self._field(source["fieldRef"]["fieldPath"])
                continue
            kind, ref = (
                ("Secret", source["secretKeyRef"])
                if "secretKeyRef" in source
                else ("ConfigMap", source.get("configMapKeyRef"))
            )
            if ref is None:
                raise WorkAgentError(
                    f"{self}: container {name}: env {var['name']}: valueFrom {list(source)} is not emulated"
                )
            optional = bool(ref.get("optional"))
            data = self._data(kind, ref["name"], optional=optional, why=f"env {var['name']} of {name}")
            if data is None:
                continue
            if ref["key"] not in data:
                if optional:
                    continue
                raise WorkAgentError(
                    f"{self}: container {name}: env {var['name']}: {kind} {self.namespace}/{ref['name']} has no "
                    f"key {ref['key']!r} (CreateContainerConfigError)"
                )
            env[var["name"]] = data[ref["key"]].decode()
        for key, value in service_env.items():
            env.setdefault(key, value)
        return env

    def resolve(self, container: Mapping[str, Any]) -> tuple[list[str], dict[str, str], str]:
        """argv, environment and working directory of ``container`` now (Secrets read again)."""
        services = service_addresses(self.cluster, self.kubelet.api)
        env = self._environment(container, services)
        mounts = self.mounts_by_container[container["name"]]

        def lookup(var: str) -> str | None:
            return env.get(var)

        command = [expand(part, lookup) for part in container["command"]]
        args = [expand(part, lookup) for part in container.get("args") or []]
        argv = [rewrite_mount_paths(part, mounts) for part in [*command, *args]]
        argv[0] = _program(argv[0], self.kubelet.bin_dir)
        env = {key: rewrite_mount_paths(value, mounts) for key, value in env.items()}
        network = self.directory / "pod-network"
        network.mkdir(parents=True, exist_ok=True)
        (network / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.kubelet.refresh_networks(services, also=self)
        home = self.directory / "home"
        home.mkdir(parents=True, exist_ok=True)
        image_env = {
            "PATH": os.pathsep.join(str(p) for p in (self.kubelet.bin_dir, *SYSTEM_BIN)),
            "HOME": str(home),
            "HOSTNAME": self.name,
            "PYTHONUNBUFFERED": "1",
        }
        full = {**image_env, **env}
        if self.kubeconfig is not None:
            full["KUBECONFIG"] = str(self.kubeconfig)
        full["PYTHONPATH"] = os.pathsep.join(p for p in (str(network), full.get("PYTHONPATH", "")) if p)
        full[POD_NETWORK_ENV] = str(network / "table.json")
        working = container.get("workingDir")
        cwd = str(home)
        if working:
            rewritten = rewrite_mount_paths(working, mounts)
            if rewritten == working:
                raise WorkAgentError(
                    f"{self}: container {container['name']}: workingDir {working} is not under a mount (the "
                    "image's file system is not emulated)"
                )
            cwd = rewritten
        return argv, full, cwd

    # lifecycle
    def start(self) -> Pod:
        """Volumes, identity, init containers to completion, then every container."""
        self.directory.mkdir(parents=True, exist_ok=True)
        roots = self._materialize_volumes()
        identity = self._identity()
        self.kubeconfig = identity / "kubeconfig" if identity is not None else None
        for spec in [*(self.spec.get("initContainers") or []), *(self.spec.get("containers") or [])]:
            self.mounts_by_container[spec["name"]] = self._mounts(spec, roots, identity)
        for init in self.init_containers:
            init.start()
            try:
                code = init.wait_exit(INIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                init.stop(1)
                raise WorkAgentError(
                    f"{self}: init container {init.name} still runs after {INIT_TIMEOUT:g}s"
                ) from None
            if code != 0:
                raise WorkAgentError(f"{self}: init container {init.name} exited {code}:\n{init.tail()}")
        for container in self.containers.values():
            container.start()
        return self

    def container(self, name: str | None = None) -> Container:
        """The container ``name`` (the only one when there is one)."""
        if name is None:
            if len(self.containers) != 1:
                raise WorkAgentError(f"{self} has containers {sorted(self.containers)}: name one")
            return next(iter(self.containers.values()))
        return self.containers[name]

    @property
    def grace(self) -> float:
        return float(self.spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE))

    def kill(self, sig: int = signal.SIGKILL, container: str | None = None) -> None:
        targets = [self.container(container)] if container else list(self.containers.values())
        for target in targets:
            target.kill(sig)
        self.ready = False

    def stop(self, grace: float | None = None) -> None:
        for target in self.containers.values():
            target.stop(self.grace if grace is None else grace)
        self.ready = False

    def restart(self, container: str | None = None, grace: float | None = None) -> Pod:
        """Restart the containers (or one) as a kubelet restarts a failed one: stopped if still running,
        Secret and ConfigMap volumes refreshed, emptyDirs kept, environment resolved again, init
        containers not run again."""
        targets = [self.container(container)] if container else list(self.containers.values())
        for target in targets:
            target.stop(self.grace if grace is None else grace)
        self._materialize_volumes(refresh_only=True)
        for target in targets:
            target.start()
        self.ready = False
        return self

    # readiness
    def probe(self, container: str | None = None) -> tuple[bool, str]:
        """One run of the readiness probe (a container without one is ready when it runs)."""
        target = self.container(container)
        if not target.running:
            return False, f"container {target.name} is not running (exit {target.returncode})"
        probe = target.spec.get("readinessProbe")
        if not probe:
            return True, "no readiness probe"
        ports = {p.get("name"): p["containerPort"] for p in target.spec.get("ports") or [] if p.get("name")}

        def port_of(value: Any) -> int:
            if isinstance(value, int):
                return value
            if isinstance(value, str) and value.isdigit():
                return int(value)
            if value in ports:
                return int(ports[value])
            raise WorkAgentError(
                f"{self}: container {target.name}: probe port {value!r} is not a declared port"
            )

        if "httpGet" in probe:
            get = probe["httpGet"]
            scheme = get.get("scheme", "HTTP").lower()
            url = f"{scheme}://{get.get('host') or '127.0.0.1'}:{port_of(get['port'])}{get.get('path', '/')}"
            context = ssl._create_unverified_context() if scheme == "https" else None  # as the kubelet
            request = urllib.request.Request(
                url, headers={h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            )
            try:
                with urllib.request.urlopen(
                    request, timeout=probe.get("timeoutSeconds", 1) + 1, context=context
                ) as answer:
                    return 200 <= answer.status < 400, f"{url}: {answer.status}"
            except urllib.error.HTTPError as exc:
                return False, f"{url}: {exc.code}"
            except (OSError, ssl.SSLError) as exc:
                return False, f"{url}: {exc}"
        if "tcpSocket" in probe:
            port = port_of(probe["tcpSocket"]["port"])
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2):
                    return True, f"tcp {port} open"
            except OSError as exc:
                return False, f"tcp {port}: {exc}"
        if "exec" in probe:
            argv = [
                rewrite_mount_paths(p, self.mounts_by_container[target.name])
                for p in probe["exec"]["command"]
            ]
            argv[0] = _program(argv[0], self.kubelet.bin_dir)
            done = subprocess.run(argv, env=target.env, capture_output=True, timeout=30)
            return done.returncode == 0, f"exec exit {done.returncode}"
        raise WorkAgentError(f"{self}: container {target.name}: probe {sorted(probe)} is not emulated")

    def wait_ready(self, timeout: float = 60.0) -> Pod:
        """Every container's readiness probe passes; then the Deployment's status says so."""
        for name, target in self.containers.items():
            last = ["not probed"]

            def passes(name: str = name, last: list[str] = last) -> bool:
                ok, last[0] = self.probe(name)
                if not ok and not self.containers[name].running:
                    raise AssertionError(f"{self}: {last[0]}:\n{self.containers[name].tail()}")
                return ok

            try:
                poll_until(passes, timeout=timeout, what=f"{self}/{name} ready", interval=0.2)
            except AssertionError as exc:
                raise AssertionError(f"{exc} (last probe: {last[0]}):\n{target.tail()}") from None
        self.ready = True
        self.kubelet.report_status(self.namespace, self.deployment_name)
        return self


class Kubelet:
    """Runs Deployments' pods of one cluster as local processes under ``directory``."""

    def __init__(self, cluster: KubeCluster, directory: Path, *, bin_dir: Path = BIN) -> None:
        self.cluster = cluster
        self.directory = directory
        self.bin_dir = bin_dir
        self.api = cluster.api_client()
        self.pods: list[Pod] = []

    def deployment(self, namespace: str, name: str) -> dict[str, Any]:
        from kubernetes import client

        try:
            found = client.AppsV1Api(self.api).read_namespaced_deployment(name, namespace)
        except Exception as exc:
            if _status_code(exc) == 404:
                raise WorkAgentError(f"no Deployment {namespace}/{name} on {self.cluster.name}") from None
            raise
        return self.api.sanitize_for_serialization(found)

    def wait_deployment(self, namespace: str, name: str, timeout: float = 30.0) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            try:
                return self.deployment(namespace, name)
            except WorkAgentError:
                return None

        return poll_until(
            found, timeout=timeout, what=f"Deployment {namespace}/{name} on {self.cluster.name}"
        )

    def refresh_networks(self, services: list[ServiceAddress], *, also: Pod | None = None) -> None:
        """Rewrite the pod network table of every pod started so far (and ``also``'s) from ``services``:
        what kube-proxy and cluster DNS do whenever a Service changes, done here whenever a container
        starts. Each table is replaced by a rename, so a process never reads half of one."""
        for pod in {id(p): p for p in [*self.pods, *([also] if also is not None else [])]}.values():
            network = pod.directory / "pod-network"
            if not network.is_dir():
                continue
            written = network / "table.json.new"
            written.write_text(json.dumps(network_table(services, pod.namespace)))
            os.replace(written, network / "table.json")

    def pod(self, namespace: str, name: str) -> Pod:
        """A pod of Deployment ``namespace/name`` as it is now, not started (:meth:`Pod.start`)."""
        pod = Pod(self, self.deployment(namespace, name))
        self.pods.append(pod)
        return pod

    def run(self, namespace: str, name: str) -> Pod:
        """A pod of Deployment ``namespace/name``, started."""
        return self.pod(namespace, name).start()

    def report_status(self, namespace: str, name: str) -> None:
        """The Deployment's status from the pods this kubelet runs for it."""
        from kubernetes import client

        apps = client.AppsV1Api(self.api)
        pods = [p for p in self.pods if (p.namespace, p.deployment_name) == (namespace, name)]
        running = [p for p in pods if any(c.running for c in p.containers.values())]
        ready = [p for p in running if p.ready]
        for attempt in range(5):
            current = self.api.sanitize_for_serialization(apps.read_namespaced_deployment(name, namespace))
            current["status"] = {
                **(current.get("status") or {}),
                "observedGeneration": current["metadata"].get("generation", 1),
                "replicas": len(running),
                "updatedReplicas": len(running),
                "readyReplicas": len(ready),
                "availableReplicas": len(ready),
            }
            try:
                apps.replace_namespaced_deployment_status(name, namespace, current)
                return
            except Exception as exc:
                if _status_code(exc) != 409 or attempt == 4:
                    raise

    def stop(self, grace: float | None = None) -> None:
        """Stop every pod (containers SIGTERM, then SIGKILL after the grace period)."""
        for pod in self.pods:
            pod.stop(grace)

    def close(self, grace: float | None = None) -> None:
        self.stop(grace)
        self.api.close()


# --- the whole addon on the test API servers ---------------------------------------------------------------

MPC_CRD = (
    Path(__file__).resolve().parents[2]
    / "deploy/kustomize/base/crds/proxy.open-cluster-management.io_managedproxyconfigurations.yaml"
)
MPC_GROUP, MPC_VERSION, MPC_PLURAL = (
    "proxy.open-cluster-management.io",
    "v1alpha1",
    "managedproxyconfigurations",
)
ADDON_GROUP, ADDON_VERSION = "addon.open-cluster-management.io", "v1alpha1"
ADDON_NAME = "cluster-proxy"
MANIFEST_WORK = "addon-cluster-proxy-deploy"
SERVER_DEPLOYMENT = "cluster-proxy"
SIGNER_DEPLOYMENT = "cluster-proxy-cert-signer"
AGENT_DEPLOYMENT = "cluster-proxy-proxy-agent"
STORE_PREFIX = "cluster-proxy-ca"


def install_mpc_crd(hub: KubeCluster, timeout: float = 60.0) -> None:
    """The ManagedProxyConfiguration CRD of deploy/kustomize/base/crds, Established."""
    applied = hub.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(MPC_CRD), timeout=timeout)
    assert applied.returncode == 0, f"the MPC CRD was refused:\n{applied.stderr}"
    name = yaml.safe_load(MPC_CRD.read_text())["metadata"]["name"]
    waited = hub.kubectl("wait", "--for=condition=Established", f"--timeout={timeout:g}s", f"crd/{name}")
    assert waited.returncode == 0, f"the MPC CRD is not Established:\n{waited.stdout}{waited.stderr}"


@dataclass
class Member:
    """A managed cluster of the addon: its ManagedCluster ``name`` on the hub, its API server ``api``
    where the work agent applies and the kubelet runs its agent."""

    name: str
    api: KubeCluster
    install_namespace: str
    work_agent: WorkAgent
    kubelet: Kubelet
    agent: Pod | None = None


@dataclass(frozen=True)
class Ports:
    client: int
    agent: int
    admin: int
    signer: int


class AddonStack:
    """The addon as the tests run it: the addon-manager process on the hub API server, a
    ManagedProxyConfiguration with an entrypoint of type Hostname ``127.0.0.1`` and free ports, the
    cert-signer and proxy-server started from the Deployments the manager wrote (:class:`Kubelet`),
    and managed clusters joined with :meth:`join` (ManagedCluster + ManagedClusterAddOn -> the
    ManifestWork applied by a :class:`WorkAgent` -> the agent started from its Deployment)."""

    def __init__(self, hub: KubeCluster, directory: Path, *, manager_args: Iterable[str] = ()) -> None:
        from tests.support.kubeapi import free_port

        tag = secrets.token_hex(3)
        self.hub = hub
        self.directory = directory
        self.tag = tag
        self.namespace = f"cp-hub-{tag}"
        self.mpc_name = f"cp-{tag}"
        self.ports = Ports(free_port(), free_port(), free_port(), free_port())
        self.manager_args = list(manager_args)
        self.hub_kubelet = Kubelet(hub, directory / "hub")
        self.api = hub.api_client()
        self.members: dict[str, Member] = {}
        self.manager: Any = None
        self.signer: Pod | None = None
        self.server: Pod | None = None
        self._admin_tls: ssl.SSLContext | None = None
        self.timings: dict[str, float] = {}

    # hub
    @property
    def store(self) -> str:
        return f"kubernetes:{self.namespace}/{STORE_PREFIX}"

    @property
    def admin_url(self) -> str:
        """The proxy-server's admin port for its agents and clusters: mutual TLS with a hub client
        certificate (:meth:`admin_tls`); its certificate names the entrypoint's host, 127.0.0.1."""
        return f"https://127.0.0.1:{self.ports.admin}"

    def mpc(self, **agent: Any) -> dict[str, Any]:
        return {
            "apiVersion": f"{MPC_GROUP}/{MPC_VERSION}",
            "kind": "ManagedProxyConfiguration",
            "metadata": {"name": self.mpc_name},
            "spec": {
                "proxyServer": {
                    "entrypoint": {
                        "type": "Hostname",
                        "hostname": {"value": "127.0.0.1"},
                        "port": self.ports.agent,
                    },
                },
                # Pods share the machine's network here: the agents' admin port (fixed 8093 in the
                # Deployment) would collide between clusters and with other users of the machine.
                "proxyAgent": {
                    "additionalArgs": ["--admin-listen=127.0.0.1:0", "--log-level=debug"],
                    **agent,
                },
                "deploy": {
                    "ports": {
                        "proxyServer": self.ports.client,
                        "agentServer": self.ports.agent,
                        "adminServer": self.ports.admin,
                        "signer": self.ports.signer,
                    }
                },
            },
        }

    def start(self, timeout: float = 90.0) -> AddonStack:
        from kubernetes import client

        from tests.support.procs import BIN as VENV_BIN, Process

        started = time.monotonic()
        install_mpc_crd(self.hub)
        client.CoreV1Api(self.api).create_namespace({"metadata": {"name": self.namespace}})
        client.CustomObjectsApi(self.api).create_cluster_custom_object(
            MPC_GROUP, MPC_VERSION, MPC_PLURAL, self.mpc()
        )
        (self.directory / "logs").mkdir(parents=True, exist_ok=True)
        self.manager = Process(
            "addon-manager",
            [
                str(VENV_BIN / "cluster-proxy-addon-manager"),
                f"--kubeconfig={self.hub.kubeconfig}",
                f"--namespace={self.namespace}",
                f"--mpc-name={self.mpc_name}",
                f"--admin-url={self.admin_url}",
                # its own hub client certificate for that URL, from the signer the manager deploys
                # (no cluster DNS here for the default, the signer's Service)
                f"--signer=https://127.0.0.1:{self.ports.signer}",
                f"--credentials-dir={self.directory / 'addon-manager'}",
                "--admin-listen=127.0.0.1:0",
                "--log-format=json",
                "--log-level=debug",
                *self.manager_args,
            ],
            self.directory / "logs",
        )
        self.wait_manager_event("manager_synced", timeout=timeout)
        self._deployment(SIGNER_DEPLOYMENT, timeout)
        self.signer = self.hub_kubelet.run(self.namespace, SIGNER_DEPLOYMENT).wait_ready(timeout)
        self._deployment(SERVER_DEPLOYMENT, timeout)
        self.server = self.hub_kubelet.run(self.namespace, SERVER_DEPLOYMENT).wait_ready(timeout)
        self.admin_tls()
        self.timings["hub_ready"] = time.monotonic() - started
        return self

    def wait_manager_event(self, event: str, timeout: float = 60.0, **match: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            for record in self.manager.events():
                if record.get("event") == event and all(record.get(k) == v for k, v in match.items()):
                    return record
            if self.manager.popen.poll() is not None:
                raise AssertionError(
                    f"the addon-manager exited ({self.manager.popen.returncode}):\n{self.manager.tail()}"
                )
            return None

        try:
            return poll_until(found, timeout=timeout, what=f"{event} in the addon-manager's log")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.manager.tail()}") from None

    def _deployment(self, name: str, timeout: float) -> dict[str, Any]:
        try:
            return self.hub_kubelet.wait_deployment(self.namespace, name, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the addon-manager's log:\n{self.manager.tail()}") from None

    def admin_tls(self) -> ssl.SSLContext:
        """The hub client TLS the tests read the proxy-server's agents with (its certificate made once,
        from the running signer: :meth:`client_certificate`)."""
        if self._admin_tls is None:
            from clusterproxy_protocol.tls import client_context
            from clusterproxy_protocol.wire import ALPN_HTTP1

            ca, cert, key = self.client_certificate("stack-reader")
            self._admin_tls = client_context(cert, key, ca, alpn=[ALPN_HTTP1])
        return self._admin_tls

    def agents_connected(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(
            f"{self.admin_url}/api/v1/agents", timeout=5, context=self.admin_tls()
        ) as answer:
            return json.loads(answer.read())

    def tunnels(self, cluster: str) -> int:
        return sum(1 for agent in self.agents_connected() if agent["cluster"] == cluster)

    # managed clusters
    def join(self, name: str, api: KubeCluster, timeout: float = 60.0) -> Member:
        """ManagedCluster ``name`` (its namespace on the hub) and its ManagedClusterAddOn
        ``cluster-proxy`` (installNamespace unique to this stack); the work agent applies the
        ManifestWork to ``api``; the agent runs from its Deployment and holds a tunnel."""
        from kubernetes import client

        custom = client.CustomObjectsApi(self.api)
        client.CoreV1Api(self.api).create_namespace({"metadata": {"name": name}})
        custom.create_cluster_custom_object(
            "cluster.open-cluster-management.io",
            "v1",
            "managedclusters",
            {
                "apiVersion": "cluster.open-cluster-management.io/v1",
                "kind": "ManagedCluster",
                "metadata": {"name": name},
                "spec": {"hubAcceptsClient": True},
            },
        )
        install_namespace = f"cp-agent-{self.tag}"
        custom.create_namespaced_custom_object(
            ADDON_GROUP,
            ADDON_VERSION,
            name,
            "managedclusteraddons",
            {
                "apiVersion": f"{ADDON_GROUP}/{ADDON_VERSION}",
                "kind": "ManagedClusterAddOn",
                "metadata": {"name": ADDON_NAME, "namespace": name},
                "spec": {"installNamespace": install_namespace},
            },
        )
        member = Member(
            name,
            api,
            install_namespace,
            WorkAgent(self.hub, api, name).start(),
            Kubelet(api, self.directory / name),
        )
        self.members[name] = member
        started = time.monotonic()
        applied = member.work_agent.wait_applied(MANIFEST_WORK, timeout)
        assert applied.ok, f"the work agent could not apply {name}'s ManifestWork: {applied.errors()}"
        member.agent = member.kubelet.run(install_namespace, AGENT_DEPLOYMENT)
        self.wait_tunnel(name, timeout=timeout)
        self.timings[f"join_{name}"] = time.monotonic() - started
        return member

    def wait_tunnel(self, cluster: str, *, present: bool = True, timeout: float = 60.0) -> float:
        """Seconds until ``cluster`` holds a tunnel (or none, ``present=False``) on the proxy-server."""
        started = time.monotonic()
        member = self.members.get(cluster)

        def reached() -> bool:
            if present and member is not None and member.agent is not None:
                agent = member.agent.container()
                if not agent.running:
                    raise AssertionError(f"{cluster}'s agent exited ({agent.returncode}):\n{agent.tail()}")
            return (self.tunnels(cluster) > 0) == present

        try:
            poll_until(
                reached, timeout=timeout, what=f"{cluster} {'connected' if present else 'disconnected'}"
            )
        except AssertionError as exc:
            logs = member.agent.container().tail() if member is not None and member.agent is not None else ""
            server = self.server.container().tail() if self.server is not None else ""
            raise AssertionError(f"{exc}\n--- agent\n{logs}\n--- proxy-server\n{server}") from None
        return time.monotonic() - started

    # a hub user
    def client_certificate(self, name: str = "hub-admin") -> tuple[Path, Path, Path]:
        """(ca, cert, key) of a hub client: a token from the signer's store (``cluster-proxy-cert-signer
        token create --client``, as an admin does), traded with the running signer for a certificate."""
        import trio

        from clusterproxy_protocol.certclient import CertFiles, SignerEndpoint, bootstrap_files, client_csr

        signer_cli = str(self.hub_kubelet.bin_dir / "cluster-proxy-cert-signer")
        common = [f"--store={self.store}", f"--kubeconfig={self.hub.kubeconfig}"]
        directory = self.directory / "clients" / name
        directory.mkdir(parents=True, exist_ok=True)
        ca = directory / "ca.crt"
        bundle = subprocess.run(
            [signer_cli, "trust-bundle", *common, f"--out={ca}"], capture_output=True, text=True, timeout=60
        )
        assert bundle.returncode == 0, f"trust-bundle failed:\n{bundle.stderr}"
        made = subprocess.run(
            [signer_cli, "token", "create", *common, f"--client={name}", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert made.returncode == 0, f"token create failed:\n{made.stderr}"
        token = json.loads(made.stdout)["token"]
        files = CertFiles(directory / "tls.crt", directory / "tls.key", ca)
        endpoint = SignerEndpoint.parse(f"https://127.0.0.1:{self.ports.signer}", ca)
        trio.run(bootstrap_files, endpoint, token, files, lambda key: client_csr(key, name))
        return ca, files.cert, files.key

    def close(self) -> None:
        """Stop every process, then delete what the stack created on the hub (the addons, their
        ManifestWorks, the ManagedClusters, the MPC; namespaces stay Terminating: no controller-manager)
        so that the next stack's manager does not find them."""
        for member in self.members.values():
            member.work_agent.close()
            member.kubelet.close(grace=10)
        self.hub_kubelet.close(grace=10)
        if self.manager is not None:
            self.manager.stop()
        self._delete_objects()
        self.api.close()

    def _delete_objects(self) -> None:
        from kubernetes import client

        custom = client.CustomObjectsApi(self.api)
        deletions: list[Callable[[], Any]] = []
        for name in self.members:
            deletions += [
                lambda n=name: custom.delete_namespaced_custom_object(
                    ADDON_GROUP, ADDON_VERSION, n, "managedclusteraddons", ADDON_NAME
                ),
                lambda n=name: custom.delete_namespaced_custom_object(
                    WORK_GROUP, WORK_VERSION, n, WORK_PLURAL, MANIFEST_WORK
                ),
                lambda n=name: custom.delete_cluster_custom_object(
                    "cluster.open-cluster-management.io", "v1", "managedclusters", n
                ),
                lambda n=name: client.CoreV1Api(self.api).delete_namespace(n),
            ]
        deletions += [
            lambda: custom.delete_cluster_custom_object(MPC_GROUP, MPC_VERSION, MPC_PLURAL, self.mpc_name),
            lambda: client.CoreV1Api(self.api).delete_namespace(self.namespace),
        ]
        for delete in deletions:
            try:
                delete()
            except Exception as exc:
                if _status_code(exc) != 404:
                    raise
