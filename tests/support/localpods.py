"""The addon's Deployments run as local processes on the bare test API servers (tests/kube), and the
manifests of its ManifestWork applied to a managed cluster's API server: the small stand-in the tests
on bare kube-apiservers need, since no kubelet or work agent runs beside them.

Why it stays: the tests in tests/kube check what our programs do with what the addon-manager and the
overlays write (ports, flags, certificates, RBAC, tokens, the tunnel, the health page, the gateway) in
seconds, many per session, on API servers alone. What a kubelet, OCM's work agent, kube-proxy and
CoreDNS do with those objects is checked on real nodes and real OCM instead, and is not imitated here:
tests/real_platform/test_real_nodes.py (pods as a kubelet runs them: non-root, read-only root, Secret
volumes, Services through kube-proxy, names through CoreDNS), test_real_ocm.py (OCM's work agent
applies a ManifestWork, reports it Applied and Available, deletes what it applied) and
test_user_install.py (our images on the nodes from the overlays and our ManifestWork, the agent's
in-cluster default ``kubernetes.default.svc:443`` through the tunnel, Available).

What it does, and no more:

- :class:`WorkApplier` server-side applies every manifest of a cluster's ManifestWorks (field manager
  ``work-agent``, conflicts forced, as OCM's default update strategy) whenever a work's generation is
  new. It writes no status on the work and deletes nothing.
- :class:`Kubelet` runs one pod of a Deployment: init containers to completion, then the containers, with
  their ``command`` and ``args`` (``$(VAR)`` expanded as a kubelet does), ``env`` (``value``,
  ``secretKeyRef``, ``configMapKeyRef``, ``fieldRef``), ``secret``/``configMap``/``emptyDir`` volumes
  written under the pod's directory, and the ServiceAccount's token. A process cannot see a mount path,
  so **mount paths are rewritten to those directories in the command, args and env values** (path
  prefixes only). The token, CA and namespace files are written under the pod's directory too and
  ``KUBECONFIG`` names a kubeconfig with the same identity. A command without ``/`` is the console
  script of the virtualenv (the project's programs, as its images hold them) or a system program.
- Pods share the machine's loopback, so the tests give each port a free number, a Service's port the
  same as its container's. Inside Python programs (a ``sitecustomize``) a name under ``.svc`` resolves
  to 127.0.0.1, and ``kubernetes.default.svc:443`` leads to the cluster's API server.
- :meth:`Pod.wait_ready` polls the ``httpGet`` readiness probe, then writes the Deployment's status
  (ready replicas), as the kubelet and deployment controller would. Logs go to
  ``<pod>/logs/<container>.log``; :meth:`Pod.stop` and :meth:`Pod.restart` act as a kubelet stopping or
  restarting a container (Secret and ConfigMap volumes refreshed, an ``emptyDir`` kept).

Not done: ``securityContext``, resources, other probes and volume types, restarts after a crash.
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
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support.kubeapi import KubeCluster, die_with_parent
from tests.support.procs import json_lines
from tests.support.waiting import poll_until

__all__ = ["FIELD_MANAGER", "Container", "Kubelet", "Pod", "WorkApplier", "expand", "rewrite_mount_paths"]

FIELD_MANAGER = "work-agent"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_SECONDS = 3607  # what a kubelet asks for a projected token
BIN = Path(sys.executable).parent
SYSTEM_BIN = (Path("/usr/bin"), Path("/bin"))
INIT_TIMEOUT = 60.0
API_PORT_ENV = "LOCALPODS_API_PORT"
WORK_GROUP, WORK_VERSION, WORK_PLURAL = "work.open-cluster-management.io", "v1", "manifestworks"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status_code(exc: Exception) -> int | None:
    return getattr(exc, "status", None)


# --- the ManifestWork's manifests ---------------------------------------------------------------------


@dataclass
class AppliedWork:
    name: str
    uid: str
    generation: int
    refused: list[str] = field(default_factory=list)  # one line per manifest the API server refused

    @property
    def ok(self) -> bool:
        return not self.refused

    def errors(self) -> list[str]:
        return list(self.refused)


class WorkApplier:
    """Applies the ManifestWorks of ManagedCluster ``cluster_name`` (its namespace on the hub) to the
    ``managed`` API server, in a thread (:meth:`start`) polling every ``interval`` seconds."""

    def __init__(self, hub: KubeCluster, managed: KubeCluster, cluster_name: str) -> None:
        self.cluster_name = cluster_name
        self._hub = hub.api_client()
        self._managed = managed.api_client()
        # its own discovery cache: the default file is named after the server's address, which a later
        # API server on the same port would inherit
        self._discovery = tempfile.TemporaryDirectory(prefix="work-applier-discovery-")
        self._dynamic: Any = None
        self.applied: dict[str, AppliedWork] = {}
        self.last_error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _resource(self, api_version: str, kind: str) -> Any:
        from kubernetes.dynamic import DynamicClient
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        if self._dynamic is None:
            cache = str(Path(self._discovery.name) / "discovery.json")
            self._dynamic = DynamicClient(self._managed, cache_file=cache)
        try:
            return self._dynamic.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError:
            self._dynamic.resources.invalidate_cache()  # a CRD installed since discovery ran
            return self._dynamic.resources.get(api_version=api_version, kind=kind)

    def _apply(self, work: Mapping[str, Any]) -> AppliedWork:
        meta = work["metadata"]
        result = AppliedWork(meta["name"], meta.get("uid", ""), meta.get("generation", 0))
        for ordinal, manifest in enumerate(
            ((work.get("spec") or {}).get("workload") or {}).get("manifests") or []
        ):
            what = f"manifest {ordinal} ({manifest.get('kind')} {manifest.get('metadata', {}).get('name')})"
            try:
                resource = self._resource(manifest["apiVersion"], manifest["kind"])
                namespace = (
                    (manifest["metadata"].get("namespace") or "default") if resource.namespaced else None
                )
                self._dynamic.server_side_apply(
                    resource,
                    body=copy.deepcopy(dict(manifest)),
                    name=manifest["metadata"]["name"],
                    namespace=namespace,
                    field_manager=FIELD_MANAGER,
                    force_conflicts=True,
                )
            except Exception as exc:
                result.refused.append(f"{what}: {getattr(exc, 'body', None) or exc}")
        return result

    def sync_once(self) -> None:
        from kubernetes import client

        works = client.CustomObjectsApi(self._hub).list_namespaced_custom_object(
            WORK_GROUP, WORK_VERSION, self.cluster_name, WORK_PLURAL
        )
        for work in works.get("items") or []:
            meta = work["metadata"]
            done = self.applied.get(meta["name"])
            if done is None or (done.uid, done.generation) != (meta.get("uid"), meta.get("generation")):
                self.applied[meta["name"]] = self._apply(work)

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
                self.last_error = ""
            except Exception as exc:  # an API server restarting: retry
                self.last_error = f"{type(exc).__name__}: {exc}"
            self._stop.wait(interval)

    def start(self, interval: float = 0.2) -> WorkApplier:
        self._thread = threading.Thread(
            target=self._run, args=(interval,), name=f"work-applier-{self.cluster_name}", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        self._hub.close()
        self._managed.close()
        self._discovery.cleanup()

    def wait_applied(self, name: str, timeout: float = 30.0) -> AppliedWork:
        return poll_until(
            lambda: self.applied.get(name),
            timeout=timeout,
            message=lambda: (
                f"ManifestWork {self.cluster_name}/{name} not applied after {timeout:g}s "
                f"(last error: {self.last_error or 'none'})"
            ),
        )


# --- $(VAR) expansion and mount paths ---------------------------------------------------------------------


def expand(text: str, lookup: Callable[[str], str | None]) -> str:
    """The kubelet's ``$(VAR)`` expansion: ``$(NAME)`` becomes its value when ``lookup`` knows it and
    stays as written otherwise, ``$$`` is one ``$``."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        value = lookup(match.group(1))
        return match.group(0) if value is None else value

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, text)


