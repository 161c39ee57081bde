"""The agent's settings (``main.py`` fills them from flags and their environment twins) and the
converters of its own flags' values."""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from clusterproxy_agent.agent import AgentConfig, agent_version
from clusterproxy_agent.control import ServiceAccountSettings
from clusterproxy_agent.egress import EgressPolicy, Rule
from clusterproxy_protocol import (
    CLUSTER_NAME,
    WEBSOCKET_PATH,
    CertFiles,
    ForwardProxy,
    InvalidValue,
    ProxySettings,
    ReloadingContext,
    Route,
    SignerEndpoint,
    SignerSettings,
    TunnelSettings,
    agent_uri,
    client_context,
    format_authority,
    host_header,
    parse_dialable_hostport,
)

__all__ = ["TUNNEL", "AgentSettings", "WebSocketEndpoint", "agent_id", "cluster_name", "server_addresses"]

# --- converters -----------------------------------------------------------------------------------------


def cluster_name(text: str) -> str:
    """A Kubernetes object name (RFC 1123 subdomain): lower-case letters, digits, '-' and '.'."""
    name = text.strip()
    if not name or len(name) > 253 or not CLUSTER_NAME.match(name):
        raise InvalidValue(
            f"invalid cluster name {text!r}: use lower-case letters, digits, '-' and '.', starting and "
            "ending with a letter or digit (a Kubernetes object name, at most 253 characters)"
        )
    return name


def agent_id(text: str) -> str:
    value = text.strip()
    try:
        agent_uri("x", value)
    except ValueError:
        raise InvalidValue(
            f"invalid agent id {text!r}: use letters, digits, '.', '_' and '-' "
            "(starting and ending with a letter or digit, at most 253 characters)"
        ) from None
    return value


@dataclass(frozen=True)
class WebSocketEndpoint:
    """The tunnel carried in a WebSocket (``--server ws[s]://HOST[:PORT][/PATH]``): ``secure`` for
    ``wss://`` (TLS with the ingress in front of the hub), ``path`` of the upgrade request."""

    secure: bool
    path: str = WEBSOCKET_PATH

    def url(self, host: str, port: int) -> str:
        return f"{'wss' if self.secure else 'ws'}://{host_header(host, port, self.secure)}{self.path}"


ServerAddress = tuple[tuple[str, int], WebSocketEndpoint | None]


def server_address(text: str) -> ServerAddress:
    """``HOST:PORT`` (the agent port: TLS over TCP) or ``wss://HOST[:PORT][/PATH]`` / ``ws://...``
    (a WebSocket endpoint: an ingress in front of the proxy-server's WebSocket port)."""
    if "://" not in text:
        return parse_dialable_hostport(text), None
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in ("ws", "wss"):
        raise InvalidValue(
            f"invalid server address {text!r}: {scheme}:// is not a transport; give HOST:PORT for the "
            "agent port, or wss://HOST[:PORT][/PATH] for the WebSocket transport"
        )
    if parts.username is not None or parts.query or parts.fragment:
        raise InvalidValue(
            f"invalid server address {text!r}: a WebSocket URL takes no user info, query or fragment"
        )
    try:
        port = parts.port or (443 if scheme == "wss" else 80)
    except ValueError:
        raise InvalidValue(f"invalid server address {text!r}: the port must be 1-65535") from None
    if not parts.hostname:
        raise InvalidValue(f"invalid server address {text!r}: no host")
    path = parts.path if parts.path not in ("", "/") else WEBSOCKET_PATH
    return (parts.hostname, port), WebSocketEndpoint(secure=scheme == "wss", path=path)


