"""The ``proxy`` subresource: one request carried to a managed cluster's kube-apiserver.

``/apis/cluster.core.oam.dev/v1alpha1/clustergateways/NAME/proxy/REST?QUERY`` becomes ``METHOD /REST?QUERY``
on NAME's kube-apiserver: a CONNECT to the bare cluster name through the proxy-server's client port (the
agent maps it to its own API server), TLS checked against the cluster's CA, the cluster's token as the
bearer. The answer streams back as it comes (a watch, ``logs -f``), status and body unchanged: the managed
cluster's own 403 reaches the caller as it was written there. An upgrade (``Connection: Upgrade``: a
WebSocket or SPDY exec, attach, port-forward) goes the same way with its Upgrade header; a ``101`` goes
back with its headers, then the shared :func:`~clusterproxy_protocol.relay.relay_streams` carries bytes both ways; any other answer is an ordinary one.

Whose identity the managed cluster sees: the cluster's service account (the token's, seed 004), or, in
**caller** mode, the hub user the aggregator named, sent as ``Impersonate-User``/``-Group``/``-Extra-*``
with that token, so that the managed cluster's RBAC decides per hub user. Caller mode is the cluster's
(the ManagedCluster's annotation ``IDENTITY_ANNOTATION: caller``) or the request's (the header
``X-Cluster-Gateway-Identity: caller``, consumed here). A request may only narrow: it can ask for the
caller's identity on a service-account cluster, never for the service account on a caller cluster.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote

import h11
import trio

from clusterproxy_protocol import (
    ConnectRefused,
    DialTimeout,
    NoAgentConnected,
    TunnelError,
    UnknownCluster,
    describe_exception,
    get_logger,
    http1client,
    relay_streams,
    reset_if_process_dies,
)

from . import objects
from .http import HTTPConnection, IncomingRequest, ProtocolFailure, cancel_when_closed
from .inventory import (
    IDENTITY_ANNOTATION,
    IDENTITY_CALLER,
    IDENTITY_MODES,
    IDENTITY_SERVICE_ACCOUNT,
    ClusterEntry,
    ClusterToken,
    HubInventory,
    TokenNotReady,
)

if TYPE_CHECKING:
    from .server import Identity

__all__ = [
    "IDENTITY_HEADER",
    "ClusterProxy",
    "Refused",
    "StreamOpener",
    "Traffic",
    "choose_identity",
    "impersonation_headers",
    "outbound_headers",
    "upgrade_protocol",
]

IDENTITY_HEADER = "X-Cluster-Gateway-Identity"
# Not forwarded: hop-by-hop headers, the caller's credentials, the aggregator's identity headers and the
# gateway's own request header (the managed cluster sees the gateway's token, and in caller mode the
# Impersonate-* headers the gateway writes from the aggregator's identity, never a client's).
DROPPED_REQUEST_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "authorization",
        "expect",
    }
)
DROPPED_REQUEST_PREFIXES = ("x-remote-", "impersonate-", "x-cluster-gateway-")
HUB_CREDENTIAL_EXTRAS = "authentication.kubernetes.io/"
DROPPED_RESPONSE_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "trailer", "upgrade"})
KUBE_APISERVER_PORT = 443
TLS_HANDSHAKE_TIMEOUT = 15.0
RESPONSE_HEAD_TIMEOUT = 60.0
MAX_JSON_ANSWER = 1 << 20  # a TokenReview's or SubjectAccessReview's answer is a few hundred bytes


def choose_identity(entry: ClusterEntry, asked: str) -> str | tuple[int, str]:
    """IDENTITY_CALLER or IDENTITY_SERVICE_ACCOUNT for one request to ``entry``, or the (status,
    message) that refuses it. ``asked`` is the request's IDENTITY_HEADER ("" when absent)."""
    cluster = entry.name
    if entry.identity not in IDENTITY_MODES:
        return (
            500,
            f"ManagedCluster {cluster!r} has annotation {IDENTITY_ANNOTATION}={entry.identity!r}; the "
            f"cluster-gateway knows {' and '.join(repr(m) for m in IDENTITY_MODES)} (kubectl annotate "
            f"managedcluster {cluster} --overwrite {IDENTITY_ANNOTATION}={IDENTITY_CALLER})",
        )
    asked = asked.strip().lower()
    if not asked:
        return entry.identity
    if asked not in IDENTITY_MODES:
        return (
            400,
            f"header {IDENTITY_HEADER}: {asked!r} is not one of {', '.join(repr(m) for m in IDENTITY_MODES)}",
        )
    if asked == IDENTITY_SERVICE_ACCOUNT and entry.identity == IDENTITY_CALLER:
        return (
            403,
            f"cluster {cluster!r} is reached with the caller's identity only (its ManagedCluster's "
            f"annotation {IDENTITY_ANNOTATION}={IDENTITY_CALLER}); {IDENTITY_HEADER}: "
            f"{IDENTITY_SERVICE_ACCOUNT} may not widen that to the cluster's service account",
        )
    return asked


