"""A small, synchronous REST client for the Kubernetes API: get, list, watch, server-side apply,
status replace, delete, for any resource (built-in or custom) named by a :class:`Resource`.

Why not the generated ``kubernetes`` client APIs: the manager works with a dozen resources, half of
them custom (OCM, the MPC), as plain dicts; watches need exact control over resourceVersion, 410
Gone and reconnects; server-side apply needs its own content type. The ``kubernetes`` package still
does what it is good at: reading a kubeconfig or the in-cluster configuration (client certificates,
tokens, their refresh), and the :class:`kubernetes.client.CoreV1Api` the cert-signer's Secrets
store takes (:meth:`Kube.core_v1`).

Errors are :class:`KubeError` subclasses whose message says what to do: :class:`Forbidden` names the
verb, resource and namespace the manager's RBAC lacks, :class:`NotFound` with ``missing_crd`` names
the CRD to install, :class:`Unavailable` is an API server that cannot be reached (retried by the
callers with backoff).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import urllib3

__all__ = [
    "ADDON_DEPLOYMENT_CONFIG",
    "CLUSTER_MANAGEMENT_ADDON",
    "CRD",
    "DEPLOYMENT",
    "FIELD_MANAGER",
    "MANAGED_CLUSTER",
    "MANAGED_CLUSTER_ADDON",
    "MANAGED_PROXY_CONFIGURATION",
    "MANIFEST_WORK",
    "NAMESPACE",
    "NETWORK_POLICY",
    "RBAC_FILE",
    "ROLE",
    "ROLE_BINDING",
    "SECRET",
    "SERVICE",
    "SERVICE_ACCOUNT",
    "Conflict",
    "Forbidden",
    "Gone",
    "Invalid",
    "Kube",
    "KubeError",
    "NotFound",
    "Resource",
    "Unavailable",
]

FIELD_MANAGER = "cluster-proxy-addon-manager"
RBAC_FILE = "deploy/kustomize/base/addon-manager/rbac.yaml"


@dataclass(frozen=True)
class Resource:
    """One API resource: ``group`` ("" for the core group), ``version``, ``plural``, ``kind``."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    #: the file (or command) that installs its CRD, for the "CRD missing" error
    crd_source: str = ""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{self.group}"

    @property
    def describe(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str = "") -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{quote(namespace, safe='')}"
        base += f"/{self.plural}"
        if name:
            base += f"/{quote(name, safe='')}"
            if subresource:
                base += f"/{subresource}"
        return base


_OCM_CRDS = (
    "Open Cluster Management's CRDs (installed by OCM's cluster-manager; for tests: tests/kube/crds/ocm)"
)
MANAGED_PROXY_CONFIGURATION = Resource(
    "proxy.open-cluster-management.io",
    "v1alpha1",
    "managedproxyconfigurations",
    "ManagedProxyConfiguration",
    False,
    "kubectl apply -f deploy/kustomize/base/crds/proxy.open-cluster-management.io_managedproxyconfigurations.yaml",
)
MANAGED_CLUSTER = Resource(
    "cluster.open-cluster-management.io", "v1", "managedclusters", "ManagedCluster", False, _OCM_CRDS
)
MANAGED_CLUSTER_ADDON = Resource(
    "addon.open-cluster-management.io",
    "v1alpha1",
    "managedclusteraddons",
    "ManagedClusterAddOn",
    True,
    _OCM_CRDS,
)
CLUSTER_MANAGEMENT_ADDON = Resource(
    "addon.open-cluster-management.io",
    "v1alpha1",
    "clustermanagementaddons",
    "ClusterManagementAddOn",
    False,
    _OCM_CRDS,
)
ADDON_DEPLOYMENT_CONFIG = Resource(
    "addon.open-cluster-management.io",
    "v1alpha1",
    "addondeploymentconfigs",
    "AddOnDeploymentConfig",
    True,
    _OCM_CRDS,
)
MANIFEST_WORK = Resource(
    "work.open-cluster-management.io", "v1", "manifestworks", "ManifestWork", True, _OCM_CRDS
)
DEPLOYMENT = Resource("apps", "v1", "deployments", "Deployment", True)
SERVICE = Resource("", "v1", "services", "Service", True)
SECRET = Resource("", "v1", "secrets", "Secret", True)
SERVICE_ACCOUNT = Resource("", "v1", "serviceaccounts", "ServiceAccount", True)
NAMESPACE = Resource("", "v1", "namespaces", "Namespace", False)
NETWORK_POLICY = Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True)
ROLE = Resource("rbac.authorization.k8s.io", "v1", "roles", "Role", True)
ROLE_BINDING = Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True)
CRD = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False)


