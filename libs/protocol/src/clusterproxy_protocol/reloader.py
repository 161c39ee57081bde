"""Hot reload of TLS credentials, and the task that renews them before they expire.

:class:`ReloadingContext` keeps one :class:`ssl.SSLContext` for a certificate, key and trust bundle on
disk. :meth:`~ReloadingContext.reload` loads a renewed certificate (and a trust bundle that gained a
CA) *into the same context object*: OpenSSL copies the certificate into each connection when it is
created, so new handshakes use the new certificate and established connections (tunnels and their
streams) are untouched. OpenSSL cannot forget a trusted CA, so when a CA *leaves* the bundle (the
last step of a CA rotation) the context is rebuilt and :attr:`~ReloadingContext.context` returns the
new object: code that must stop trusting a retired CA reads ``.context`` at each handshake (or calls
the object: ``ReloadingContext`` is a ``Callable[[], ssl.SSLContext]``).

:class:`CertRenewer` is the trio task: renew at 80% of the certificate's lifetime (minus a random
jitter so that a fleet does not renew at once), retry failures with capped exponential backoff (with
jitter), refresh the trust bundle periodically and report to the signer what this party trusts.
"""

from __future__ import annotations

import datetime as dt
import random
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from cryptography import x509

from . import certclient, tls
from .config import ConfigError
from .logs import get_logger

__all__ = [
    "CertRenewer",
    "ReloadingContext",
    "RenewalPolicy",
    "backoff_delay",
    "renewal_time",
]


