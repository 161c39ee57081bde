"""Who a bearer token of the service proxy's callers is: the managed cluster's TokenReview first, then
the hub's (upstream cluster-proxy's service-proxy order), with the answers cached for a short while.

- **The managed cluster** (a TokenReview sent through the tunnel with the service proxy's own credential
  in that cluster): a token it authenticates is that cluster's own, and goes on unchanged: the managed
  cluster authenticates and authorizes it again itself.
- **The hub** (a TokenReview with the gateway's hub client): a hub identity, which the managed cluster
  does not know, so the service proxy impersonates it there, named as upstream names it
  (:func:`hub_username`: a hub ServiceAccount becomes ``cluster:hub:system:serviceaccount:NS:NAME``, so
  that it can never be taken for a ServiceAccount of the managed cluster; other users keep their name;
  groups keep theirs, ``system:authenticated`` added when missing).

Answers, authenticated or not, are kept for ``ttl`` seconds (default 10 s, upstream's) in a cache of at
most ``max_entries``, keyed by the SHA-256 of the token (and the cluster, for the managed step): a burst
of requests with one token (kubectl's discovery) costs one review per step, and no token is kept or
logged in clear. A review that failed (no tunnel, a refused credential) is never cached: the next
request asks again.

Between the two, when an OIDC issuer is configured (:mod:`.oidc`, ``--oidc-issuer-url``): a token whose
``iss`` is that issuer is verified here, without asking anyone; verified, its user and groups are
impersonated like a hub user's (the same naming: :func:`hub_username`, ``system:authenticated`` added);
refused, the reason is kept for the 401 and the hub's TokenReview is still asked (kube-apiserver's union
of authenticators does the same). Its answers go through the same cache, a verified one never beyond
the token's ``exp``; an issuer that could not be reached is not cached.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .oidc import IssuerUnavailable, OIDCVerifier, TokenRefused

__all__ = [
    "HUB_SERVICEACCOUNT_PREFIX",
    "AUTHENTICATED_GROUP",
    "Caller",
    "Rejected",
    "ReviewCache",
    "ReviewFailed",
    "Reviewed",
    "TokenAuthenticator",
    "hub_username",
    "review_request",
    "reviewed_from",
    "token_digest",
]

SERVICEACCOUNT_PREFIX = "system:serviceaccount:"
HUB_SERVICEACCOUNT_PREFIX = "cluster:hub:"  # upstream's (pkg/serviceproxy/hub_auth_provider.go)
AUTHENTICATED_GROUP = "system:authenticated"
MANAGED, HUB, OIDC = "managed", "hub", "oidc"


class ReviewFailed(Exception):
    """A review could not be made (no tunnel, the reviewer's credential refused, an API error): the
    request gets ``status`` and the reason, and nothing is cached."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Reviewed:
    """What a TokenReview said of an authenticated token."""

    user: str
    groups: tuple[str, ...]


@dataclass(frozen=True)
class Rejected:
    """A token the OIDC verifier refused, and why (cached like a TokenReview's "no")."""

    reason: str


@dataclass(frozen=True)
class Caller:
    """The authenticated caller: ``source`` is MANAGED (the token goes on unchanged), HUB or OIDC (the
    user is impersonated as ``user`` with ``groups``)."""

    source: str
    user: str  # as the managed cluster will know it (hub_username for the hub's and the issuer's)
    groups: tuple[str, ...]
    hub_user: str = ""  # the hub's (or the OIDC verifier's, prefixed) own name for a HUB (OIDC) caller


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def hub_username(user: str) -> str:
    """A hub user's name in a managed cluster: hub ServiceAccounts get upstream's ``cluster:hub:``
    prefix (``system:serviceaccount:ns:sa`` would otherwise name the managed cluster's own ServiceAccount
    of that namespace and name); other users keep theirs."""
    return HUB_SERVICEACCOUNT_PREFIX + user if user.startswith(SERVICEACCOUNT_PREFIX) else user


def impersonated_groups(groups: tuple[str, ...]) -> tuple[str, ...]:
    """kube-apiserver adds ``system:authenticated`` by itself only when no group is impersonated."""
    return groups if AUTHENTICATED_GROUP in groups else (*groups, AUTHENTICATED_GROUP)


def review_request(token: str) -> dict[str, Any]:
    return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}


def reviewed_from(answer: Any) -> Reviewed | None:
    """A TokenReview's answer: the user when authenticated, else None (an unknown, expired or revoked
    token; ``status.error`` says which, and is not kept: it may quote the token's claims)."""
    status = (answer or {}).get("status") or {}
    if not status.get("authenticated"):
        return None
    user = status.get("user") or {}
    name = str(user.get("username") or "")
    if not name:
        return None
    return Reviewed(name, tuple(str(g) for g in user.get("groups") or ()))