# --- errors --------------------------------------------------------------------------------------------


class KubeError(Exception):
    """An API request failed; ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, *, status: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class NotFound(KubeError):
    """404. ``missing_crd`` is set when the resource type itself is unknown to the API server."""

    missing_crd: Resource | None = None


class Conflict(KubeError):
    """409: a stale resourceVersion (retry from a fresh read) or a name that exists."""


class Forbidden(KubeError):
    """403: the manager's RBAC does not allow the request (the message names verb and resource)."""


class Gone(KubeError):
    """410: the watch's resourceVersion is too old; list again."""


class Invalid(KubeError):
    """422 or 400: the API server refused the object (a bug in what the manager renders)."""


class Unavailable(KubeError):
    """No answer, or a 5xx/429: the API server is down, restarting or overloaded. Retried."""


def _verb(method: str, *, watch: bool = False, listing: bool = False) -> str:
    if watch:
        return "watch"
    if listing:
        return "list"
    return {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[method]


def _error(
    status: int,
    body: bytes,
    *,
    method: str,
    resource: Resource,
    namespace: str | None,
    name: str | None,
    watch: bool = False,
    listing: bool = False,
    subresource: str = "",
) -> KubeError:
    try:
        answer = json.loads(body or b"{}")
    except ValueError:
        answer = {}
    message = str(answer.get("message") or body[:300].decode(errors="replace") or f"HTTP {status}")
    reason = str(answer.get("reason") or "")
    verb = _verb(method, watch=watch, listing=listing)
    what = resource.describe + (f"/{subresource}" if subresource else "")
    where = f" in namespace {namespace!r}" if namespace and resource.namespaced else ""
    target = f" {name!r}" if name else ""
    if status == 403:
        return Forbidden(
            f"forbidden: the addon-manager may not {verb} {what}{target}{where} ({message}); grant "
            f"'{verb}' on '{what}'{where} to its ServiceAccount ({RBAC_FILE} holds every rule it needs)",
            status=status,
            reason=reason,
        )
    if status == 404:
        error = NotFound(f"{resource.kind}{target}{where} not found: {message}", status=status, reason=reason)
        # A missing object answers with details naming it; a missing type answers a bare 404 page.
        if not answer.get("details") and resource.group and resource.crd_source:
            error = NotFound(
                f"the API server does not serve {resource.kind} ({resource.api_version}): the CRD "
                f"{resource.crd_name} is not installed; install it: {resource.crd_source}",
                status=status,
                reason=reason,
            )
            error.missing_crd = resource
        return error
    if status == 409:
        return Conflict(f"{verb} {what}{target}{where}: conflict: {message}", status=status, reason=reason)
    if status == 410:
        return Gone(f"{verb} {what}{where}: {message}", status=status, reason=reason)
    if status in (400, 422):
        return Invalid(
            f"the API server refused to {verb} {what}{target}{where}: {message}", status=status, reason=reason
        )
    if status == 429 or status >= 500:
        return Unavailable(f"{verb} {what}{where}: HTTP {status}: {message}", status=status, reason=reason)
    return KubeError(f"{verb} {what}{target}{where}: HTTP {status}: {message}", status=status, reason=reason)


# --- the client ----------------------------------------------------------------------------------------


class Kube:
    """Requests to one API server. Thread-safe (urllib3's pool is); every method blocks."""

    def __init__(self, configuration: Any, *, timeout: float = 30.0, pool_size: int = 32) -> None:
        self.configuration = configuration
        self.host = str(configuration.host).rstrip("/")
        self.timeout = timeout
        kwargs: dict[str, Any] = {"maxsize": pool_size, "block": False}
        if self.host.startswith("https://"):
            if configuration.verify_ssl:
                kwargs["cert_reqs"] = ssl.CERT_REQUIRED
                if configuration.ssl_ca_cert:
                    kwargs["ca_certs"] = configuration.ssl_ca_cert
            else:
                kwargs["cert_reqs"] = ssl.CERT_NONE
            if configuration.cert_file:
                kwargs["cert_file"] = configuration.cert_file
            if configuration.key_file:
                kwargs["key_file"] = configuration.key_file
            server_name = getattr(configuration, "tls_server_name", None)
            if server_name:
                kwargs["server_hostname"] = server_name
        # No urllib3 retries: the callers own retrying (a watch must not silently resend).
        self.pool = urllib3.PoolManager(retries=False, **kwargs)
        self._core_v1: Any = None

    def core_v1(self) -> Any:
        """A ``kubernetes.client.CoreV1Api`` on the same configuration (for the signer's store)."""
        if self._core_v1 is None:
            from kubernetes import client

            self._core_v1 = client.CoreV1Api(client.ApiClient(self.configuration))
        return self._core_v1

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        for setting in self.configuration.auth_settings().values():
            if setting.get("in") == "header" and setting.get("value"):
                headers[str(setting["key"])] = str(setting["value"])
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def _open(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str | None = None,
        timeout: urllib3.Timeout | float | None = None,
        stream: bool = False,
    ) -> urllib3.BaseHTTPResponse:
        url = self.host + path
        if query:
            url += "?" + urlencode({k: v for k, v in query.items() if v is not None})
        data = None if body is None else json.dumps(body).encode()
        try:
            return self.pool.request(
                method,
                url,
                body=data,
                headers=self._headers(content_type or ("application/json" if data else None)),
                timeout=timeout if timeout is not None else self.timeout,
                preload_content=not stream,
                redirect=False,
            )
        except urllib3.exceptions.HTTPError as exc:
            raise Unavailable(f"{method} {self.host}{path}: the API server did not answer: {exc}") from None

    def request(
        self,
        method: str,
        resource: Resource,
        *,
        namespace: str | None = None,
        name: str | None = None,
        subresource: str = "",
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        path = resource.path(namespace, name, subresource)
        response = self._open(method, path, query=query, body=body, content_type=content_type)
        if response.status >= 300:
            raise _error(
                response.status,
                response.data,
                method=method,
                resource=resource,
                namespace=namespace,
                name=name,
                listing=method == "GET" and not name,
                subresource=subresource,
            )
        try:
            answer: dict[str, Any] = json.loads(response.data or b"{}")
        except ValueError:
            raise Unavailable(
                f"{method} {path}: the API server answered something that is not JSON"
            ) from None
        return answer

    # -- reads --------------------------------------------------------------------------------------

    def get(self, resource: Resource, name: str, namespace: str | None = None) -> dict[str, Any]:
        return self.request("GET", resource, namespace=namespace, name=name)

    def get_or_none(
        self, resource: Resource, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        try:
            return self.get(resource, name, namespace)
        except NotFound as exc:
            if exc.missing_crd is not None:
                raise
            return None

    def list(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> tuple[list[dict[str, Any]], str]:
        """Every object (paged) and the list's resourceVersion to watch from."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            answer = self.request(
                "GET",
                resource,
                namespace=namespace,
                query={
                    "labelSelector": label_selector,
                    "fieldSelector": field_selector,
                    "limit": 500,
                    "continue": token,
                },
            )
            for item in answer.get("items") or []:
                item.setdefault("apiVersion", resource.api_version)
                item.setdefault("kind", resource.kind)
                items.append(item)
            token = (answer.get("metadata") or {}).get("continue") or None
            if not token:
                return items, str((answer.get("metadata") or {}).get("resourceVersion") or "")

    def watch(
        self,
        resource: Resource,
        namespace: str | None,
        resource_version: str,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        timeout_seconds: int = 60,
    ) -> Iterator[dict[str, Any]]:
        """Watch events (``{"type", "object"}``) from ``resource_version`` until the server ends the
        watch (after ``timeout_seconds``). :class:`Gone` when the version is too old (relist);
        :class:`Unavailable` when the connection fails."""
        path = resource.path(namespace)
        query = {
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": timeout_seconds,
            "labelSelector": label_selector,
            "fieldSelector": field_selector,
        }
        # A read timeout well past the server's own end of the watch: a connection that went silent
        # (a dead peer) is noticed without a bookmark's help.
        timeout = urllib3.Timeout(connect=10.0, read=timeout_seconds + 30.0)
        response = self._open("GET", path, query=query, timeout=timeout, stream=True)
        try:
            if response.status >= 300:
                raise _error(
                    response.status,
                    response.read(),
                    method="GET",
                    resource=resource,
                    namespace=namespace,
                    name=None,
                    watch=True,
                )
            buffer = b""
            try:
                for chunk in response.stream(65536, decode_content=True):
                    buffer += chunk
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        if not line.strip():
                            continue
                        try:
                            event = json.loads(line)
                        except ValueError:
                            raise Unavailable(f"watch {resource.describe}: a line that is not JSON") from None
                        if event.get("type") == "ERROR":
                            status = event.get("object") or {}
                            code = int(status.get("code") or 0)
                            raise _error(
                                code or 500,
                                json.dumps(status).encode(),
                                method="GET",
                                resource=resource,
                                namespace=namespace,
                                name=None,
                                watch=True,
                            )
                        yield event
            except urllib3.exceptions.HTTPError as exc:
                raise Unavailable(f"watch {resource.describe}: the connection failed: {exc}") from None
        finally:
            response.release_conn()

    # -- writes -------------------------------------------------------------------------------------

    def apply(self, resource: Resource, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` (with apiVersion, kind, metadata.name) as this manager, forcing
        ownership of the fields it sets: the manager is the one writer of what it renders."""
        metadata = obj["metadata"]
        return self.request(
            "PATCH",
            resource,
            namespace=metadata.get("namespace"),
            name=metadata["name"],
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    def create(self, resource: Resource, obj: Mapping[str, Any]) -> dict[str, Any]:
        metadata = obj["metadata"]
        return self.request(
            "POST",
            resource,
            namespace=metadata.get("namespace"),
            query={"fieldManager": FIELD_MANAGER},
            body=obj,
        )

    def replace_status(self, resource: Resource, obj: Mapping[str, Any]) -> dict[str, Any]:
        """PUT the status subresource; ``obj`` carries the resourceVersion it was read at, so a
        concurrent change answers :class:`Conflict` (read again and retry)."""
        metadata = obj["metadata"]
        return self.request(
            "PUT",
            resource,
            namespace=metadata.get("namespace"),
            name=metadata["name"],
            subresource="status",
            query={"fieldManager": FIELD_MANAGER},
            body=obj,
        )

    def delete(self, resource: Resource, name: str, namespace: str | None = None) -> bool:
        """Delete (background propagation); False when it was already gone."""
        try:
            self.request(
                "DELETE",
                resource,
                namespace=namespace,
                name=name,
                body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            )
        except NotFound as exc:
            if exc.missing_crd is not None:
                raise
            return False
        return True