def _bundle(path: Path) -> tuple[str, ...]:
    try:
        return certclient.bundle_fingerprints(Path(path).read_bytes())
    except OSError as exc:
        raise ConfigError(f"cannot read CA bundle {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"CA bundle {path} holds no valid PEM certificate: {exc}") from None


class ReloadingContext:
    """An SSL context whose certificate, key and trust bundle follow their files on :meth:`reload`.

    ``build`` makes a complete context from the files (it is called at creation and whenever a CA
    leaves the bundle); ``cert``/``key`` may be None for a context without a certificate of its own.
    """

    def __init__(
        self, build: Callable[[], ssl.SSLContext], *, cert: Path | None, key: Path | None, ca: Path
    ) -> None:
        self._build = build
        self.cert, self.key, self.ca = cert, key, ca
        self._trusted = _bundle(ca)
        self._ctx = build()
        self.generation = 0
        self.rebuilds = 0

    @classmethod
    def server(
        cls, cert: Path, key: Path, ca: Path, *, alpn: Sequence[str], require_client_cert: bool = True
    ) -> ReloadingContext:
        """A TLS 1.3 server context (:func:`tls.server_context`); ``require_client_cert=False`` asks for
        a client certificate and verifies one if sent, but lets a client without one in."""

        def build() -> ssl.SSLContext:
            ctx = tls.server_context(cert, key, ca, alpn=alpn)
            if not require_client_cert:
                ctx.verify_mode = ssl.CERT_OPTIONAL
            return ctx

        return cls(build, cert=cert, key=key, ca=ca)

    @classmethod
    def client(
        cls, cert: Path | None, key: Path | None, ca: Path, *, alpn: Sequence[str]
    ) -> ReloadingContext:
        """A TLS 1.3 client context (:func:`tls.client_context`)."""
        return cls(lambda: tls.client_context(cert, key, ca, alpn=alpn), cert=cert, key=key, ca=ca)

    @property
    def context(self) -> ssl.SSLContext:
        """The context for the next handshake."""
        return self._ctx

    def __call__(self) -> ssl.SSLContext:
        return self._ctx

    @property
    def trusted(self) -> tuple[str, ...]:
        """Fingerprints (``sha256:<hex>``) of the CAs the context trusts (as of the last load)."""
        return self._trusted

    def reload(self) -> str:
        """Load the files again: ``"reloaded"`` (same context object, new certificate / added CAs) or
        ``"rebuilt"`` (a CA left the bundle: a new context object). On a bad file this raises
        :class:`ConfigError` and the context keeps serving what it had."""
        trusted = _bundle(self.ca)
        if set(self._trusted) - set(trusted):
            ctx = self._build()
            self._ctx, self._trusted = ctx, trusted
            self.rebuilds += 1
            self.generation += 1
            return "rebuilt"
        if self.cert is not None and self.key is not None:
            tls.load_cert_chain(self._ctx, self.cert, self.key)
        if set(trusted) - set(self._trusted):
            tls.load_trust(self._ctx, self.ca)
        self._trusted = trusted
        self.generation += 1
        return "reloaded"


# --- scheduling ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RenewalPolicy:
    """When to renew and how to retry. Defaults are starting points (docs/certificates.md)."""

    fraction: float = 0.8  # renew at this fraction of the lifetime...
    jitter: float = 0.05  # ...minus up to this fraction of it, at random
    retry_initial: float = 1.0
    retry_max: float = 300.0
    trust_refresh: float = 300.0  # seconds between trust-bundle fetches; 0 turns them off

    def __post_init__(self) -> None:
        if not 0 < self.fraction < 1 or not 0 <= self.jitter < self.fraction:
            raise ValueError("renewal needs 0 < fraction < 1 and 0 <= jitter < fraction")
        if self.retry_initial <= 0 or self.retry_max < self.retry_initial or self.trust_refresh < 0:
            raise ValueError("renewal needs 0 < retry_initial <= retry_max and trust_refresh >= 0")


def renewal_time(cert: x509.Certificate, policy: RenewalPolicy, sample: float) -> dt.datetime:
    """``not_before + lifetime * (fraction - jitter * sample)`` for ``sample`` in [0, 1)."""
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return start + (end - start) * (policy.fraction - policy.jitter * sample)


def backoff_delay(attempt: int, policy: RenewalPolicy, sample: float) -> float:
    """Capped exponential backoff with jitter: between half and all of ``initial * 2**attempt``."""
    base = min(policy.retry_max, policy.retry_initial * 2 ** min(attempt, 32))
    return base * (0.5 + 0.5 * sample)


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(Path(path).read_bytes())
    except OSError as exc:
        raise ConfigError(f"cannot read certificate {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"certificate file {path} holds no valid PEM certificate: {exc}") from None


class CertRenewer:
    """Keeps ``files`` fresh and ``contexts`` loaded with them.

    - renews at :func:`renewal_time` (via :func:`certclient.renew`, mTLS with the current
      certificate, a new key each time), writes the files, reloads every context;
    - fetches the trust bundle every ``policy.trust_refresh`` seconds (and at start), installs a
      changed one, reloads, and fetches once more so the signer records the new trust;
    - retries failures with :func:`backoff_delay`, never giving up (an expired certificate is logged
      as such: it needs a new bootstrap token).

    ``endpoint.ca`` should be ``files.ca`` (the signer is verified with the current bundle).
    """

    def __init__(
        self,
        endpoint: certclient.SignerEndpoint,
        files: certclient.CertFiles,
        contexts: Sequence[ReloadingContext] = (),
        policy: RenewalPolicy = RenewalPolicy(),
        *,
        rng: random.Random | None = None,
        clock: Callable[[], dt.datetime] = _utc_now,
        on_renewed: Callable[[certclient.Issued], None] | None = None,
        log: Any = None,
    ) -> None:
        self.endpoint = endpoint
        self.files = files
        self.contexts = list(contexts)
        self.policy = policy
        self.rng = rng or random.Random()
        self.clock = clock
        self.on_renewed = on_renewed
        self.renewals = 0
        self.failures = 0
        self.trust_updates = 0
        self.last_error: str | None = None
        self.next_renewal: dt.datetime | None = None
        self._pending_key: Any = None
        self._wake = trio.Event()
        self._renewed = trio.Event()
        cert = _load_cert(files.cert)
        self.log = log or get_logger("cert-renewer", subject=cert.subject.rfc4514_string())

    # -- public ------------------------------------------------------------------------------------------

    @property
    def certificate(self) -> x509.Certificate:
        return _load_cert(self.files.cert)

    def request_renewal(self) -> None:
        """Renew now instead of at the scheduled time (e.g. an operator's request)."""
        self._wake.set()

    async def wait_renewed(self) -> None:
        """Until the next successful renewal."""
        await self._renewed.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._renew_loop)
            if self.policy.trust_refresh > 0:
                nursery.start_soon(self._trust_loop)
            task_status.started()

    async def renew_once(self) -> certclient.Issued:
        """One renewal attempt: CSR for a new key (the same key across retries of one renewal, so a
        retry after a lost answer gets the same certificate), renew, write the files, reload."""
        current = self.certificate
        if self._pending_key is None:
            self._pending_key = certclient.generate_key()
        key = self._pending_key
        issued = await certclient.renew(
            self.endpoint,
            self.files.cert,
            self.files.key,
            certclient.csr_like(current, key),
            trusted=_bundle(self.files.ca),
        )
        certclient.write_credentials(self.files, key, issued)
        self._pending_key = None
        self._reload_all()
        self.renewals += 1
        self.last_error = None
        self.log.info(
            "cert_renewed",
            serial=issued.serial,
            not_after=issued.not_after.isoformat(),
            renewals=self.renewals,
        )
        if self.on_renewed is not None:
            self.on_renewed(issued)
        self._renewed.set()
        self._renewed = trio.Event()
        return issued

    async def refresh_trust_once(self) -> bool:
        """Fetch the trust bundle (reporting what we trust); install and reload if it changed, then
        report again. True when the bundle changed."""
        bundle = await self._fetch_trust()
        if bundle.fingerprints == _bundle(self.files.ca):
            return False
        certclient.write_bundle(self.files.ca, bundle.pem)
        self._reload_all()
        self.trust_updates += 1
        self.log.info("trust_bundle_updated", cas=[c.get("id") for c in bundle.cas])
        await self._fetch_trust()  # the signer now records the bundle we actually use
        return True

    # -- internals ---------------------------------------------------------------------------------------

    async def _fetch_trust(self) -> certclient.TrustBundle:
        return await certclient.fetch_trust_bundle(
            self.endpoint, cert=self.files.cert, key=self.files.key, trusted=_bundle(self.files.ca)
        )

    def _reload_all(self) -> None:
        for ctx in self.contexts:
            ctx.reload()

    async def _sleep_or_wake(self, seconds: float) -> None:
        with trio.move_on_after(max(0.0, seconds)):
            await self._wake.wait()
        if self._wake.is_set():
            self._wake = trio.Event()

    async def _renew_loop(self) -> None:
        while True:
            cert = self.certificate
            self.next_renewal = renewal_time(cert, self.policy, self.rng.random())
            await self._sleep_or_wake((self.next_renewal - self.clock()).total_seconds())
            attempt = 0
            while True:
                try:
                    await self.renew_once()
                    break
                except (certclient.SignerRequestError, ConfigError, OSError, ValueError) as exc:
                    delay = backoff_delay(attempt, self.policy, self.rng.random())
                    attempt += 1
                    self.failures += 1
                    self.last_error = str(exc)
                    try:
                        expired = self.certificate.not_valid_after_utc <= self.clock()
                    except ConfigError:
                        expired = False
                    level = self.log.error if expired or not _retryable(exc) else self.log.warning
                    level(
                        "cert_renewal_failed",
                        error=str(exc),
                        attempt=attempt,
                        retry_in=round(delay, 2),
                        expired=expired,
                        hint="the certificate has expired: bootstrap again with a new token"
                        if expired
                        else None,
                    )
                    await self._sleep_or_wake(delay)

    async def _trust_loop(self) -> None:
        attempt = 0
        while True:
            try:
                await self.refresh_trust_once()
                attempt = 0
                delay = self.policy.trust_refresh * (1 - 0.1 * self.rng.random())
            except (certclient.SignerRequestError, ConfigError, OSError, ValueError) as exc:
                delay = min(self.policy.trust_refresh, backoff_delay(attempt, self.policy, self.rng.random()))
                attempt += 1
                self.log.warning("trust_refresh_failed", error=str(exc), retry_in=round(delay, 2))
            await trio.sleep(delay)


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, certclient.SignerRequestError) and exc.retryable
