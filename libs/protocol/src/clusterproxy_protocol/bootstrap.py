"""A service's first certificate from the cert-signer, waiting for a signer that is not up yet."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
import trio

from clusterproxy_protocol import certclient
from clusterproxy_protocol.certclient import CertFiles, Issued, SignerEndpoint, SignerRequestError
from clusterproxy_protocol.config import ConfigError

BOOTSTRAP_PATIENCE = 60.0  # seconds to keep retrying a signer that does not answer (or answers 429/5xx)


async def bootstrap_with_retry(
    endpoint: SignerEndpoint,
    files: CertFiles,
    token: str | None,
    make_csr: Callable[[Any], str],
    log: structlog.typing.FilteringBoundLogger,
    *,
    patience: float = BOOTSTRAP_PATIENCE,
) -> Issued | None:
    """Trade ``token`` for a first certificate when ``files`` hold no valid one (None: they do).

    A refused token (used, expired, for someone else) is final: :class:`ConfigError` with the signer's
    reason. A signer that does not answer yet, or asks to slow down, is retried for ``patience``
    seconds with a doubling delay."""
    deadline = trio.current_time() + patience
    delay = 0.5
    while True:
        try:
            issued = await certclient.ensure_bootstrapped(endpoint, files, token, make_csr)
            break
        except SignerRequestError as exc:
            if not exc.retryable or trio.current_time() + delay > deadline:
                raise ConfigError(f"bootstrap with the cert-signer at {endpoint.url} failed: {exc}") from None
            log.warning("cert_bootstrap_retry", error=str(exc), retry_in=delay)
            await trio.sleep(delay)
            delay = min(2 * delay, 10.0)
    if issued is not None:
        log.info("cert_bootstrapped", serial=issued.serial, not_after=issued.not_after.isoformat())
    return issued
