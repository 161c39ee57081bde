"""``cluster-proxy-agent``: the command line (flags and their environment twins) and ``main``.

The settings are in ``config.py``, the running agent (tunnels, admin port, certificate renewal,
drain) in ``app.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from clusterproxy_agent.agent import AgentConfig
from clusterproxy_agent.app import serve
from clusterproxy_agent.config import (
    TUNNEL,
    AgentSettings,
    agent_id,
    cluster_name,
    default_agent_id,
    server_addresses,
)
from clusterproxy_agent.control import ServiceAccountSettings
from clusterproxy_agent.egress import parse_rule
from clusterproxy_protocol import (
    LOG_FORMATS,
    SIGNER_HELP,
    ConfigError,
    NoProxy,
    ProxySettings,
    ProxyURL,
    SignerSettings,
    add_certificate_flags,
    add_log_flags,
    add_signer_flags,
    allocator,
    check_without_signer,
    configure_logging,
    existing_file,
    failure_in_log,
    flag_adder,
    format_authority,
    format_size,
    get_logger,
    parse_args_or_exit,
    parse_count,
    parse_dialable_hostport,
    parse_duration,
    parse_hostport,
    parse_positive_duration,
    parse_size,
    run_service,
    web_client_context,
    workarounds,
)

__all__ = ["AgentSettings", "build_parser", "main", "parse_settings", "serve"]

ENV_PREFIX = "CLUSTER_PROXY_AGENT_"
PROG = "cluster-proxy-agent"
IN_CLUSTER_KUBE_APISERVER = ("kubernetes.default.svc", 443)
SERVICEACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")  # the pod's own token and CA


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="cluster-proxy agent: dials out to the hub's proxy-server and serves its tunnel streams "
        "inside this cluster's network.",
    )

    flag = flag_adder(parser, ENV_PREFIX)

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
    add_certificate_flags(
        flag,
        ca_help="CA bundle to verify the server",
        cert_help="agent certificate (PEM); with --signer it is written (and renewed) there",
        key_help="agent private key (PEM); with --signer, as --cert",
        ca_type=existing_file,
        metavar="FILE",
    )
    add_signer_flags(
        flag,
        signer_help=SIGNER_HELP + "dropping the tunnel",
        token_help="single-use token bound to this cluster (cluster-proxy certs token create --cluster NAME); "
        "only used when --cert/--key hold no valid certificate",
        trust_refresh=True,
        trust_refresh_metavar="DURATION",
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
        metavar="HOST:PORT",
        help="where the bare cluster name as dial host leads (default, in a pod: the address the kubelet "
        "gives in KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT, as client-go's in-cluster "
        "config; elsewhere kubernetes.default.svc:443)",
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
        default="30s",
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


def in_cluster_kube_apiserver(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> tuple[str, int]:
    """The kube-apiserver's address as the kubelet gives every pod (the ``kubernetes`` Service's
    cluster IP and port): no DNS lookup, so the tunnel reaches the API server while the cluster's DNS
    is down or being moved (a node drain evicts CoreDNS with the agent). Outside a pod, the name."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST", ""), environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host:
        return IN_CLUSTER_KUBE_APISERVER
    try:
        return parse_dialable_hostport(format_authority(host, int(port or 443)))
    except ValueError as exc:
        parser.error(f"KUBERNETES_SERVICE_HOST={host!r} KUBERNETES_SERVICE_PORT={port!r}: {exc}")
        raise  # not reached: parser.error exits


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
        agent_id=args.agent_id or default_agent_id(),
        ca=args.ca,
        cert=args.cert,
        key=args.key,
        kube_apiserver=args.kube_apiserver or in_cluster_kube_apiserver(parser, environ),
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
    signer = SignerSettings.from_args(args)
    if signer is not None:
        settings.signer, settings.bootstrap_token = signer.url, signer.bootstrap_token
        settings.trust_refresh = signer.trust_refresh
        # The certificate may not exist yet (the first start bootstraps it); the CA bundle must: it is
        # how the signer is verified.
        return settings
    check_without_signer(
        parser.error, tokens=[("--bootstrap-token", args.bootstrap_token)], files=(), needs="--signer"
    )
    try:
        settings.ssl_context()
    except ConfigError as exc:
        parser.error(f"--ca/--cert/--key: {exc}")
    return settings


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
    sys.exit(run_service(serve, settings, on_failure=failure_in_log(log, "agent_failed")))


if __name__ == "__main__":
    main()
