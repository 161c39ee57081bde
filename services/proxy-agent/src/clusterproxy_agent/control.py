"""The agent's control endpoint: ServiceAccounts and their TokenRequest tokens, made in this cluster for
the hub (the managed service accounts, docs/managed-serviceaccount.md).

The proxy-server opens a ``CONNECT`` to the reserved target
:data:`~clusterproxy_protocol.agent_control.CONTROL_AUTHORITY` only for a hub client of its control
allow-list, and marks that stream with the client's name; the agent answers the target itself (it is
never dialed) and only on a marked stream. Inside, one HTTP/1.1 request (see
:mod:`clusterproxy_protocol.agent_control`). The agent talks to its own kube-apiserver with its own
ServiceAccount token (``--kube-token-file``, read at each call: the kubelet rotates it) and CA
(``--kube-ca-file``), in the one namespace ``--serviceaccount-namespace``, where its RBAC allows exactly
get/create/delete on serviceaccounts and create on serviceaccounts/token. Nothing of the hub is needed
in the managed cluster.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from clusterproxy_agent.dialer import Connector, Resolver, connect_any, resolve
from clusterproxy_protocol import (
    CONTROL_CLIENT_HEADER,
    CONTROL_HOST,
    SERVICEACCOUNT_PATH,
    HttpLimits,
    IncomingRequest,
    Request,
    Response,
    describe_exception,
    get_logger,
    http1client,
    serve_stream,
)

__all__ = ["ControlEndpoint", "KubeAPI", "KubeError", "ServiceAccountSettings", "is_control_target"]

MAX_REQUEST_BODY = 64 * 1024
MAX_KUBE_ANSWER = 1024 * 1024
REQUEST_TIMEOUT = 30.0
KUBE_TIMEOUT = 20.0
MANAGED_LABEL = "authentication.open-cluster-management.io/managed-by"
MANAGED_BY = "cluster-proxy-agent"
MIN_EXPIRATION = 600  # what TokenRequest accepts at least
# the request's head, its body, its deadline (the whole exchange is under REQUEST_TIMEOUT too)
CONTROL_LIMITS = HttpLimits(max_body=MAX_REQUEST_BODY, max_head=16 * 1024, request_timeout=REQUEST_TIMEOUT)


@dataclass(frozen=True)
class ServiceAccountSettings:
    namespace: str  # where the managed ServiceAccounts live in this cluster
    token_file: Path  # the agent's own ServiceAccount token (the pod's)
    ca_file: Path  # the CA of this cluster's kube-apiserver (the pod's)


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class KubeAPI:
    """The few calls the control endpoint makes to this cluster's kube-apiserver: HTTPS, JSON, one
    request per connection, the agent's own bearer token."""

    def __init__(
        self,
        address: tuple[str, int],
        settings: ServiceAccountSettings,
        *,
        resolver: Resolver = resolve,
        connector: Connector = connect_any,
    ) -> None:
        self.address = address
        self.settings = settings
        self._resolve = resolver
        self._connect = connector

    def _context(self) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=str(self.settings.ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise KubeError(
                500,
                f"cannot read the kube-apiserver's CA at {self.settings.ca_file}: {describe_exception(exc)} "
                "(the agent's --kube-ca-file; its pod must mount its ServiceAccount token)",
            ) from None
        context.set_alpn_protocols(["http/1.1"])
        return context

    def _token(self) -> str:
        try:
            return self.settings.token_file.read_text().strip()
        except OSError as exc:
            raise KubeError(
                500,
                f"cannot read the agent's ServiceAccount token at {self.settings.token_file}: "
                f"{exc.strerror or exc} (the agent's --kube-token-file; automountServiceAccountToken of its pod)",
            ) from None

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
        host, port = self.address
        payload = json.dumps(body).encode() if body is not None else b""
        headers = [("Authorization", f"Bearer {self._token()}"), ("Accept", "application/json")]
        if body is not None:
            headers.append(("Content-Type", "application/json"))
        context = self._context()
        try:
            with trio.fail_after(KUBE_TIMEOUT):
                tcp = await self._connect(await self._resolve(host, port), port)
                tls = trio.SSLStream(tcp, context, server_hostname=host)
                try:
                    response = await http1client.request(
                        tls,
                        method,
                        path,
                        f"{host}:{port}",
                        payload,
                        headers=headers,
                        max_body=MAX_KUBE_ANSWER,
                    )
                finally:
                    await trio.aclose_forcefully(tls)
        except trio.TooSlowError:
            raise KubeError(
                504, f"the kube-apiserver at {host}:{port} did not answer within {KUBE_TIMEOUT:g}s"
            ) from None
        except (OSError, ssl.SSLError, trio.BrokenResourceError, http1client.HTTPClientError) as exc:
            raise KubeError(
                502, f"the kube-apiserver at {host}:{port} could not be reached: {describe_exception(exc)}"
            ) from None
        try:
            decoded = response.json() if response.body else {}
        except ValueError:
            decoded = {"message": response.body[:300].decode("utf-8", "replace")}
        return response.status, decoded if isinstance(decoded, dict) else {}


def _kube_failure(status: int, answer: dict[str, Any], doing: str) -> KubeError:
    message = str(answer.get("message") or f"status {status}")
    hint = ""
    if status == 403:
        hint = (
            " (the agent's RBAC in this cluster: the addon's ManifestWork grants its ServiceAccount get, create "
            "and delete on serviceaccounts and create on serviceaccounts/token in that namespace)"
        )
    return KubeError(status, f"{doing} failed in the managed cluster ({status}): {message}{hint}")


class ServiceAccounts:
    def __init__(self, kube: KubeAPI, namespace: str) -> None:
        self.kube = kube
        self.namespace = namespace

    def _path(self, name: str = "", suffix: str = "") -> str:
        base = f"/api/v1/namespaces/{self.namespace}/serviceaccounts"
        return f"{base}/{name}{suffix}" if name else base

    async def ensure(self, name: str) -> bool:
        """True when the ServiceAccount had to be made."""
        status, answer = await self.kube.call("GET", self._path(name))
        if status == 200:
            return False
        if status != 404:
            raise _kube_failure(status, answer, f"reading ServiceAccount {self.namespace}/{name}")
        account = {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": self.namespace, "labels": {MANAGED_LABEL: MANAGED_BY}},
        }
        status, answer = await self.kube.call("POST", self._path(), account)
        if status not in (200, 201, 409):
            raise _kube_failure(status, answer, f"creating ServiceAccount {self.namespace}/{name}")
        return status != 409

    async def token(self, name: str, expiration_seconds: int) -> dict[str, Any]:
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": expiration_seconds},
        }
        status, answer = await self.kube.call("POST", self._path(name, "/token"), request)
        if status not in (200, 201):
            raise _kube_failure(status, answer, f"TokenRequest for ServiceAccount {self.namespace}/{name}")
        token_status = answer.get("status") or {}
        if not token_status.get("token"):
            raise KubeError(502, "the kube-apiserver answered a TokenRequest without a token")
        return token_status

    async def delete(self, name: str) -> bool:
        status, answer = await self.kube.call("DELETE", self._path(name))
        if status == 404:
            return False
        if status not in (200, 202):
            raise _kube_failure(status, answer, f"deleting ServiceAccount {self.namespace}/{name}")
        return True


