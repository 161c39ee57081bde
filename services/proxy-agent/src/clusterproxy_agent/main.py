"""``cluster-proxy-agent``: command line, startup, admin endpoints, graceful shutdown."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import socket
import ssl
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import trio

from clusterproxy_agent.agent import Agent, AgentConfig, agent_version
from clusterproxy_agent.aiming import aimed_dial
from clusterproxy_agent.control import ControlEndpoint, ServiceAccountSettings
from clusterproxy_agent.egress import EgressPolicy, Rule, parse_rule
from clusterproxy_agent.replicas import ReplicaSet
from clusterproxy_agent.tunnel import Opener, TunnelOptions, tls_opener, websocket_carrier
from clusterproxy_protocol import allocator, certclient, workarounds
from clusterproxy_protocol.admin import Response, metrics_response, serve_admin
from clusterproxy_protocol.bootstrap import bootstrap_with_retry
from clusterproxy_protocol.certclient import CertFiles, SignerEndpoint
from clusterproxy_protocol.config import (
    ConfigError,
    InvalidValue,
    add_flag,
    existing_file,
    format_size,
    parse_args_or_exit,
    parse_count,
    parse_dialable_hostport,
    parse_duration,
    parse_hostport,
    parse_positive_duration,
    parse_size,
)
from clusterproxy_protocol.forward_proxy import NoProxy, ProxySettings, ProxyURL, Route
from clusterproxy_protocol.forward_proxy_trio import ForwardProxy
from clusterproxy_protocol.logs import LOG_FORMATS, add_log_flags, configure_logging, get_logger
from clusterproxy_protocol.pki import agent_uri
from clusterproxy_protocol.reloader import ReloadingContext
from clusterproxy_protocol.renewer import CertRenewer, RenewalPolicy
from clusterproxy_protocol.settings import TunnelSettings
from clusterproxy_protocol.tls import client_context, web_client_context
from clusterproxy_protocol.websocket import host_header
from clusterproxy_protocol.wire import CLUSTER_NAME, WEBSOCKET_PATH, format_authority

__all__ = ["AgentSettings", "build_parser", "main", "parse_settings", "serve"]

ENV_PREFIX = "CLUSTER_PROXY_AGENT_"
PROG = "cluster-proxy-agent"
SERVICEACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")  # the pod's own token and CA


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


def signer_url(text: str) -> str:
    """``https://HOST:PORT`` (or ``HOST:PORT``) of the cert-signer."""
    try:
        SignerEndpoint.parse(text, Path("."))  # the form only; --ca is checked on its own
    except ConfigError as exc:
        raise InvalidValue(str(exc)) from None
    return text.strip()


