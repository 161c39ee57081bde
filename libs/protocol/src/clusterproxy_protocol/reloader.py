"""Hot reload of TLS credentials: an SSL context that follows its certificate, key and trust bundle.

:class:`ReloadingContext` keeps one :class:`ssl.SSLContext` for a certificate, key and trust bundle on
disk. :meth:`~ReloadingContext.reload` loads a renewed certificate (and a trust bundle that gained a
CA) *into the same context object*: OpenSSL copies the certificate into each connection when it is
created, so new handshakes use the new certificate and established connections (tunnels and their
streams) are untouched. OpenSSL cannot forget a trusted CA, so when a CA *leaves* the bundle (the
last step of a CA rotation) the context is rebuilt and :attr:`~ReloadingContext.context` returns the
new object: code that must stop trusting a retired CA reads ``.context`` at each handshake (or calls
the object: ``ReloadingContext`` is a ``Callable[[], ssl.SSLContext]``).

The task that renews the files and reloads these contexts is
:class:`~clusterproxy_protocol.renewer.CertRenewer`.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from cryptography import x509

from . import certclient, tls
from .config import ConfigError

_T = TypeVar("_T")

__all__ = ["ReloadingContext", "bundle_in_file", "certificate_serial"]


def certificate_serial(cert: x509.Certificate) -> str:
    """A certificate's serial as the signer's reports name it: lowercase hex."""
    return format(cert.serial_number, "x")


def _file_serial(path: Path) -> str | None:
    try:
        return certificate_serial(x509.load_pem_x509_certificate(Path(path).read_bytes()))
    except (OSError, ValueError):
        return None


def bundle_in_file(path: Path) -> tuple[str, ...]:
    """The fingerprints of the CAs in the trust bundle at ``path``; ConfigError when it holds none."""
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
        self._trusted = bundle_in_file(ca)
        self._presenting: str | None = None
        self._ctx = self._loading_cert(build)
        self.generation = 0
        self.rebuilds = 0

    def _loading_cert(self, load: Callable[[], _T]) -> _T:
        """``load()``, noting the serial of the certificate it read from ``cert``. The file is read
        again afterwards: a change in between (another writer) means we cannot tell, so load again."""
        if self.cert is None:
            return load()
        for _ in range(3):
            before = _file_serial(self.cert)
            result = load()
            after = _file_serial(self.cert)
            if before == after:
                self._presenting = after
                return result
        self._presenting = None
        return result

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

    @property
    def presenting(self) -> str | None:
        """The serial (hex) of the certificate new handshakes present (as of the last load); None
        without a certificate of its own, or when it could not be told."""
        return self._presenting

    def reload(self) -> str:
        """Load the files again: ``"reloaded"`` (same context object, new certificate / added CAs) or
        ``"rebuilt"`` (a CA left the bundle: a new context object). On a bad file this raises
        :class:`ConfigError` and the context keeps serving what it had."""
        trusted = bundle_in_file(self.ca)
        if set(self._trusted) - set(trusted):
            ctx = self._loading_cert(self._build)
            self._ctx, self._trusted = ctx, trusted
            self.rebuilds += 1
            self.generation += 1
            return "rebuilt"
        cert, key = self.cert, self.key
        if cert is not None and key is not None:
            self._loading_cert(lambda: tls.load_cert_chain(self._ctx, cert, key))
        if set(trusted) - set(self._trusted):
            tls.load_trust(self._ctx, self.ca)
        self._trusted = trusted
        self.generation += 1
        return "reloaded"
