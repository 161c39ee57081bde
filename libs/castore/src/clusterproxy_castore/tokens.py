"""Bootstrap tokens: ``<id>.<secret>``, shown once, stored as the SHA-256 of the secret.

The id (12 hex digits) is public: it names the token in logs, in ``token list`` and in errors. The
secret is 32 random bytes (256 bits, URL-safe base64), so a plain SHA-256 is enough to store it: there
is nothing to brute-force that a slow password hash would protect. Comparison is constant-time.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from .models import Binding, TokenRecord
from .store import CertStore

__all__ = [
    "MAX_TOKEN_TTL",
    "MalformedToken",
    "NewToken",
    "create_token",
    "hash_secret",
    "new_token",
    "parse_token",
    "secret_matches",
]

MAX_TOKEN_TTL = dt.timedelta(hours=24)
_TOKEN = re.compile(r"^([0-9a-f]{12})\.([A-Za-z0-9_-]{43})$")


@dataclass(frozen=True)
class NewToken:
    """A freshly created token: ``token`` is the only copy of the secret; ``record`` goes to the store."""

    token: str
    record: TokenRecord


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, record: TokenRecord) -> bool:
    return hmac.compare_digest(hash_secret(secret), record.secret_sha256)


class MalformedToken(ValueError):
    """Not a token at all (the signer answers it as ``401 invalid_token``)."""


def parse_token(token: object) -> tuple[str, str]:
    """``(id, secret)`` of a well-formed token, else :class:`MalformedToken`."""
    if not isinstance(token, str) or not _TOKEN.match(token.strip()):
        raise MalformedToken(
            "bootstrap token is malformed: expected <12 hex digits>.<43 characters> as printed by "
            "`cluster-proxy-cert-signer token create`"
        )
    token_id, secret = token.strip().split(".", 1)
    return token_id, secret


def new_token(binding: Binding, *, ttl: dt.timedelta, now: dt.datetime, description: str = "") -> NewToken:
    """A token for ``binding``, valid for ``ttl`` (at most :data:`MAX_TOKEN_TTL`: tokens are short-lived)."""
    if ttl <= dt.timedelta(0):
        raise ValueError("token lifetime must be positive")
    if ttl > MAX_TOKEN_TTL:
        raise ValueError(f"token lifetime {ttl} is longer than the maximum {MAX_TOKEN_TTL}")
    token_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    record = TokenRecord(
        id=token_id,
        secret_sha256=hash_secret(secret),
        binding=binding,
        created_at=now,
        expires_at=now + ttl,
        description=description,
    )
    return NewToken(token=f"{token_id}.{secret}", record=record)


def create_token(
    store: CertStore,
    binding: Binding,
    ttl: dt.timedelta,
    *,
    description: str = "",
    now: dt.datetime | None = None,
) -> NewToken:
    """Create and store a bootstrap token; the returned ``token`` string is the only copy. The
    signer's ``token create`` and the addon-manager mint tokens through this one function."""
    created = new_token(binding, ttl=ttl, now=now or dt.datetime.now(dt.UTC), description=description)
    store.create_token(created.record)
    return created
