"""The collector's rounds: every ``interval``, read the proxy-servers (and the addons), then probe every
cluster through its tunnel, concurrently.

Probes run at most ``max_concurrent_probes`` at a time (below the proxy-server's per-connection
pending-dial bound, 128 by default, so the collector never earns a 429), each bounded by its own
``probe_timeout``: a hung target holds one slot for that long and no other probe waits for it. A
round that outlasts the interval is logged; the next one starts when it ends.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from clusterproxy_protocol import ALPN_HTTP1, ConfigError, client_context, get_logger

from .credentials import DEFAULT_CLIENT_NAME, ClientCertificate
from .metrics import CollectorMetrics
from .probe import ProbeSpec, StreamOpener, probe_cluster
from .servers import AdminTLS, resolve_admin_service, server_views
from .state import AddonsView, State

__all__ = ["Collector", "CollectorSettings"]

MAX_CERTIFICATE_RETRY = 30.0  # seconds: a Secret created (or a signer started) later is seen this soon


@dataclass
class CollectorSettings:
    admin_urls: list[str] = field(default_factory=list)
    admin_service: tuple[str, int] | None = None
    proxy: tuple[str, int] | None = None
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None
    signer: str | None = None  # https://HOST:PORT: the client certificate is bootstrapped and renewed
    bootstrap_token: str | None = None
    bootstrap_secret: tuple[str, str] | None = None  # NAMESPACE, NAME: the token (and CA) via the API
    client_name: str = DEFAULT_CLIENT_NAME
    probe: ProbeSpec = field(default_factory=lambda: ProbeSpec("https", "{cluster}", 443, "/healthz"))
    interval: float = 10.0
    probe_timeout: float = 5.0
    server_timeout: float = 5.0
    max_concurrent_probes: int = 64
    history: int = 60
    forget_after: float = 3600.0
    kubernetes: bool = False
    kubeconfig: Path | None = None
    addon_name: str = "cluster-proxy"
    listen: tuple[str, int] = ("0.0.0.0", 8080)
    log_level: str = "info"
    log_format: str = "auto"

    @property
    def probing(self) -> bool:
        return self.proxy is not None


class Collector:
    def __init__(
        self,
        settings: CollectorSettings,
        *,
        opener: StreamOpener | None = None,
        read_addons: Callable[[float], AddonsView] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.opener = opener
        self.read_addons = read_addons
        self.clock = clock
        self.metrics = CollectorMetrics()
        self.state = State(
            history=settings.history, forget_after=settings.forget_after, kubernetes=settings.kubernetes
        )
        if settings.proxy is None:
            self.state.probing = (
                "probes are off: the collector has no --proxy (the proxy-server's client port) and "
                "hub client certificate (--ca, --cert, --key)"
            )
        elif opener is None:
            self.state.probing = "probes are not connected to the proxy-server's client port yet"
        self.log = get_logger("clusterproxy_health")
        self.round_done = trio.Event()
        self.address = ""  # HOST:PORT of the HTTP port, once serving
        self.published = self.render_document()
        self._health: dict[str, str] = {}

    def attach(self, opener: StreamOpener) -> None:
        """Probes go through ``opener`` from the next round on."""
        self.opener = opener
        self.state.probing = None

    def probes_off(self, why: str) -> None:
        """No probes until :meth:`attach`; ``why`` is shown as a problem (in words: what to do)."""
        self.opener = None
        self.state.probing = why

    # -- one round ------------------------------------------------------------------------------------

    async def admin_urls(self) -> list[str]:
        urls = list(self.settings.admin_urls)
        if self.settings.admin_service is not None:
            host, port = self.settings.admin_service
            found = await resolve_admin_service(host, port)
            if not found:
                self.state.problems.append(
                    f"--admin-service {host}:{port} resolves to no address (no proxy-server replica found)"
                )
            urls += [u for u in found if u not in urls]
        return urls

    def admin_tls(self) -> AdminTLS | str:
        """The TLS the admin ports want (they list clusters and agents to hub clients only), with the
        certificate files as they are now (renewed ones included); or why there is none yet."""
        s = self.settings
        if s.ca is None or s.cert is None or s.key is None:
            return "the admin API needs a hub client certificate: give --ca, --cert and --key"
        try:
            context = client_context(s.cert, s.key, s.ca, alpn=[ALPN_HTTP1])
        except ConfigError as exc:
            return f"no hub client certificate for the admin API yet: {exc}"
        return AdminTLS(context, s.server_name or (s.proxy[0] if s.proxy is not None else None))

    async def round(self) -> None:
        started = trio.current_time()
        now = self.clock()
        self.state.problems = []
        urls = await self.admin_urls()
        if not urls and self.settings.admin_service is None:
            self.state.problems.append("no proxy-server to ask: give --admin-url or --admin-service")
        addons: AddonsView | None = None
        views = []
        async with trio.open_nursery() as nursery:

            async def read_servers() -> None:
                tls = self.admin_tls()
                views.extend(await server_views(urls, timeout=self.settings.server_timeout, now=now, tls=tls))

            async def read_kube() -> None:
                nonlocal addons
                if self.read_addons is not None:
                    addons = await trio.to_thread.run_sync(self.read_addons, now, abandon_on_cancel=True)

            nursery.start_soon(read_servers)
            nursery.start_soon(read_kube)
        for view in views:
            if not view.reachable:
                self.log.warning("proxy_server_unreachable", url=view.url, error=view.error)
        if addons is not None and addons.error is not None:
            self.log.warning("addons_unreadable", error=addons.error)
        for name in self.state.update_sources(views, addons, now):
            self.metrics.forget(name)
            self._health.pop(name, None)
        self.metrics.servers({v.url: v.reachable for v in views})
        await self.probe_all(self.state.names())
        unreachable = {
            r.last_probe.error
            for r in self.state.clusters.values()
            if r.last_probe is not None and r.last_probe.reason == "proxy_server" and r.last_probe.error
        }
        if unreachable:
            self.state.problems.append(
                f"probes cannot reach the proxy-server's client port: {sorted(unreachable)[0]}"
            )
        for name in self.state.names():
            record = self.state.clusters[name]
            self.metrics.cluster(record)
            self._log_transition(name)
        self.metrics.clusters.set(len(self.state.clusters))
        elapsed = trio.current_time() - started
        self.state.rounds += 1
        self.state.last_round_at = now
        self.state.last_round_seconds = elapsed
        self.metrics.round_seconds.set(elapsed)
        self.metrics.rounds.inc()
        self.published = self.render_document()
        log = self.log.warning if elapsed > self.settings.interval else self.log.debug
        log("round_finished", clusters=len(self.state.clusters), seconds=round(elapsed, 3))
        self.round_done.set()
        self.round_done = trio.Event()

    async def probe_all(self, names: Sequence[str]) -> None:
        if self.opener is None:
            return
        slots = trio.CapacityLimiter(self.settings.max_concurrent_probes)

        async def one(name: str) -> None:
            async with slots:
                assert self.opener is not None
                result = await probe_cluster(
                    self.opener,
                    self.settings.probe,
                    name,
                    timeout=self.settings.probe_timeout,
                    clock=self.clock,
                )
            record = self.state.clusters.get(name)
            if record is not None:
                record.record_probe(result)
                self.metrics.probe(name, result.latency, result.reason)

        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(one, name)

    def _log_transition(self, name: str) -> None:
        record = self.state.clusters[name]
        before, now = self._health.get(name), record.state
        self._health[name] = now
        if before == now or (before is None and now == "healthy"):
            return
        probe = record.last_probe
        self.log.info(
            f"cluster_{now}",
            cluster=name,
            installed=record.installed,
            available=record.available,
            probed=record.probed,
            error=probe.error if probe is not None else None,
        )

    # -- the loop -------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """A round every ``interval`` (from the start of one to the start of the next), forever."""
        task_status.started()
        while True:
            started = trio.current_time()
            await self.round()
            await trio.sleep_until(max(started + self.settings.interval, trio.current_time()))

    def render_document(self) -> bytes:
        """The document as served, built once a round: with a thousand clusters and their histories
        it is megabytes, and every reader (the page refreshes every few seconds) gets the same bytes."""
        return json.dumps(self.document(), separators=(",", ":"), sort_keys=True).encode() + b"\n"

    def document(self) -> dict[str, Any]:
        return self.state.document(
            interval=self.settings.interval, probe=self.probe_description(), now=self.clock()
        )

    def probe_description(self) -> dict[str, Any]:
        return {
            **self.settings.probe.describe(),
            "timeout_seconds": self.settings.probe_timeout,
            "enabled": self.opener is not None,
        }


async def run_with(
    settings: CollectorSettings, body: Callable[[Collector], Awaitable[None]], **kwargs: Any
) -> None:
    """Build a Collector, connect its probes (the SDK's shared tunnel to ``settings.proxy``, after
    getting a client certificate from ``settings.signer`` when given) and run ``body``."""
    collector = Collector(settings, **kwargs)
    if settings.proxy is None:
        await body(collector)
        return
    async with trio.open_nursery() as nursery:
        await nursery.start(_connect_probes, settings, collector)
        await body(collector)
        nursery.cancel_scope.cancel()


def _secret_reader(settings: CollectorSettings) -> Any:
    if settings.bootstrap_secret is None:
        return None
    from .addons import hub_configuration
    from .credentials import SecretReader

    namespace, name = settings.bootstrap_secret
    reader = SecretReader(
        hub_configuration(settings.kubeconfig),
        namespace,
        name,
        settings.client_name,
        timeout=settings.server_timeout,
    )
    return reader.read


async def _connect_probes(
    settings: CollectorSettings, collector: Collector, *, task_status: trio.TaskStatus[None]
) -> None:
    """Started once the probes are connected, or once the first try to get the client certificate
    failed (then the rounds run with probes off, the reason shown, while a retryable failure is
    retried with a growing delay)."""
    from clusterproxy_protocol import CertFiles, CertRenewer
    from clusterproxy_sdk import TLSFiles, open_shared_tunnel

    assert settings.proxy is not None and settings.ca is not None
    log = get_logger("clusterproxy_health")
    announced = False

    def announce() -> None:
        nonlocal announced
        if not announced:
            announced = True
            task_status.started()

    async with trio.open_nursery() as nursery:
        if settings.signer is not None:
            assert settings.cert is not None and settings.key is not None
            certificate = ClientCertificate(
                settings.signer,
                CertFiles(settings.cert, settings.key, settings.ca),
                token=settings.bootstrap_token,
                secret=_secret_reader(settings),
                name=settings.client_name,
            )
            delay = 1.0
            said = ""
            while (problem := await certificate.obtain(log)) is not None:
                if problem.message != said:
                    log.warning("client_certificate_missing", error=problem.message)
                    said = problem.message
                collector.probes_off(problem.message)
                announce()
                if not problem.retryable:
                    await trio.sleep_forever()
                await trio.sleep(delay)
                delay = min(2 * delay, MAX_CERTIFICATE_RETRY)
            renewer = CertRenewer(certificate.endpoint, certificate.files, log=log)
            await nursery.start(renewer.run)
        tls = TLSFiles(settings.ca, settings.cert, settings.key).reloading(log=log)
        async with open_shared_tunnel(
            settings.proxy,
            tls,
            server_hostname=settings.server_name,
            connect_timeout=settings.probe_timeout,
            keepalive=(min(10.0, settings.interval), settings.probe_timeout),
        ) as tunnel:
            collector.attach(tunnel)
            announce()
            await trio.sleep_forever()
