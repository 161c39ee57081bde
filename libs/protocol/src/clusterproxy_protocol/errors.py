"""The CONNECT error statuses of the wire protocol and the exceptions that carry them.

Every refusal travels as an HTTP status plus a one-line reason (header ``cluster-proxy-reason`` on
HTTP/2, the body on HTTP/1.1), and the client side turns it back into one of these typed exceptions.
"""

from __future__ import annotations

import ssl
import sys
from collections.abc import Mapping

from clusterproxy_protocol.wire import REASON_HEADER


class TunnelError(Exception):
    """Base class of every error the tunnel raises to its users."""


class TunnelClosed(TunnelError):
    """The HTTP/2 connection carrying the tunnel is gone."""


class ConnectRefused(TunnelError):
    """A CONNECT was answered with an error status."""

    status: int = 0  # a subclass's own, or the one given

    def __init__(
        self, reason: str, *, status: int | None = None, headers: Mapping[str, str] | None = None
    ) -> None:
        if status is not None:
            self.status = status
        self.reason = reason
        # The answer's other headers, when it came over HTTP/2 (cluster-proxy-fault, for one).
        self.headers: Mapping[str, str] = headers or {}
        super().__init__(f"{self.status} {reason}")


class MalformedTarget(ConnectRefused):
    status = 400


class Forbidden(ConnectRefused):
    status = 403


class UnknownCluster(ConnectRefused):
    status = 404


class TooManyRequests(ConnectRefused):
    status = 429


class TargetUnreachable(ConnectRefused):
    status = 502


class NoAgentConnected(ConnectRefused):
    status = 503


class DialTimeout(ConnectRefused):
    status = 504


_BY_STATUS: dict[int, type[ConnectRefused]] = {
    cls.status: cls
    for cls in (
        MalformedTarget,
        Forbidden,
        UnknownCluster,
        TooManyRequests,
        TargetUnreachable,
        NoAgentConnected,
        DialTimeout,
    )
}

STATUS_PHRASES = {
    200: "Connection Established",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    407: "Proxy Authentication Required",
    408: "Request Timeout",
    413: "Content Too Large",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


def refusal(status: int, reason: str, headers: Mapping[str, str] | None = None) -> ConnectRefused:
    """The typed exception for an error status (a plain :class:`ConnectRefused` for unlisted ones)."""
    cls = _BY_STATUS.get(status)
    if cls is None:
        return ConnectRefused(reason, status=status, headers=headers)
    return cls(reason, headers=headers)


def clean_reason(reason: str) -> str:
    """A reason safe to put in a header: one line, printable ASCII, bounded."""
    text = " ".join(reason.split())
    return text.encode("ascii", "replace").decode("ascii")[:300]


def error_reply(reason: str) -> tuple[list[tuple[str, str]], bytes]:
    """The headers (without content-length) and body of an error reply: the reason in a header and,
    for humans, in the body."""
    reason = clean_reason(reason)
    return [(REASON_HEADER, reason), ("content-type", "text/plain")], (reason + "\n").encode()


def describe_exception(exc: BaseException) -> str:
    """A one-line reason a person can act on for a failed connect, handshake or transfer: the TLS
    cause of a broken stream, every address's error of a failed connect, an OS error's text."""
    cause = exc.__cause__ or exc.__context__
    # The sans-IO core imports this module, so trio is not imported here: a trio error exists only
    # in a process that imported trio already.
    trio = sys.modules.get("trio")
    if trio is not None and isinstance(exc, trio.BrokenResourceError) and isinstance(cause, ssl.SSLError):
        exc = cause
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS handshake failed: certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed: {getattr(exc, 'reason', None) or exc}"
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe_exception(e) for e in exc.exceptions)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror if not exc.filename else f"{exc.strerror}: {exc.filename}"
    text = str(exc) or (repr(cause) if cause is not None and cause is not exc else "") or type(exc).__name__
    if isinstance(exc, OSError) and isinstance(cause, BaseException) and cause is not exc:
        # trio.open_tcp_stream: "all attempts to connect to H:P failed" from a group of the real errors
        detail = describe_exception(cause)
        if detail and detail not in text:
            text = f"{text}: {detail}"
    return text
