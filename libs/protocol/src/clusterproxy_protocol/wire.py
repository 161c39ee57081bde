"""The wire vocabulary shared by server, agent, SDK and CLI: header names, paths, ALPN ids, the
cluster-name rule, and how an address is written and read. One place, so that both ends agree."""

from __future__ import annotations

import re

# Request and response headers of the tunnel and the client port.
CLUSTER_HEADER = "cluster-proxy-cluster"  # which cluster a client's CONNECT is for
REASON_HEADER = "cluster-proxy-reason"  # the one-line reason of a refusal
# On an agent's 5xx answer to a CONNECT: whose failure it is. FAULT_TARGET: the agent did its job and
# the target refused, was unreachable, did not resolve or did not answer in time. A 5xx without it is
# the agent's own failure (the proxy-server retries it on another agent and may eject the tunnel).
FAULT_HEADER = "cluster-proxy-fault"
FAULT_TARGET = "target"
SERVER_ID_HEADER = "cluster-proxy-server-id"  # on the server's GET /v1/info to an agent
SERVER_COUNT_HEADER = "cluster-proxy-server-count"
# A worker of a server with several: "I/N", its index and their count (clusterproxy_protocol.steering)
SERVER_WORKER_HEADER = "cluster-proxy-server-worker"

# Request headers of the cert-signer's GET /v1/trust-bundle: what the caller's TLS contexts have
# loaded, recorded for the certificate it authenticates with (a CA rotation waits on these reports).
TRUSTED_HEADER = "cluster-proxy-trusted"  # sha256:<hex> of every CA the contexts trust, comma-separated
PRESENTING_HEADER = "cluster-proxy-presenting"  # serials (hex) of the leaves the contexts present

# Control paths the server asks an agent on the tunnel.
INFO_PATH = "/v1/info"

# The WebSocket transport (websocket.py): the agent's upgrade request path and the subprotocol both
# ends require (a WebSocket endpoint that is not a proxy-server's does not choose it).
WEBSOCKET_PATH = "/v1/tunnel"
WEBSOCKET_SUBPROTOCOL = "cluster-proxy-tunnel.v1"

# TLS ALPN protocol ids.
ALPN_H2 = "h2"
ALPN_HTTP1 = "http/1.1"

# A cluster name: a DNS-1123 subdomain (as Kubernetes names a ManagedCluster), at most 253 characters.
CLUSTER_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


EXPECTED_HOSTPORT = "expected HOST:PORT, e.g. 10.0.0.1:443, kubernetes.default.svc:443 or [fd00::1]:443"


class MalformedAddress(ValueError):
    """``HOST:PORT`` text that cannot be read; the message says why, without the text itself."""


def format_authority(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets: ``[::1]:443``."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def format_address(sock_name: tuple[str, int] | tuple[str, int, int, int]) -> str:
    """A socket's ``getsockname()`` / ``getpeername()`` as ``host:port``."""
    return format_authority(sock_name[0], sock_name[1])


def split_hostport(text: str) -> tuple[str, str]:
    """``host:port`` or ``[v6]:port`` -> (host without brackets, port text), neither checked further.
    Raises :class:`MalformedAddress` whose message is the reason alone (callers quote the text)."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1 : end + 2] != ":":
            raise MalformedAddress("expected [IPv6]:PORT, e.g. [fd00::1]:443")
        return text[1:end], text[end + 2 :]
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise MalformedAddress(EXPECTED_HOSTPORT)
    if ":" in host:
        raise MalformedAddress(f"put an IPv6 address in brackets, e.g. [{host}]:{port_text or 443}")
    return host, port_text


def port_number(text: str) -> int | None:
    """``text`` as a TCP port 1-65535, or None. ASCII digits only: ``str.isdigit`` alone takes "¹"
    too, which ``int`` then refuses."""
    if not (text.isascii() and text.isdigit()):
        return None
    port = int(text)
    return port if 0 < port < 65536 else None


def parse_authority(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` with a port 1-65535 -> (host without brackets, port)."""
    host, port_text = split_hostport(text)
    port = port_number(port_text)
    if port is None:
        raise MalformedAddress(f"port must be 1-65535, not {port_text!r}")
    return host, port
