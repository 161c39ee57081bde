"""``cluster-proxy port-forward``: a local TCP port that leads to ``host:port`` inside a cluster.

Every accepted local connection becomes one CONNECT stream over a single shared HTTP/2 connection
to the proxy-server (re-dialed when it dies). A refused CONNECT is logged with its status and reason
and the local connection is reset. Every local connection ends with RST unless its relay ended cleanly,
also when this process dies (see docs/protocol.md, "Resets that reach the target").

The client certificate files are followed, not loaded once: each dial presents what the files hold
then, so a port-forward outlives its certificate as long as something renews the files (in local mode
``cluster-proxy local up`` renews the local admin files it points to; see docs/sdk.md).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

import trio
from structlog.typing import FilteringBoundLogger

from clusterproxy_protocol import (
    ConnectRefused,
    TunnelError,
    format_address,
    get_logger,
    relay_streams,
    reset_if_process_dies,
)
from clusterproxy_sdk import SharedTunnel, TLSSource, format_authority

from .hubtunnel import expiry_hint, serve_locally


@dataclass(frozen=True)
class PortForward:
    cluster: str
    target_host: str
    target_port: int
    listen_host: str
    listen_port: int
    proxy: tuple[str, int]
    tls: TLSSource  # TLSFiles are followed: each dial presents the certificate the files hold then
    server_name: str | None = None
    connect_timeout: float = 10.0

    @property
    def target(self) -> str:
        return format_authority(self.target_host, self.target_port)


def _format_sockaddr(sockaddr: tuple[str, int] | tuple[str, int, int, int]) -> str:
    return format_address(sockaddr)


async def _handle(
    pf: PortForward,
    shared: SharedTunnel,
    local: trio.SocketStream,
    log: FilteringBoundLogger,
    counter: list[int],
) -> None:
    # The local client may read a close-delimited answer (HTTP/1.0, a raw TCP protocol): the FIN the
    # kernel sends for a killed port-forward would end it as if complete. Armed, every close but the
    # relay's clean one is a RST: this process dying, a refused CONNECT, the tunnel unavailable.
    reset_if_process_dies(local)
    counter[0] += 1
    conn_id = counter[0]
    try:
        peer = _format_sockaddr(local.socket.getpeername())
    except OSError:
        peer = "?"
    log = log.bind(conn=conn_id, peer=peer, cluster=pf.cluster, target=pf.target)
    try:
        remote = await shared.connect(pf.cluster, pf.target_host, pf.target_port)
    except ConnectRefused as exc:
        log.error("connect_refused", status=exc.status, reason=exc.reason)
        await trio.aclose_forcefully(local)
        return
    except TunnelError as exc:  # ProxyConnectionError, TunnelClosed
        log.error("tunnel_unavailable", error=str(exc), **expiry_hint(shared.tls))
        await trio.aclose_forcefully(local)
        return
    except BaseException:
        await trio.aclose_forcefully(local)
        raise
    log.debug("stream_opened", stream_id=remote.stream_id)
    result = await relay_streams(client=local, target=remote)
    log.info(
        "connection_closed",
        stream_id=remote.stream_id,
        bytes_to_target=result.bytes_to_target,
        bytes_to_client=result.bytes_to_client,
        error=result.error,
        # The relay ends a failed stream (the hub gone, an EOF without close_notify among them) with
        # a reset of the local connection, so the local client sees a failure, never a clean end.
        local_end="reset" if result.error else "closed",
    )


async def run_port_forward(
    pf: PortForward,
    *,
    out: TextIO | None = None,
    stop_on_signals: bool = False,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen and forward until cancelled. Dials the proxy once at start so that a wrong address or
    certificate fails at once (raises ProxyConnectionError); later failures are per connection.
    ``task_status.started`` gets the bound addresses. With ``stop_on_signals``, SIGINT or SIGTERM
    ends it (normally, returning)."""
    log = get_logger("port-forward")
    counter = [0]

    def banner(bound: tuple[str, int]) -> str:
        return f"Forwarding from {_format_sockaddr(bound)} -> {pf.cluster}/{pf.target}"

    async def handle(shared: SharedTunnel, local: trio.SocketStream) -> None:
        await _handle(pf, shared, local, log, counter)

    await serve_locally(
        pf,
        handle,
        banner,
        log=log,
        out=out or sys.stdout,
        stop_on_signals=stop_on_signals,
        task_status=task_status,
    )
