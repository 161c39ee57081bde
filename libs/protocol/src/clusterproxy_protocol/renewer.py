"""The task that renews a party's certificate before it expires and keeps its trust bundle current.

:class:`CertRenewer` is the trio task: renew at 80% of the certificate's lifetime (minus a random
jitter so that a fleet does not renew at once), retry failures with capped exponential backoff (with
jitter), refresh the trust bundle periodically and report to the signer what this party's contexts
trust and which leaf they present (as loaded, not as written: a CA rotation retires the old CA only
once every party presents a leaf of the new one). When the trust bundle says another CA is active
than the one that signed this party's leaf (a rotation was activated), it renews early: within a
jittered fraction of the trust refresh interval instead of at 80% of the lifetime. While a rotation is
under way the signer's answer asks for the next fetch sooner (``refresh_after``): the trust refresh
interval is then the smaller of the two, so every step of a rotation reaches the party within seconds.

The contexts it reloads are :class:`~clusterproxy_protocol.reloader.ReloadingContext`.
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from . import certclient
from .config import ConfigError
from .logs import get_logger
from .reloader import ReloadingContext, bundle_in_file, certificate_serial

__all__ = [
    "MIN_REFRESH_AFTER",
    "CertRenewer",
    "RenewalPolicy",
    "backoff_delay",
    "early_renewal_delay",
    "renewal_time",
    "trust_refresh_interval",
]


# --- scheduling ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RenewalPolicy:
    """When to renew and how to retry. Defaults are starting points (docs/certificates.md)."""

    fraction: float = 0.8  # renew at this fraction of the lifetime...
    jitter: float = 0.05  # ...minus up to this fraction of it, at random
    retry_initial: float = 1.0
    retry_max: float = 300.0
    # seconds between trust-bundle fetches (0 turns them off): a rotation's start is noticed within
    # it; once noticed, the signer's refresh hint takes over until the rotation ends
    trust_refresh: float = 60.0
    # a leaf not from the active CA renews within this fraction of the trust refresh interval, at random
    early_jitter: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.fraction < 1 or not 0 <= self.jitter < self.fraction:
            raise ValueError("renewal needs 0 < fraction < 1 and 0 <= jitter < fraction")
        if self.retry_initial <= 0 or self.retry_max < self.retry_initial or self.trust_refresh < 0:
            raise ValueError("renewal needs 0 < retry_initial <= retry_max and trust_refresh >= 0")
        if not 0 <= self.early_jitter <= 1:
            raise ValueError("renewal needs 0 <= early_jitter <= 1")


# The fastest trust refresh a signer's hint may ask for: a broken or hostile hint cannot make a fleet
# hammer the signer.
MIN_REFRESH_AFTER = 1.0


def trust_refresh_interval(policy: RenewalPolicy, refresh_after: float | None) -> float:
    """Seconds between trust-bundle fetches: ``policy.trust_refresh``, or the signer's hint
    ``refresh_after`` (at least :data:`MIN_REFRESH_AFTER`) when that is sooner. 0: no fetches."""
    if policy.trust_refresh <= 0 or refresh_after is None:
        return policy.trust_refresh
    return min(policy.trust_refresh, max(MIN_REFRESH_AFTER, refresh_after))


def early_renewal_delay(interval: float, policy: RenewalPolicy, sample: float) -> float:
    """Seconds until a leaf that is not from the active CA renews: ``interval * early_jitter * sample``
    for the current trust refresh ``interval`` and ``sample`` in [0, 1) (a fleet that learns of an
    activation together spreads out)."""
    return interval * policy.early_jitter * sample


def renewal_time(cert: x509.Certificate, policy: RenewalPolicy, sample: float) -> dt.datetime:
    """``not_before + lifetime * (fraction - jitter * sample)`` for ``sample`` in [0, 1)."""
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return start + (end - start) * (policy.fraction - policy.jitter * sample)


def backoff_delay(attempt: int, policy: RenewalPolicy, sample: float) -> float:
    """Capped exponential backoff with jitter: between half and all of ``initial * 2**attempt``."""
    base = min(policy.retry_max, policy.retry_initial * 2.0 ** min(attempt, 32))
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
      certificate, a new key each time), writes the files, reloads every context, then reports to
      the signer what the contexts present now;
    - fetches the trust bundle every :attr:`trust_interval` seconds (and at start), reporting what
      the contexts trust and present; installs a changed bundle, reloads, and reports again. The
      interval is ``policy.trust_refresh``, shortened to the signer's ``refresh_after`` while a
      rotation is under way (:func:`trust_refresh_interval`);
    - renews early (:func:`early_renewal_delay`) when the bundle names an active CA that did not sign
      this party's leaf: after a rotation's ``activate``, every party moves within about one trust
      refresh interval, whatever the leaf lifetime;
    - retries failures with :func:`backoff_delay`, never giving up (an expired certificate is logged
      as such: it needs a new bootstrap token).

    Without ``contexts`` the files are what the party presents (tools that read them at each
    connection). ``endpoint.ca`` should be ``files.ca`` (the signer is verified with the current
    bundle).
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
        self.early_renewals = 0
        self.failures = 0
        self.trust_updates = 0
        self.last_error: str | None = None
        self.next_renewal: dt.datetime | None = None
        self.early_renewal_at: dt.datetime | None = None
        self.refresh_after: float | None = None  # the signer's hint of the last trust-bundle answer
        self._pending_key: Any = None
        self._rescheduled = trio.Event()
        self._trust_interval_shortened = trio.Event()
        self._renewed = trio.Event()
        self._trust_lock = trio.Lock()
        cert = _load_cert(files.cert)
        self.log = log or get_logger("cert-renewer", subject=cert.subject.rfc4514_string())

    # -- public ------------------------------------------------------------------------------------------

    @property
    def certificate(self) -> x509.Certificate:
        return _load_cert(self.files.cert)

    @property
    def trust_interval(self) -> float:
        """Seconds between trust-bundle fetches now (the policy's, or the signer's sooner hint)."""
        return trust_refresh_interval(self.policy, self.refresh_after)

    @property
    def presenting(self) -> tuple[str, ...]:
        """Serials (hex) of the leaves new handshakes present: what the contexts loaded (the files'
        certificate when there are none). More than one only while a context failed to reload."""
        loaded = [c.presenting for c in self.contexts if c.cert is not None]
        if not loaded:
            return (certificate_serial(self.certificate),)
        return tuple(dict.fromkeys(serial for serial in loaded if serial is not None))

    @property
    def trusted(self) -> tuple[str, ...]:
        """Fingerprints of the CAs every context trusts (the files' bundle when there are none)."""
        in_file = bundle_in_file(self.files.ca)
        if not self.contexts:
            return in_file
        common = set.intersection(*(set(c.trusted) for c in self.contexts))
        ordered = [fp for fp in in_file if fp in common]
        return tuple(ordered + sorted(common - set(ordered)))

    def request_renewal(self) -> None:
        """Renew now instead of at the scheduled time (e.g. an operator's request)."""
        self._schedule_early(self.clock())

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
        retry after a lost answer gets the same certificate), renew, write the files, reload, report
        what the contexts present now (best effort: the trust refresh reports again)."""
        current = self.certificate
        if self._pending_key is None:
            self._pending_key = certclient.generate_key()
        key = self._pending_key
        issued = await certclient.renew(
            self.endpoint,
            self.files.cert,
            self.files.key,
            certclient.csr_like(current, key),
            trusted=self.trusted,
        )
        certclient.write_credentials(self.files, key, issued)
        self._pending_key = None
        self._reload_all()  # a failure leaves a context behind: the trust refresh tries again
        self.renewals += 1
        self.last_error = None
        if self.early_renewal_at is not None:
            self.early_renewals += 1
            self.early_renewal_at = None
        self.log.info(
            "cert_renewed",
            serial=issued.serial,
            not_after=issued.not_after.isoformat(),
            renewals=self.renewals,
            presenting=list(self.presenting),
        )
        if self.on_renewed is not None:
            self.on_renewed(issued)
        self._renewed.set()
        self._renewed = trio.Event()
        try:
            await self.refresh_trust_once()
        except (certclient.SignerRequestError, ConfigError, OSError, ValueError) as exc:
            self.log.warning("trust_report_failed", error=str(exc), hint="the next trust refresh reports")
        return issued

    async def refresh_trust_once(self) -> bool:
        """Fetch the trust bundle (reporting what we trust and present); install and reload if it
        changed, then report again; schedule an early renewal if our leaf is not from the active CA.
        True when the bundle changed."""
        async with self._trust_lock:
            bundle = await self._fetch_trust()
            changed = bundle.fingerprints != bundle_in_file(self.files.ca)
            if changed:
                certclient.write_bundle(self.files.ca, bundle.pem)
            if changed or self._contexts_behind():
                reported = (self.trusted, self.presenting)
                self._reload_all()
                if changed:
                    self.trust_updates += 1
                    self.log.info("trust_bundle_updated", cas=[c.get("id") for c in bundle.cas])
                if (self.trusted, self.presenting) != reported:
                    await self._fetch_trust()  # the signer now records what the contexts hold
            self._follow_active_ca(bundle)
            return changed

    # -- internals ---------------------------------------------------------------------------------------

    async def _fetch_trust(self) -> certclient.TrustBundle:
        bundle = await certclient.fetch_trust_bundle(
            self.endpoint,
            cert=self.files.cert,
            key=self.files.key,
            trusted=self.trusted,
            presenting=self.presenting,
        )
        self._follow_refresh_hint(bundle.refresh_after)
        return bundle

    def _follow_refresh_hint(self, refresh_after: float | None) -> None:
        before = self.trust_interval
        self.refresh_after = refresh_after
        after = self.trust_interval
        if after == before:
            return
        self.log.info(
            "trust_refresh_interval_changed",
            interval=after,
            reason="a CA rotation is under way: the signer asks for sooner trust refreshes"
            if after < self.policy.trust_refresh
            else "no CA rotation under way",
        )
        if after < before:
            self._trust_interval_shortened.set()

    def _follow_active_ca(self, bundle: certclient.TrustBundle) -> None:
        active = next((c for c in bundle.cas if c.get("state") == "active"), None)
        if active is None or self.policy.trust_refresh <= 0:
            return
        by_fingerprint = dict(
            zip(bundle.fingerprints, x509.load_pem_x509_certificates(bundle.pem.encode()), strict=False)
        )
        active_cert = by_fingerprint.get(str(active.get("fingerprint")))
        if active_cert is None:
            return
        leaf = self.certificate
        try:
            leaf.verify_directly_issued_by(active_cert)
            return
        except (ValueError, TypeError, InvalidSignature):
            pass
        if self.early_renewal_at is not None:
            return
        delay = early_renewal_delay(self.trust_interval, self.policy, self.rng.random())
        self.log.info(
            "cert_early_renewal_scheduled",
            serial=certificate_serial(leaf),
            active_ca=active.get("id"),
            renew_in=round(delay, 2),
            reason="the certificate is not from the active CA (a rotation was activated)",
        )
        self._schedule_early(self.clock() + dt.timedelta(seconds=delay))

    def _schedule_early(self, at: dt.datetime) -> None:
        if self.early_renewal_at is None or at < self.early_renewal_at:
            self.early_renewal_at = at
        self._rescheduled.set()

    def _contexts_behind(self) -> bool:
        """A context does not hold what the files do (an earlier reload failed)."""
        if not self.contexts:
            return False
        serial, trusted = certificate_serial(self.certificate), set(bundle_in_file(self.files.ca))
        return any(
            (c.cert is not None and c.presenting != serial) or set(c.trusted) != trusted
            for c in self.contexts
        )

    def _reload_all(self) -> None:
        """Reload every context; one that fails keeps what it had (and says so in ``presenting``)."""
        for ctx in self.contexts:
            try:
                ctx.reload()
            except ConfigError as exc:
                self.log.error("cert_reload_failed", error=str(exc), presenting=ctx.presenting)

    async def _sleep_until(self, when: dt.datetime) -> bool:
        """Sleep until ``when``; False if rescheduled before."""
        with trio.move_on_after(max(0.0, (when - self.clock()).total_seconds())):
            await self._rescheduled.wait()
        if self._rescheduled.is_set():
            self._rescheduled = trio.Event()
            return False
        return True

    async def _renew_loop(self) -> None:
        sample: tuple[str, float] | None = None  # one jitter draw per certificate
        while True:
            cert = self.certificate
            if sample is None or sample[0] != certificate_serial(cert):
                sample = (certificate_serial(cert), self.rng.random())
            due = renewal_time(cert, self.policy, sample[1])
            if self.early_renewal_at is not None:
                due = min(due, self.early_renewal_at)
            self.next_renewal = due
            if not await self._sleep_until(due):
                continue  # rescheduled (an early renewal, a request): work the time out again
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
                    with trio.move_on_after(delay):
                        await self._rescheduled.wait()
                    self._rescheduled = trio.Event()

    async def _trust_loop(self) -> None:
        attempt = 0
        while True:
            backoff: float | None = None
            try:
                await self.refresh_trust_once()
                attempt = 0
            except (certclient.SignerRequestError, ConfigError, OSError, ValueError) as exc:
                backoff = backoff_delay(attempt, self.policy, self.rng.random())
                attempt += 1
                retry_in = min(self.trust_interval, backoff)
                self.log.warning("trust_refresh_failed", error=str(exc), retry_in=round(retry_in, 2))
            await self._wait_next_trust_fetch(trio.current_time(), self.rng.random(), backoff)

    async def _wait_next_trust_fetch(self, fetched_at: float, sample: float, backoff: float | None) -> None:
        """Until one trust interval (less up to 10% jitter), or ``backoff``, after ``fetched_at``. A
        hint that shortens the interval meanwhile (the report after a renewal) shortens this wait."""

        def due() -> float:
            interval = self.trust_interval
            return fetched_at + (interval * (1 - 0.1 * sample) if backoff is None else min(interval, backoff))

        until = due()
        while trio.current_time() < until:
            with trio.move_on_at(until):
                await self._trust_interval_shortened.wait()
            if self._trust_interval_shortened.is_set():
                self._trust_interval_shortened = trio.Event()
                until = min(until, due())


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, certclient.SignerRequestError) and exc.retryable