Answer = Reviewed | Rejected | None


class ReviewCache:
    """Answers by (step, scope, token digest), each for ``ttl`` seconds; the oldest dropped beyond
    ``max_entries``. ``clock`` is injectable for tests."""

    def __init__(self, ttl: float, max_entries: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self.clock = clock
        # key -> (the monotonic time it goes stale, the answer)
        self._entries: OrderedDict[tuple[str, str, str], tuple[float, Answer]] = OrderedDict()

    def get(self, key: tuple[str, str, str]) -> tuple[bool, Answer]:
        hit = self._entries.get(key)
        if hit is None:
            return False, None
        if self.clock() >= hit[0]:
            del self._entries[key]
            return False, None
        return True, hit[1]

    def put(self, key: tuple[str, str, str], value: Answer, ttl: float | None = None) -> None:
        """Kept for the cache's ttl, or ``ttl`` when that is shorter (a token that expires sooner)."""
        ttl = self.ttl if ttl is None else min(ttl, self.ttl)
        if ttl <= 0:
            return
        self._entries[key] = (self.clock() + ttl, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


ManagedReview = Callable[[str, str], Awaitable[Reviewed | None]]  # (cluster, token)
HubReview = Callable[[str], Awaitable[Reviewed | None]]  # (token)


class TokenAuthenticator:
    """The steps, cached. ``managed`` reviews a token in a cluster, ``hub`` on the hub (None: hub
    tokens are not accepted); both raise ReviewFailed when they cannot answer. ``oidc`` verifies the
    tokens of one OIDC issuer between them (None: none)."""

    def __init__(
        self,
        managed: ManagedReview,
        hub: HubReview | None,
        *,
        oidc: OIDCVerifier | None = None,
        ttl: float = 10.0,
        max_entries: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.managed = managed
        self.hub = hub
        self.oidc = oidc
        self.cache = ReviewCache(ttl, max_entries, clock)

    async def _step(
        self, step: str, scope: str, digest: str, review: Callable[[], Awaitable[Reviewed | None]]
    ) -> Reviewed | None:
        key = (step, scope, digest)
        cached, value = self.cache.get(key)
        if not cached:
            value = await review()
            self.cache.put(key, value)
        return value if isinstance(value, Reviewed) else None

    async def _oidc(self, oidc: OIDCVerifier, digest: str, token: str) -> Reviewed | Rejected | None:
        """The OIDC step: None when the token is not the issuer's; Rejected when the verifier refused it
        (cached) or could not judge it (the issuer's keys out of reach: not cached, the next request
        tries again)."""
        key = (OIDC, "", digest)
        cached, value = self.cache.get(key)
        if cached:
            return value
        try:
            verified = await oidc.verify(token)
        except TokenRefused as exc:
            if exc.final:
                self.cache.put(key, Rejected(exc.reason))
            return Rejected(exc.reason)
        except IssuerUnavailable as exc:
            return Rejected(f"its keys could not be had: {exc.reason}")
        if verified is None:
            return None
        reviewed = Reviewed(verified.user, verified.groups)
        self.cache.put(key, reviewed, verified.expires - oidc.clock())
        return reviewed

    async def authenticate(self, cluster: str, token: str, why: list[str] | None = None) -> Caller | None:
        """The caller, or None when neither the managed cluster, the OIDC issuer nor the hub knows the
        token (``why`` gets the OIDC verifier's reason, if it refused the token)."""
        digest = token_digest(token)
        managed = await self._step(MANAGED, cluster, digest, lambda: self.managed(cluster, token))
        if managed is not None:
            return Caller(MANAGED, managed.user, managed.groups)
        if self.oidc is not None:
            verdict = await self._oidc(self.oidc, digest, token)
            if isinstance(verdict, Reviewed):
                user = verdict.user
                return Caller(OIDC, hub_username(user), impersonated_groups(verdict.groups), user)
            if isinstance(verdict, Rejected) and why is not None:
                why.append(f"OIDC issuer {self.oidc.config.issuer}: {verdict.reason}")
        if self.hub is None:
            return None
        hub = self.hub
        reviewed = await self._step(HUB, "", digest, lambda: hub(token))
        if reviewed is None:
            return None
        return Caller(HUB, hub_username(reviewed.user), impersonated_groups(reviewed.groups), reviewed.user)