def rewrite_mount_paths(text: str, mounts: Mapping[str, Path]) -> str:
    """``text`` with every mount path (longest first) that starts a path replaced by its directory:
    ``/etc/x`` in ``--ca=/etc/x/ca.crt``, never in ``/etc/xy`` or ``/a/etc/x``."""
    for mount in sorted(mounts, key=len, reverse=True):
        pattern = re.compile(r"(?<![\w./-])" + re.escape(mount.rstrip("/")) + r"(?![\w.-])")
        text = pattern.sub(lambda _m, t=str(mounts[mount]): t, text)
    return text


# --- names under .svc, for Python programs ------------------------------------------------------------------

SITECUSTOMIZE = '''"""tests/support/localpods.py: a name under .svc is this machine (pods share its loopback and the
tests give each Service its container's port); kubernetes.default.svc is 127.0.0.2, where port 443
leads to the cluster's API server (the programs dial the address they resolved, at the port they
were given)."""

import os as _os
import socket as _socket

_API = ("127.0.0.1", int(_os.environ["%(env)s"]))
_API_NAMES = {"kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}
_real_getaddrinfo, _real_connect, _real_connect_ex = (
    _socket.getaddrinfo, _socket.socket.connect, _socket.socket.connect_ex
)


def _getaddrinfo(host, port, *args, **kwargs):
    name = (host.decode() if isinstance(host, bytes) else host or "").rstrip(".").lower()
    if name in _API_NAMES:
        return _real_getaddrinfo("127.0.0.2", port, *args, **kwargs)
    if name.endswith(".svc") or name.endswith(".svc.cluster.local"):
        return _real_getaddrinfo("127.0.0.1", port, *args, **kwargs)
    return _real_getaddrinfo(host, port, *args, **kwargs)


def _to(address):
    return _API if tuple(address) == ("127.0.0.2", 443) else address


_socket.getaddrinfo = _getaddrinfo
_socket.socket.connect = lambda self, address: _real_connect(self, _to(address))
_socket.socket.connect_ex = lambda self, address: _real_connect_ex(self, _to(address))
'''.replace("%(env)s", API_PORT_ENV)


