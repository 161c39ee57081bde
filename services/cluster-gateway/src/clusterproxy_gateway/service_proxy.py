"""The hub's HTTPS endpoint per cluster (upstream cluster-proxy's service-proxy / user-server):
``https://HUB/<cluster>/<path>`` carries ``/<path>`` to ``<cluster>``'s kube-apiserver through the tunnel,
and ``https://HUB/<cluster>/api/v1/namespaces/<ns>/services/[<scheme>:]<svc>[:<port>]/proxy-service/<path>``
to an in-cluster Service the allow-list names (:mod:`.allowlist`). A second listener of the cluster-gateway
(``--service-proxy-listen``): it shares the gateway's tunnel, its hub client, the managed clusters' CAs
and its request loop, answer relay and upgrade relay (:class:`~.proxy.ClusterProxy`).

Who the caller is, from its bearer token (:mod:`.tokenreview`): a token the managed cluster authenticates
goes on **unchanged** (with any ``Impersonate-*`` headers: the managed cluster authorizes them itself, as
upstream's #336 does); a token the hub authenticates is **impersonated** in the managed cluster by the
service proxy's credential there (the hub Secret ``<cluster>/cluster-proxy-service-proxy``, a
ServiceAccount that may only review tokens and access, and impersonate): upstream's naming, and
``Impersonate-User``/``-Group`` of its own honoured only when a SubjectAccessReview in the managed cluster
says that hub identity may impersonate them there. Anything else is 401 with ``WWW-Authenticate: Bearer``.
"""

from __future__ import annotations

import json
import re
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import trio

from clusterproxy_protocol import CLUSTER_NAME, AuditRecord, AuditSink, get_logger

from . import objects
from .allowlist import AllowList, ServiceTarget
from .http import (
    HANDSHAKE_TIMEOUT,
    HTTPConnection,
    IncomingRequest,
    ProtocolFailure,
    header_values,
    serve_requests,
    serve_tls,
)
from .inventory import ClusterToken, HubInventory, TokenNotReady
from .oidc import OIDCVerifier
from .proxy import ClusterProxy, Refused, Traffic, outbound_headers
from .tokenreview import (
    MANAGED,
    Caller,
    Reviewed,
    ReviewFailed,
    TokenAuthenticator,
    review_request,
    reviewed_from,
)

__all__ = ["DEFAULT_CREDENTIAL_SECRET", "FRONTEND", "ServiceProxy", "ServingCertificate", "parse_service"]

