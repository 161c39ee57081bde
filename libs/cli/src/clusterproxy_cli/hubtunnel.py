"""The hub connection of the CLI's local front doors (``port-forward``, ``proxy``, ``kubectl``): one
shared HTTP/2 tunnel to the proxy-server's client port, re-dialed when it dies, whose client
certificate files are followed (each dial presents what the files hold then; docs/sdk.md,
"Certificates: it outlives them").
"""

from __future__ import annotations

import argparse
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

import trio

from clusterproxy_protocol import (
    ConfigError,
    InvalidValue,
    add_flag,
    existing_file,
    parse_duration,
    parse_hostport,
)
from clusterproxy_sdk import (
    ReloadingTLSFiles,
    SharedTunnel,
    TLSFiles,
    TLSSource,
    Tunnel,
    format_authority,
    open_shared_tunnel,
)

from .state import DEFAULT_STATE_DIR, LOCAL_JSON, proxy_settings, read_local_json


def expiry_hint(tls: TLSSource) -> dict[str, Any]:
    """When the client certificate in use has expired, say so: the likely reason a dial failed."""
    if not isinstance(tls, ReloadingTLSFiles) or not tls.loaded.expired():
        return {}
    not_after = tls.loaded.not_after
    return {
        "client_cert_expired": not_after.isoformat() if not_after else None,
        "hint": f"the client certificate {tls.cert} has expired and was not replaced: renew it (in "
        "local mode `cluster-proxy local up` renews it while it runs)",
    }


def _log_connected(log: Any, shared: SharedTunnel, tunnel: Tunnel) -> None:
    cert = tunnel.client_certificate
    log.info(
        "tunnel_connected",
        proxy=format_authority(*tunnel.address),
        client_cert_serial=format(cert.serial_number, "x") if cert is not None else None,
        client_cert_not_after=cert.not_valid_after_utc.isoformat() if cert is not None else None,
        connections_made=shared.connections_made,
    )


@asynccontextmanager
async def open_hub_tunnel(
    proxy: tuple[str, int],
    tls: TLSSource,
    *,
    server_name: str | None,
    connect_timeout: float,
    log: Any,
) -> AsyncIterator[SharedTunnel]:
    """The shared tunnel, dialed once before it is yielded so that a wrong address or certificate
    fails at once (ProxyConnectionError); later failures are per stream. ``TLSFiles`` are followed
    (a ReloadingTLSFiles logging its reloads to ``log``); each dial logs ``tunnel_connected`` with the
    serial and expiry of the certificate it presented."""
    tls = tls.reloading(log=log) if isinstance(tls, TLSFiles) else tls
    async with open_shared_tunnel(
        proxy,
        tls,
        server_hostname=server_name,
        connect_timeout=connect_timeout,
        on_connected=lambda tunnel: _log_connected(log, shared, tunnel),
    ) as shared:
        await shared.tunnel()
        yield shared


class LocalDoor(Protocol):
    """What a local front door is told: where the hub is, its certificate, and where to listen.
    Read-only (properties), so the frozen dataclasses of the commands are front doors."""

    @property
    def proxy(self) -> tuple[str, int]: ...
    @property
    def tls(self) -> TLSSource: ...
    @property
    def server_name(self) -> str | None: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def listen_host(self) -> str: ...
    @property
    def listen_port(self) -> int: ...


Handler = Callable[[SharedTunnel, trio.SocketStream], Awaitable[None]]


