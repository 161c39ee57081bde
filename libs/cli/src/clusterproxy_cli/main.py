"""The ``cluster-proxy`` command.

::

    cluster-proxy local up [--state-dir DIR] [--base-port N] [--cert-ttl 24h] [--no-cert-signer]
                  [--servers N] [--proxied-cluster NAME]
    cluster-proxy local down [--state-dir DIR]
    cluster-proxy port-forward CLUSTER HOST:PORT [--listen ADDR] (--state-dir DIR | --proxy HOST:PORT
                  --ca FILE --cert FILE --key FILE) [--server-name NAME]
    cluster-proxy proxy [--listen 127.0.0.1:1080] [--allow-remote] [--cluster NAME] (hub flags as port-forward)
    cluster-proxy kubectl CLUSTER [--cluster-ca FILE | --insecure] [--token T | --token-file F |
                  --client-certificate F --client-key F | --kubeconfig F [--context C]] [hub flags] -- ARGS
    cluster-proxy certs status [--json] [--store DIR]
    cluster-proxy certs rotate-ca [start|activate|retire] [--force] [--store DIR]
    cluster-proxy certs token create|list|delete [--store DIR] ...
    cluster-proxy health [--collector URL | --admin-url URL ... | --state-dir DIR] [-o wide|json] [CLUSTER...]

``certs`` runs the cert-signer's own command (``cluster-proxy-cert-signer COMMAND ...``) on its store
(default: the local mode's, ``STATE/pki/store``).

Every flag has an environment twin ``CLUSTER_PROXY_<FLAG>`` (``--state-dir`` ->
``CLUSTER_PROXY_STATE_DIR``); a bad value exits with status 2 and a message naming it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from clusterproxy_protocol import (
    LOG_LEVELS,
    ConfigError,
    InvalidValue,
    TunnelError,
    add_flag,
    allocator,
    configure_logging,
    get_logger,
    parse_args_or_exit,
    parse_duration,
    parse_hostport,
    parse_port,
    parse_positive_duration,
    parse_positive_int,
    workarounds,
)
from clusterproxy_sdk import check_cluster

from . import certs as certs_command
from .commands import SIGNER
from .enroll import add_enroll_command, run_enroll
from .health import add_health_command, run_health
from .hubtunnel import add_hub_flags, followed_tls, resolve_hub
from .kubeconfig import add_kubeconfig_command, run_kubeconfig
from .kubectl import add_kubectl_command, run_kubectl
from .local_down import add_local_down_command, run_local_down
from .local_supervise import AGENT_RESTART_DELAY, REPLICA_RESTART
from .proxy import add_proxy_command, run_proxy
from .state import DEFAULT_STATE_DIR

if TYPE_CHECKING:
    from .portforward import PortForward  # imported where used: most commands never load it

# --- converters --------------------------------------------------------------------------------------


def parse_cluster(text: str) -> str:
    try:
        return check_cluster(text)
    except ValueError as exc:
        raise InvalidValue(str(exc)) from None


def parse_target(text: str) -> tuple[str, int]:
    """``HOST:PORT`` to dial inside the cluster (port 1-65535)."""
    host, port = parse_hostport(text)
    if port == 0:
        raise InvalidValue(f"invalid target {text!r}: port 0 cannot be dialed")
    return host, port


def positive_duration_arg(text: str) -> str:
    """A positive duration, passed on to a service as seconds (``90s``)."""
    return f"{parse_positive_duration(text):g}s"


def parse_base_port(text: str) -> int:
    port = parse_port(text)
    if port != 0 and port + 11 > 65535:
        raise InvalidValue(f"invalid base port {text!r}: ports base..base+11 must fit below 65536")
    return port


# --- parser ------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cluster-proxy",
        description="Reach services inside managed clusters through the cluster-proxy hub.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    local = commands.add_parser("local", help="run every service on loopback (local mode)")
    local_commands = local.add_subparsers(dest="local_command", metavar="COMMAND", required=True)
    up = local_commands.add_parser(
        "up",
        help="start a proxy-server and two simulated clusters; stays in the foreground",
        description="Start a proxy-server and two simulated managed clusters (cluster1, cluster2), each "
        "with a proxy-agent and an echo service, as processes on loopback. Writes DIR/local.json once "
        "ready; Ctrl-C stops everything.",
    )
    add_flag(up, "--state-dir", env="CLUSTER_PROXY_STATE_DIR", type=Path, default=str(DEFAULT_STATE_DIR),
             help="certificates, logs and local.json")  # fmt: skip
    add_flag(up, "--base-port", env="CLUSTER_PROXY_BASE_PORT", type=parse_base_port, default="0",
             help="client port = base, agent port base+1, admin base+2, agents' admin base+3.., echo "
             "services base+10..; 0: free ephemeral ports")  # fmt: skip
    add_flag(up, "--ready-timeout", env="CLUSTER_PROXY_READY_TIMEOUT", type=parse_duration, default="30s",
             help="how long to wait for every agent to connect")  # fmt: skip
    add_flag(up, "--cert-signer", env="CLUSTER_PROXY_CERT_SIGNER", type=bool, default=True,
             help="run a cert-signer: parties bootstrap from tokens and renew their certificates "
             "(--no-cert-signer: static certificates from a development CA)")  # fmt: skip
    add_flag(up, "--cert-ttl", env="CLUSTER_PROXY_CERT_TTL", type=positive_duration_arg, default="24h",
             help="lifetime of the certificates the signer issues (renewed at 80%)")  # fmt: skip
    add_flag(up, "--trust-refresh", env="CLUSTER_PROXY_TRUST_REFRESH", type=positive_duration_arg, default="30s",
             help="how often every party fetches the trust bundle (a CA rotation waits for it)")  # fmt: skip
    add_flag(up, "--servers", env="CLUSTER_PROXY_SERVERS", type=parse_positive_int, default="1",
             help="proxy-server processes; above 1, replicas behind haproxy (Debian's haproxy package) on "
             "the client and agent ports, each agent holding a tunnel to each (at most 9)")  # fmt: skip
    add_flag(up, "--proxied-cluster", env="CLUSTER_PROXY_PROXIED_CLUSTER", type=parse_cluster,
             help="this cluster's agent reaches the hub only through a forward proxy: tinyproxy (Debian's "
             "tinyproxy package) on loopback")  # fmt: skip
    add_flag(up, "--agent-restart-delay", env="CLUSTER_PROXY_AGENT_RESTART_DELAY", type=parse_duration,
             default=f"{AGENT_RESTART_DELAY:g}s", help="an agent that dies is started again after this long (its "
             f"cluster unreachable meanwhile); one that dies {REPLICA_RESTART.limit} times within "
             f"{REPLICA_RESTART.window:g}s stops everything")  # fmt: skip
    add_flag(up, "--haproxy", env="CLUSTER_PROXY_HAPROXY", default="haproxy",
             help="the haproxy program (a name searched on PATH and in /usr/sbin, /sbin, or a path)")  # fmt: skip
    add_flag(up, "--tinyproxy", env="CLUSTER_PROXY_TINYPROXY", default="tinyproxy",
             help="the tinyproxy program (as --haproxy)")  # fmt: skip
    down = add_local_down_command(local_commands)
    down.set_defaults(run=run_local_down, subparser=down)

    certs = commands.add_parser(
        "certs",
        help="certificates: status, CA rotation, bootstrap tokens",
        description=f"Runs `{SIGNER} COMMAND ARG...` (the cert-signer's own command, from the "
        f"{SIGNER} package) on the signer's store: no running signer needed, it follows the store "
        "within its poll interval. --store defaults to the local mode's "
        f"({certs_command.DEFAULT_STORE}) unless {certs_command.STORE_ENV} names one.",
        epilog="commands: status [--json] (CAs, rotation phase, parties and what they trust); "
        "rotate-ca [start|activate|retire] [--force] (rotate the CA with overlap, one step at a time); "
        "token create|list|delete (bootstrap tokens). `cluster-proxy certs COMMAND --help` shows "
        "a command's flags.",
    )
    certs.add_argument("certs_command", metavar="COMMAND", choices=certs_command.COMMANDS,
                       help=", ".join(certs_command.COMMANDS))  # fmt: skip
    certs.add_argument("certs_args", metavar="ARG", nargs=argparse.REMAINDER,
                       help="the command's arguments and flags")  # fmt: skip

    pf = commands.add_parser(
        "port-forward",
        help="forward a local port to HOST:PORT inside a cluster",
        description="Listen locally; every accepted connection becomes a stream to HOST:PORT inside "
        "CLUSTER over one shared HTTP/2 connection to the proxy-server. Proxy settings come from the "
        "flags, else from --state-dir/local.json (default: the local mode's, if it is running). The "
        "certificate files are followed: when they are replaced (renewed), the next connection to the "
        "proxy-server presents the new certificate.",
    )
    pf.add_argument("cluster", metavar="CLUSTER", type=parse_cluster, help="managed cluster name")
    pf.add_argument("target", metavar="HOST:PORT", type=parse_target, help="target inside the cluster")
    add_flag(pf, "--listen", env="CLUSTER_PROXY_LISTEN", type=parse_hostport, default="127.0.0.1:0",
             help="local address (port 0: a free port, shown in the Forwarding line)")  # fmt: skip
    add_hub_flags(pf)

    enrolment = add_enroll_command(commands)
    enrolment.set_defaults(run=run_enroll, subparser=enrolment)
    health = add_health_command(commands)
    health.set_defaults(run=run_health, subparser=health)
    kubeconfig = add_kubeconfig_command(commands)
    kubeconfig.set_defaults(run=run_kubeconfig, subparser=kubeconfig)
    local_proxy = add_proxy_command(commands)
    local_proxy.set_defaults(run=run_proxy, subparser=local_proxy)
    kubectl = add_kubectl_command(commands)
    kubectl.set_defaults(run=run_kubectl, subparser=kubectl)

    up.set_defaults(run=_local_up, subparser=up)
    certs.set_defaults(run=_certs, subparser=certs)
    pf.set_defaults(run=_port_forward, subparser=pf)
    for sub in (up, pf):
        add_flag(sub, "--log-level", env="CLUSTER_PROXY_LOG_LEVEL", default="info", choices=LOG_LEVELS,
                 help="log level (logs go to stderr)")  # fmt: skip
    return parser


# --- port-forward ------------------------------------------------------------------------------------


def resolve_port_forward(args: argparse.Namespace, parser: argparse.ArgumentParser) -> PortForward:
    """Turn parsed flags into a PortForward: explicit flags win over ``local.json``."""
    from .portforward import PortForward

    hub = resolve_hub(args, parser, "port-forward")
    return PortForward(
        cluster=args.cluster,
        target_host=args.target[0],
        target_port=args.target[1],
        listen_host=args.listen[0],
        listen_port=args.listen[1],
        proxy=hub.proxy,
        tls=hub.tls,
        server_name=hub.server_name,
        connect_timeout=hub.connect_timeout,
    )


def _port_forward(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .portforward import run_port_forward

    pf = resolve_port_forward(args, parser)
    configure_logging(args.log_level)
    tls = followed_tls(pf.tls, parser, get_logger("port-forward"))  # type: ignore[arg-type]  # resolve_port_forward sets files (TLSFiles), the one kind followed
    try:
        trio.run(partial(run_port_forward, replace(pf, tls=tls), stop_on_signals=True))
    except KeyboardInterrupt:
        return 0
    except TunnelError as exc:
        print(f"cluster-proxy port-forward: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        host, port = pf.listen_host, pf.listen_port
        print(
            f"cluster-proxy port-forward: cannot listen on {host}:{port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    return 0


def _local_up(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .local import local_up

    configure_logging(args.log_level)
    try:
        return trio.run(
            partial(
                local_up,
                args.state_dir,
                args.base_port,
                ready_timeout=args.ready_timeout,
                cert_signer=args.cert_signer,
                cert_ttl=args.cert_ttl,
                trust_refresh=args.trust_refresh,
                servers=args.servers,
                proxied_cluster=args.proxied_cluster,
                haproxy=args.haproxy,
                tinyproxy=args.tinyproxy,
                agent_restart_delay=args.agent_restart_delay,
            )
        )
    except ConfigError as exc:
        print(f"cluster-proxy local up: {exc}", file=sys.stderr)
        return 1


def _certs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        return certs_command.run_certs(args.certs_command, args.certs_args)
    except ConfigError as exc:
        print(f"cluster-proxy certs: {exc}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> None:
    workarounds.apply()
    allocator.tune()
    args = parse_args_or_exit(build_parser(), argv)
    raise SystemExit(args.run(args, args.subparser))


if __name__ == "__main__":
    main()
