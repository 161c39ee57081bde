"""``cluster-proxy-server``: command line and process lifecycle."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import structlog
import trio

from clusterproxy_protocol import (
    CLUSTER_NAME,
    LOG_FORMATS,
    SIGNER_HELP,
    CertFiles,
    ConfigError,
    InvalidValue,
    SignerSettings,
    TunnelSettings,
    add_audit_flag,
    add_certificate_flags,
    add_log_flags,
    add_signer_flags,
    allocator,
    certclient,
    check_without_signer,
    configure_logging,
    existing_file,
    failure_on_stderr,
    flag_adder,
    format_size,
    get_logger,
    parse_args_or_exit,
    parse_count,
    parse_duration,
    parse_fraction,
    parse_hostport,
    parse_non_negative_float,
    parse_positive_duration,
    parse_positive_int,
    parse_size,
    run_service,
    serve_until_signalled,
    workarounds,
    worker_spec,
)
from clusterproxy_server.app import ProxyServer, ServerConfig
from clusterproxy_server.authz import load_policy
from clusterproxy_server.config import AGENT_TUNNEL, CLIENT_TUNNEL, FIRST_WINDOW
from clusterproxy_server.ejection import EjectionPolicy
from clusterproxy_server.quotas import QuotaSettings
from clusterproxy_server.workers import (
    WORKER_ENV,
    Supervisor,
    WorkerSpec,
    default_workers,
    follow_cert_files,
    watch_parent,
)

ENV = "CLUSTER_PROXY_SERVER_"
PROG = "cluster-proxy-server"
AGENT_ANSWER_TIMEOUT = 12.0  # the agents' default --dial-timeout (10 s) plus a margin
# With replicas, a new one waits this long for agents before refusing (most find it within a few
# seconds: docs/architecture.md, "High availability").
REPLICA_STARTUP_GRACE = 10.0
SERVER_CERT_NAME = "proxy-server"  # CN of a certificate from the signer (bootstrap tokens name it)


def _cluster_names(text: str) -> list[str]:
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    for name in names:
        if not CLUSTER_NAME.match(name):
            raise ConfigError(f"invalid cluster name {name!r}: expected a DNS name like cluster1")
    return names


def _tls_host(text: str) -> str:
    host = text.strip().removeprefix("[").removesuffix("]")
    if not host or any(c.isspace() or c in "/@" for c in host):
        raise InvalidValue(f"invalid TLS host {text!r}: expected a DNS name or an IP address")
    return host


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Hub side of cluster-proxy: agents dial in on the agent port; hub clients open "
        "CONNECT streams to targets inside managed clusters on the client port.",
    )

    flag = flag_adder(p, ENV)

    flag(
        "--agent-listen",
        type=parse_hostport,
        default="0.0.0.0:8091",
        help="address agents dial (mTLS, HTTP/2)",
    )
    flag(
        "--agent-websocket-listen",
        type=parse_hostport,
        metavar="HOST:PORT",
        help="also take agent tunnels carried in WebSockets (plain HTTP upgrade at /v1/tunnel, for an L7 "
        "ingress that terminates TLS in front of it; agents dial wss://INGRESS/v1/tunnel). The agent's "
        "mutual TLS runs inside the WebSocket, end to end (default: off)",
    )
    flag(
        "--client-listen",
        type=parse_hostport,
        default="0.0.0.0:8090",
        help="address hub clients use (mTLS; HTTP/2 CONNECT and HTTP/1.1 CONNECT)",
    )
    flag(
        "--admin-listen",
        type=parse_hostport,
        default="0.0.0.0:8092",
        help="plain HTTP: /healthz /readyz /metrics (no cluster or agent labels); mutual TLS with a hub "
        "client certificate on the same port: /api/v1/agents /api/v1/clusters /metrics (every label)",
    )
    add_certificate_flags(
        flag,
        ca_help="CA bundle trusted for agent and client certificates",
        cert_help="server certificate (PEM); with --signer it is written (and renewed) there",
        key_help="server private key (PEM); with --signer, as --cert",
        ca_type=existing_file,
    )
    add_signer_flags(
        flag,
        signer_help=SIGNER_HELP + "a restart",
        token_help="single-use token for the first certificate (cluster-proxy certs token create --server "
        "proxy-server --host ...); only used when --cert/--key hold no valid certificate",
        trust_refresh=True,
    )
    flag(
        "--tls-host",
        type=_tls_host,
        multiple=True,
        help="DNS name or IP address the server certificate is for (repeat); with --signer",
    )
    flag(
        "--client-policy",
        type=existing_file,
        metavar="FILE",
        help="JSON file mapping client certificates (subject or SAN) to the clusters they may reach; "
        "others get 403 (docs/certificates.md). Re-read when it changes. Default: every client "
        "reaches every cluster",
    )
    flag(
        "--control-client",
        multiple=True,
        metavar="CN",
        help="common name of a hub client certificate allowed to reach the agents' control endpoint (the "
        "managed service accounts' tokens; repeat; an empty value allows nobody; docs/managed-serviceaccount.md); "
        "default: cluster-gateway",
    )
    flag(
        "--server-id",
        help="this replica's identity, told to agents (each keeps one tunnel per id); unique per "
        "running process (default: the host name plus a random suffix, new at every start)",
    )
    flag(
        "--workers",
        type=parse_positive_int,
        metavar="N",
        help="worker processes sharing the ports, one per core to use: each is a replica to the agents "
        "(server id <--server-id>.w<i>, count --server-count x N), a client's stream is served by the "
        "worker that accepted its connection; the parent restarts a worker that dies, drains them all "
        "on SIGTERM, renews the certificate once and answers the admin port for all. 1: one process, "
        'as before (docs/architecture.md, "Workers"). Default: the cores this process may use (its CPU '
        "affinity, capped by its cgroup's CPU quota rounded up)",
    )
    flag(
        "--server-count",
        type=parse_positive_int,
        default="1",
        help="number of proxy-server replicas behind the agents' address: each agent keeps dialing it "
        "until it holds a tunnel to that many distinct replicas",
    )
    flag(
        "--startup-grace",
        type=parse_duration,
        help="for this long after start, a request for a cluster this replica has no agent of waits "
        "for one to connect (within --dial-timeout) instead of 404/503 at once: agents are still "
        "finding a new replica. Default: 10s with --server-count above 1, else 0",
    )
    flag(
        "--known-clusters",
        type=_cluster_names,
        default="",
        help="comma-separated clusters known before any agent connects (a request for one of them "
        "without an agent gets 503, not 404)",
    )
    flag(
        "--dial-timeout",
        type=parse_duration,
        default="30s",
        help="longest a client waits for its stream to open (an agent's answer, a retry on another "
        "agent included)",
    )
    flag(
        "--agent-answer-timeout",
        type=parse_positive_duration,
        help="longest one agent may take to answer a CONNECT; beyond it the agent has failed (it answers "
        "a slow target itself within its own --dial-timeout, 10s by default: keep this above the "
        "agents' value): the dial goes once to another agent of the cluster and counts toward "
        "ejecting the slow one. At most --dial-timeout. Default: 12s, or --dial-timeout if shorter",
    )
    flag(
        "--ejection-cooldown",
        type=parse_positive_duration,
        default="30s",
        help="how long a tunnel whose agent fails dials far more often than its cluster's other "
        "tunnels stays out of routing",
    )
    flag(
        "--ejection-window",
        type=parse_positive_duration,
        default="1m",
        help="how far back a tunnel's dial outcomes count for ejection",
    )
    flag(
        "--ejection-min-dials",
        type=parse_positive_int,
        default="5",
        help="dial outcomes a tunnel needs within the window before it can be ejected",
    )
    flag(
        "--ejection-failure-rate",
        type=parse_fraction,
        default="0.5",
        help="share of a tunnel's dials failed by its agent that ejects it (when also at least twice "
        "the share of the cluster's other tunnels)",
    )
    flag(
        "--max-pending-dials-per-connection",
        type=parse_positive_int,
        default="128",
        help="dials one client connection may have waiting for an agent's answer; more get 429",
    )
    flag(
        "--max-pending-dials-per-client",
        type=parse_positive_int,
        default="512",
        help="dials one client identity (certificate subject), over all its connections, may have "
        "waiting for an agent's answer; more get 429",
    )
    # Per client identity (quotas.py; docs/protocol.md, "Budgets per client"); 0 turns a bound off.
    # One row a bound: (flag, converter, default, help).
    defaults = QuotaSettings  # its fields' defaults
    for name, convert, default, text in (
        ("--client-max-connections", parse_count, str(defaults.max_connections),
         "client connections one identity (certificate subject) may hold; more are refused with 429"),
        ("--client-max-concurrent-streams", parse_count, str(defaults.max_streams),
         "streams one client identity may have open over all its connections; more get 429"),
        ("--client-stream-rate", parse_non_negative_float, f"{defaults.stream_rate:g}",
         "new streams per second one client identity may open (a token bucket of --client-stream-burst); "
         "more get 429"),
        ("--client-stream-burst", parse_count, str(defaults.stream_burst),
         "new streams one client identity may open at once before --client-stream-rate applies"),
        ("--client-buffer-budget", parse_size, format_size(defaults.buffer),
         "bytes of stream windows (data received and not read yet by the other end) the server may hold "
         "for one client identity; its new streams get 429 beyond it"),
        ("--connection-buffer-budget", parse_size, format_size(defaults.connection_buffer),
         "the same for one client connection"),
        ("--buffer-budget", parse_size, format_size(defaults.process_buffer),
         "the same for all clients together; new streams get 503 beyond it"),
    ):  # fmt: skip
        flag(name, type=convert, default=default, help=text)
    flag(
        "--handshake-timeout",
        type=parse_duration,
        default="10s",
        help="longest TLS handshake / request head / agent registration",
    )
    flag("--keepalive-interval", type=parse_duration, default="30s", help="PING interval on agent tunnels")
    flag(
        "--keepalive-timeout",
        type=parse_duration,
        default="20s",
        help="a tunnel whose PING is unanswered this long is declared dead",
    )
    flag(
        "--drain-timeout",
        type=parse_duration,
        default="30s",
        help="on SIGTERM, how long open streams may finish",
    )
    flag(
        "--shutdown-delay",
        type=parse_duration,
        default="0s",
        help="on SIGTERM, /readyz fails at once but the ports keep accepting and serving this long "
        "before the drain begins: the time a load balancer takes to stop sending new connections "
        "(a Kubernetes Service dropping the pod: a few seconds). 0: drain at once (a balancer that "
        "retries a refused connection elsewhere, like haproxy with option redispatch, needs none)",
    )
    flag(
        "--stream-window",
        type=parse_size,
        default="1MiB",
        help="largest HTTP/2 stream window a stream grows to while its reader keeps up",
    )
    flag(
        "--initial-stream-window",
        type=parse_size,
        default=format_size(FIRST_WINDOW),
        help="HTTP/2 stream window a stream starts with (65535 .. --stream-window)",
    )
    flag("--connection-window", type=parse_size, default="32MiB", help="HTTP/2 connection window")
    flag("--max-frame-size", type=parse_size, default="64KiB", help="HTTP/2 max frame size")
    # HTTP/2 abuse limits (docs/protocol.md, "Abuse limits"); defaults as in config.CLIENT_TUNNEL/AGENT_TUNNEL
    flag(
        "--client-max-streams",
        type=parse_positive_int,
        default=str(CLIENT_TUNNEL.max_concurrent_streams),
        help="concurrent streams per client HTTP/2 connection (advertised; the excess is refused "
        "with REFUSED_STREAM)",
    )
    flag(
        "--client-idle-timeout",
        type=parse_duration,
        default="5m",
        help="a client HTTP/2 connection with no stream open this long is closed; 0: never",
    )
    flag(
        "--reset-budget",
        type=parse_count,
        default=str(CLIENT_TUNNEL.reset_budget),
        help="streams a peer may open and then reset (or have refused) per 10 s on one HTTP/2 "
        "connection, client port and agent port; beyond it GOAWAY ENHANCE_YOUR_CALM (rapid reset); "
        "0: no limit",
    )
    flag(
        "--max-reply-backlog",
        type=parse_size,
        default="256KiB",
        help="bytes of control replies (PING/SETTINGS ACKs, RST_STREAMs) a peer may leave unread "
        "before its connection is closed (ENHANCE_YOUR_CALM); 0: no limit",
    )
    flag(
        "--frame-timeout",
        type=parse_duration,
        default="30s",
        help="an HTTP/2 frame (or header block) must arrive whole within this of its first byte, "
        "else the connection is closed; 0: no limit",
    )
    flag(
        "--stream-stall-timeout",
        type=parse_duration,
        default="60s",
        help="a stream blocked on flow control with no byte either way this long is reset, and a "
        "connection whose peer reads nothing this long is closed; 0: never",
    )
    add_log_flags(flag)
    add_audit_flag(flag)
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    try:
        tunnel = TunnelSettings(
            stream_window=args.stream_window,
            initial_stream_window=args.initial_stream_window,
            connection_window=args.connection_window,
            max_frame_size=args.max_frame_size,
            max_concurrent_streams=AGENT_TUNNEL.max_concurrent_streams,
            reset_budget=args.reset_budget,
            max_reply_backlog=args.max_reply_backlog,
            frame_timeout=args.frame_timeout,
            stall_timeout=args.stream_stall_timeout,
        )
        client_tunnel = dataclasses.replace(
            tunnel, max_concurrent_streams=args.client_max_streams, idle_timeout=args.client_idle_timeout
        )
        quotas = QuotaSettings(
            max_connections=args.client_max_connections,
            max_streams=args.client_max_concurrent_streams,
            stream_rate=args.client_stream_rate,
            stream_burst=args.client_stream_burst,
            buffer=args.client_buffer_budget,
            connection_buffer=args.connection_buffer_budget,
            process_buffer=args.buffer_budget,
        )
        ejection = EjectionPolicy(
            cooldown=args.ejection_cooldown,
            min_dials=args.ejection_min_dials,
            failure_rate=args.ejection_failure_rate,
            window=args.ejection_window,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.startup_grace is not None and not math.isfinite(args.startup_grace):
        raise ConfigError(f"--startup-grace {args.startup_grace!r} must be finite")
    for name, value in (("--drain-timeout", args.drain_timeout), ("--shutdown-delay", args.shutdown_delay)):
        if not math.isfinite(value):
            raise ConfigError(f"{name} {value!r} must be finite")
    answer_timeout = args.agent_answer_timeout or min(AGENT_ANSWER_TIMEOUT, args.dial_timeout)
    if answer_timeout > args.dial_timeout:
        raise ConfigError(
            f"--agent-answer-timeout ({args.agent_answer_timeout:g}s) is longer than --dial-timeout "
            f"({args.dial_timeout:g}s): a client would give up before the agent is judged"
        )
    config = ServerConfig(
        ca=args.ca,
        cert=args.cert,
        key=args.key,
        agent_listen=args.agent_listen,
        agent_websocket_listen=args.agent_websocket_listen,
        client_listen=args.client_listen,
        admin_listen=args.admin_listen,
        server_count=args.server_count,
        known_clusters=set(args.known_clusters),
        dial_timeout=args.dial_timeout,
        agent_answer_timeout=answer_timeout,
        ejection=ejection,
        max_pending_dials_per_connection=args.max_pending_dials_per_connection,
        max_pending_dials_per_client=args.max_pending_dials_per_client,
        quotas=quotas,
        handshake_timeout=args.handshake_timeout,
        keepalive_interval=args.keepalive_interval,
        keepalive_timeout=args.keepalive_timeout,
        drain_timeout=args.drain_timeout,
        shutdown_delay=args.shutdown_delay,
        startup_grace=_startup_grace(args, args.server_count),
        tunnel=tunnel,
        client_tunnel=client_tunnel,
        audit_log=args.audit_log,
    )
    if args.server_id:
        config.server_id = args.server_id
    signer = SignerSettings.from_args(args)
    if signer is not None:
        config.signer, config.bootstrap_token = signer.url, signer.bootstrap_token
        config.tls_hosts = tuple(dict.fromkeys(args.tls_host))
        config.trust_refresh = signer.trust_refresh
    else:
        check_without_signer(
            _config_error,
            tokens=[("--bootstrap-token", args.bootstrap_token), ("--tls-host", args.tls_host)],
            files=[("--cert", args.cert), ("--key", args.key)],
            needs="--signer",
            missing="{flag}: {error} (or use --signer to get one)",
        )
    if args.control_client:
        config.control_clients = tuple(name.strip() for name in args.control_client if name.strip())
    if args.client_policy is not None:
        config.client_policy = args.client_policy
        load_policy(args.client_policy)  # a broken policy stops the start, not the first request
    return config


def _config_error(message: str) -> NoReturn:
    raise ConfigError(message)


async def bootstrap(config: ServerConfig) -> None:
    """With a signer: get a first certificate when the files hold no valid one (else nothing)."""
    if not config.signer:
        return
    signer = SignerSettings(config.signer, config.bootstrap_token, config.trust_refresh)
    files = CertFiles(config.cert, config.key, config.ca)
    if signer.needs_bootstrap(files) and not config.tls_hosts:
        raise ConfigError("bootstrapping a server certificate needs --tls-host (the names clients dial)")
    hosts = list(config.tls_hosts)
    await signer.bootstrap(
        files,
        lambda key: certclient.server_csr(key, SERVER_CERT_NAME, hosts),
        get_logger("proxy-server", hosts=hosts),
    )


def _startup_grace(args: argparse.Namespace, server_count: int) -> float:
    """--startup-grace, else its default: agents need a while to find a new replica among several."""
    if args.startup_grace is not None:
        return float(args.startup_grace)
    return REPLICA_STARTUP_GRACE if server_count > 1 else 0.0


def worker_config(config: ServerConfig, args: argparse.Namespace, spec: WorkerSpec) -> ServerConfig:
    """A worker's settings: its replica id and count from the parent; no signer (the parent bootstraps
    and renews the files, the worker reloads them); an audit log file of its own (``audit.w0.jsonl``:
    two processes rotating one file would lose records)."""
    return dataclasses.replace(
        config,
        audit_log=worker_spec(config.audit_log, spec.index),
        server_id=spec.server_id,
        server_count=spec.server_count,
        worker=(spec.index, spec.workers),
        startup_grace=_startup_grace(args, spec.server_count),
        signer=None,
        bootstrap_token=None,
    )


async def serve(config: ServerConfig, worker: WorkerSpec | None = None, follow_files: bool = False) -> None:
    """Run until SIGTERM/SIGINT, then drain (a second signal cuts the drain short). A worker also stops
    when its parent is gone (at once, without waiting for streams), and with ``follow_files`` reloads
    the certificate its parent renews."""
    if worker is None:
        await bootstrap(config)
    server = ProxyServer(config, worker)
    log = get_logger("proxy-server", server_id=config.server_id)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(allocator.return_free_memory)  # RSS comes back after a burst (an attack)
        if worker is not None:

            def parent_gone() -> None:
                log.error("parent_gone", error="the supervising process is gone: stopping now")
                server.cut_drain()
                stop.set()

            nursery.start_soon(watch_parent, worker.parent_alive, parent_gone)
            if follow_files:
                files = [config.cert, config.key, config.ca]
                nursery.start_soon(follow_cert_files, [server._agent_tls, server._client_tls], files)
        await serve_until_signalled(server.run, log, drain=server.shutdown, cut=server.cut_drain, stop=stop)
        nursery.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> None:
    workarounds.apply()  # the third-party speed-ups; services only, never on import
    allocator.tune()
    parser = build_parser()
    args = parse_args_or_exit(parser, argv)
    configure_logging(args.log_level, json=LOG_FORMATS[args.log_format])
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        parser.exit(2, f"{PROG}: error: {exc}\n")
    spec_text = os.environ.pop(WORKER_ENV, None)
    if spec_text:
        spec = WorkerSpec.from_json(spec_text)
        structlog.contextvars.bind_contextvars(worker=spec.index)
        config = worker_config(config, args, spec)
        failed = failure_on_stderr(PROG, what=f"worker {spec.index}")
        sys.exit(run_service(serve, config, spec, bool(args.signer), on_failure=failed))
    workers = args.workers or default_workers()
    if workers > 1:
        sys.exit(run_parent(config, list(sys.argv[1:] if argv is None else argv), workers))
    sys.exit(run_service(serve, config, on_failure=failure_on_stderr(PROG)))


def run_parent(config: ServerConfig, argv: list[str], workers: int) -> int:
    """``--workers`` above 1: bootstrap the certificate once, then supervise the workers."""
    supervisor = Supervisor(config, argv, workers)
    status = 0

    async def supervise() -> None:
        nonlocal status
        await bootstrap(config)
        status = await supervisor.run()

    failed = run_service(supervise, on_failure=failure_on_stderr(PROG))
    if failed or not status:
        return failed
    print(f"{PROG}: error: {supervisor.failure}", file=sys.stderr)
    return status


if __name__ == "__main__":  # how the parent starts a worker: python -m clusterproxy_server.main
    main()
