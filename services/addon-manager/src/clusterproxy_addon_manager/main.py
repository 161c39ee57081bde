"""``cluster-proxy-addon-manager``: command line, the trio runner, the admin port.

The runner: informer threads (informer.py) keep copies of the watched objects and hand keys to a
trio work queue; ``--workers`` trio tasks take keys and run the blocking reconcile for each in a
worker thread (``trio.to_thread``); a poller asks the proxy-servers which clusters hold tunnels, with
the manager's own hub client certificate (hubclient.py); a resync re-reconciles everything every
``--resync-period`` (a safety net: every change already arrives as an event). SIGTERM or SIGINT stops
it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trio

from clusterproxy_protocol import (
    CLUSTER_NAME,
    LOG_FORMATS,
    ConfigError,
    InvalidValue,
    Response,
    add_log_flags,
    configure_logging,
    failure_in_log,
    flag_adder,
    format_authority,
    get_logger,
    listen_on,
    load_configuration,
    metrics_response,
    parse_args_or_exit,
    parse_duration,
    parse_hostport,
    parse_positive_duration,
    parse_positive_int,
    run_service,
    serve_admin,
    serve_until_signalled,
    signer_url,
)

from . import render
from .availability import AdminTLS, admin_urls_from_dns, poll_once
from .controller import Controller, ManagerOptions, NotReady
from .hubclient import HubClientCertificate
from .identity import Credentials
from .kube import Forbidden, Kube, KubeError, Unavailable
from .metrics import ManagerMetrics
from .workqueue import WorkQueue

__all__ = ["ManagerSettings", "build_parser", "main", "parse_settings", "serve"]

ENV_PREFIX = "CLUSTER_PROXY_ADDON_MANAGER_"
PROG = "cluster-proxy-addon-manager"


def _name(text: str) -> str:
    value = text.strip()
    if not CLUSTER_NAME.match(value):
        raise InvalidValue(
            f"invalid name {text!r}: a Kubernetes object name (lower-case letters, digits, '-' and '.', "
            "starting and ending with a letter or digit, at most 253 characters)"
        )
    return value


def _hub_client(text: str) -> render.HubClient:
    """``NAME=SECRET`` or ``NAME=NAMESPACE/SECRET``."""
    name, sep, where = text.strip().partition("=")
    namespace, _, secret = where.rpartition("/")
    if not sep or not name or not secret:
        raise InvalidValue(
            f"invalid hub client {text!r}: expected NAME=SECRET or NAME=NAMESPACE/SECRET (e.g. "
            "health-collector=cluster-proxy-health-collector-bootstrap): the client certificate's CN and the "
            "Secret that receives its bootstrap token"
        )
    return render.HubClient(_name(name), _name(secret), _name(namespace) if namespace else "")


def _hub_server(text: str) -> render.HubClient:
    """``NAME=[NAMESPACE/]SECRET=HOST[,HOST...]``: a hub server's bootstrap Secret (a server token)."""
    where, sep, hosts = text.strip().rpartition("=")
    names = tuple(h.strip() for h in hosts.split(",") if h.strip())
    if not sep or not names or "=" not in where:
        raise InvalidValue(
            f"invalid hub server {text!r}: expected NAME=[NAMESPACE/]SECRET=HOST[,HOST...] (e.g. cluster-proxy-"
            "service-proxy=cluster-gateway-service-proxy-bootstrap=cluster-gateway.NS.svc): the serving "
            "certificate's CN, the Secret that receives its bootstrap token, the names it may carry"
        )
    client = _hub_client(where)
    return render.HubClient(client.name, client.secret, client.namespace, names)


def _admin_url(text: str) -> str:
    value = text.strip().rstrip("/")
    if value.startswith("http://"):
        raise InvalidValue(
            f"invalid admin URL {text!r}: the proxy-servers list their clusters over mutual TLS only: "
            f"https://{value.removeprefix('http://')} (the same port)"
        )
    if not value.startswith("https://") or len(value) <= len("https://"):
        raise InvalidValue(
            f"invalid admin URL {text!r}: expected https://HOST:PORT of a proxy-server's admin port "
            "(its --admin-listen)"
        )
    return value


