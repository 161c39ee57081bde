"""A client TLS context that follows its PEM files, so that a process can outlive its certificate.

A renewer (``cluster-proxy local up`` for the local admin files, cert-manager, any tool that replaces
the files) writes a new certificate and key; the next TLS handshake must present them. Connections
already established keep the session they have.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509

from clusterproxy_protocol import ConfigError, client_context

# Reading the files before and after building the context must agree; a renewer that keeps writing
# through this many attempts leaves the last good context in place until the next handshake.
_LOAD_ATTEMPTS = 3


@dataclass(frozen=True)
class LoadedTLS:
    """One client context and what it was built from."""

    context: ssl.SSLContext
    certificate: x509.Certificate | None  # the client certificate it presents (None: presents none)
    fingerprint: str  # sha256 over the contents of the CA bundle, certificate and key files

    @property
    def serial(self) -> str | None:
        """The client certificate's serial number in lower-case hex (as the cert-signer logs it)."""
        return None if self.certificate is None else format(self.certificate.serial_number, "x")

    @property
    def not_after(self) -> dt.datetime | None:
        return None if self.certificate is None else self.certificate.not_valid_after_utc

    def expired(self, now: dt.datetime | None = None) -> bool:
        """True when the client certificate is past its end of validity."""
        end = self.not_after
        return end is not None and end <= (now or dt.datetime.now(dt.UTC))


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None


class ReloadingTLSFiles:
    """A TLS 1.3 client context built from PEM files and rebuilt whenever their content changes.

    Call the object (or :meth:`current`) for the context of the next handshake: it reads the three
    files and, when their content differs from what the current context was built from, builds a
    **new** context (verification as :meth:`TLSFiles.context`). A new object rather than loading into
    the live one: OpenSSL cannot forget a CA that left the bundle, and a certificate/key pair caught
    between a renewer's two renames must not half-replace a working pair. When the new files cannot
    be loaded (unreadable, mismatched, still being written), the last good context stays and the next
    call tries again; ``failures`` and ``last_error`` say so, and ``log`` (a structlog-style logger,
    optional) gets ``client_tls_reloaded`` / ``client_tls_reload_failed``.

    Construction loads the files once and raises :class:`ConfigError` naming a bad one.
    """

    def __init__(
        self,
        ca: Path | str,
        cert: Path | str | None = None,
        key: Path | str | None = None,
        *,
        alpn: Sequence[str] = ("h2",),
        log: Any = None,
    ) -> None:
        self.ca = Path(ca)
        self.cert = Path(cert) if cert is not None else None
        self.key = Path(key) if key is not None else None
        self.alpn = list(alpn)
        self.log = log
        self.reloads = 0
        self.failures = 0
        self.last_error: str | None = None
        loaded = self._load()
        if isinstance(loaded, str):
            raise ConfigError(loaded)
        self._loaded = loaded

    def __call__(self) -> ssl.SSLContext:
        return self.current().context

    @property
    def loaded(self) -> LoadedTLS:
        """What the last call handed out (without looking at the files)."""
        return self._loaded

    def current(self) -> LoadedTLS:
        """The context for the next handshake, rebuilt first if the files changed."""
        loaded = self._load(unless=self._loaded.fingerprint)
        if isinstance(loaded, str):
            self.failures += 1
            self.last_error = loaded
            if self.log is not None:
                self.log.warning(
                    "client_tls_reload_failed",
                    error=loaded,
                    keeping_serial=self._loaded.serial,
                    failures=self.failures,
                )
            return self._loaded
        if loaded is not self._loaded:
            self._loaded = loaded
            self.reloads += 1
            self.last_error = None
            if self.log is not None:
                self.log.info(
                    "client_tls_reloaded",
                    serial=loaded.serial,
                    not_after=loaded.not_after.isoformat() if loaded.not_after else None,
                    reloads=self.reloads,
                )
        return self._loaded

    def _fingerprint(self) -> tuple[str, x509.Certificate | None]:
        digest = hashlib.sha256()
        certificate = None
        parts = [(self.ca, "CA bundle")]
        if self.cert is not None and self.key is not None:
            parts += [(self.cert, "certificate"), (self.key, "private key")]
        for path, what in parts:
            data = _read(path, what)
            digest.update(len(data).to_bytes(8, "big"))
            digest.update(data)
            if path is self.cert:
                try:
                    certificate = x509.load_pem_x509_certificate(data)
                except ValueError as exc:
                    raise ConfigError(
                        f"certificate file {path} holds no valid PEM certificate: {exc}"
                    ) from None
        return digest.hexdigest(), certificate

    def _load(self, *, unless: str | None = None) -> LoadedTLS | str:
        """A context from the files as they are now; the current one when they still hold ``unless``;
        a reason (str) when they cannot be loaded."""
        for _ in range(_LOAD_ATTEMPTS):
            try:
                before, certificate = self._fingerprint()
                if before == unless:
                    return self._loaded
                context = client_context(self.cert, self.key, self.ca, alpn=self.alpn)
                after, _ = self._fingerprint()
            except ConfigError as exc:
                return str(exc)
            if after == before:
                return LoadedTLS(context, certificate, after)
        return f"{self.cert or self.ca} kept changing while being loaded"


__all__ = ["LoadedTLS", "ReloadingTLSFiles"]