FRONTEND = "service-proxy"
DEFAULT_CREDENTIAL_SECRET = "cluster-proxy-service-proxy"
HEALTH_PATHS = frozenset({"/healthz", "/livez", "/readyz"})
TOKENREVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
SUBJECTACCESSREVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
SERVICE_PATH = re.compile(r"^api/v1/namespaces/([^/]+)/services/([^/]+)/proxy-service(/.*)?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# What a caller's request may not carry on: hop-by-hop headers are dropped by outbound_headers; the
# aggregator's identity headers and the gateway's own mean nothing here. A hub caller's Impersonate-*
# are dropped too (its identity is written by the service proxy; the ones it asked for after review).
MANAGED_DROPPED = ("x-remote-", "x-cluster-gateway-")
HUB_DROPPED = ("x-remote-", "x-cluster-gateway-", "impersonate-")
SERVICE_DROPPED = ("x-remote-", "x-cluster-gateway-", "impersonate-")


def parse_service(cluster: str, namespace: str, spec: str) -> ServiceTarget | str:
    """``[scheme:]name[:port]`` (kube-apiserver's services/NAME/proxy form; upstream's default scheme is
    https, its default port the scheme's), or the reason it is not one."""
    parts = spec.split(":")
    scheme = ""
    if len(parts) > 1 and parts[0] in ("http", "https"):
        scheme = parts.pop(0)
    if len(parts) > 2 or not parts[0]:
        return f"{spec!r} is not [http:|https:]SERVICE[:PORT]"
    name, port = parts[0], parts[1] if len(parts) == 2 else ""
    scheme = scheme or "https"
    port = port or ("443" if scheme == "https" else "80")
    if not DNS_LABEL.match(name) or not DNS_LABEL.match(namespace):
        return f"{namespace}/{name} is not a Service name (a DNS label)"
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"port {port!r} is not a number (named ports are not resolved here: give the number)"
    return ServiceTarget(cluster, namespace, name, port, scheme)


class ServingCertificate:
    """The endpoint's TLS: a certificate and key from files, loaded again when the certificate file
    changes (the cert-signer's renewal writes it), looked at before each handshake."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert, self.key = cert, key
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        # HTTP/1.1 only: kubectl and client-go then send upgrades (exec, port-forward) as HTTP/1.1
        self.context.set_alpn_protocols(["http/1.1"])
        self._stamp: tuple[int, int] | None = None
        self.current()

    def current(self) -> ssl.SSLContext:
        try:
            info = self.cert.stat()
            stamp = (info.st_ino, info.st_mtime_ns)
        except OSError:
            return self.context  # keep serving what was loaded
        if stamp != self._stamp:
            self.context.load_cert_chain(str(self.cert), str(self.key))
            self._stamp = stamp
        return self.context


@dataclass
class Note:
    """What one request did, for its log line and audit record."""

    cluster: str = ""
    user: str = ""
    kind: str = ""
    groups: tuple[str, ...] = ()
    target: str = ""
    reason: str = ""
    outcome: str = "ok"  # "refused": answered by the endpoint itself; "failed": broken off
    traffic: Traffic = field(default_factory=Traffic)


class ServiceProxy:
    def __init__(
        self,
        inventory: HubInventory,
        proxy: ClusterProxy,
        allowlist: AllowList,
        *,
        hub_api: Any | None,
        credential_secret: str = DEFAULT_CREDENTIAL_SECRET,
        cache_ttl: float = 10.0,
        cache_size: int = 4096,
        audit: AuditSink | None = None,
        max_body: int = 32 << 20,
        oidc: OIDCVerifier | None = None,
    ) -> None:
        self.inventory = inventory
        self.proxy = proxy
        self.allowlist = allowlist
        self.hub_api = hub_api
        self.credential_secret = credential_secret
        self.audit = audit
        self.max_body = max_body
        self.authenticator = TokenAuthenticator(
            self._managed_review,
            self._hub_review if hub_api is not None else None,
            oidc=oidc,
            ttl=cache_ttl,
            max_entries=cache_size,
        )
        self.log = get_logger("cluster-gateway")

    # connections
    async def serve(self, listeners: list[trio.SocketListener], serving: ServingCertificate) -> None:
        await serve_tls(listeners, serving.current, self.handle_connection)

    async def handle_connection(self, stream: trio.SSLStream[Any]) -> None:
        """One client connection after its TLS handshake (``serve_tls`` closes it)."""
        try:
            await serve_requests(
                HTTPConnection(stream, h11.SERVER),
                self.handle_request,
                max_body=self.max_body,
                too_large=lambda reason: objects.status(413, reason),
            )
        except Exception:
            self.log.exception("service_proxy_connection_failed")  # this connection only

    # one request
    async def handle_request(self, http: HTTPConnection, request: IncomingRequest) -> None:
        if request.path in HEALTH_PATHS:
            await http.respond(200, b"ok", "text/plain; charset=utf-8")
            return
        started_wall, started = time.time(), time.monotonic()
        note = Note(target=request.path)
        status = 0
        try:
            status = await self._route(http, request, note)
        except Refused as exc:
            status, note.reason, note.outcome = exc.status, exc.message, "refused"
            self.log.warning(
                "service_proxy_refused", cluster=note.cluster, status=exc.status, reason=exc.message
            )
            headers = [("WWW-Authenticate", 'Bearer realm="cluster-proxy"')] if exc.status == 401 else []
            await http.respond(exc.status, _json(objects.status(exc.status, exc.message)), headers=headers)
        except (ProtocolFailure, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            note.reason, note.outcome = note.reason or f"connection ended: {exc}", "failed"
            raise
        except Exception as exc:
            self.log.exception("service_proxy_failed", method=request.method, path=request.path)
            if http.conn.our_state is not h11.SEND_RESPONSE:
                raise trio.BrokenResourceError(f"request failed after its answer started: {exc!r}") from None
            status, note.reason = 500, f"the service proxy failed: {type(exc).__name__}: {exc}"
            note.outcome = "failed"
            await http.respond(500, _json(objects.status(500, note.reason)))
        finally:
            elapsed = time.monotonic() - started
            self.log.info(
                "service_proxy_request",
                method=request.method,
                path=request.path,
                cluster=note.cluster,
                user=note.user,
                source=note.kind,
                status=status,
                ms=round(elapsed * 1000, 1),
            )
            self._audit(request, note, status, started_wall, started_wall + elapsed)

    def _audit(self, request: IncomingRequest, note: Note, status: int, start: float, end: float) -> None:
        """One record per request (docs/protocol.md, "Audit records"): the token's user (never the
        token), the path as the target, what the endpoint carried each way."""
        if self.audit is None:
            return
        self.audit.write(
            AuditRecord(
                start=start,
                end=end,
                client=note.user,
                client_kind="token",
                cluster=note.cluster or None,
                target=note.target,
                frontend=FRONTEND,
                outcome=note.outcome if status else "failed",
                status=status or None,
                reason=note.reason or None,
                bytes_to_target=note.traffic.to_target,
                bytes_to_client=note.traffic.to_client,
                groups=note.groups,
                method=request.method,
            )
        )

    async def _route(self, http: HTTPConnection, request: IncomingRequest, note: Note) -> int:
        cluster, _, rest = request.path.lstrip("/").partition("/")
        if not cluster or not CLUSTER_NAME.match(cluster):
            raise Refused(
                404, f"no such path {request.path!r}: the service proxy serves https://HOST/<cluster>/<path>"
            )
        note.cluster = cluster
        token = _bearer(request)
        if token is None:
            raise Refused(
                401, "no bearer token: send Authorization: Bearer <a token of the managed cluster or the hub>"
            )
        entry = await trio.to_thread.run_sync(self.inventory.cluster, cluster)
        if entry is None:
            raise Refused(404, objects.not_found_message(cluster))
        credential = await self._credential(cluster)
        why: list[str] = []
        try:
            caller = await self.authenticator.authenticate(cluster, token, why)
        except ReviewFailed as exc:
            raise Refused(exc.status, exc.message) from None
        if caller is None:
            # the OIDC verifier's reason (an expired token, another audience) tells its owner what to fix
            raise Refused(
                401,
                f"the token is valid neither in cluster {cluster!r} nor on the hub (a TokenReview in each "
                f"said so{''.join('; ' + reason for reason in why)}); send a token of either",
            )
        note.user, note.kind, note.groups = caller.user, caller.source, caller.groups
        service = SERVICE_PATH.match(rest)
        if service is not None:
            return await self._service(http, request, note, credential, service)
        path = "/" + rest
        if caller.source == MANAGED:
            headers = outbound_headers(request, MANAGED_DROPPED)
            headers.append((b"Authorization", f"Bearer {token}".encode()))
        else:
            headers = outbound_headers(request, HUB_DROPPED)
            headers.append((b"Authorization", f"Bearer {credential.token}".encode()))
            headers += await self._impersonation(request, cluster, credential, caller)
        headers.append((b"Host", credential.server_name.encode()))
        tls = await self.proxy.open_kube(cluster, credential, self.credential_secret)
        try:
            return await self.proxy.exchange(
                http,
                request,
                cluster,
                path,
                headers,
                tls,
                self._failer(http, cluster, note),
                on_unauthorized=lambda: self.inventory.forget_token(cluster, self.credential_secret),
                traffic=note.traffic,
            )
        finally:
            await trio.aclose_forcefully(tls)

    def _failer(self, http: HTTPConnection, cluster: str, note: Note) -> Any:
        async def fail(code: int, message: str) -> int:
            note.reason, note.outcome = message, "refused"
            self.log.warning("service_proxy_refused", cluster=cluster, status=code, reason=message)
            await http.respond_json(code, objects.status(code, message, name=cluster))
            return code

        return fail

    async def _credential(self, cluster: str) -> ClusterToken:
        try:
            return await trio.to_thread.run_sync(self.inventory.token, cluster, self.credential_secret)
        except TokenNotReady as exc:
            raise Refused(
                503, f"{exc} (the service proxy's own credential in the cluster: docs/cluster-gateway.md)"
            ) from None

    # authentication
    async def _managed_review(self, cluster: str, token: str) -> Reviewed | None:
        credential = await self._credential(cluster)
        try:
            status, answer = await self.proxy.request_json(
                cluster, credential, self.credential_secret, "POST", TOKENREVIEWS, review_request(token)
            )
        except Refused as exc:
            raise ReviewFailed(exc.status, exc.message) from None
        if status in (200, 201):
            return reviewed_from(answer)
        raise ReviewFailed(503, self._refused_credential(cluster, "create tokenreviews", status, answer))

    def _refused_credential(self, cluster: str, verb: str, status: int, answer: Any) -> str:
        message = (answer or {}).get("message", "") if isinstance(answer, dict) else ""
        return (
            f"cluster {cluster!r} refused the service proxy's {verb} ({status}: {message}); its credential is "
            f"Secret {cluster}/{self.credential_secret} on the hub, whose ServiceAccount needs the ClusterRole "
            "cluster-proxy-service-proxy the addon renders in the cluster"
        )

    async def _hub_review(self, token: str) -> Reviewed | None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        assert self.hub_api is not None  # the reviewer is set up only with a hub API (__init__)
        api = client.AuthenticationV1Api(self.hub_api)
        try:
            answer = await trio.to_thread.run_sync(
                api.create_token_review,  # type: ignore[arg-type]  # given a dict: its validate_call (pydantic) makes the V1TokenReview
                review_request(token),
            )
        except ApiException as exc:
            raise ReviewFailed(
                503,
                f"the hub's TokenReview failed ({exc.status} {exc.reason}); the gateway needs create on "
                "tokenreviews on the hub (deploy/kustomize/base/cluster-gateway/rbac.yaml)",
            ) from None
        return reviewed_from(self.hub_api.sanitize_for_serialization(answer))

    # impersonation asked for by a hub caller
    async def _impersonation(
        self, request: IncomingRequest, cluster: str, credential: ClusterToken, caller: Caller
    ) -> list[tuple[bytes, bytes]]:
        """The hub caller's identity as impersonation headers; or, when it asks to impersonate someone
        (``Impersonate-User``/``-Group``), that identity, once cluster's RBAC allows the caller to."""
        asked_user = header_values(request.headers, "Impersonate-User")
        asked_groups = header_values(request.headers, "Impersonate-Group")
        other = sorted(
            {
                k.decode("latin-1")
                for k, _ in request.headers
                if k.lower().startswith(b"impersonate-")
                and k.lower() not in (b"impersonate-user", b"impersonate-group")
            }
        )
        if not asked_user and not asked_groups and not other:
            return [(b"Impersonate-User", caller.user.encode("latin-1"))] + [
                (b"Impersonate-Group", g.encode("latin-1")) for g in caller.groups
            ]
        if other:
            raise Refused(
                403,
                f"{', '.join(other)}: a hub identity may impersonate a user and groups only (the service "
                "proxy's credential in the cluster may impersonate nothing else)",
            )
        if len(asked_user) != 1:
            raise Refused(
                400, "Impersonate-Group needs exactly one Impersonate-User (as kube-apiserver wants)"
            )
        user = asked_user[0]
        checks: list[tuple[str, str, str]] = []  # (resource, namespace, name)
        if user.startswith("system:serviceaccount:") and user.count(":") == 3:
            _, _, namespace, name = user.split(":")
            checks.append(("serviceaccounts", namespace, name))
        else:
            checks.append(("users", "", user))
        checks += [("groups", "", group) for group in asked_groups]
        for resource, namespace, name in checks:
            await self._may_impersonate(cluster, credential, caller, resource, namespace, name)
        self.log.info(
            "service_proxy_impersonating", cluster=cluster, caller=caller.user, user=user, groups=asked_groups
        )
        return [(b"Impersonate-User", user.encode("latin-1"))] + [
            (b"Impersonate-Group", g.encode("latin-1")) for g in asked_groups
        ]

    async def _may_impersonate(
        self, cluster: str, credential: ClusterToken, caller: Caller, resource: str, namespace: str, name: str
    ) -> None:
        """A SubjectAccessReview in ``cluster``: may ``caller`` impersonate ``resource``/``name`` there?"""
        attributes = {"verb": "impersonate", "resource": resource, "name": name}
        if namespace:
            attributes["namespace"] = namespace
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {"user": caller.user, "groups": list(caller.groups), "resourceAttributes": attributes},
        }
        status, answer = await self.proxy.request_json(
            cluster, credential, self.credential_secret, "POST", SUBJECTACCESSREVIEWS, review
        )
        if status not in (200, 201):
            raise Refused(
                503, self._refused_credential(cluster, "create subjectaccessreviews", status, answer)
            )
        result = (answer or {}).get("status") or {}
        if result.get("allowed") and not result.get("denied"):
            return
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        why = result.get("reason") or "no RBAC rule of the cluster allows it"
        raise Refused(
            403,
            f'User "{caller.user}" ({caller.source} user "{caller.hub_user}") cannot impersonate resource "{resource}" '
            f'"{name}" in API group "" {scope} in cluster {cluster!r}: {why} (a SubjectAccessReview there said so)',
        )

    # in-cluster services
    async def _service(
        self, http: HTTPConnection, request: IncomingRequest, note: Note, credential: ClusterToken, match: Any
    ) -> int:
        namespace, spec, tail = match.group(1), match.group(2), match.group(3) or "/"
        target = parse_service(note.cluster, namespace, spec)
        if isinstance(target, str):
            raise Refused(400, target)
        refusal = await trio.to_thread.run_sync(self.allowlist.decide, target)
        if refusal is not None:
            raise Refused(403, refusal)
        host = f"{target.service}.{target.namespace}.svc"
        what = f"service {target.namespace}/{target.service}:{target.port} of cluster {note.cluster!r}"
        stream: Any = await self.proxy.dial(note.cluster, host, int(target.port), what)
        try:
            if target.protocol == "https":
                # checked against the managed cluster's CA (its serving certificates' usual signer)
                stream = trio.SSLStream(
                    stream, self.proxy.client_context(credential.ca_pem), server_hostname=host
                )
                try:
                    with trio.fail_after(HANDSHAKE_TIMEOUT):
                        await stream.do_handshake()
                except (trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError) as exc:
                    raise Refused(
                        502, f"TLS with {what} failed: {exc} (checked with the cluster's CA)"
                    ) from None
            headers = outbound_headers(request, SERVICE_DROPPED)  # the caller's token stays here
            headers.append((b"Host", f"{host}:{target.port}".encode()))
            return await self.proxy.exchange(
                http,
                request,
                note.cluster,
                tail,
                headers,
                stream,
                self._failer(http, note.cluster, note),
                traffic=note.traffic,
                what=what,
            )
        finally:
            await trio.aclose_forcefully(stream)


def _bearer(request: IncomingRequest) -> str | None:
    scheme, _, token = request.header("authorization").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _json(value: Any) -> bytes:
    return (json.dumps(value) + "\n").encode()
