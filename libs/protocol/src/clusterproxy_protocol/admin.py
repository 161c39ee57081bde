"""The services' admin ports: GET routes (/healthz, /readyz, /metrics, JSON APIs) over the shared
HTTP/1.1 server (:mod:`clusterproxy_protocol.httpserver`).

An admin port may also hold routes for authenticated peers only (:class:`Authenticated`): what lists
clusters and agents must not go to every pod that can open a TCP connection. Those are served over
mutual TLS **on the same port**, told apart from plain HTTP by the client's first byte (a TLS
handshake record), so the kubelet's probes and Prometheus keep their plain ``/healthz``, ``/readyz``
and ``/metrics``, and no port, Service or flag is added. A plain request for such a route is answered
403 with the ``https://`` URL to use instead.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import prometheus_client
import trio
from cryptography import x509
from prometheus_client.metrics_core import Metric

from clusterproxy_protocol.httpserver import HttpLimits, Request, Response, serve_http
from clusterproxy_protocol.logs import get_logger
from clusterproxy_protocol.pki import CertRole, certificate_role, role_refusal

__all__ = [
    "INVENTORY_LABELS",
    "Authenticated",
    "PeerRoute",
    "Response",
    "AdminRoute",
    "metrics_response",
    "serve_admin",
]

AdminRoute = Callable[[], Awaitable[Response] | Response]
#: a route for an authenticated peer: it is handed the peer's verified certificate
PeerRoute = Callable[[x509.Certificate], Awaitable[Response] | Response]

#: the metric labels that name clusters and agents: summed away on a plain /metrics
INVENTORY_LABELS = frozenset({"cluster", "agent_id"})


class _Families(Protocol):
    def collect(self) -> Iterable[Metric]: ...


@dataclass(frozen=True)
class _Relabelled:
    """``source``'s families with the ``drop`` labels summed away (``_created`` samples: the
    earliest), after dropping the samples whose labels ``keep`` refuses."""

    source: _Families
    drop: Collection[str] = ()
    keep: Callable[[Mapping[str, str]], bool] | None = None

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            samples = [s for s in family.samples if self.keep is None or self.keep(s.labels)]
            if len(samples) == len(family.samples) and not any(
                name in self.drop for s in samples for name in s.labels
            ):
                yield family
                continue
            merged: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for sample in samples:
                key = (
                    sample.name,
                    tuple(sorted((k, v) for k, v in sample.labels.items() if k not in self.drop)),
                )
                if key in merged and sample.name.endswith("_created"):
                    merged[key] = min(merged[key], sample.value)
                else:
                    merged[key] = merged.get(key, 0.0) + sample.value
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for (name, labels), value in merged.items():
                out.add_sample(name, dict(labels), value)
            yield out


def metrics_response(
    registry: _Families,
    *,
    without: Collection[str] = (),
    keep: Callable[[Mapping[str, str]], bool] | None = None,
) -> Response:
    """``registry`` in Prometheus' text format; ``without``: labels summed away (a plain /metrics
    passes :data:`INVENTORY_LABELS`); ``keep``: which samples (by their labels) are shown at all."""
    families = _Relabelled(registry, without, keep) if without or keep is not None else registry
    return Response(
        200,
        prometheus_client.generate_latest(families),
        content_type=prometheus_client.CONTENT_TYPE_LATEST,
    )


@dataclass(frozen=True)
class Authenticated:
    """Routes served only over mutual TLS on the admin port, to a certificate ``accepted`` (the
    hub client role by default). ``tls``: the server context, read at each handshake (it requires a
    client certificate signed by the hub's CA: no certificate, or another CA's, fails the handshake).
    A path in both these routes and the plain ones (``/metrics``) is the plain one's for everyone
    else."""

    routes: Mapping[str, PeerRoute]
    tls: Callable[[], ssl.SSLContext]
    accepted: CertRole = CertRole.CLIENT

    def refusal(self, cert: x509.Certificate) -> str | None:
        return role_refusal(certificate_role(cert), "admin", self.accepted)


async def serve_admin(
    listeners: list[trio.SocketListener],
    routes: Mapping[str, AdminRoute],
    *,
    authenticated: Authenticated | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve GET (and HEAD) requests for ``routes`` (exact paths) on ``listeners``, and
    ``authenticated``'s routes to the peers it accepts (over TLS on the same listeners)."""
    private: Mapping[str, PeerRoute] = authenticated.routes if authenticated is not None else {}
    known = sorted({*routes, *private})

    async def handle(request: Request) -> Response:
        if request.path not in routes and request.path not in private:
            return Response.text(f"not found: {request.path} (try: {', '.join(known)})", 404)
        if request.method not in ("GET", "HEAD"):
            return Response.text(f"method {request.method} not allowed; use GET", 405)
        result: Awaitable[Response] | Response | None = None
        if authenticated is not None and request.path in private:
            if request.peer_cert is None:
                if request.path not in routes:
                    host = request.headers.get("host") or "HOST:PORT"
                    return Response.text(
                        f"forbidden: {request.path} lists clusters and agents and is served over mutual "
                        f"TLS only, on this same port: https://{host}{request.path} with a hub client "
                        "certificate (docs/architecture.md, 'The admin port')",
                        403,
                    )
            else:
                refusal = authenticated.refusal(request.peer_cert)
                if refusal is None:
                    result = private[request.path](request.peer_cert)
                elif request.path not in routes:
                    return Response.text(f"forbidden: {refusal}", 403)
        if result is None:
            result = routes[request.path]()
        return await result if isinstance(result, Awaitable) else result

    await serve_http(
        listeners,
        handle,
        HttpLimits(max_body=0),
        tls=authenticated.tls if authenticated is not None else None,
        tls_optional=True,
        log=get_logger("admin"),
        task_status=task_status,
    )
