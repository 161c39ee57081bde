"""``cluster-proxy proxy``: a local SOCKS5 and HTTP proxy whose streams lead into clusters.

One loopback port serves SOCKS5 and HTTP/1.1 (``CONNECT``, plain-HTTP forward requests), told apart
by the first byte (:mod:`clusterproxy_cli.proxy_handshake`, sans-IO). Every accepted request becomes
one CONNECT stream over a single shared HTTP/2 tunnel to the proxy-server, re-dialed when it dies,
presenting the hub client certificate the files hold at each dial (:mod:`clusterproxy_cli.hubtunnel`,
as ``port-forward``). A refusal is answered with the nearest SOCKS reply or the hub's HTTP status and
reason, and logged with the hub's reason. A relayed connection that fails ends with a reset, also
when this process dies, as ``port-forward``'s do.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any, TextIO

import trio

from clusterproxy_protocol import (
    LOG_LEVELS,
    ConnectRefused,
    InvalidValue,
    TunnelError,
    abort,
    add_flag,
    close_cleanly,
    configure_logging,
    format_address,
    get_logger,
    parse_hostport,
    relay_streams,
    reset_if_process_dies,
)
from clusterproxy_sdk import SharedTunnel, TLSSource, TunnelStream, check_cluster, format_authority

from .hubtunnel import add_hub_flags, expiry_hint, followed_tls, resolve_hub, serve_locally
from .proxy_handshake import Handshake, Refusal, Request, route

DEFAULT_LISTEN = "127.0.0.1:1080"
HANDSHAKE_TIMEOUT = 30.0  # a client that has not finished asking by then is dropped
REPLY_TIMEOUT = 5.0  # sending a refusal to a client that does not read
READ_SIZE = 16 << 10


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` keeps the port to this machine: ``localhost`` or a loopback
    address. Other names are not resolved: what a name leads to can change."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listen_text(host: str, port: int) -> str:
    """``HOST:PORT`` as given to --listen (port 0 included, which format_authority refuses)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def remote_listen_refusal(listen: str, cert: object) -> str:
    """Why a non-loopback ``--listen`` is refused, and the flag that allows it."""
    return (
        f"--listen {listen} is not a loopback address: anyone who can reach that port would open "
        f"streams into your clusters as you, with your hub client certificate ({cert}); the proxy asks "
        "its clients for no credential. Listen on 127.0.0.1 or ::1, or pass --allow-remote if every "
        "host that can reach the port may do so"
    )


@dataclass(frozen=True)
class LocalProxy:
    listen_host: str
    listen_port: int
    proxy: tuple[str, int]
    tls: TLSSource  # TLSFiles are followed: each dial presents the certificate the files hold then
    default_cluster: str | None = None
    server_name: str | None = None
    connect_timeout: float = 10.0


async def _open(shared: SharedTunnel, request: Request, cluster: str, named_by: str) -> TunnelStream:
    if named_by == "bare-cluster-name":
        # The upstream convention, as the hub reads it: no cluster header, the host names the cluster
        # and the agent maps its own name to its kube-apiserver (whatever port was asked).
        return await shared.connect_kube_apiserver(cluster)
    return await shared.connect(cluster, request.host, request.port)


async def _answer_and_close(local: trio.SocketStream, reply: bytes) -> None:
    """Send a refusal, then a clean close (a FIN: the reply is the whole answer); a client that does
    not take it in time is reset."""
    with trio.move_on_after(REPLY_TIMEOUT):
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            if reply:
                await local.send_all(reply)
            await close_cleanly(local)
            return
    await trio.aclose_forcefully(local)


async def _handshake(local: trio.SocketStream) -> tuple[Handshake, Request | Refusal | None]:
    handshake = Handshake()
    with trio.move_on_after(HANDSHAKE_TIMEOUT):
        while True:
            data = await local.receive_some(READ_SIZE)
            reply, decision = handshake.feed(data)
            if reply:
                await local.send_all(reply)
            if decision is not None:
                return handshake, decision
    return handshake, None