def _default_agent_id() -> str:
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
    agent_id: str = field(default_factory=_default_agent_id)
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
    keepalive_interval: float = 10.0
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="cluster-proxy agent: dials out to the hub's proxy-server and serves its tunnel streams "
        "inside this cluster's network.",
    )

    def flag(name: str, **kwargs: object) -> None:
        add_flag(parser, name, env=ENV_PREFIX + name.lstrip("-").upper().replace("-", "_"), **kwargs)  # type: ignore[arg-type]

    flag(
        "--server",
        type=server_addresses,
        multiple=True,
        required=True,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the proxy-server's agent port. One address (a load balancer or Service in front of every "
        "replica): the agent keeps dialing it until it holds a tunnel to each replica the servers "
        "count. Several addresses (comma-separated or repeated), one per replica: a tunnel to each. "
        "wss://HOST[:PORT][/PATH] (path default /v1/tunnel) carries the tunnel in a WebSocket, for a hub "
        "reachable only through an L7 ingress; the mutual TLS with the proxy-server runs inside it",
    )
    flag(
        "--websocket-ca-file",
        type=existing_file,
        metavar="FILE",
        help="CA bundle to verify the TLS of a wss:// --server (the ingress's certificate; default: the "
        "system's trust store). The proxy-server itself is verified with --ca as always",
    )
    flag(
        "--server-name",
        help="TLS name expected in the server certificate (default: the host of the first --server)",
    )
    flag("--cluster", type=cluster_name, required=True, help="name of this managed cluster")
    flag("--agent-id", type=agent_id, help="id of this agent replica (default: the host name)")
    flag("--ca", type=existing_file, required=True, metavar="FILE", help="CA bundle to verify the server")
    flag(
        "--cert",
        type=Path,
        required=True,
        metavar="FILE",
        help="agent certificate (PEM); with --signer it is written (and renewed) there",
    )
    flag(
        "--key",
        type=Path,
        required=True,
        metavar="FILE",
        help="agent private key (PEM); with --signer, as --cert",
    )
    flag(
        "--signer",
        type=signer_url,
        metavar="URL",
        help="cert-signer (https://HOST:PORT, verified with --ca): bootstrap --cert/--key with "
        "--bootstrap-token when they hold no valid certificate, renew them at 80% of their lifetime "
        "and follow the trust bundle, all without dropping the tunnel",
    )
    flag(
        "--bootstrap-token",
        metavar="TOKEN",
        help="single-use token bound to this cluster (cluster-proxy certs token create --cluster NAME); "
        "only used when --cert/--key hold no valid certificate",
    )
    flag(
        "--trust-refresh",
        metavar="DURATION",
        type=parse_duration,
        default="1m",
        help="with --signer: how often the trust bundle is fetched (a CA rotation is noticed within "
        "it; while one is under way the signer asks for sooner refreshes); 0: never (no CA rotation)",
    )
    flag(
        "--proxy-url",
        type=ProxyURL.parse,
        metavar="URL",
        help="forward proxy to reach the hub and the cert-signer through (HTTP CONNECT; the mTLS stays "
        "end to end): http://[USER:PASSWORD@]HOST:PORT or https://...; user info is sent as Basic "
        "proxy authorization; SOCKS is not supported (default: HTTPS_PROXY, then https_proxy)",
    )
    flag(
        "--proxy-ca-file",
        type=existing_file,
        metavar="FILE",
        help="CA bundle to verify an https:// proxy's certificate (default: the system's trust store)",
    )
    flag(
        "--no-proxy",
        type=NoProxy.parse,
        metavar="LIST",
        help="destinations reached directly, comma-separated: * (all), example.com (it and its "
        "subdomains), .example.com (subdomains), IPs, CIDRs, each with an optional :PORT; host names "
        "are matched as written in --server/--signer, not resolved (default: NO_PROXY, then no_proxy)",
    )
    flag(
        "--kube-apiserver",
        type=parse_dialable_hostport,
        default="kubernetes.default.svc:443",
        metavar="HOST:PORT",
        help="where the bare cluster name as dial host leads",
    )
    flag(
        "--serviceaccount-namespace",
        metavar="NAMESPACE",
        help="serve the hub's managed service accounts: ServiceAccounts and their TokenRequest tokens in this "
        "namespace of the cluster, asked for through the tunnel by an authorized hub client "
        "(docs/managed-serviceaccount.md); unset: the control endpoint answers 503",
    )
    flag(
        "--kube-token-file",
        type=Path,
        default=str(SERVICEACCOUNT_DIR / "token"),
        metavar="FILE",
        help="with --serviceaccount-namespace: the agent's own ServiceAccount token (read at each call)",
    )
    flag(
        "--kube-ca-file",
        type=Path,
        default=str(SERVICEACCOUNT_DIR / "ca.crt"),
        metavar="FILE",
        help="with --serviceaccount-namespace: the CA of the cluster's kube-apiserver (also handed to the hub "
        "with each token)",
    )
    flag(
        "--dial-timeout",
        metavar="DURATION",
        type=parse_positive_duration,
        default="10s",
        help="bound on resolving and connecting a target",
    )
    flag(
        "--allow",
        type=parse_rule,
        multiple=True,
        metavar="RULE",
        help="egress allow rule (repeatable): CIDR, host pattern like *.svc, optional :PORTS "
        "(default: the kube-apiserver, *.svc, *.svc.cluster.local)",
    )
    flag("--deny", type=parse_rule, multiple=True, metavar="RULE", help="egress deny rule (repeatable)")
    flag(
        "--default-deny",
        type=bool,
        default=True,
        help="built-in denies: link-local and cloud metadata endpoints (--no-default-deny turns them off)",
    )
    flag(
        "--admin-listen",
        type=parse_hostport,
        default="0.0.0.0:8093",
        metavar="HOST:PORT",
        help="admin HTTP (port 0: any free port)",
    )
    flag(
        "--connect-timeout",
        metavar="DURATION",
        type=parse_positive_duration,
        default="10s",
        help="bound on TCP connect plus TLS handshake to the server",
    )
    flag(
        "--backoff-initial",
        metavar="DURATION",
        type=parse_positive_duration,
        default="0.5s",
        help="first reconnect delay ceiling",
    )
    flag(
        "--backoff-max",
        metavar="DURATION",
        type=parse_positive_duration,
        default="30s",
        help="largest reconnect delay ceiling",
    )
    flag(
        "--replica-search-backoff-max",
        metavar="DURATION",
        type=parse_positive_duration,
        default="2s",
        help="the longest wait between dials that cost the hub no TLS handshake: dials refused with "
        "nothing listening (a restarting proxy-server is found within it) and, behind a load balancer "
        "while a replica is missing, dials that reach replicas already held (one handshake per wait)",
    )
    flag(
        "--keepalive-interval",
        metavar="DURATION",
        type=parse_positive_duration,
        default="10s",
        help="PING the hub after 1.5 times this without hearing from it (its own PINGs, every "
        "--keepalive-interval of the server, or data keep a live tunnel from needing ours)",
    )
    flag(
        "--keepalive-timeout",
        metavar="DURATION",
        type=parse_positive_duration,
        default="20s",
        help="a PING unanswered this long kills the tunnel",
    )
    flag(
        "--drain-timeout",
        metavar="DURATION",
        type=parse_duration,
        default="30s",
        help="on SIGTERM, how long open streams may take to finish",
    )
    flag(
        "--buffer-budget",
        type=parse_size,
        default=format_size(AgentConfig.buffer_budget),
        help="bytes of stream windows (data from the hub that targets have not read yet) the agent may "
        "hold for all streams together; new streams get 503 beyond it; 0: no bound",
    )
    flag(
        "--initial-stream-window",
        type=parse_size,
        default=format_size(TUNNEL.initial_stream_window),
        help="HTTP/2 stream window a stream starts with; it doubles up to 1 MiB while its target keeps up",
    )
    flag(
        "--reset-budget",
        type=parse_count,
        default=str(TUNNEL.reset_budget),
        help="streams the server may open and then reset per 10 s on one tunnel before it is closed "
        "(GOAWAY ENHANCE_YOUR_CALM); 0: no limit (the server budgets each of its clients)",
    )
    flag(
        "--max-reply-backlog",
        type=parse_size,
        default="256KiB",
        help="bytes of control replies (PING/SETTINGS ACKs, RST_STREAMs) the server may leave unread "
        "before the tunnel is closed; 0: no limit",
    )
    flag(
        "--frame-timeout",
        metavar="DURATION",
        type=parse_duration,
        default="30s",
        help="an HTTP/2 frame must arrive whole within this of its first byte, else the tunnel is "
        "closed; 0: no limit",
    )
    flag(
        "--stream-stall-timeout",
        metavar="DURATION",
        type=parse_duration,
        default="60s",
        help="a stream blocked on flow control with no byte either way this long is reset; 0: never",
    )
    add_log_flags(flag)
    return parser


