"""Errors of the signing API: each maps to an HTTP status and a JSON body ``{"error", "reason"}``.

``error`` is a short stable code for programs; ``reason`` a sentence for people that says what was
wrong and, where it helps, what to do.
"""

from __future__ import annotations

__all__ = [
    "BadRequest",
    "Forbidden",
    "Gone",
    "InvalidCSR",
    "RateLimited",
    "Conflict",
    "SignerError",
    "TooLarge",
    "Unauthorized",
]


class SignerError(Exception):
    status = 500
    error = "internal_error"

    def __init__(self, reason: str, *, error: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        if error is not None:
            self.error = error

    def body(self) -> dict[str, str]:
        return {"error": self.error, "reason": self.reason}


class BadRequest(SignerError):
    status = 400
    error = "bad_request"


class InvalidCSR(BadRequest):
    error = "invalid_csr"


class Unauthorized(SignerError):
    status = 401
    error = "unauthorized"


class Forbidden(SignerError):
    status = 403
    error = "forbidden"


class Conflict(SignerError):
    status = 409
    error = "conflict"


class Gone(SignerError):
    status = 410
    error = "gone"


class TooLarge(SignerError):
    status = 413
    error = "request_too_large"


class RateLimited(SignerError):
    status = 429
    error = "rate_limited"

    def __init__(self, reason: str, *, retry_after: float) -> None:
        super().__init__(reason)
        self.retry_after = retry_after