class ControlEndpoint:
    """Answers the reserved control target; ``settings`` None: this agent manages no ServiceAccounts."""

    def __init__(
        self,
        cluster: str,
        kube_apiserver: tuple[str, int],
        settings: ServiceAccountSettings | None,
        *,
        resolver: Resolver = resolve,
        connector: Connector = connect_any,
    ) -> None:
        self.settings = settings
        self.log = get_logger("clusterproxy_agent", cluster=cluster, component="control")
        self.accounts = (
            ServiceAccounts(
                KubeAPI(kube_apiserver, settings, resolver=resolver, connector=connector), settings.namespace
            )
            if settings is not None
            else None
        )

    async def handle(self, request: IncomingRequest) -> None:
        client = request.headers.get(CONTROL_CLIENT_HEADER, "").strip()
        if not client:
            await request.refuse(
                403,
                "the agent's control endpoint answers only streams the proxy-server authorized "
                "(its --control-client allow-list); this one was not",
            )
            return
        stream = await request.accept()
        try:
            with trio.fail_after(REQUEST_TIMEOUT):
                await self._serve(stream, client)
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.log.info("control_request_failed", client=client, error=describe_exception(exc))
        finally:
            await stream.aclose()

    async def _serve(self, stream: trio.abc.Stream, client: str) -> None:
        """One request on the tunnel stream, served by the admin ports' server loop (httpserver)."""

        async def answer(request: Request) -> Response:
            status, answer = await self._route(request.method, request.path, request.body)
            self.log.info(
                "control_request", client=client, method=request.method, path=request.path, status=status
            )
            return _json(status, answer)

        def refusal(status: int, error: str, reason: str) -> Response:
            if error == "bad_request":
                self.log.info("control_request_malformed", client=client, error=reason)
            return _json(status, {"message": reason})

        await serve_stream(stream, answer, CONTROL_LIMITS, peer=client, error_response=refusal, log=self.log)

    async def _route(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        match = SERVICEACCOUNT_PATH.match(path)
        if match is None:
            return 404, {
                "message": f"no such control path {path[:100]!r}; this agent serves /v1/serviceaccounts/NAME[/token]"
            }
        if self.accounts is None:
            return 503, {
                "message": "this agent manages no ServiceAccounts: start it with --serviceaccount-namespace "
                "(the addon's ManifestWork does, with the RBAC it needs)"
            }
        name = match.group("name")
        wants_token = match.group("token") is not None
        action: Callable[[], Awaitable[dict[str, Any]]]
        if wants_token and method == "POST":
            try:
                spec = json.loads(body or b"{}")
                seconds = int(spec.get("expirationSeconds", 3600))
            except (ValueError, TypeError, AttributeError):
                return 400, {"message": 'expected a JSON body {"expirationSeconds": N}'}
            if seconds < MIN_EXPIRATION:
                return 400, {
                    "message": f"expirationSeconds must be at least {MIN_EXPIRATION} (TokenRequest's minimum)"
                }

            async def action() -> dict[str, Any]:
                return await self._token(name, seconds)

        elif not wants_token and method == "DELETE":

            async def action() -> dict[str, Any]:
                assert self.accounts is not None
                deleted = await self.accounts.delete(name)
                if deleted:
                    self.log.info("serviceaccount_deleted", name=name, namespace=self.accounts.namespace)
                return {"deleted": deleted}

        else:
            allowed = "POST" if wants_token else "DELETE"
            return 405, {"message": f"method {method} not allowed on {path}; use {allowed}"}
        try:
            return 200, await action()
        except KubeError as exc:
            self.log.warning("control_kube_failed", name=name, status=exc.status, error=exc.message)
            return exc.status, {"message": exc.message}

    async def _token(self, name: str, seconds: int) -> dict[str, Any]:
        assert self.accounts is not None and self.settings is not None
        if await self.accounts.ensure(name):
            self.log.info("serviceaccount_created", name=name, namespace=self.accounts.namespace)
        issued = await self.accounts.token(name, seconds)
        try:
            ca_bundle = self.settings.ca_file.read_text()
        except OSError as exc:
            raise KubeError(500, f"cannot read {self.settings.ca_file}: {exc.strerror or exc}") from None
        self.log.info(
            "serviceaccount_token_issued",
            name=name,
            expires=issued.get("expirationTimestamp"),
            seconds=seconds,
        )
        return {
            "namespace": self.accounts.namespace,
            "serviceAccount": name,
            "token": issued["token"],
            "expirationTimestamp": issued.get("expirationTimestamp"),
            "caBundle": ca_bundle,
        }


def _json(status: int, answer: dict[str, Any]) -> Response:
    return Response(status, json.dumps(answer).encode())


def is_control_target(authority: str) -> bool:
    """The reserved target (any port: the agent never dials it, whatever is asked)."""
    host = authority.rpartition(":")[0] if ":" in authority else authority
    return host.rstrip(".").lower() == CONTROL_HOST
