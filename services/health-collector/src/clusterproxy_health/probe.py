"""One probe of one cluster through its tunnel: a real request through the proxy-server's client port.

The probe URL is a template: ``{cluster}`` stands for the cluster's name. The default,
``https://{cluster}:443/healthz``, follows the upstream convention: the bare cluster name as the dial
host reaches that cluster's kube-apiserver (the agent maps its own cluster name to its
``--kube-apiserver``). Schemes:

- ``https``: TLS to the target, then ``GET PATH``; the target's certificate is checked only with
  ``--probe-ca`` (the hub rarely holds every cluster's CA; ``/healthz`` is public, and the point is
  that the tunnel carries a request end to end);
- ``http``: ``GET PATH`` in clear (local mode's echo service stands in for a kube-apiserver);
- ``tcp``: the CONNECT alone (the agent dialed the target).

An answer below 400 is success. Everything a probe does is bounded by one timeout, so a target that
accepts and never answers costs that probe its timeout and nothing else.
"""

from __future__ import annotations

import re
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import trio

from clusterproxy_protocol import (
    CLUSTER_NAME,
    ConnectRefused,
    InvalidValue,
    TunnelError,
    describe_exception,
    format_authority,
    http1client,
)

from .state import ProbeResult

__all__ = ["CLUSTER_PLACEHOLDER", "ProbeSpec", "StreamOpener", "parse_probe_url", "probe_cluster"]

CLUSTER_PLACEHOLDER = "{cluster}"
KUBE_APISERVER_NAME = "kubernetes.default.svc"  # on every kube-apiserver's serving certificate
MAX_BODY = 64 << 10
MAX_ERROR_TEXT = 200
_HOST = re.compile(r"^[A-Za-z0-9._-]{1,253}$|^\[[0-9A-Fa-f:.]+\]$")


class StreamOpener(Protocol):
    """What probes need of the SDK's SharedTunnel: a stream to ``host:port`` inside ``cluster``."""

    async def connect(self, cluster: str, host: str, port: int) -> Any: ...


@dataclass(frozen=True)
class ProbeSpec:
    scheme: str  # https, http, tcp
    host: str  # a host, or CLUSTER_PLACEHOLDER
    port: int
    path: str = "/healthz"
    ca: Path | None = None  # verify the target's certificate (https)
    server_name: str | None = None  # the name checked against it (default: kubernetes.default.svc)

    @property
    def url(self) -> str:
        path = "" if self.scheme == "tcp" else self.path
        return f"{self.scheme}://{format_authority(self.host, self.port)}{path}"

    def target(self, cluster: str) -> tuple[str, int]:
        return (cluster if self.host == CLUSTER_PLACEHOLDER else self.host), self.port

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "verify": self.ca is not None,
            "what": "the cluster's kube-apiserver"
            if self.host == CLUSTER_PLACEHOLDER and self.port == 443
            else "a target inside each cluster",
        }

    def tls_context(self) -> ssl.SSLContext:
        if self.ca is not None:
            context = ssl.create_default_context(cafile=str(self.ca))
        else:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        context.set_alpn_protocols(["http/1.1"])
        return context


def parse_probe_url(text: str) -> ProbeSpec:
    """``https://{cluster}:443/healthz``, ``http://10.0.0.5:8080/ready``, ``tcp://{cluster}:443``."""
    raw = text.strip()
    url = urlsplit(raw.replace(CLUSTER_PLACEHOLDER, "cluster-placeholder"))
    if url.scheme not in ("https", "http", "tcp"):
        raise InvalidValue(
            f"invalid probe URL {text!r}: the scheme must be https, http or tcp "
            "(e.g. https://{cluster}:443/healthz)"
        )
    if url.username or url.password or url.query or url.fragment:
        raise InvalidValue(f"invalid probe URL {text!r}: no user, query or fragment")
    netloc = url.netloc
    host, _, port_text = netloc.rpartition(":") if not netloc.endswith("]") else (netloc, "", "")
    if not host or (port_text and not (port_text.isascii() and port_text.isdigit())):
        host, port_text = netloc, ""
    host = CLUSTER_PLACEHOLDER if host == "cluster-placeholder" else host
    if host != CLUSTER_PLACEHOLDER and not _HOST.match(host):
        raise InvalidValue(f"invalid probe URL {text!r}: {host!r} is not a host name or IP address")
    default_port = {"https": 443, "http": 80, "tcp": 0}[url.scheme]
    port = int(port_text) if port_text else default_port
    if not 1 <= port <= 65535:
        raise InvalidValue(f"invalid probe URL {text!r}: a port 1-65535 is needed")
    path = url.path or "/"
    return ProbeSpec(url.scheme, host.strip("[]") if host.startswith("[") else host, port, path)