def _token_ttl(text: str) -> float:
    seconds = parse_duration(text)
    if not 60 <= seconds <= 24 * 3600:
        raise InvalidValue(f"invalid token lifetime {text!r}: between 1m and 24h (the signer's maximum)")
    return seconds


@dataclass
class ManagerSettings:
    kubeconfig: Path | None = None
    namespace: str = "open-cluster-management-addon"
    mpc_name: str = "cluster-proxy"
    create_default_configuration: bool = True
    admin_urls: list[str] = field(default_factory=list)
    signer: str | None = None
    credentials_dir: Path = Path("/var/lib/cluster-proxy")
    resync_period: float = 600.0
    availability_poll: float = 10.0
    token_ttl: float = 24 * 3600.0
    store_prefix: str = "cluster-proxy-ca"
    cert_signer_image: str = "cluster-proxy/cert-signer:dev"
    workers: int = 4
    hub_clients: list[render.HubClient] = field(default_factory=list)
    admin_listen: tuple[str, int] = ("0.0.0.0", 8094)
    watch_timeout: int = 60
    log_level: str = "info"
    log_format: str = "auto"

    def summary(self) -> dict[str, Any]:
        return {
            "kubeconfig": str(self.kubeconfig) if self.kubeconfig else "in-cluster or $KUBECONFIG",
            "namespace": self.namespace,
            "mpc_name": self.mpc_name,
            "create_default_configuration": self.create_default_configuration,
            "admin_urls": self.admin_urls or f"every address of {render.ADMIN_SERVICE}.<namespace>.svc",
            "signer": self.signer or f"https://{render.SIGNER_SERVICE}.<namespace>.svc:<signer port>",
            "credentials_dir": str(self.credentials_dir),
            "resync_period": self.resync_period,
            "availability_poll": self.availability_poll,
            "token_ttl": self.token_ttl,
            "store_prefix": self.store_prefix,
            "cert_signer_image": self.cert_signer_image,
            "workers": self.workers,
            "hub_clients": [
                f"{c.name}={c.namespace + '/' if c.namespace else ''}{c.secret}" for c in self.hub_clients
            ],
            "admin_listen": format_authority(*self.admin_listen),
        }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="cluster-proxy addon-manager: deploys the proxy-servers and the cert-signer on the hub "
        "from the ManagedProxyConfiguration, and a proxy-agent (one ManifestWork) into every managed "
        "cluster whose ManagedClusterAddOn 'cluster-proxy' exists; keeps their status.",
    )

    flag = flag_adder(parser, ENV_PREFIX)

    flag(
        "--kubeconfig",
        type=Path,
        metavar="FILE",
        help="kubeconfig of the hub (default: the pod's service account, else $KUBECONFIG)",
    )
    flag(
        "--namespace",
        type=_name,
        default="open-cluster-management-addon",
        help="hub namespace of the proxy-servers, the cert-signer and its CA store when the "
        "ManagedProxyConfiguration does not name one (spec.proxyServer.namespace)",
    )
    flag("--mpc-name", type=_name, default="cluster-proxy", help="the ManagedProxyConfiguration to follow")
    flag(
        "--create-default-configuration",
        type=bool,
        default=True,
        help="at start, create the ManagedProxyConfiguration --mpc-name with the CRD's defaults when it "
        "does not exist (never overwrites one)",
    )
    flag(
        "--admin-url",
        type=_admin_url,
        multiple=True,
        metavar="URL",
        help="admin address of a proxy-server replica, https://HOST:PORT (repeat; its certificate must "
        f"name HOST); default: every address of the headless Service {render.ADMIN_SERVICE} (one per "
        "replica), whose certificate must name the in-cluster Service of the proxy-servers",
    )
    flag(
        "--signer",
        type=signer_url,
        metavar="URL",
        help="the cert-signer that issues the manager's own hub client certificate (the proxy-servers "
        f"list their clusters to hub clients only), https://HOST:PORT; default: its Service "
        f"{render.SIGNER_SERVICE} in the proxy-server namespace",
    )
    flag(
        "--credentials-dir",
        type=Path,
        default="/var/lib/cluster-proxy",
        metavar="DIR",
        help="where the manager keeps that certificate, its key and the trust bundle (a folder per "
        "proxy-server namespace); in Kubernetes a memory-backed emptyDir",
    )
    flag(
        "--resync-period",
        type=parse_positive_duration,
        default="10m",
        metavar="DURATION",
        help="every object is reconciled again this often, whether or not an event arrived",
    )
    flag(
        "--availability-poll",
        type=parse_positive_duration,
        default="10s",
        metavar="DURATION",
        help="how often the proxy-servers are asked which clusters hold tunnels (the addons' Available "
        "condition follows within it)",
    )
    flag(
        "--token-ttl",
        type=_token_ttl,
        default="24h",
        metavar="DURATION",
        help="lifetime of the bootstrap tokens minted for agents and proxy-servers (replaced when used, "
        "or when a quarter of it is left)",
    )
    flag(
        "--store-prefix",
        type=_name,
        default="cluster-proxy-ca",
        help="the cert-signer's store: Secrets <prefix>-* in the proxy-server namespace",
    )
    flag(
        "--cert-signer-image",
        default="cluster-proxy/cert-signer:dev",
        help="image of the cert-signer Deployment",
    )
    flag(
        "--hub-client",
        type=_hub_client,
        multiple=True,
        metavar="NAME=[NAMESPACE/]SECRET",
        help="keep a bootstrap Secret for hub client NAME (repeat): keys bootstrap-token (a single-use token "
        "for a client certificate CN=NAME, replaced once used or expiring) and ca.crt; the Secret in "
        "NAMESPACE, by default the proxy-server namespace",
    )
    flag(
        "--hub-server",
        type=_hub_server,
        multiple=True,
        metavar="NAME=[NAMESPACE/]SECRET=HOST[,HOST...]",
        help="keep a bootstrap Secret for a hub server NAME (repeat; the cluster-gateway's HTTPS endpoint): as "
        "--hub-client, with a server token for a certificate CN=NAME naming the HOSTs",
    )
    flag("--workers", type=parse_positive_int, default="4", help="reconciles run at once")
    flag(
        "--admin-listen",
        type=parse_hostport,
        default="0.0.0.0:8094",
        metavar="HOST:PORT",
        help="plain HTTP: /healthz /readyz /metrics (port 0: any free port)",
    )
    add_log_flags(flag)
    return parser