async def serve_locally(
    door: LocalDoor,
    handle: Handler,
    banner: Callable[[tuple[str, int]], str],
    *,
    log: Any,
    out: TextIO,
    stop_on_signals: bool,
    task_status: trio.TaskStatus[list[tuple[str, int]]],
) -> None:
    """Dial the hub (a wrong address or certificate fails here: ProxyConnectionError), listen on the
    door's address, print ``banner`` of each bound address, and hand every local connection to
    ``handle`` with the shared tunnel, until cancelled or, with ``stop_on_signals``, SIGINT or
    SIGTERM (then normally, returning). ``task_status.started`` gets the bound addresses."""
    with contextlib.ExitStack() as stack:
        # Open before the banner: a signal sent as soon as it shows must stop us cleanly (exit
        # status 0), not kill us; one that arrives during the first dial waits for its end.
        signals = (
            stack.enter_context(trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM))
            if stop_on_signals
            else None
        )
        async with open_hub_tunnel(
            door.proxy, door.tls, server_name=door.server_name, connect_timeout=door.connect_timeout, log=log
        ) as shared:
            listeners = await trio.open_tcp_listeners(door.listen_port, host=door.listen_host)
            bound = [listener.socket.getsockname()[:2] for listener in listeners]
            for address in bound:
                print(banner(address), file=out, flush=True)

            async def serve(local: trio.SocketStream) -> None:
                await handle(shared, local)

            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, serve, listeners)
                task_status.started([(host, port) for host, port in bound])
                if signals is not None:
                    async for signum in signals:
                        log.info("stopping", signal=signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()
                        break


# --- flags: where the hub is and which certificate to present ----------------------------------------


def parse_proxy(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``https://HOST:PORT`` of the proxy-server's client port."""
    raw = text
    if text.startswith("https://"):
        text = text[len("https://") :].rstrip("/").rpartition("@")[2]
    elif "://" in text:
        raise InvalidValue(
            f"invalid proxy {raw!r}: the client port speaks TLS; use HOST:PORT or https://HOST:PORT"
        )
    host, port = parse_hostport(text)
    if port == 0:
        raise InvalidValue(f"invalid proxy {raw!r}: port 0 cannot be dialed")
    return host, port


@dataclass(frozen=True)
class HubSettings:
    proxy: tuple[str, int]
    tls: TLSFiles
    server_name: str | None
    connect_timeout: float


def add_hub_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that say how to reach the hub: the proxy-server's client port and the client
    certificate, or a local mode's ``local.json``."""
    add_flag(parser, "--proxy", env="CLUSTER_PROXY_PROXY", type=parse_proxy,
             help="proxy-server client port, HOST:PORT")  # fmt: skip
    add_flag(parser, "--ca", env="CLUSTER_PROXY_CA", type=existing_file, help="CA bundle for the server")
    add_flag(parser, "--cert", env="CLUSTER_PROXY_CERT", type=existing_file, help="client certificate (PEM)")
    add_flag(parser, "--key", env="CLUSTER_PROXY_KEY", type=existing_file, help="client private key (PEM)")
    add_flag(parser, "--server-name", env="CLUSTER_PROXY_SERVER_NAME",
             help="name checked against the server certificate (default: the proxy host)")  # fmt: skip
    add_flag(parser, "--state-dir", env="CLUSTER_PROXY_STATE_DIR", type=Path,
             help=f"take the proxy settings from DIR/{LOCAL_JSON} (written by `local up`)")  # fmt: skip
    add_flag(parser, "--connect-timeout", env="CLUSTER_PROXY_CONNECT_TIMEOUT", type=parse_duration, default="10s",
             help="TCP+TLS connect timeout to the proxy-server")  # fmt: skip


def resolve_hub(args: argparse.Namespace, parser: argparse.ArgumentParser, command: str) -> HubSettings:
    """The hub settings from :func:`add_hub_flags`' flags: explicit flags win over ``local.json`` (the
    local mode's default state directory when it has one and no flag names the proxy)."""
    proxy, ca, cert, key = args.proxy, args.ca, args.cert, args.key
    state_dir = args.state_dir
    if state_dir is None and proxy is None and (DEFAULT_STATE_DIR / LOCAL_JSON).exists():
        state_dir = DEFAULT_STATE_DIR
    if state_dir is not None:
        try:
            settings = proxy_settings(read_local_json(state_dir), str(Path(state_dir) / LOCAL_JSON))
        except ConfigError as exc:
            parser.error(f"--state-dir {str(state_dir)!r}: {exc}")
        proxy = proxy or (settings.host, settings.port)
        ca, cert, key = ca or settings.ca, cert or settings.cert, key or settings.key
    missing = [
        flag
        for flag, value in (("--proxy", proxy), ("--ca", ca), ("--cert", cert), ("--key", key))
        if not value
    ]
    if missing:
        parser.error(
            f"{command} needs {', '.join(missing)} (or --state-dir DIR with a {LOCAL_JSON} from "
            "`cluster-proxy local up`)"
        )
    return HubSettings(proxy, TLSFiles(ca, cert, key), args.server_name, args.connect_timeout)


def followed_tls(files: TLSFiles, parser: argparse.ArgumentParser, log: Any) -> ReloadingTLSFiles:
    """The files, followed rather than loaded once: a renewer (local up, cert-manager) may replace them
    while the command runs, and the next dial must present the new certificate. A bad file is a usage
    error naming it."""
    try:
        return files.reloading(log=log)
    except ConfigError as exc:
        parser.error(str(exc))