def impersonation_headers(identity: Identity) -> list[tuple[bytes, bytes]]:
    """The hub caller as Kubernetes impersonation headers. Groups go as they came, system:authenticated
    included: kube-apiserver adds that group by itself only when no group is impersonated. Extra keys
    arrive from the aggregator already percent-encoded, as Impersonate-Extra-* wants them; the ones under
    ``authentication.kubernetes.io/`` are left out: the hub's authenticators put them there to describe
    the hub credential (credential-id: the hash of a client certificate or a token's JTI; the pod and
    node a service-account token is bound to), which means nothing in the managed cluster, and carrying
    them would need an impersonate grant per key there."""
    headers = [(b"Impersonate-User", identity.user.encode("latin-1"))]
    headers += [(b"Impersonate-Group", group.encode("latin-1")) for group in identity.groups]
    for key, values in sorted(identity.extra.items()):
        if unquote(key).lower().startswith(HUB_CREDENTIAL_EXTRAS):
            continue
        headers += [(f"Impersonate-Extra-{key}".encode("latin-1"), v.encode("latin-1")) for v in values]
    return headers


class StreamOpener(Protocol):
    """What the gateway needs of the SDK's SharedTunnel."""

    async def connect(self, cluster: str, host: str, port: int) -> Any: ...


