"""The running signer: the HTTPS signing API, its own serving certificate, and housekeeping.

Routes (JSON; errors ``{"error", "reason"}`` with 400/401/403/404/405/409/410/413/429)::

    POST /v1/bootstrap        {"token", "csr_pem"}                       no client certificate needed
    POST /v1/renew            {"csr_pem", "trusted"?}                    mTLS: the current certificate
    GET  /v1/trust-bundle     headers cluster-proxy-trusted: fp,fp       mTLS optional (records what
                              and cluster-proxy-presenting: serial       the caller trusts and presents;
                                                                         refresh_after during a rotation)
    GET  /healthz

The signer serves with a certificate it issues itself from the active CA (re-issued when the active
CA changes or at 80% of its lifetime) and trusts the current bundle for client certificates; both are
re-read from the store every ``store_poll`` seconds, so ``rotate-ca`` and ``token create`` run by
another process apply without a restart.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio
from cryptography import x509

from clusterproxy_castore.rotation import DEFAULT_CA_DAYS, ensure_ca
from clusterproxy_castore.store import CertStore
from clusterproxy_protocol import PRESENTING_HEADER, TRUSTED_HEADER, ReloadingContext, certclient, get_logger

from .core import (
    DEFAULT_CERT_TTL,
    DEFAULT_ROTATION_REFRESH,
    IssueResult,
    SignerCore,
    parse_presenting,
    parse_trusted,
    utc_now,
)
from .errors import BadRequest, RateLimited, SignerError
from .https import HttpLimits, Request, Response, serve_https
from .ratelimit import RateLimiter

__all__ = ["SignerConfig", "SignerService"]

SELF_NAME = "cert-signer"


@dataclass
class SignerConfig:
    store: CertStore
    tls_dir: Path
    listen: tuple[str, int] = ("0.0.0.0", 8443)
    tls_hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")
    cert_ttl: dt.timedelta = DEFAULT_CERT_TTL
    ca_days: int = DEFAULT_CA_DAYS
    limits: HttpLimits = field(default_factory=HttpLimits)
    ip_burst: float = 20.0
    ip_rate: float = 2.0  # per second
    cert_burst: float = 20.0
    cert_rate: float = 1.0  # per second
    token_burst: float = 5.0
    token_rate: float = 1 / 60  # per second
    store_poll: float = 5.0
    prune_interval: float = 3600.0
    rotation_refresh: float = DEFAULT_ROTATION_REFRESH  # trust refresh asked of parties mid-rotation


class SignerService:
    def __init__(
        self,
        config: SignerConfig,
        *,
        clock: Callable[[], dt.datetime] = utc_now,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.store = config.store
        self.core = SignerCore(
            config.store, cert_ttl=config.cert_ttl, clock=clock, rotation_refresh=config.rotation_refresh
        )
        self.clock = clock
        self.monotonic = monotonic
        self.ip_limiter = RateLimiter(burst=config.ip_burst, rate=config.ip_rate)
        self.cert_limiter = RateLimiter(burst=config.cert_burst, rate=config.cert_rate)
        self.token_limiter = RateLimiter(burst=config.token_burst, rate=config.token_rate)
        self.log = get_logger("cert-signer")
        self.files = certclient.CertFiles(
            cert=config.tls_dir / "signer.crt",
            key=config.tls_dir / "signer.key",
            ca=config.tls_dir / "bundle.crt",
        )
        self.tls: ReloadingContext | None = None
        self._own: x509.Certificate | None = None
        self._store_slots = trio.CapacityLimiter(8)

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._store_slots)

    # -- running -----------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        authorities = await self._in_thread(lambda: ensure_ca(self.store, now=self.clock(), days=cfg.ca_days))
        assert authorities.active is not None
        await self._in_thread(self._issue_own)
        self.tls = ReloadingContext.server(
            self.files.cert, self.files.key, self.files.ca, alpn=[certclient.ALPN], require_client_cert=False
        )
        await self._in_thread(self._report_own)
        listeners = await trio.open_tcp_listeners(cfg.listen[1], host=cfg.listen[0] or None)
        sockname = listeners[0].socket.getsockname()
        bound = (str(sockname[0]), int(sockname[1]))
        async with trio.open_nursery() as nursery:
            https_log = self.log.bind(logger="cert-signer.https")
            await nursery.start(
                partial(serve_https, listeners, self.tls, self.handle, cfg.limits, log=https_log)
            )
            nursery.start_soon(self._poll_loop)
            self.log.info(
                "signer_started",
                listen=f"{bound[0]}:{bound[1]}",
                store=self.store.description,
                active_ca=authorities.active.id,
                cas=[r.id for r in authorities.bundle()],
            )
            task_status.started(bound)

    def _issue_own(self) -> None:
        self.config.tls_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        previous = self._own
        if previous is None:  # a restart: the certificate the last run served with, if any
            with contextlib.suppress(OSError, ValueError):
                previous = x509.load_pem_x509_certificate(self.files.cert.read_bytes())
        key = certclient.generate_key()
        result = self.core.issue_self(
            key.public_key(),
            SELF_NAME,
            self.config.tls_hosts,
            predecessor=None if previous is None else format(previous.serial_number, "x"),
        )
        certclient.write_credentials(self.files, key, certclient.Issued.from_json(result.body()))
        self._own = x509.load_pem_x509_certificate(result.record.cert_pem.encode())

    def _refresh_tls(self) -> bool:
        """Follow the store: a new bundle, a new active CA, or our own certificate due for renewal."""
        current = self.store.read_authorities()
        changed = certclient.write_bundle(self.files.ca, current.bundle_pem())
        own = self._own
        active = current.active
        if own is not None and active is not None:
            lifetime = own.not_valid_after_utc - own.not_valid_before_utc
            due = own.not_valid_before_utc + lifetime * 0.8 <= self.clock()
            if due or own.issuer != active.cert.subject:
                self._issue_own()
                changed = True
        return changed

    async def _poll_loop(self) -> None:
        last_prune = self.monotonic()
        while True:
            await trio.sleep(self.config.store_poll)
            await self.refresh()
            if self.monotonic() - last_prune >= self.config.prune_interval:
                last_prune = self.monotonic()
                try:
                    removed = await self._in_thread(self.core.prune)
                    if removed:
                        self.log.info("store_pruned", removed=removed)
                except Exception as exc:
                    self.log.warning("store_prune_failed", error=str(exc))

    async def refresh(self) -> None:
        """Re-read the CAs now and reload the TLS context if anything changed (the poll loop does this
        every ``store_poll`` seconds)."""
        try:
            if await self._in_thread(self._refresh_tls) and self.tls is not None:
                how = self.tls.reload()
                self.log.info("signer_tls_reloaded", how=how, trusted=len(self.tls.trusted))
            await self._in_thread(self._report_own)
        except Exception as exc:
            self.log.warning("signer_tls_refresh_failed", error=str(exc))

    def _report_own(self) -> None:
        """Record what our TLS context trusts and presents, as every party reports its own: a rotation
        activates only once we trust the new CA and retires the old one once we present a new leaf."""
        if self.tls is None or self._own is None:
            return
        presenting = self.tls.presenting
        self.core.trust_bundle(self._own, self.tls.trusted, (presenting,) if presenting else ())

    # -- requests ----------------------------------------------------------------------------------------

    def _limit(self, limiter: RateLimiter, key: str, what: str) -> None:
        wait = limiter.check(key, self.monotonic())
        if wait > 0:
            raise RateLimited(f"too many requests {what}; retry in {wait:.0f}s", retry_after=wait)

    async def handle(self, request: Request) -> Response:
        routes: dict[str, tuple[str, Callable[[Request], Any]]] = {
            "/v1/bootstrap": ("POST", self._bootstrap),
            "/v1/renew": ("POST", self._renew),
            "/v1/trust-bundle": ("GET", self._trust_bundle),
            "/healthz": ("GET", self._healthz),
        }
        route = routes.get(request.path)
        if route is None:
            return Response.json(
                {"error": "not_found", "reason": f"no route {request.path}; try {', '.join(sorted(routes))}"},
                404,
            )
        method, fn = route
        if request.method != method:
            return Response.json(
                {
                    "error": "method_not_allowed",
                    "reason": f"{request.path} takes {method}, not {request.method}",
                },
                405,
                (("allow", method),),
            )
        if request.path != "/healthz":
            # A verified client certificate is the requester's identity: parties that share an
            # address (loopback in local mode, a fleet behind one NAT) must not starve each other.
            peer = request.peer_cert
            if peer is not None:
                self._limit(
                    self.cert_limiter,
                    format(peer.serial_number, "x"),
                    f"with certificate {peer.subject.rfc4514_string()}",
                )
            else:
                self._limit(self.ip_limiter, request.peer_ip, f"from {request.peer_ip}")
        try:
            result: Response = await fn(request)
        except SignerError as exc:
            self.log.info(
                "request_refused", path=request.path, peer=request.peer_ip, error=exc.error, reason=exc.reason
            )
            raise
        return result

    def _issued(self, result: IssueResult, request: Request) -> Response:
        r = result.record
        self.log.info(
            "cert_issued",
            via=r.via,
            identity=r.identity.key,
            serial=r.serial,
            ca_id=r.ca_id,
            not_after=r.not_after.isoformat(),
            token_id=r.token_id,
            predecessor=r.predecessor,
            peer=request.peer_ip,
            **(
                {"cluster": r.identity.cluster, "agent_id": r.identity.name}
                if r.identity.kind == "agent"
                else {}
            ),
        )
        return Response.json(result.body())

    async def _bootstrap(self, request: Request) -> Response:
        body = _json_object(request.body)
        token = body.get("token")
        if isinstance(token, str) and "." in token:
            self._limit(self.token_limiter, token.split(".", 1)[0][:32], "with this token")
        result = await self._in_thread(self.core.bootstrap, token, body.get("csr_pem"))
        return self._issued(result, request)

    async def _renew(self, request: Request) -> Response:
        body = _json_object(request.body)
        trusted = parse_trusted(body.get("trusted"))
        result = await self._in_thread(self.core.renew, request.peer_cert, body.get("csr_pem"), trusted)
        return self._issued(result, request)

    async def _trust_bundle(self, request: Request) -> Response:
        header = request.headers.get(TRUSTED_HEADER)
        trusted = parse_trusted(header) if header is not None else None
        presenting = parse_presenting(request.headers.get(PRESENTING_HEADER))
        return Response.json(
            await self._in_thread(self.core.trust_bundle, request.peer_cert, trusted, presenting)
        )

    async def _healthz(self, request: Request) -> Response:
        return Response.json({"status": "ok"})


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body) if body else None
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadRequest("request body must be a JSON object")
    return value