def parse_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> AgentSettings:
    """Parse and validate everything; a bad value exits with status 2 and a message naming it."""
    parser = build_parser()
    environ = os.environ if environ is None else environ
    args = parse_args_or_exit(parser, argv, environ=environ)
    if args.backoff_max < args.backoff_initial:
        parser.error(
            f"--backoff-max {args.backoff_max:g}s is smaller than --backoff-initial {args.backoff_initial:g}s"
        )
    if not math.isfinite(args.drain_timeout):
        parser.error(f"--drain-timeout {args.drain_timeout!r} must be finite")
    given = [address for addresses in args.server for address in addresses]
    servers = [address for address, _websocket in given]
    repeated = sorted({format_authority(*a) for a in servers if servers.count(a) > 1})
    if repeated:
        parser.error(f"--server lists {', '.join(repeated)} more than once: give each replica once")
    transports = {websocket for _address, websocket in given}
    if len(transports) > 1:
        parser.error(
            "--server mixes transports or WebSocket paths: give every replica the same way (all HOST:PORT, "
            "or all wss:// URLs with one path)"
        )
    websocket = transports.pop()
    if args.websocket_ca_file is not None:
        if websocket is None or not websocket.secure:
            parser.error("--websocket-ca-file verifies a wss:// --server, and none is given")
        try:
            web_client_context(args.websocket_ca_file)
        except ConfigError as exc:
            parser.error(f"--websocket-ca-file: {exc}")
    settings = AgentSettings(
        server=servers[0],
        servers=servers,
        websocket=websocket,
        websocket_ca_file=args.websocket_ca_file,
        server_name=(args.server_name or "").strip(),
        cluster=args.cluster,
        agent_id=args.agent_id or _default_agent_id(),
        ca=args.ca,
        cert=args.cert,
        key=args.key,
        kube_apiserver=args.kube_apiserver,
        serviceaccounts=(
            ServiceAccountSettings(args.serviceaccount_namespace, args.kube_token_file, args.kube_ca_file)
            if args.serviceaccount_namespace
            else None
        ),
        dial_timeout=args.dial_timeout,
        allow=list(args.allow),
        deny=list(args.deny),
        default_deny=args.default_deny,
        admin_listen=args.admin_listen,
        connect_timeout=args.connect_timeout,
        backoff_initial=args.backoff_initial,
        backoff_max=args.backoff_max,
        replica_search_backoff_max=args.replica_search_backoff_max,
        keepalive_interval=args.keepalive_interval,
        keepalive_timeout=args.keepalive_timeout,
        drain_timeout=args.drain_timeout,
        log_level=args.log_level,
        log_format=args.log_format,
    )
    try:
        settings.proxy = ProxySettings.resolve(
            proxy_url=args.proxy_url,
            proxy_url_source="--proxy-url",
            no_proxy=args.no_proxy,
            no_proxy_source="--no-proxy",
            environ=environ,
        )
    except ConfigError as exc:
        parser.error(str(exc))
    settings.proxy_ca_file = args.proxy_ca_file
    if settings.proxy_ca_file is not None:
        try:
            web_client_context(settings.proxy_ca_file)
        except ConfigError as exc:
            parser.error(f"--proxy-ca-file: {exc}")
    try:
        settings.tunnel = dataclasses.replace(
            TUNNEL,
            initial_stream_window=args.initial_stream_window,
            reset_budget=args.reset_budget,
            max_reply_backlog=args.max_reply_backlog,
            frame_timeout=args.frame_timeout,
            stall_timeout=args.stream_stall_timeout,
        )
    except ValueError as exc:
        parser.error(str(exc))
    settings.buffer_budget = args.buffer_budget
    if args.signer:
        settings.signer = args.signer
        settings.bootstrap_token = (args.bootstrap_token or "").strip() or None
        settings.trust_refresh = args.trust_refresh
        if not math.isfinite(args.trust_refresh) or args.trust_refresh < 0:
            parser.error(f"--trust-refresh {args.trust_refresh!r} must be finite and not negative")
        # The certificate may not exist yet (the first start bootstraps it); the CA bundle must: it is
        # how the signer is verified.
        return settings
    if args.bootstrap_token:
        parser.error("--bootstrap-token needs --signer")
    try:
        settings.ssl_context()
    except ConfigError as exc:
        parser.error(f"--ca/--cert/--key: {exc}")
    return settings