def parse_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ManagerSettings:
    """Parse and validate everything; a bad value exits with status 2 and a message naming it."""
    args = parse_args_or_exit(build_parser(), argv, environ=environ)
    return ManagerSettings(
        kubeconfig=args.kubeconfig,
        namespace=args.namespace,
        mpc_name=args.mpc_name,
        create_default_configuration=args.create_default_configuration,
        admin_urls=list(dict.fromkeys(args.admin_url)),
        signer=args.signer,
        credentials_dir=args.credentials_dir,
        resync_period=args.resync_period,
        availability_poll=args.availability_poll,
        token_ttl=args.token_ttl,
        store_prefix=args.store_prefix,
        cert_signer_image=args.cert_signer_image.strip() or "cluster-proxy/cert-signer:dev",
        workers=args.workers,
        hub_clients=_unique_hub_clients([*args.hub_client, *args.hub_server]),
        admin_listen=args.admin_listen,
        log_level=args.log_level,
        log_format=args.log_format,
    )


def _unique_hub_clients(clients: Sequence[render.HubClient]) -> list[render.HubClient]:
    """Each client once; two clients writing one Secret would replace each other's token forever."""
    by_secret: dict[tuple[str, str], render.HubClient] = {}
    for hub_client in dict.fromkeys(clients):
        where = (hub_client.namespace, hub_client.secret)
        other = by_secret.setdefault(where, hub_client)
        if other != hub_client:
            print(
                f"{PROG}: --hub-client {other.name} and {hub_client.name} name the same Secret "
                f"{hub_client.secret}: give each client a Secret of its own",
                file=sys.stderr,
            )
            sys.exit(2)
    return list(by_secret.values())