class Refused(Exception):
    """A request the gateway answers itself: the status and the reason in words."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Traffic:
    """Bytes carried for one request (the audit's counts): toward the target and back to the client."""

    to_target: int = 0
    to_client: int = 0


def outbound_headers(
    request: IncomingRequest, dropped_prefixes: tuple[str, ...] = DROPPED_REQUEST_PREFIXES
) -> list[tuple[bytes, bytes]]:
    """The caller's headers as they go on: hop-by-hop headers, its credential and those of
    ``dropped_prefixes`` left out (the caller of :meth:`ClusterProxy.exchange` adds its own)."""
    return [
        (k, v)
        for k, v in request.headers
        if k.lower().decode("latin-1") not in DROPPED_REQUEST_HEADERS
        and not k.lower().decode("latin-1").startswith(dropped_prefixes)
    ]


class ClusterProxy:
    def __init__(self, inventory: HubInventory, tunnel: StreamOpener, *, proxy_server: str) -> None:
        self.inventory = inventory
        self.tunnel = tunnel
        self.proxy_server = proxy_server
        self.log = get_logger("cluster-gateway")
        self._contexts: dict[bytes, ssl.SSLContext] = {}

    def client_context(self, ca_pem: bytes) -> ssl.SSLContext:
        context = self._contexts.get(ca_pem)
        if context is None:
            context = ssl.create_default_context(cadata=ca_pem.decode())
            context.set_alpn_protocols(["http/1.1"])
            # one CA per cluster (the gateway's and the service proxy's credentials name the same CA); a
            # rotated CA replaces the old ones
            self._contexts = {**dict(list(self._contexts.items())[-7:]), ca_pem: context}
        return context

    async def dial(self, cluster: str, host: str, port: int, what: str = "its kube-apiserver") -> Any:
        """A tunnel stream to ``host:port`` in ``cluster`` (``what`` names it in reasons); :class:`Refused`
        with the status and reason the caller gets when there is none."""
        try:
            # the cluster named in the header (so the proxy-server says 503 for a cluster without agents)
            return await self.tunnel.connect(cluster, host, port)
        except (UnknownCluster, NoAgentConnected) as exc:
            raise Refused(
                503,
                f"no tunnel to cluster {cluster!r}: no proxy-agent of it is connected to the proxy-server "
                f"({exc.reason or exc}); check kubectl get managedclusteraddon -n {cluster} cluster-proxy "
                f"and the agent in the managed cluster",
            ) from None
        except DialTimeout as exc:
            raise Refused(
                504, f"cluster {cluster!r}: its agent could not reach {what} in time ({exc})"
            ) from None
        except ConnectRefused as exc:
            raise Refused(502, f"cluster {cluster!r}: the tunnel refused the connection: {exc}") from None
        except TunnelError as exc:
            raise Refused(
                503,
                f"the cluster-gateway cannot reach the proxy-server at {self.proxy_server}: {exc} "
                "(check the gateway's --proxy-server and its client certificate)",
            ) from None

    async def open_kube(self, cluster: str, token: ClusterToken, secret: str) -> trio.SSLStream[Any]:
        """TLS with ``cluster``'s kube-apiserver through the tunnel (the bare cluster name as the host,
        which the agent maps to its own kube-apiserver), checked with ``token``'s CA; ``secret`` names
        the hub Secret that holds it, for the reason of a failure."""
        stream = await self.dial(cluster, cluster, KUBE_APISERVER_PORT)
        tls = trio.SSLStream(stream, self.client_context(token.ca_pem), server_hostname=token.server_name)
        try:
            with trio.fail_after(TLS_HANDSHAKE_TIMEOUT):
                await tls.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError) as exc:
            await trio.aclose_forcefully(tls)
            self.inventory.forget_token(cluster, secret)
            raise Refused(
                502,
                f"TLS with the kube-apiserver of cluster {cluster!r} failed: {describe_exception(exc)} "
                f"(its CA is 'ca.crt' of Secret {cluster}/{secret} on the hub; the "
                f"name checked is {token.server_name!r})",
            ) from None
        return tls

    async def request_json(
        self, cluster: str, token: ClusterToken, secret: str, method: str, path: str, body: Any
    ) -> tuple[int, Any]:
        """One JSON request of the gateway's own (a TokenReview, a SubjectAccessReview) to ``cluster``'s
        kube-apiserver with ``token``; the status and the decoded answer. :class:`Refused` when the
        cluster cannot be reached or does not answer."""
        payload = json.dumps(body).encode()
        tls = await self.open_kube(cluster, token, secret)
        try:
            headers = [
                ("Authorization", f"Bearer {token.token}"),
                ("Content-Type", "application/json"),
                ("Accept", "application/json"),
            ]
            with trio.fail_after(RESPONSE_HEAD_TIMEOUT):
                response = await http1client.request(
                    tls, method, path, token.server_name, payload, headers=headers, max_body=MAX_JSON_ANSWER
                )
        except (http1client.HTTPClientError, trio.BrokenResourceError, trio.TooSlowError) as exc:
            raise Refused(
                502, f"the kube-apiserver of cluster {cluster!r} did not answer {path}: {exc}"
            ) from None
        finally:
            await trio.aclose_forcefully(tls)
        if response.status == 401:
            self.inventory.forget_token(cluster, secret)  # a rotated token: read the Secret again next time
        try:
            return response.status, json.loads(response.body or b"null")
        except ValueError:
            return response.status, {"message": response.body[:300].decode("utf-8", "replace")}

    async def forward(
        self, http: HTTPConnection, request: IncomingRequest, cluster: str, path: str, identity: Identity
    ) -> int:
        async def fail(code: int, message: str) -> int:
            self.log.warning("proxy_refused", cluster=cluster, status=code, reason=message)
            await http.respond_json(code, objects.status(code, message, name=cluster))
            return code

        entry = await trio.to_thread.run_sync(self.inventory.cluster, cluster)
        if entry is None:
            return await fail(404, objects.not_found_message(cluster))
        mode = choose_identity(entry, request.header(IDENTITY_HEADER))
        if isinstance(mode, tuple):
            return await fail(*mode)
        impersonate = impersonation_headers(identity) if mode == IDENTITY_CALLER else []
        try:
            token = await trio.to_thread.run_sync(self.inventory.token, cluster)
        except TokenNotReady as exc:
            return await fail(503, str(exc))
        try:
            tls = await self.open_kube(cluster, token, self.inventory.token_secret)
        except Refused as exc:
            return await fail(exc.status, exc.message)
        try:
            return await self._exchange(http, request, cluster, path, token, tls, fail, impersonate)
        finally:
            await trio.aclose_forcefully(tls)

    async def _exchange(
        self,
        http: HTTPConnection,
        request: IncomingRequest,
        cluster: str,
        path: str,
        token: ClusterToken,
        tls: trio.SSLStream[Any],
        fail: Any,
        impersonate: list[tuple[bytes, bytes]],
    ) -> int:
        """The gateway's request: the caller's headers, the cluster's token, the caller's identity in
        caller mode."""
        headers = outbound_headers(request)
        headers += [
            (b"Host", token.server_name.encode()),
            (b"Authorization", f"Bearer {token.token}".encode()),
            *impersonate,
        ]

        def unauthorized() -> None:
            self.inventory.forget_token(cluster)  # a rotated token: read the Secret again next time

        return await self.exchange(
            http, request, cluster, path, headers, tls, fail, on_unauthorized=unauthorized
        )

    async def exchange(
        self,
        http: HTTPConnection,
        request: IncomingRequest,
        cluster: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        stream: trio.abc.Stream,
        fail: Any,
        *,
        on_unauthorized: Callable[[], None] | None = None,
        traffic: Traffic | None = None,
        what: str = "",
    ) -> int:
        """Send ``request`` (its method, ``path`` with its query, its body) with ``headers`` over
        ``stream`` and carry the answer back as it comes: streamed, or, after a 101, the bytes of the
        upgraded connection both ways. Returns the status."""
        traffic = traffic if traffic is not None else Traffic()
        what = what or f"the kube-apiserver of cluster {cluster!r}"
        upstream = HTTPConnection(stream, h11.CLIENT)
        headers = list(headers)
        upgrade = upgrade_protocol(request)
        if upgrade:
            headers += [(b"Connection", b"Upgrade"), (b"Upgrade", upgrade.encode("latin-1"))]
        else:
            headers.append((b"Connection", b"close"))
        if request.body or request.method in ("POST", "PUT", "PATCH"):
            headers.append((b"Content-Length", str(len(request.body)).encode()))
        target = path + (f"?{request.query}" if request.query else "")
        try:
            await upstream.send(h11.Request(method=request.method, target=target, headers=headers))
            if request.body:
                await upstream.send(h11.Data(data=request.body))
                traffic.to_target += len(request.body)
            await upstream.send(h11.EndOfMessage())
            with trio.fail_after(RESPONSE_HEAD_TIMEOUT):
                head = await upstream.next_event()
                while isinstance(head, h11.InformationalResponse) and head.status_code != 101:
                    head = await upstream.next_event()  # 100 Continue, 103 Early Hints: not for the caller
        except (ProtocolFailure, trio.BrokenResourceError, trio.TooSlowError) as exc:
            return int(await fail(502, f"{what} did not answer: {exc}"))
        if isinstance(head, h11.InformationalResponse):  # 101: h11 lets it through only if we asked
            return await self._switch(http, upstream, head, cluster, upgrade, traffic)
        if not isinstance(head, h11.Response):
            return int(await fail(502, f"{what} answered {head!r}"))
        if head.status_code == 401 and on_unauthorized is not None:
            on_unauthorized()
        relayed = [
            (k, v) for k, v in head.headers if k.lower().decode("latin-1") not in DROPPED_RESPONSE_HEADERS
        ]
        await http.send(h11.Response(status_code=head.status_code, headers=relayed, reason=head.reason))
        cut: str | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_when_closed, http, nursery.cancel_scope)
            try:
                while True:
                    event = await upstream.next_event()
                    if isinstance(event, h11.Data):
                        await http.send(h11.Data(data=event.data))
                        traffic.to_client += len(event.data)
                    elif isinstance(event, h11.EndOfMessage):
                        await http.send(h11.EndOfMessage())
                        break
                    else:
                        raise ProtocolFailure(f"unexpected {event!r}")
            except ProtocolFailure as exc:
                cut = str(exc)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the caller went away
            nursery.cancel_scope.cancel()
        if cut is not None:
            # cut short upstream: the caller must see a broken answer, not a complete one
            self.log.warning("proxy_answer_cut", cluster=cluster, reason=cut)
            raise trio.BrokenResourceError(cut)
        return head.status_code

    async def _switch(
        self,
        http: HTTPConnection,
        upstream: HTTPConnection,
        head: h11.InformationalResponse,
        cluster: str,
        protocol: str,
        traffic: Traffic,
    ) -> int:
        """The managed cluster switched protocols: its 101 goes to the caller with its headers (Upgrade,
        Sec-WebSocket-Accept/-Protocol, X-Stream-Protocol-Version ...), then bytes flow both ways."""
        relayed = [(k, v) for k, v in head.headers if k.lower() not in (b"connection", b"keep-alive")]
        relayed.append((b"Connection", b"Upgrade"))
        # After the 101 only the connection's end ends the bytes, and the aggregator (Go's TLS) takes a
        # bare FIN for a clean end: the one the kernel sends for a killed gateway must be a RST instead.
        # The relay's clean end disarms it (close_notify, then FIN). Ordinary answers need no arming:
        # their length or chunked framing tells a cut answer.
        reset_if_process_dies(http.stream)
        await http.send(h11.InformationalResponse(status_code=101, headers=relayed, reason=head.reason))
        # bytes that arrived behind either head are the new protocol's first ones
        from_caller, _ = http.conn.trailing_data
        from_cluster, _ = upstream.conn.trailing_data
        self.log.info("proxy_upgraded", cluster=cluster, protocol=protocol)
        try:
            if from_cluster:
                await http.stream.send_all(from_cluster)
            if from_caller:
                await upstream.stream.send_all(from_caller)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return 101  # one side is gone already; the caller's finally blocks close both
        result = await relay_streams(http.stream, upstream.stream)
        traffic.to_target += len(from_caller) + result.bytes_to_target
        traffic.to_client += len(from_cluster) + result.bytes_to_client
        return 101


def upgrade_protocol(request: IncomingRequest) -> str:
    """The Upgrade header's value when the request asks to switch protocols (``Connection: Upgrade``
    with ``Upgrade: websocket`` or ``SPDY/3.1``), else ""."""
    connection = {token.strip().lower() for token in request.header("connection").split(",")}
    return request.header("upgrade").strip() if "upgrade" in connection else ""
