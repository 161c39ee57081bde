"""The aggregated API server: TLS, who may talk to it, and what each path answers.

Only the hub kube-apiserver's aggregator talks to the gateway. It has already authenticated the caller
and authorized the request with the hub's RBAC (``clustergateways`` get/list/watch, ``clustergateways/proxy``
for the subresource); it presents its front-proxy client certificate (``--proxy-client-cert-file``) and
names the caller in the requestheader headers (``X-Remote-User``, ``X-Remote-Group``). The gateway
checks that certificate against the requestheader CA and allowed names and trusts the headers of no one
else: any other client gets 401 (health paths excepted).
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import h11
import trio
from cryptography import x509
from cryptography.x509.oid import NameOID

from clusterproxy_protocol import get_logger

from . import objects
from .http import (
    HTTPConnection,
    IncomingRequest,
    ProtocolFailure,
    cancel_when_closed,
    header_values,
    incoming,
    serve_requests,
    serve_tls,
)
from .inventory import HubInventory, RequestHeaderConfig
from .proxy import ClusterProxy

__all__ = ["GatewayServer", "Identity", "serving_context"]

PREFIX = f"/apis/{objects.GROUP}/{objects.VERSION}/{objects.RESOURCE}"
HEALTH_PATHS = frozenset({"/healthz", "/livez", "/readyz"})
# The aggregator downloads every APIService's OpenAPI documents; empty ones say "no schema" (kubectl then
# validates nothing client-side for these kinds) instead of an error in the hub's log every minute.
OPENAPI: dict[str, dict[str, Any]] = {
    "/openapi/v2": {
        "swagger": "2.0",
        "info": {"title": "cluster-gateway", "version": "v1alpha1"},
        "paths": {},
    },
    "/openapi/v3": {"paths": {}},
}


@dataclass(frozen=True)
class Identity:
    """The hub user the aggregator names (point 4, impersonation, will carry it to the cluster)."""

    user: str
    groups: tuple[str, ...]
    extra: dict[str, tuple[str, ...]]


def describe_hub_error(exc: Exception) -> str:
    """A failed call of the hub's API in words (the kubernetes client's ApiException carries the hub's
    status and its Status message), anything else as its type and text."""
    status = getattr(exc, "status", None)
    if status is None:
        return f"{type(exc).__name__}: {exc}"
    body = getattr(exc, "body", None) or ""
    try:
        message = json.loads(body).get("message") or body
    except (ValueError, AttributeError):
        message = body
    hint = (
        " (the gateway's RBAC on the hub: deploy/kustomize/base/cluster-gateway/rbac.yaml)"
        if status == 403
        else ""
    )
    return f"reading the hub failed ({status} {getattr(exc, 'reason', '')}): {message}{hint}"


def serving_context(cert: Path, key: Path, requestheader: RequestHeaderConfig) -> ssl.SSLContext:
    """TLS for the aggregator: the gateway's serving certificate; a client certificate is asked for and
    verified against the requestheader CA (optional at TLS level so that probes of /healthz work)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert), str(key))
    context.verify_mode = ssl.CERT_OPTIONAL
    context.load_verify_locations(cadata=requestheader.client_ca_pem.decode())
    context.set_alpn_protocols(["http/1.1"])  # the aggregator then speaks HTTP/1.1 (watch streams, upgrades)
    return context


def _common_name(der: bytes | None) -> str | None:
    if not der:
        return None
    names = x509.load_der_x509_certificate(der).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


