"""``cluster-proxy-server``: command line and process lifecycle."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Sequence

import trio

from clusterproxy_protocol.config import (
    ConfigError,
    add_flag,
    existing_file,
    parse_args_or_exit,
    parse_duration,
    parse_hostport,
    parse_positive_int,
    parse_size,
)
from clusterproxy_protocol.core import TunnelSettings
from clusterproxy_protocol.logs import configure_logging, get_logger
from clusterproxy_server.app import ProxyServer, ServerConfig
from clusterproxy_server.routing import CLUSTER_NAME

ENV = "CLUSTER_PROXY_SERVER_"


def _cluster_names(text: str) -> list[str]:
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    for name in names:
        if not CLUSTER_NAME.match(name):
            raise ConfigError(f"invalid cluster name {name!r}: expected a DNS name like cluster1")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cluster-proxy-server",
        description="Hub side of cluster-proxy: agents dial in on the agent port; hub clients open "
        "CONNECT streams to targets inside managed clusters on the client port.",
    )

    def flag(name: str, **kwargs: object) -> None:
        add_flag(p, name, env=ENV + name[2:].upper().replace("-", "_"), **kwargs)  # type: ignore[arg-type]

    flag(
        "--agent-listen",
        type=parse_hostport,
        default="0.0.0.0:8091",
        help="address agents dial (mTLS, HTTP/2)",
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
        help="plain HTTP: /healthz /readyz /metrics /api/v1/agents",
    )
    flag(
        "--ca", type=existing_file, required=True, help="CA bundle trusted for agent and client certificates"
    )
    flag("--cert", type=existing_file, required=True, help="server certificate (PEM)")
    flag("--key", type=existing_file, required=True, help="server private key (PEM)")
    flag("--server-id", help="identity told to agents (default: hostname plus a random suffix)")
    flag("--server-count", type=parse_positive_int, default="1", help="number of server replicas")
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
        help="longest wait for an agent's answer to a CONNECT",
    )
    flag(
        "--handshake-timeout",
        type=parse_duration,
        default="10s",
        help="longest TLS handshake / request head / agent registration",
    )
    flag("--keepalive-interval", type=parse_duration, default="10s", help="PING interval on agent tunnels")
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
    flag("--stream-window", type=parse_size, default="1MiB", help="HTTP/2 stream window")
    flag("--connection-window", type=parse_size, default="32MiB", help="HTTP/2 connection window")
    flag("--max-frame-size", type=parse_size, default="64KiB", help="HTTP/2 max frame size")
    flag("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    flag(
        "--log-format",
        default="auto",
        choices=["auto", "json", "console"],
        help="auto: JSON unless stderr is a terminal",
    )
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    try:
        tunnel = TunnelSettings(
            stream_window=args.stream_window,
            connection_window=args.connection_window,
            max_frame_size=args.max_frame_size,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    config = ServerConfig(
        ca=args.ca,
        cert=args.cert,
        key=args.key,
        agent_listen=args.agent_listen,
        client_listen=args.client_listen,
        admin_listen=args.admin_listen,
        server_count=args.server_count,
        known_clusters=set(args.known_clusters),
        dial_timeout=args.dial_timeout,
        handshake_timeout=args.handshake_timeout,
        keepalive_interval=args.keepalive_interval,
        keepalive_timeout=args.keepalive_timeout,
        drain_timeout=args.drain_timeout,
        tunnel=tunnel,
    )
    if args.server_id:
        config.server_id = args.server_id
    return config


async def serve(config: ServerConfig) -> None:
    server = ProxyServer(config)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                get_logger("proxy-server").info("signal_received", signal=signal.Signals(signum).name)
                await server.shutdown()
                nursery.cancel_scope.cancel()
                break


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args_or_exit(parser, argv)
    configure_logging(args.log_level, json={"auto": None, "json": True, "console": False}[args.log_format])
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        parser.exit(2, f"cluster-proxy-server: error: {exc}\n")
    try:
        trio.run(serve, config)
    except* OSError as group:  # e.g. a listen address already in use
        parser.exit(1, f"cluster-proxy-server: error: {group.exceptions[0]}\n")
