"""The proxy-server replicas and what each holds, from their admin ports (mutual TLS).

The replicas are a list of admin URLs (``--admin-url https://HOST:PORT``), or every address of a name
(``--admin-service HOST:PORT``, resolved each round: in Kubernetes the headless Service of the servers'
admin port, one address per replica). Each round asks every replica ``/api/v1/clusters`` (the
clusters it knows and the tunnels it holds) and ``/api/v1/agents`` (each tunnel: agent id, streams,
bytes, RTT). Those list clusters and agents, so the admin port serves them over TLS only, to a hub
client certificate: the collector's own, the one its probes present (docs/architecture.md, "The
admin port"). The replica's certificate is the client port's, checked against the name the probes
check (``--server-name``, else the ``--proxy`` host): an address from ``--admin-service`` is a pod's
IP, which no certificate names.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import trio

from clusterproxy_protocol import InvalidValue, describe_exception, format_authority, http1client

from .state import ServerView, parse_agents, parse_clusters

__all__ = ["AdminTLS", "fetch_json", "parse_admin_url", "resolve_admin_service", "server_view"]

MAX_ANSWER = 64 << 20  # /api/v1/agents of 10,000 tunnels is ~5 MiB


def parse_admin_url(text: str) -> str:
    """``https://HOST:PORT`` of a proxy-server's admin port (its ``--admin-listen``)."""
    value = text.strip().rstrip("/")
    url = urlsplit(value)
    if url.scheme == "http":
        raise InvalidValue(
            f"invalid admin URL {text!r}: the proxy-server's agents and clusters are served over mutual "
            f"TLS only: https://{url.netloc} (the same port)"
        )
    if url.scheme != "https" or not url.hostname or url.path or url.query:
        raise InvalidValue(
            f"invalid admin URL {text!r}: expected https://HOST:PORT of a proxy-server's admin port "
            "(its --admin-listen)"
        )
    try:
        url.port  # noqa: B018 - validates
    except ValueError:
        raise InvalidValue(f"invalid admin URL {text!r}: bad port") from None
    return value


async def resolve_admin_service(host: str, port: int) -> list[str]:
    """One admin URL per address of ``host``; empty when the name does not resolve."""
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    addresses = sorted({str(info[4][0]) for info in infos})
    return [f"https://{format_authority(address, port)}" for address in addresses]


async def fetch_json(url: str, *, timeout: float, tls: AdminTLS | None = None) -> object:
    """``GET url``, its JSON answer: plain HTTP, or with ``tls`` (an ``https://`` URL) TLS.
    OSError, ValueError, HTTPClientError (an answer other than 200 in words) or TooSlowError."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 80
    with trio.fail_after(timeout):
        stream = await http1client.connect(
            host,
            port,
            tls=tls.context if tls is not None else None,
            server_name=tls.server_name if tls is not None else None,
        )
        async with stream:
            response = await http1client.request(
                stream, "GET", parts.path or "/", format_authority(host, port), max_body=MAX_ANSWER
            )
    if response.status != 200:
        raise http1client.HTTPStatusError(response)
    return response.json()


@dataclass(frozen=True)
class AdminTLS:
    """How the collector speaks to the admin ports: its hub client certificate (``context``) and the
    name the replicas' certificate must carry (None: the URL's host)."""

    context: ssl.SSLContext
    server_name: str | None = None


async def server_view(
    url: str, *, timeout: float, now: float, tls: AdminTLS | str | None = None
) -> ServerView:
    """What one replica holds; a failure is the view's ``error`` in words, never an exception.
    ``tls``: a string says why there is no TLS context (no client certificate yet)."""
    if isinstance(tls, str):
        return ServerView(url, now, error=tls)
    try:
        with trio.fail_after(timeout):
            known = parse_clusters(await fetch_json(f"{url}/api/v1/clusters", timeout=timeout, tls=tls))
            tunnels = parse_agents(await fetch_json(f"{url}/api/v1/agents", timeout=timeout, tls=tls), url)
    except trio.TooSlowError:
        return ServerView(url, now, error=f"no answer within {timeout:g}s")
    except (OSError, ValueError, http1client.HTTPClientError, trio.BrokenResourceError) as exc:
        return ServerView(url, now, error=describe_exception(exc.__cause__ or exc))
    return ServerView(url, now, known=known, tunnels=tunnels)


async def server_views(
    urls: Sequence[str], *, timeout: float, now: float, tls: AdminTLS | str | None = None
) -> list[ServerView]:
    """Every replica at once; the views in the order of ``urls``."""
    views: dict[str, ServerView] = {}

    async def one(url: str) -> None:
        views[url] = await server_view(url, timeout=timeout, now=now, tls=tls)

    async with trio.open_nursery() as nursery:
        for url in urls:
            nursery.start_soon(one, url)
    return [views[url] for url in urls]
