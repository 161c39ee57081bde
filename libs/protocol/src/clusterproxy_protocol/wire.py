"""The wire vocabulary shared by server, agent, SDK and CLI: header names, paths, ALPN ids, the
cluster-name rule, and how an address is written and read. One place, so that both ends agree."""

from __future__ import annotations

import re

# Request and response headers of the tunnel and the client port.
CLUSTER_HEADER = "cluster-proxy-cluster"  # which cluster a client's CONNECT is for
REASON_HEADER = "cluster-proxy-reason"  # the one-line reason of a refusal
SERVER_ID_HEADER = "cluster-proxy-server-id"  # on the server's GET /v1/info to an agent
SERVER_COUNT_HEADER = "cluster-proxy-server-count"

# Control paths the server asks an agent on the tunnel.
INFO_PATH = "/v1/info"

# TLS ALPN protocol ids.
ALPN_H2 = "h2"
ALPN_HTTP1 = "http/1.1"

# A cluster name: a DNS-1123 subdomain, as Kubernetes names a ManagedCluster.
CLUSTER_NAME = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")


class MalformedAddress(ValueError):
    """``HOST:PORT`` text that cannot be read; the message says why, quoting the text."""


def format_authority(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets: ``[::1]:443``."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def format_address(sock_name: tuple[str, int] | tuple[str, int, int, int]) -> str:
    """A socket's ``getsockname()`` / ``getpeername()`` as ``host:port``."""
    return format_authority(sock_name[0], sock_name[1])


def parse_authority(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port) with the brackets removed."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise MalformedAddress(f"malformed address {text!r}: expected [IPv6]:PORT")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or ":" in host:
            raise MalformedAddress(f"malformed address {text!r}: expected HOST:PORT")
    if not host:
        raise MalformedAddress(f"malformed address {text!r}: empty host")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise MalformedAddress(f"malformed address {text!r}: port must be 1-65535")
    return host, int(port_text)