def server_addresses(text: str) -> list[ServerAddress]:
    """``HOST:PORT`` or a ``wss://`` URL, or several separated by commas: the proxy-server replicas."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise InvalidValue(
            f"invalid server address {text!r}: expected HOST:PORT[,HOST:PORT...] or wss://HOST[:PORT][/PATH]"
        )
    return [server_address(item) for item in items]


def default_agent_id() -> str:
    host = socket.gethostname().split(".", 1)[0] or "agent"
    try:
        return agent_id(host)
    except InvalidValue:
        return "agent"


# --- settings ---------------------------------------------------------------------------------------------

# The tunnel's abuse limits. No reset budget by default: the only peer is the authenticated hub, which
# carries every hub client's resets (each client connection has its own budget there); a budget here
# would let one client's abuse take down the tunnel every client shares.
# Stream windows start at 64 KiB and grow while the target keeps up: a target that stops reading pins
# 64 KiB per stream, not the whole window (charged to --buffer-budget).
TUNNEL = TunnelSettings(initial_stream_window=64 << 10, stall_timeout=60.0)


@dataclass
class AgentSettings:
    server: tuple[str, int]  # the first (often the only) address of --server
    cluster: str
    ca: Path
    cert: Path
    key: Path
    server_name: str = ""
    agent_id: str = field(default_factory=default_agent_id)
    kube_apiserver: tuple[str, int] = ("kubernetes.default.svc", 443)
    serviceaccounts: ServiceAccountSettings | None = None  # the control endpoint's (control.py)
    dial_timeout: float = 10.0
    allow: list[Rule] = field(default_factory=list)
    deny: list[Rule] = field(default_factory=list)
    default_deny: bool = True
    admin_listen: tuple[str, int] = ("0.0.0.0", 8093)
    connect_timeout: float = 10.0
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    replica_search_backoff_max: float = 2.0
    keepalive_interval: float = 30.0  # as the server's: ours PINGs after 45 s of its silence only
    keepalive_timeout: float = 20.0
    drain_timeout: float = 30.0
    log_level: str = "info"
    log_format: str = "auto"
    # cert-signer: bootstrap --cert/--key from a token, renew them, follow the trust bundle
    signer: str | None = None
    bootstrap_token: str | None = None
    trust_refresh: float = 60.0
    tunnel: TunnelSettings = TUNNEL  # HTTP/2 settings and abuse limits of the tunnel
    buffer_budget: int = AgentConfig.buffer_budget  # every stream's window together (agent.Agent.buffers)
    # forward proxy for the hub and the signer: flags or HTTPS_PROXY / NO_PROXY (ProxySettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    proxy_ca_file: Path | None = None
    # every address of --server: one (load-balanced: dialed until each replica is held) or one per
    # replica; empty means [server]
    servers: list[tuple[str, int]] = field(default_factory=list)
    # the tunnel inside a WebSocket to each server address (--server wss://...), None: TLS over TCP
    websocket: WebSocketEndpoint | None = None
    websocket_ca_file: Path | None = None  # verifies a wss:// endpoint (else the system's trust store)

    def __post_init__(self) -> None:
        if not self.servers:
            self.servers = [self.server]
        if not self.server_name:
            self.server_name = self.server[0]

    @property
    def server_list(self) -> str:
        return ",".join(self.server_label(address) for address in self.servers)

    def server_label(self, address: tuple[str, int]) -> str:
        """``HOST:PORT``, or the WebSocket URL it is reached at."""
        if self.websocket is not None:
            return self.websocket.url(*address)
        return format_authority(*address)

    def policy(self) -> EgressPolicy:
        return EgressPolicy.build(
            self.allow, self.deny, default_deny=self.default_deny, kube_apiserver=self.kube_apiserver
        )

    def ssl_context(self) -> ssl.SSLContext:
        return client_context(self.cert, self.key, self.ca, alpn=["h2"])

    def reloading_context(self) -> ReloadingContext:
        """The context for each dial, kept in step with the files (renewal, trust bundle changes)."""
        return ReloadingContext.client(self.cert, self.key, self.ca, alpn=["h2"])

    def cert_files(self) -> CertFiles:
        return CertFiles(self.cert, self.key, self.ca)

    def forward_proxy(self, host: str, port: int) -> tuple[ForwardProxy | None, Route]:
        """The forward proxy to reach ``host:port`` through (None: dial it directly), and why."""
        route = self.proxy.route(host, port)
        if route.proxy is None:
            return None, route
        return ForwardProxy(route.proxy, self.proxy_ca_file, f"cluster-proxy-agent/{agent_version()}"), route

    def signer_address(self) -> tuple[str, int]:
        assert self.signer
        endpoint = SignerEndpoint.parse(self.signer, self.ca)
        return endpoint.host, endpoint.port

    def signer_endpoint(self) -> SignerEndpoint:
        assert self.signer
        proxy, _route = self.forward_proxy(*self.signer_address())
        return SignerEndpoint.parse(self.signer, self.ca, proxy=proxy)

    def signer_settings(self) -> SignerSettings | None:
        """``--signer``, ``--bootstrap-token``, ``--trust-refresh`` (None without a signer)."""
        if not self.signer:
            return None
        return SignerSettings(self.signer, self.bootstrap_token, self.trust_refresh)

    def proxy_notes(self) -> list[str]:
        """Proxy settings found and not used, for a warning at start."""
        notes = list(self.proxy.notes)
        routes = [self.proxy.route(*address) for address in self.servers]
        if self.signer:
            routes.append(self.proxy.route(*self.signer_address()))
        if self.proxy_ca_file and not any(r.proxy and r.proxy.scheme == "https" for r in routes):
            notes.append(f"--proxy-ca-file {self.proxy_ca_file} is not used: no https:// proxy applies")
        return notes

    def summary(self) -> dict[str, object]:
        """The effective configuration for the startup log (paths only, never key material)."""
        return {
            "server": self.server_list,
            "server_name": self.server_name,
            "kube_apiserver": format_authority(*self.kube_apiserver),
            "serviceaccount_namespace": self.serviceaccounts.namespace if self.serviceaccounts else None,
            "ca": str(self.ca),
            "cert": str(self.cert),
            "key": str(self.key),
            "dial_timeout": self.dial_timeout,
            "egress": self.policy().describe(),
            "default_deny": self.default_deny,
            "admin_listen": format_authority(*self.admin_listen),
            "connect_timeout": self.connect_timeout,
            "backoff_initial": self.backoff_initial,
            "backoff_max": self.backoff_max,
            "replica_search_backoff_max": self.replica_search_backoff_max,
            "keepalive_interval": self.keepalive_interval,
            "keepalive_timeout": self.keepalive_timeout,
            "drain_timeout": self.drain_timeout,
            "signer": self.signer,
            "trust_refresh": self.trust_refresh if self.signer else None,
            "proxy_to_server": "; ".join(self.proxy.route(*address).why for address in self.servers),
            "proxy_to_signer": self.proxy.route(*self.signer_address()).why if self.signer else None,
            "proxy_ca_file": str(self.proxy_ca_file) if self.proxy_ca_file else None,
            "transport": "websocket" if self.websocket is not None else "tls",
            "websocket_ca_file": str(self.websocket_ca_file) if self.websocket_ca_file else None,
            "version": agent_version(),
        }