async def _handle(
    lp: LocalProxy, shared: SharedTunnel, local: trio.SocketStream, log: Any, counter: list[int]
) -> None:
    # As port-forward's: a killed proxy must reset its clients' connections, never end them with a FIN
    # that a close-delimited answer (HTTP/1.0, a raw protocol) would take for its end.
    reset_if_process_dies(local)
    counter[0] += 1
    try:
        peer = format_address(local.socket.getpeername())
    except OSError:
        peer = "?"
    log = log.bind(conn=counter[0], peer=peer)
    try:
        handshake, decision = await _handshake(local)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        log.info("client_gone", error=str(exc) or type(exc).__name__)
        await trio.aclose_forcefully(local)
        return
    if decision is None:
        log.warning("handshake_timeout", protocol=handshake.protocol, timeout=HANDSHAKE_TIMEOUT)
        await trio.aclose_forcefully(local)
        return
    if isinstance(decision, Refusal):
        if decision.protocol is not None:  # a client that connected and left without a byte: no log
            log.warning("request_refused", protocol=decision.protocol, reason=decision.reason)
        await _answer_and_close(local, decision.reply)
        return
    request = decision
    log = log.bind(protocol=request.protocol, target=request.target)
    chosen = route(request, lp.default_cluster)
    if chosen is None:
        reason = (
            f"no cluster named for {request.target}: name it as the proxy user name "
            "(socks5h://CLUSTER@HOST:PORT, http://CLUSTER@HOST:PORT), give the proxy --cluster, or ask "
            "for a bare cluster name as the host (its kube-apiserver)"
        )
        log.warning("no_cluster_named", reason=reason)
        await _answer_and_close(local, handshake.no_cluster(reason))
        return
    log = log.bind(cluster=chosen.cluster, named_by=chosen.named_by)
    try:
        remote = await _open(shared, request, chosen.cluster, chosen.named_by)
    except ConnectRefused as exc:
        if exc.status == 400 and chosen.named_by == "bare-cluster-name":
            # The hub knows no cluster of that name: to the client, it named no cluster.
            log.warning("no_cluster_named", status=exc.status, reason=exc.reason)
            await _answer_and_close(local, handshake.no_cluster(exc.reason))
            return
        log.error("connect_refused", status=exc.status, reason=exc.reason)
        await _answer_and_close(local, handshake.refused(exc.status, exc.reason))
        return
    except TunnelError as exc:  # ProxyConnectionError, TunnelClosed
        log.error("tunnel_unavailable", error=str(exc), **expiry_hint(shared.tls))
        await _answer_and_close(local, handshake.hub_unavailable(f"the hub is unreachable: {exc}"))
        return
    except BaseException:
        await trio.aclose_forcefully(local)
        raise
    log = log.bind(stream_id=remote.stream_id)
    try:
        await local.send_all(handshake.opened())
        if request.first_bytes:
            await remote.send_all(request.first_bytes)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        log.info("client_gone", error=str(exc) or type(exc).__name__)
        await abort(remote)
        await trio.aclose_forcefully(local)
        return
    log.debug("stream_opened")
    result = await relay_streams(client=local, target=remote)
    log.info(
        "connection_closed",
        bytes_to_target=result.bytes_to_target + len(request.first_bytes),
        bytes_to_client=result.bytes_to_client,
        error=result.error,
        local_end="reset" if result.error else "closed",
    )


async def run_local_proxy(
    lp: LocalProxy,
    *,
    out: TextIO | None = None,
    stop_on_signals: bool = False,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen and proxy until cancelled. Dials the hub once at start so that a wrong address or
    certificate fails at once (raises ProxyConnectionError). ``task_status.started`` gets the bound
    addresses. With ``stop_on_signals``, SIGINT or SIGTERM ends it (normally, returning)."""
    log = get_logger("proxy")
    counter = [0]
    default = f", default cluster {lp.default_cluster}" if lp.default_cluster else ""

    def banner(bound: tuple[str, int]) -> str:
        address = format_authority(*bound)
        return f"Proxying on {address} (SOCKS5 and HTTP{default}): socks5h://CLUSTER@{address}, http://CLUSTER@{address}"

    async def handle(shared: SharedTunnel, local: trio.SocketStream) -> None:
        await _handle(lp, shared, local, log, counter)

    await serve_locally(
        lp,
        handle,
        banner,
        log=log,
        out=out or sys.stdout,
        stop_on_signals=stop_on_signals,
        task_status=task_status,
    )


# --- the command ---------------------------------------------------------------------------------------


def _parse_cluster(text: str) -> str:
    try:
        return check_cluster(text)
    except ValueError as exc:
        raise InvalidValue(str(exc)) from None


def add_proxy_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "proxy",
        help="a local SOCKS5 and HTTP proxy into the clusters (curl, kubectl, browsers)",
        description="Listen on loopback for SOCKS5 (RFC 1928, with the RFC 1929 user name) and HTTP proxy "
        "requests (CONNECT, plain-HTTP forwarding) on one port. The proxy user name names the cluster "
        "(socks5h://cluster1@127.0.0.1:1080, http://cluster1@127.0.0.1:1080); a bare cluster name as "
        "the host reaches that cluster's kube-apiserver. Every stream goes over one shared HTTP/2 "
        "tunnel to the proxy-server, presenting the hub client certificate (followed: renewed files "
        "are used at the next dial). Hub settings as for port-forward. docs/local-proxy.md",
    )
    add_flag(parser, "--listen", env="CLUSTER_PROXY_LISTEN", type=parse_hostport, default=DEFAULT_LISTEN,
             help="local address (port 0: a free port, shown in the Proxying line); loopback only unless "
             "--allow-remote")  # fmt: skip
    add_flag(parser, "--allow-remote", env="CLUSTER_PROXY_ALLOW_REMOTE", type=bool, default=False,
             help="allow a --listen address that is not loopback: whoever reaches the port acts with "
             "your hub client certificate")  # fmt: skip
    add_flag(parser, "--cluster", env="CLUSTER_PROXY_CLUSTER", type=_parse_cluster,
             help="the cluster of requests that name none (SOCKS5 without a user name, browsers)")  # fmt: skip
    add_hub_flags(parser)
    add_flag(parser, "--log-level", env="CLUSTER_PROXY_LOG_LEVEL", default="info", choices=LOG_LEVELS,
             help="log level (logs go to stderr; one connection_closed line per connection at info)")  # fmt: skip
    return parser


def run_proxy(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    hub = resolve_hub(args, parser, "proxy")
    host, port = args.listen
    if not args.allow_remote and not is_loopback(host):
        parser.error(remote_listen_refusal(listen_text(host, port), hub.tls.cert))
    configure_logging(args.log_level)
    tls = followed_tls(hub.tls, parser, get_logger("proxy"))
    lp = LocalProxy(host, port, hub.proxy, tls, args.cluster, hub.server_name, hub.connect_timeout)
    try:
        trio.run(partial(run_local_proxy, lp, stop_on_signals=True))
    except KeyboardInterrupt:
        return 0
    except TunnelError as exc:
        print(f"cluster-proxy proxy: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(
            f"cluster-proxy proxy: cannot listen on {listen_text(host, port)}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    return 0