class GatewayServer:
    def __init__(
        self,
        inventory: HubInventory,
        proxy: ClusterProxy,
        requestheader: RequestHeaderConfig,
        *,
        watch_interval: float = 1.0,
        max_body: int = 32 << 20,
    ) -> None:
        self.inventory = inventory
        self.proxy = proxy
        self.requestheader = requestheader
        self.watch_interval = watch_interval
        self.max_body = max_body
        self.log = get_logger("cluster-gateway")

    # connections
    async def serve(self, listeners: list[trio.SocketListener], context: ssl.SSLContext) -> None:
        await serve_tls(listeners, lambda: context, self.handle_connection)

    async def handle_connection(self, stream: trio.SSLStream[Any]) -> None:
        """One aggregator connection after its TLS handshake (``serve_tls`` closes it)."""
        peer = _common_name(stream.getpeercert(binary_form=True))
        http = HTTPConnection(stream, h11.SERVER)

        async def handle(http: HTTPConnection, request: IncomingRequest) -> None:
            await self.handle_request(http, request, peer)

        try:
            await serve_requests(
                http, handle, max_body=self.max_body, too_large=lambda reason: objects.status(413, reason)
            )
        except Exception:
            self.log.exception("connection_failed", peer=peer)  # this connection only, never the server

    # kept for the tests that drive one exchange by hand
    _request = staticmethod(incoming)

    # who is asking
    def authenticate(self, request: IncomingRequest, peer: str | None) -> Identity | str:
        """The caller named by a trusted aggregator, or the reason the request is refused."""
        config = self.requestheader
        if peer is None:
            return (
                "no client certificate: only the hub kube-apiserver's aggregator (its front-proxy client "
                "certificate) may call the cluster-gateway; call it through the hub, e.g. kubectl get --raw "
                f"{PREFIX}/CLUSTER/proxy/healthz"
            )
        if config.allowed_names and peer not in config.allowed_names:
            return (
                f"client certificate CN={peer!r} is not one of the requestheader allowed names "
                f"{list(config.allowed_names)}"
            )
        user = next((v for h in config.username_headers for v in header_values(request.headers, h)), "")
        if not user:
            return f"the aggregator named no user ({', '.join(config.username_headers)} missing)"
        groups = tuple(v for h in config.group_headers for v in header_values(request.headers, h))
        extra: dict[str, list[str]] = {}
        for key, value in request.headers:
            name = key.decode("latin-1").lower()
            for prefix in config.extra_headers_prefixes:
                if name.startswith(prefix.lower()):
                    extra.setdefault(name[len(prefix) :], []).append(value.decode("latin-1"))
        return Identity(user, groups, {k: tuple(v) for k, v in extra.items()})

    # routing
    async def handle_request(self, http: HTTPConnection, request: IncomingRequest, peer: str | None) -> None:
        started = time.monotonic()
        if request.path in HEALTH_PATHS:
            await http.respond(200, b"ok", "text/plain; charset=utf-8")
            return
        identity = self.authenticate(request, peer)
        if isinstance(identity, str):
            self.log.warning("request_unauthenticated", path=request.path, peer=peer, reason=identity)
            await http.respond_json(401, objects.status(401, identity))
            return
        try:
            status = await self._route(http, request, identity)
        except (ProtocolFailure, trio.BrokenResourceError, trio.ClosedResourceError):
            raise
        except Exception as exc:
            # a failed read of the hub (or a bug) costs this request a 500, never the server
            self.log.exception("request_failed", method=request.method, path=request.path)
            if http.conn.our_state is not h11.SEND_RESPONSE:
                raise trio.BrokenResourceError(f"request failed after its answer started: {exc!r}") from None
            status = 500
            await http.respond_json(
                500, objects.status(500, f"the cluster-gateway failed: {describe_hub_error(exc)}")
            )
        self.log.info(
            "request",
            method=request.method,
            path=request.path,
            user=identity.user,
            status=status,
            ms=round((time.monotonic() - started) * 1000, 1),
        )

    async def _route(self, http: HTTPConnection, request: IncomingRequest, identity: Identity) -> int:
        path = request.path.rstrip("/") or "/"
        documents: dict[str, Callable[[], dict[str, Any]]] = {
            "/apis": objects.api_group_list,
            f"/apis/{objects.GROUP}": objects.api_group,
            f"/apis/{objects.GROUP}/{objects.VERSION}": objects.api_resource_list,
        }
        if path in documents:
            return await self._document(http, request, documents[path])
        if path in OPENAPI:
            return await self._document(http, request, lambda: OPENAPI[path])
        if path == PREFIX or request.path.startswith(PREFIX + "/"):
            rest = request.path[len(PREFIX) :].lstrip("/")
            name, _, subresource = rest.partition("/")
            if not name:
                return await self._collection(http, request)
            if not subresource:
                return await self._get(http, request, name)
            sub, _, tail = subresource.partition("/")
            if sub == "proxy":
                return await self.proxy.forward(http, request, name, "/" + tail, identity)
            return await self._fail(http, 404, f'the server could not find the subresource "{sub}"')
        return await self._fail(http, 404, f"the server could not find the requested resource {request.path}")

    async def _fail(self, http: HTTPConnection, code: int, message: str, name: str | None = None) -> int:
        await http.respond_json(code, objects.status(code, message, name=name))
        return code

    async def _document(
        self, http: HTTPConnection, request: IncomingRequest, make: Callable[[], dict[str, Any]]
    ) -> int:
        if request.method != "GET":
            return await self._fail(http, 405, f"{request.method} is not allowed on {request.path}")
        await http.respond_json(200, make())
        return 200

    async def _read_only(self, http: HTTPConnection, request: IncomingRequest) -> int | None:
        if request.method == "GET":
            return None
        return await self._fail(
            http,
            405,
            f"{request.method} is not allowed: ClusterGateways are derived from the ManagedClusters that have "
            "the cluster-proxy addon (add or remove the addon instead)",
        )

    async def _collection(self, http: HTTPConnection, request: IncomingRequest) -> int:
        if (refused := await self._read_only(http, request)) is not None:
            return refused
        query = parse_qs(request.query)
        if query.get("watch", [""])[0] in ("1", "true"):
            return await self._watch(http, request, query)
        entries, newest = await trio.to_thread.run_sync(self.inventory.clusters)
        if objects.wants_table(request.header("accept")):
            await http.respond_json(200, objects.table(entries, newest))
        else:
            await http.respond_json(200, objects.cluster_gateway_list(entries, newest))
        return 200

    async def _get(self, http: HTTPConnection, request: IncomingRequest, name: str) -> int:
        if (refused := await self._read_only(http, request)) is not None:
            return refused
        entry = await trio.to_thread.run_sync(self.inventory.cluster, name)
        if entry is None:
            return await self._fail(http, 404, objects.not_found_message(name), name=name)
        if objects.wants_table(request.header("accept")):
            await http.respond_json(200, objects.table([entry], entry.resource_version))
        else:
            await http.respond_json(200, objects.cluster_gateway(entry))
        return 200

    async def _watch(
        self, http: HTTPConnection, request: IncomingRequest, query: dict[str, list[str]]
    ) -> int:
        """Watch by polling the hub every ``watch_interval``: ADDED/MODIFIED/DELETED from the difference.
        With ``resourceVersion=N`` (kubectl get -w after its list), objects newer than N are ADDED first;
        without it, every object is (the Kubernetes convention)."""
        as_table = objects.wants_table(request.header("accept"))
        since = int(query.get("resourceVersion", ["0"])[0] or 0)
        timeout = float(query.get("timeoutSeconds", ["0"])[0] or 0) or None
        await http.send(
            h11.Response(
                status_code=200,
                headers=[("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")],
            )
        )
        seen: dict[str, Any] = {}
        first = True

        async def emit(kind: str, entry: Any) -> None:
            if as_table:
                document = objects.table([entry], entry.resource_version, with_columns=first)
            else:
                document = objects.cluster_gateway(entry)
            line = json.dumps({"type": kind, "object": document}) + "\n"
            await http.send(h11.Data(data=line.encode()))

        async def poll() -> None:
            nonlocal first
            while True:
                entries, _ = await trio.to_thread.run_sync(self.inventory.clusters)
                current = {e.name: e for e in entries}
                for name, entry in current.items():
                    if name not in seen:
                        if not (first and since and entry.resource_version <= since):
                            await emit("ADDED", entry)
                    elif seen[name] != entry:
                        await emit("MODIFIED", entry)
                for name, entry in seen.items():
                    if name not in current:
                        await emit("DELETED", entry)
                seen.clear()
                seen.update(current)
                first = False
                await trio.sleep(self.watch_interval)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_when_closed, http, nursery.cancel_scope)
            with trio.move_on_after(timeout if timeout else float("inf")):
                try:
                    await poll()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            nursery.cancel_scope.cancel()
        with trio.move_on_after(2):
            try:
                await http.send(h11.EndOfMessage())
            except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
                pass
        return 200