async def bootstrap(settings: AgentSettings) -> None:
    """With a signer: trade the bootstrap token for a first certificate when the files hold no valid
    one. A refused token (used, expired, for another cluster) is final: ConfigError with the signer's
    reason. A signer that does not answer yet is retried (``bootstrap_with_retry``)."""
    if not settings.signer:
        return
    await bootstrap_with_retry(
        settings.signer_endpoint(),
        settings.cert_files(),
        settings.bootstrap_token,
        lambda key: certclient.agent_csr(key, settings.cluster, settings.agent_id),
        get_logger("clusterproxy_agent", cluster=settings.cluster, agent_id=settings.agent_id),
    )


# --- running ---------------------------------------------------------------------------------------------


class Service:
    """A running agent: tunnel, admin server; :meth:`shutdown` drains it."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.agent = Agent(
            AgentConfig(
                cluster=settings.cluster,
                agent_id=settings.agent_id,
                kube_apiserver=settings.kube_apiserver,
                dial_timeout=settings.dial_timeout,
                policy=settings.policy(),
                buffer_budget=settings.buffer_budget,
            ),
            control=ControlEndpoint(settings.cluster, settings.kube_apiserver, settings.serviceaccounts),
        )
        self.tls = settings.reloading_context()
        self.replicas = ReplicaSet(self.agent, [self._target(address) for address in settings.servers])
        self.renewer: CertRenewer | None = None
        if settings.signer:
            self.renewer = CertRenewer(
                settings.signer_endpoint(),
                settings.cert_files(),
                [self.tls],
                RenewalPolicy(trust_refresh=settings.trust_refresh),
            )
            self.agent.metrics.watch_renewer(self.renewer)
        self.log = self.agent.log
        self.admin_address = ""
        self.draining = False
        self.stop_requested = trio.Event()

    def _target(self, address: tuple[str, int]) -> tuple[TunnelOptions, Opener]:
        """How to reach one --server address: its tunnel options and its TLS opener (through the
        forward proxy that applies to it, if any; in a WebSocket with a wss:// --server)."""
        settings = self.settings
        proxy, _route = settings.forward_proxy(*address)
        options = TunnelOptions(
            server=address,
            url=settings.websocket.url(*address) if settings.websocket is not None else None,
            connect_timeout=settings.connect_timeout,
            keepalive=(settings.keepalive_interval, settings.keepalive_timeout),
            backoff_initial=settings.backoff_initial,
            backoff_max=settings.backoff_max,
            search_backoff_max=settings.replica_search_backoff_max,
            settings=settings.tunnel,
            proxy=str(proxy) if proxy is not None else None,
        )
        carrier = None
        if settings.websocket is not None:
            ca_file = settings.websocket_ca_file
            outer = (lambda: web_client_context(ca_file)) if settings.websocket.secure else None
            carrier = websocket_carrier(*address, settings.websocket.path, outer)
        opener = tls_opener(
            address,
            self.tls,
            settings.server_name,
            dial=proxy.open if proxy else aimed_dial(self.agent),
            carrier=carrier,
        )
        return options, opener

    # admin routes
    def healthz(self) -> Response:
        return Response.text("ok")

    def readyz(self) -> Response:
        if self.draining:
            return Response.text("not ready: shutting down", 503)
        connected = self.agent.connected
        if connected:
            return Response.text(f"ok: {connected} tunnel(s) connected to {self.settings.server_list}")
        last = self.agent.last_error or "still connecting"
        return Response.text(f"not ready: no tunnel connected to {self.settings.server_list} ({last})", 503)

    def metrics(self) -> Response:
        return metrics_response(self.agent.metrics.registry)

    def servers(self) -> Response:
        return Response.json(self.agent.describe_servers())

    async def run(self, *, task_status: trio.TaskStatus[Service] = trio.TASK_STATUS_IGNORED) -> None:
        host, port = self.settings.admin_listen
        try:
            listeners = await trio.open_tcp_listeners(port, host=host or None)
        except OSError as exc:
            where = format_authority(*self.settings.admin_listen)
            raise ConfigError(f"cannot listen on --admin-listen {where}: {exc.strerror or exc}") from None
        sockname = listeners[0].socket.getsockname()
        self.admin_address = format_authority(str(sockname[0]), int(sockname[1]))
        async with trio.open_nursery() as nursery:
            await nursery.start(
                serve_admin,
                listeners,
                {
                    "/healthz": self.healthz,
                    "/readyz": self.readyz,
                    "/metrics": self.metrics,
                    "/api/v1/servers": self.servers,
                },
            )
            if self.renewer is not None:
                await nursery.start(self.renewer.run)
            await nursery.start(self.replicas.run)
            self.log.info("agent_started", admin_port=self.admin_address, server=self.settings.server_list)
            task_status.started(self)
            await self.stop_requested.wait()
            await self.shutdown()
            nursery.cancel_scope.cancel()

    async def shutdown(self) -> None:
        """Drain: no new streams, open ones get up to --drain-timeout, then every tunnel closes."""
        self.draining = True
        self.replicas.stop()
        self.agent.drain()
        open_streams = sum(m.open_streams for m in self.agent.tunnels)
        self.log.info("draining", open_streams=open_streams, drain_timeout=self.settings.drain_timeout)
        with trio.move_on_after(self.settings.drain_timeout) as scope:
            await self.agent.wait_idle()
        if scope.cancelled_caught:
            left = sum(m.open_streams for m in self.agent.tunnels)
            self.log.warning("drain_timeout", open_streams=left)
        self.agent.close_all("agent shutting down")
        with trio.move_on_after(5):
            await self.replicas.stopped.wait()
        self.log.info("agent_stopped")


async def serve(
    settings: AgentSettings, *, task_status: trio.TaskStatus[Service] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run until SIGTERM/SIGINT, then drain (a second signal cuts the drain short)."""
    await bootstrap(settings)
    service = Service(settings)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def watch_signals() -> None:
                count = 0
                async for signum in signals:
                    count += 1
                    name = signal.Signals(signum).name
                    if count == 1:
                        service.log.info("shutdown_requested", signal=name)
                        service.stop_requested.set()
                    else:
                        service.log.warning("shutdown_forced", signal=name)
                        service.agent.close_all("agent stopped")

            nursery.start_soon(watch_signals)
            await service.run(task_status=task_status)
            nursery.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> None:
    workarounds.apply()  # the third-party speed-ups; services only, never on import
    allocator.tune()
    settings = parse_settings(argv)
    json_logs = LOG_FORMATS[settings.log_format]
    configure_logging(settings.log_level, json=json_logs)
    log = get_logger("clusterproxy_agent", cluster=settings.cluster, agent_id=settings.agent_id)
    log.info("agent_starting", **settings.summary())
    for note in settings.proxy_notes():
        log.warning("proxy_setting_unused", note=note)
    try:
        trio.run(serve, settings)
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        leaves = _leaves(exc)
        if not all(isinstance(e, OSError | ConfigError) for e in leaves):
            raise
        log.error("agent_failed", error="; ".join(str(e) for e in leaves))
        sys.exit(1)
    sys.exit(0)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


if __name__ == "__main__":
    main()