# --- pods -------------------------------------------------------------------------------------------------


def _program(command: str, bin_dir: Path) -> str:
    for candidate in [Path(command)] if "/" in command else [d / command for d in (bin_dir, *SYSTEM_BIN)]:
        if os.access(candidate, os.X_OK):
            return str(candidate)
    raise RuntimeError(f"program {command!r} is neither a console script in {bin_dir} nor a system one")


class Container:
    """One container's process; its output (stdout and stderr) appended to ``log_path``."""

    def __init__(self, pod: Pod, spec: dict[str, Any]) -> None:
        self.pod = pod
        self.spec = spec
        self.name: str = spec["name"]
        self.log_path = pod.directory / "logs" / f"{self.name}.log"
        self.popen: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}
        self._log_offset = 0

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def start(self) -> None:
        argv, self.env = self.pod.resolve(self.spec)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._log_offset = log.tell()
            log.write(f"=== start {_now()}: {' '.join(argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.pod.directory / "home",
                preexec_fn=die_with_parent if threading.current_thread() is threading.main_thread() else None,
            )

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

        return poll_until(
            found,
            timeout=timeout,
            interval=0.05,
            message=lambda: (
                f"no {event} {match} in {self.pod.name}/{self.name} after {timeout:g}s:\n{self.tail()}"
            ),
        )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.running:
            assert self.popen is not None
            self.popen.send_signal(sig)

    def wait_exit(self, timeout: float = 15.0) -> int:
        assert self.popen is not None, f"container {self.name} never started"
        return self.popen.wait(timeout)

    def stop(self, grace: float) -> None:
        """SIGTERM, SIGKILL after ``grace`` seconds."""
        if self.running:
            assert self.popen is not None
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


