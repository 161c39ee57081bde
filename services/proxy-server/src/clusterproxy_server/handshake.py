"""The TLS handshake both the agent port and the client port start with, and the role each port
accepts: agent certificates on the agent port, client certificates on the client port, nothing else
(see :func:`clusterproxy_protocol.pki.certificate_role`)."""

from __future__ import annotations

import ssl
from typing import NamedTuple

import structlog
import trio
from cryptography import x509

from clusterproxy_protocol import CertRole, certificate_role, role_refusal
from clusterproxy_server.metrics import ServerMetrics


class Peer(NamedTuple):
    """A peer through the handshake: its stream and its certificate, parsed once."""

    stream: trio.SSLStream[trio.abc.Stream]
    cert: x509.Certificate


async def accept_tls(
    transport: trio.abc.Stream,
    context: ssl.SSLContext,
    port: str,
    timeout: float,
    metrics: ServerMetrics,
    log: structlog.typing.FilteringBoundLogger,
    accepted: CertRole,
    peer: str,
) -> Peer | None:
    """The mutually authenticated peer whose certificate has the ``accepted`` role, or
    None (counted, logged, connection closed) on failure. ``transport``: TCP, or a WebSocket's byte
    stream; ``peer`` names it in the logs."""
    stream = trio.SSLStream(transport, context, server_side=True, https_compatible=True)
    try:
        with trio.fail_after(timeout):
            await stream.do_handshake()
    except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        cause = exc.__cause__ or exc
        reason = "handshake timeout" if isinstance(exc, trio.TooSlowError) else type(cause).__name__
        metrics.rejected.labels(port, reason).inc()
        log.info("tls_handshake_failed", port=port, peer=peer, error=str(cause) or reason)
        await trio.aclose_forcefully(transport)
        return None
    cert = x509.load_der_x509_certificate(stream.getpeercert(binary_form=True))
    check = certificate_role(cert)
    refusal = role_refusal(check, port, accepted)
    if refusal is None:
        return Peer(stream, cert)
    metrics.rejected.labels(port, "certificate_role").inc()
    log.warning(
        "tls_peer_refused",
        port=port,
        peer=peer,
        role=check.found,
        accepted=accepted.value,
        subject=cert.subject.rfc4514_string(),
        error=refusal,
    )
    await trio.aclose_forcefully(stream)
    return None
