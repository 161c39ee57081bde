"""TLS 1.3 contexts for mutual TLS (both the tunnel and the hub client frontends).

Every file is checked before OpenSSL sees it, so a missing, unreadable or mismatched file gives a
:class:`~clusterproxy_protocol.config.ConfigError` naming the path instead of a bare ``ssl.SSLError``.

:func:`load_cert_chain` may be called again on a live context to rotate its certificate: new handshakes
use the new certificate, established connections are untouched.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from .config import ConfigError

__all__ = ["client_context", "load_cert_chain", "load_trust", "server_context"]


def _read(path: Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} path is a directory, not a file: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise ConfigError(f"{what} file is empty: {path}")
    return data


# A renewal replaces the key file, then the certificate file (certclient.write_credentials): a reader
# in another process (the SDK or port-forward following a hub client's files, a probe) can meet the new
# key with the old certificate while the writer is between its two renames. A mismatched pair is read
# again after each of these pauses before it counts as a real mismatch.
PAIR_SETTLE_PAUSES = (0.002, 0.01, 0.05, 0.1)


class _MismatchedPair(ConfigError):
    pass


def load_cert_chain(ctx: ssl.SSLContext, cert: Path, key: Path) -> None:
    """Check ``cert``/``key`` (PEM; ``cert`` may hold a chain, leaf first) and load them into ``ctx``.
    A pair that does not match is read again a few times within about 0.2 s (a renewal in another
    process may be between replacing the key and replacing the certificate) before it is refused."""
    for pause in PAIR_SETTLE_PAUSES:
        try:
            _load_pair(ctx, cert, key)
            return
        except _MismatchedPair:
            time.sleep(pause)  # blocks the caller's thread for a moment, and only in this rare case
    _load_pair(ctx, cert, key)


def _load_pair(ctx: ssl.SSLContext, cert: Path, key: Path) -> None:
    cert_pem = _read(cert, "certificate")
    key_pem = _read(key, "private key")
    try:
        certs = x509.load_pem_x509_certificates(cert_pem)
    except ValueError as exc:
        raise ConfigError(f"certificate file {cert} holds no valid PEM certificate: {exc}") from None
    try:
        private_key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"private key file {key} holds no valid unencrypted PEM private key: {exc}"
        ) from None
    if private_key.public_key() != certs[0].public_key():
        raise _MismatchedPair(f"private key {key} does not match the certificate {cert}")
    try:
        # OpenSSL reads both files again: a renewal may have come in between
        ctx.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except ssl.SSLError as exc:
        error = _MismatchedPair if exc.reason == "KEY_VALUES_MISMATCH" else ConfigError
        raise error(f"cannot load certificate {cert} with key {key}: {exc.reason or exc}") from None


def load_trust(ctx: ssl.SSLContext, ca: Path) -> None:
    """Trust the CA certificate(s) in the PEM bundle ``ca`` (a rotation bundle may hold old and new)."""
    pem = _read(ca, "CA bundle")
    try:
        x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise ConfigError(f"CA bundle {ca} holds no valid PEM certificate: {exc}") from None
    try:
        ctx.load_verify_locations(cafile=str(ca))
    except ssl.SSLError as exc:
        raise ConfigError(f"cannot load CA bundle {ca}: {exc.reason or exc}") from None


def _base(ctx: ssl.SSLContext, alpn: Sequence[str]) -> ssl.SSLContext:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.options |= ssl.OP_NO_COMPRESSION
    if alpn:
        ctx.set_alpn_protocols(list(alpn))
    return ctx


def server_context(cert: Path, key: Path, ca: Path, *, alpn: Sequence[str]) -> ssl.SSLContext:
    """A TLS 1.3 server context that requires a client certificate signed by ``ca``."""
    ctx = _base(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), alpn)
    ctx.verify_mode = ssl.CERT_REQUIRED
    # OpenSSL sends two TLS 1.3 session tickets after every handshake, each serializing the session
    # with the client's certificate: a large share of the server's handshake (python -m bench.handshake;
    # the figures are in docs/benchmarks.md, "Third round"), spent for clients that never resume
    # (client-go, konnectivity clients, curl, our agents).
    ctx.num_tickets = 0
    load_cert_chain(ctx, cert, key)
    load_trust(ctx, ca)
    return ctx


def client_context(cert: Path | None, key: Path | None, ca: Path, *, alpn: Sequence[str]) -> ssl.SSLContext:
    """A TLS 1.3 client context: verifies the server against ``ca`` only, checks its host name, and
    presents ``cert``/``key`` (pass ``None`` for both to present no client certificate)."""
    if (cert is None) != (key is None):
        raise ConfigError("a client certificate needs both a certificate and a key file")
    ctx = _base(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), alpn)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = True
    if cert is not None and key is not None:
        load_cert_chain(ctx, cert, key)
    load_trust(ctx, ca)
    return ctx


def web_client_context(ca_file: Path | None) -> ssl.SSLContext:
    """TLS to an HTTP/1.1 server that is not ours (a forward proxy, an ingress): verified with
    ``ca_file`` or else the system's trust store, TLS 1.2 or later (not ours to pin to 1.3).
    ConfigError when ``ca_file`` cannot be read or holds no certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = True
    ctx.set_alpn_protocols(["http/1.1"])
    if ca_file is not None:
        load_trust(ctx, ca_file)
    else:
        ctx.load_default_certs()
    return ctx