def _text(data: bytes) -> str:
    """The start of an answer's body on one line, for an error message."""
    line = " ".join(data.decode("utf-8", "replace").split())
    return line[:MAX_ERROR_TEXT] + ("..." if len(line) > MAX_ERROR_TEXT else "")


def _refusal_words(exc: ConnectRefused) -> str:
    status = exc.status
    what = {
        400: "the proxy-server refused the probe target",
        403: "refused by policy",
        404: "the proxy-server does not know this cluster",
        429: "the proxy-server has too many of the collector's dials waiting",
        502: "the agent could not reach the probe target",
        503: "no agent of this cluster is connected to the proxy-server",
        504: "the probe target did not answer the agent in time",
    }.get(status, "the dial was refused")
    return f"{what} ({status}: {exc.reason})"


async def probe_cluster(
    opener: StreamOpener, spec: ProbeSpec, cluster: str, *, timeout: float, clock: Any = None
) -> ProbeResult:
    """Probe ``cluster`` once; never raises for a failure of the probe itself (it is the result)."""
    if not CLUSTER_NAME.match(cluster):
        return ProbeResult(_now(clock), None, f"not a cluster name: {cluster!r}", "invalid_cluster")
    at = _now(clock)
    started = trio.current_time()
    host, port = spec.target(cluster)
    where = "the kube-apiserver" if spec.host == CLUSTER_PLACEHOLDER else format_authority(host, port)
    stream = None
    error: str | None = None
    reason = ""
    with trio.move_on_after(timeout) as deadline:
        try:
            stream = await opener.connect(cluster, host, port)
            if spec.scheme == "https":
                server_name = spec.server_name or (
                    KUBE_APISERVER_NAME if spec.host == CLUSTER_PLACEHOLDER else host
                )
                tls = trio.SSLStream(stream, spec.tls_context(), server_hostname=server_name)
                try:
                    await tls.do_handshake()
                except trio.BrokenResourceError as exc:
                    raise _ProbeFailed(
                        f"TLS handshake with {where} failed: {describe_exception(exc)}", "tls"
                    ) from None
                stream = tls
            if spec.scheme in ("http", "https"):
                answer = await http1client.request(
                    stream,
                    "GET",
                    spec.path,
                    format_authority(host, port),
                    headers=[("user-agent", "cluster-proxy-health-collector")],
                    max_body=MAX_BODY,
                    truncate=True,  # only the start of the body says anything to a person
                )
                if answer.status >= 400:
                    raise _ProbeFailed(
                        f"{where} answered {answer.status} to GET {spec.path}: {_text(answer.body) or '(no body)'}",
                        f"http_{answer.status}",
                    )
        except _ProbeFailed as exc:
            error, reason = exc.message, exc.reason
        except ConnectRefused as exc:
            error, reason = _refusal_words(exc), f"refused_{exc.status}"
        except TunnelError as exc:  # the proxy-server cannot be reached, or its connection died
            error, reason = f"proxy-server: {exc}", "proxy_server"
        except http1client.HTTPClientError as exc:
            error, reason = f"{where} did not answer HTTP: {exc}", "protocol"
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            error, reason = f"the stream to {where} broke: {describe_exception(exc)}", "broken"
        finally:
            if stream is not None:
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(stream)
    if deadline.cancelled_caught:
        return ProbeResult(at, None, f"no answer from {where} within {timeout:g}s (probe timeout)", "timeout")
    if error is not None:
        return ProbeResult(at, None, error, reason)
    return ProbeResult(at, trio.current_time() - started)


class _ProbeFailed(Exception):
    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


def _now(clock: Any) -> float:
    return clock() if clock is not None else time.time()