class Pod:
    """One replica of a Deployment, run as processes (see the module's docstring for how)."""

    def __init__(self, kubelet: Kubelet, deployment: dict[str, Any]) -> None:
        self.kubelet = kubelet
        self.cluster = kubelet.cluster
        self.deployment_name: str = deployment["metadata"]["name"]
        self.namespace: str = deployment["metadata"]["namespace"]
        template = deployment["spec"]["template"]
        self.spec: dict[str, Any] = template["spec"]
        digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
        self.name = f"{self.deployment_name}-{digest}-{secrets.token_hex(3)[:5]}"
        self.uid = str(uuid.uuid4())
        self.directory = kubelet.directory / self.namespace / self.name
        self.service_account: str = self.spec.get("serviceAccountName") or "default"
        self.mounts: dict[str, dict[str, Path]] = {}  # by container
        self.kubeconfig: Path | None = None
        self.ready = False
        self.init_containers = [Container(self, c) for c in self.spec.get("initContainers") or []]
        self.containers = {c["name"]: Container(self, c) for c in self.spec["containers"]}

    def __repr__(self) -> str:
        return f"Pod({self.cluster.name}:{self.namespace}/{self.name})"

    def _data(self, kind: str, name: str, *, optional: bool) -> dict[str, bytes] | None:
        """A Secret's or ConfigMap's data; a missing one that is not ``optional`` is an error, as the
        kubelet's CreateContainerConfigError."""
        from kubernetes import client

        core = client.CoreV1Api(self.kubelet.api)
        read = core.read_namespaced_secret if kind == "Secret" else core.read_namespaced_config_map
        try:
            obj = self.kubelet.api.sanitize_for_serialization(read(name, self.namespace))
        except Exception as exc:
            if _status_code(exc) == 404 and optional:
                return None
            raise RuntimeError(f"{self}: {kind} {self.namespace}/{name}: {exc}") from None
        if kind == "Secret":
            return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        return {k: v.encode() for k, v in (obj.get("data") or {}).items()}

    def _volumes(self) -> dict[str, Path]:
        """Every volume's directory, Secrets' and ConfigMaps' files written (again)."""
        roots: dict[str, Path] = {}
        for volume in self.spec.get("volumes") or []:
            root = roots[volume["name"]] = self.directory / "volumes" / volume["name"]
            root.mkdir(parents=True, exist_ok=True)
            if "emptyDir" in volume:
                continue
            kind, source = (
                ("Secret", volume["secret"]) if "secret" in volume else ("ConfigMap", volume["configMap"])
            )
            name = source.get("secretName") if kind == "Secret" else source.get("name")
            data = self._data(kind, name, optional=bool(source.get("optional"))) or {}
            for old in root.iterdir():
                old.unlink()
            mode = source.get("defaultMode", 0o644)
            items = source.get("items") or [{"key": key, "path": key} for key in data]
            for item in items:
                target = root / item["path"]
                target.write_bytes(data[item["key"]])
                target.chmod(item.get("mode", mode))
        return roots

    def _identity(self) -> Path | None:
        """The service-account files and kubeconfig; None when no token is mounted."""
        from kubernetes import client

        core = client.CoreV1Api(self.kubelet.api)
        account = core.read_namespaced_service_account(self.service_account, self.namespace)
        automount = self.spec.get("automountServiceAccountToken")
        if automount is False or (automount is None and account.automount_service_account_token is False):
            return None
        answer = core.create_namespaced_service_account_token(
            self.service_account, self.namespace, {"spec": {"expirationSeconds": TOKEN_SECONDS}}
        )
        directory = self.directory / "serviceaccount"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "token").write_text(answer.status.token)
        (directory / "ca.crt").write_bytes(self.cluster.ca_path.read_bytes())
        (directory / "namespace").write_text(self.namespace)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "c",
                    "cluster": {
                        "server": self.cluster.url,
                        "certificate-authority": str(directory / "ca.crt"),
                    },
                }
            ],
            "users": [{"name": "u", "user": {"tokenFile": str(directory / "token")}}],
            "contexts": [
                {"name": "pod", "context": {"cluster": "c", "user": "u", "namespace": self.namespace}}
            ],
            "current-context": "pod",
        }
        (directory / "kubeconfig").write_text(yaml.safe_dump(config))
        return directory

    def _environment(self, container: Mapping[str, Any]) -> dict[str, str]:
        fields = {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "metadata.uid": self.uid,
            "spec.nodeName": socket.gethostname(),
            "spec.serviceAccountName": self.service_account,
            "status.podIP": "127.0.0.1",
            "status.hostIP": "127.0.0.1",
        }
        env: dict[str, str] = {}
        for var in container.get("env") or []:
            source = var.get("valueFrom")
            if source is None:
                env[var["name"]] = expand(var.get("value", ""), env.get)
            elif "fieldRef" in source:
                env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
            else:
                kind = "Secret" if "secretKeyRef" in source else "ConfigMap"
                ref = source["secretKeyRef" if kind == "Secret" else "configMapKeyRef"]
                data = self._data(kind, ref["name"], optional=bool(ref.get("optional"))) or {}
                if ref["key"] in data:
                    env[var["name"]] = data[ref["key"]].decode()
                elif not ref.get("optional"):
                    raise RuntimeError(
                        f"{self}: env {var['name']}: {kind} {ref['name']} has no key {ref['key']!r}"
                    )
        return env

    def resolve(self, container: Mapping[str, Any]) -> tuple[list[str], dict[str, str]]:
        """argv and environment of ``container`` now (Secrets read again)."""
        env = self._environment(container)
        mounts = self.mounts[container["name"]]
        parts = [expand(part, env.get) for part in [*container["command"], *(container.get("args") or [])]]
        argv = [rewrite_mount_paths(part, mounts) for part in parts]
        argv[0] = _program(argv[0], self.kubelet.bin_dir)
        network = self.directory / "pod-network"
        network.mkdir(parents=True, exist_ok=True)
        (network / "sitecustomize.py").write_text(SITECUSTOMIZE)
        home = self.directory / "home"
        home.mkdir(parents=True, exist_ok=True)
        full = {
            "PATH": os.pathsep.join(str(p) for p in (self.kubelet.bin_dir, *SYSTEM_BIN)),
            "HOME": str(home),
            "HOSTNAME": self.name,
            "PYTHONUNBUFFERED": "1",
            **{key: rewrite_mount_paths(value, mounts) for key, value in env.items()},
            "PYTHONPATH": str(network),
            API_PORT_ENV: str(self.cluster.port),
        }
        if self.kubeconfig is not None:
            full["KUBECONFIG"] = str(self.kubeconfig)
        return argv, full

    def start(self) -> Pod:
        """Volumes, identity, init containers to completion, then every container."""
        self.directory.mkdir(parents=True, exist_ok=True)
        roots = self._volumes()
        identity = self._identity()
        self.kubeconfig = identity / "kubeconfig" if identity is not None else None
        for spec in [*(self.spec.get("initContainers") or []), *self.spec["containers"]]:
            mounts = {SERVICE_ACCOUNT_DIR: identity} if identity is not None else {}
            for mount in spec.get("volumeMounts") or []:
                mounts[mount["mountPath"].rstrip("/")] = roots[mount["name"]]
            self.mounts[spec["name"]] = mounts
        for init in self.init_containers:
            init.start()
            code = init.wait_exit(INIT_TIMEOUT)
            assert code == 0, f"{self}: init container {init.name} exited {code}:\n{init.tail()}"
        for container in self.containers.values():
            container.start()
        return self

    def container(self, name: str | None = None) -> Container:
        """The container ``name`` (the only one when there is one)."""
        if name is None:
            (only,) = self.containers.values()
            return only
        return self.containers[name]

    @property
    def grace(self) -> float:
        return float(self.spec.get("terminationGracePeriodSeconds", 30))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        for target in self.containers.values():
            target.kill(sig)
        self.ready = False

    def stop(self, grace: float | None = None) -> None:
        for target in self.containers.values():
            target.stop(self.grace if grace is None else grace)
        self.ready = False

    def restart(self, grace: float | None = None) -> Pod:
        """The containers restarted as a kubelet restarts failed ones: Secret and ConfigMap volumes
        refreshed, emptyDirs kept, environment resolved again, init containers not run again."""
        self.stop(grace)
        self._volumes()
        for target in self.containers.values():
            target.start()
        return self

    def probe(self, target: Container) -> tuple[bool, str]:
        """One run of ``target``'s readiness probe (``httpGet``; none: ready while it runs)."""
        if not target.running:
            return False, f"container {target.name} is not running (exit {target.returncode})"
        get = (target.spec.get("readinessProbe") or {}).get("httpGet")
        if get is None:
            return True, "no readiness probe"
        ports = {p.get("name"): p["containerPort"] for p in target.spec.get("ports") or []}
        port = ports.get(get["port"], get["port"])
        scheme = get.get("scheme", "HTTP").lower()
        url = f"{scheme}://127.0.0.1:{port}{get.get('path', '/')}"
        context = ssl._create_unverified_context() if scheme == "https" else None  # as the kubelet
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as answer:
                return 200 <= answer.status < 400, f"{url}: {answer.status}"
        except urllib.error.HTTPError as exc:
            return False, f"{url}: {exc.code}"
        except (OSError, ssl.SSLError) as exc:
            return False, f"{url}: {exc}"

    def wait_ready(self, timeout: float = 60.0) -> Pod:
        """Every container's readiness probe passes; then the Deployment's status says so."""
        for target in self.containers.values():
            last = ["not probed"]

            def passes(target: Container = target, last: list[str] = last) -> bool:
                ok, last[0] = self.probe(target)
                if not ok and not target.running:
                    raise AssertionError(f"{self}: {last[0]}:\n{target.tail()}")
                return ok

            poll_until(
                passes,
                timeout=timeout,
                interval=0.2,
                message=lambda t=target, last=last: (
                    f"{self}/{t.name} not ready after {timeout:g}s (last probe: {last[0]}):\n{t.tail()}"
                ),
            )
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

    def deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes import client

        try:
            found = client.AppsV1Api(self.api).read_namespaced_deployment(name, namespace)
        except Exception as exc:
            if _status_code(exc) == 404:
                return None
            raise
        return self.api.sanitize_for_serialization(found)

    def wait_deployment(self, namespace: str, name: str, timeout: float = 30.0) -> dict[str, Any]:
        return poll_until(
            lambda: self.deployment(namespace, name),
            timeout=timeout,
            interval=0.05,
            what=f"Deployment {namespace}/{name} on {self.cluster.name}",
        )

    def pod(self, namespace: str, name: str) -> Pod:
        """A pod of Deployment ``namespace/name`` as it is now, not started (:meth:`Pod.start`)."""
        deployment = self.deployment(namespace, name)
        assert deployment is not None, f"no Deployment {namespace}/{name} on {self.cluster.name}"
        pod = Pod(self, deployment)
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
        running = sum(1 for p in pods if any(c.running for c in p.containers.values()))
        ready = sum(1 for p in pods if p.ready and any(c.running for c in p.containers.values()))
        for attempt in range(5):
            current = self.api.sanitize_for_serialization(apps.read_namespaced_deployment(name, namespace))
            current["status"] = {
                **(current.get("status") or {}),
                "observedGeneration": current["metadata"].get("generation", 1),
                "replicas": running,
                "updatedReplicas": running,
                "readyReplicas": ready,
                "availableReplicas": ready,
            }
            try:
                apps.replace_namespaced_deployment_status(name, namespace, current)
                return
            except Exception as exc:
                if _status_code(exc) != 409 or attempt == 4:
                    raise

    def close(self, grace: float | None = None) -> None:
        for pod in self.pods:
            pod.stop(grace)
        self.api.close()