class Manager:
    """A running manager: the controller, its work queue and the periodic tasks."""

    def __init__(self, settings: ManagerSettings, kube: Kube) -> None:
        from clusterproxy_castore.kubestore import KubernetesSecretStore

        self.settings = settings
        self.kube = kube
        self.metrics = ManagerMetrics()
        self.credentials = Credentials(
            lambda namespace: KubernetesSecretStore(
                namespace=namespace, prefix=settings.store_prefix, api=kube.core_v1()
            ),
            token_ttl=dt.timedelta(seconds=settings.token_ttl),
        )
        self.controller = Controller(
            kube,
            ManagerOptions(
                namespace=settings.namespace,
                mpc_name=settings.mpc_name,
                store_prefix=settings.store_prefix,
                signer_image=settings.cert_signer_image,
                watch_timeout=settings.watch_timeout,
                hub_clients=tuple(settings.hub_clients),
            ),
            self.credentials,
            self.metrics,
        )
        self.queue: WorkQueue[str] = WorkQueue()
        self.log = get_logger("clusterproxy_addon_manager")
        self.certificate = HubClientCertificate(
            self.credentials,
            settings.credentials_dir,
            metrics=self.metrics,
            log=self.log,
            signer_url=settings.signer,
        )
        self.admin_address = ""
        self.ready = False

    # admin routes
    def readyz(self) -> Response:
        problems = self.controller.problems()
        if not self.ready or problems:
            detail = "; ".join(problems) or "listing the watched objects"
            return Response.text(f"not ready: {detail}", 503)
        return Response.text(
            f"ok: {len(self.controller.addons.items())} addon(s), {len(self.queue)} key(s) queued"
        )

    def _enqueue_from_any_thread(self, trio_token: trio.lowlevel.TrioToken, trio_thread: int) -> Any:
        def enqueue(key: str) -> None:
            if threading.get_ident() == trio_thread:
                self.queue.add(key)
                return
            try:
                trio.from_thread.run_sync(self.queue.add, key, trio_token=trio_token)
            except trio.RunFinishedError:
                pass

        return enqueue

    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            self.metrics.queue_depth.set(len(self.queue))
            kind = str(key).split("/", 1)[0]
            started = trio.current_time()
            try:
                await trio.to_thread.run_sync(self.controller.reconcile, key, abandon_on_cancel=True)
            except NotReady as exc:
                # an informer is still listing (the hub namespace changed): retried with the key's
                # backoff (0.1 s, then longer if it persists, e.g. a namespace the RBAC does not
                # cover: its informer logs why), quietly
                delay = self.queue.done(key, failed=True)
                self.metrics.reconciles.labels(kind, "retry").inc()
                self.log.debug("reconcile_waiting", key=key, reason=str(exc), retry_in=round(delay or 0, 2))
            except Exception as exc:
                delay = self.queue.done(key, failed=True)
                self.metrics.reconciles.labels(kind, "error").inc()
                known = isinstance(exc, KubeError | ConfigError | OSError) or type(exc).__module__.startswith(
                    "clusterproxy_castore"
                )
                log = self.log.warning if known else self.log.exception
                log(
                    "reconcile_failed",
                    key=key,
                    error=str(exc) or type(exc).__name__,
                    attempt=self.queue.failures(key),
                    retry_in=round(delay or 0, 2),
                )
            else:
                self.queue.done(key)
                self.metrics.reconciles.labels(kind, "ok").inc()
            finally:
                self.metrics.reconcile_seconds.labels(kind).observe(trio.current_time() - started)

    async def _resync(self) -> None:
        while True:
            await trio.sleep(self.settings.resync_period)
            for key in self.controller.all_keys():
                self.queue.add(key)
            try:
                await trio.to_thread.run_sync(
                    self.controller.prune_tokens, self.certificate.token_ids(), abandon_on_cancel=True
                )
            except Exception as exc:
                self.log.warning("token_prune_failed", error=str(exc))

    async def _poll_availability(self) -> None:
        while True:
            target = self.controller.admin_target()
            urls = self.settings.admin_urls
            tls = self.certificate.tls(target.namespace)
            if not urls:
                urls = await trio.to_thread.run_sync(
                    admin_urls_from_dns,
                    f"{render.ADMIN_SERVICE}.{target.namespace}.svc",
                    target.port,
                    abandon_on_cancel=True,
                )
                if isinstance(tls, AdminTLS):  # pod IPs: the name the manager gave their certificate
                    tls = replace(tls, server_name=target.server_name)
            availability = await trio.to_thread.run_sync(poll_once, urls, tls, abandon_on_cancel=True)
            self.metrics.availability_polls.labels("ok" if availability.answered else "failed").inc()
            self.metrics.clusters_available.set(sum(1 for n in availability.agents.values() if n > 0))
            self.controller.set_availability(availability)
            await trio.sleep(self.settings.availability_poll)

    async def _create_default_configuration(self) -> None:
        """The controller's create, retried while the API server cannot answer; any other refusal is
        logged (what to do included) and the manager goes on without it."""
        delay = 0.2
        while True:
            try:
                await trio.to_thread.run_sync(
                    self.controller.create_default_configuration, abandon_on_cancel=True
                )
                return
            except Unavailable as exc:
                self.log.warning("default_configuration_failed", error=str(exc), retry_in=delay)
                await trio.sleep(delay)
                delay = min(delay * 2, 5.0)
            except Forbidden as exc:
                self.log.error(
                    "default_configuration_failed",
                    error=f"{exc}; or start the manager with --no-create-default-configuration "
                    f"and create the ManagedProxyConfiguration {self.settings.mpc_name!r} yourself",
                )
                return
            except KubeError as exc:
                self.log.error("default_configuration_failed", error=str(exc))
                return

    async def run(self, *, task_status: trio.TaskStatus[Manager] = trio.TASK_STATUS_IGNORED) -> None:
        listeners, self.admin_address = await listen_on("--admin-listen", self.settings.admin_listen)
        self.controller.enqueue = self._enqueue_from_any_thread(
            trio.lowlevel.current_trio_token(), threading.get_ident()
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(
                serve_admin,
                listeners,
                {
                    "/healthz": lambda: Response.text("ok"),
                    "/readyz": self.readyz,
                    "/metrics": lambda: metrics_response(self.metrics.registry),
                },
            )
            await nursery.start(self.queue.run)
            self.controller.start()
            self.log.info("manager_started", admin_port=self.admin_address)
            task_status.started(self)
            started = trio.current_time()
            while not self.controller.synced:
                await trio.sleep(0.02)
            if self.settings.create_default_configuration:
                await self._create_default_configuration()
            # the hub namespace's informers too, before the first reconcile needs them; and the
            # store's client (importing the generated kubernetes client takes most of a second)
            await trio.to_thread.run_sync(self.controller.start_hub_informers)
            await trio.to_thread.run_sync(self.kube.core_v1)
            self.log.info("manager_synced", seconds=round(trio.current_time() - started, 3))
            self.ready = True
            for key in self.controller.all_keys():
                self.queue.add(key)
            for _ in range(self.settings.workers):
                nursery.start_soon(self._worker)
            nursery.start_soon(self._resync)
            nursery.start_soon(
                self.certificate.follow, self.controller.admin_target, self.settings.availability_poll
            )
            nursery.start_soon(self._poll_availability)


async def serve(
    settings: ManagerSettings, *, task_status: trio.TaskStatus[Manager] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run until SIGTERM/SIGINT."""
    kube = Kube(load_configuration(settings.kubeconfig, flag_env=ENV_PREFIX + "KUBECONFIG").configuration)
    manager = Manager(settings, kube)
    await serve_until_signalled(
        manager.run, manager.log, first_event="shutdown_requested", task_status=task_status
    )


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(argv)
    json_logs = LOG_FORMATS[settings.log_format]
    configure_logging(settings.log_level, json=json_logs)
    log = get_logger("clusterproxy_addon_manager")
    log.info("manager_starting", **settings.summary())
    status = run_service(serve, settings, on_failure=failure_in_log(log, "manager_failed"))
    if status == 0:
        log.info("manager_stopped")
    sys.exit(status)


if __name__ == "__main__":
    main()
