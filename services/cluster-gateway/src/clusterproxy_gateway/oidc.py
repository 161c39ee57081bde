"""OpenID Connect ID tokens for the service proxy (docs/cluster-gateway.md, "The HTTPS endpoint", "Who the
caller is"): upstream's service-proxy verifies them itself (its ``--oidc-issuer-url``), and so do we, with
kube-apiserver's ``--oidc-*`` flags' names and meanings.

- **Whose token.** A JWS (``header.payload.signature``) whose payload's ``iss`` is the configured issuer,
  byte for byte. Any other token is none of this verifier's business (:meth:`OIDCVerifier.verify` says
  None) and the hub's TokenReview is asked, as kube-apiserver's union of authenticators does.
- **Keys.** The discovery document ``ISSUER/.well-known/openid-configuration`` (its ``issuer`` must be
  ours, OpenID Connect Discovery 4.3; its ``jwks_uri`` https), then the key set at ``jwks_uri``, both
  over HTTPS checked with ``--oidc-ca-file`` (else the system's roots), kept in memory. A ``kid`` we do
  not hold makes us fetch both again (the issuer rotated its keys), at most once per ``refresh_interval``:
  a flood of tokens with made-up ``kid`` costs the issuer one fetch per interval.
- **Signature.** Only ``--oidc-signing-algs`` (kube-apiserver's default RS256; any of RS, PS and ES
  256/384/512), checked with ``cryptography``; the key's type and curve must fit the algorithm and its
  own ``alg``/``use``, when given, agree. ``none`` and HMAC never: an HMAC "checked" with a public key
  as its secret is the classic confusion attack. The header's ``jku``, ``x5u`` and ``jwk`` are ignored
  (keys come from the issuer only) and a ``crit`` header is refused (we understand no extension).
- **Claims.** ``iss``; ``aud`` (a string or a list) containing ``--oidc-client-id``; ``exp`` required,
  no leeway (go-oidc's, which kube-apiserver uses: an expired token is expired); ``nbf`` and ``iat`` at
  most SKEW in the future (clocks differ); ``--oidc-required-claim``. Duplicate JSON keys are refused
  (two parsers could read two different claims).
- **Who.** The user is ``--oidc-username-prefix`` + the ``--oidc-username-claim`` (default ``sub``);
  the prefix by default is ``ISSUER#`` unless the claim is ``email`` (then none, and ``email_verified``,
  when present, must be true); ``-`` is no prefix. Groups: ``--oidc-groups-claim`` (a string or a list of
  strings), each with ``--oidc-groups-prefix``.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import trio
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from clusterproxy_protocol import get_logger, http1client

__all__ = [
    "DEFAULT_SIGNING_ALGS",
    "SUPPORTED_ALGS",
    "IssuerUnavailable",
    "OIDCConfig",
    "OIDCVerifier",
    "TokenRefused",
    "Verified",
    "fetch_json",
    "load_jwks",
    "parse_required_claim",
    "verify_signature",
]

SUPPORTED_ALGS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512")
DEFAULT_SIGNING_ALGS = ("RS256",)  # kube-apiserver's --oidc-signing-algs default
SKEW = 60.0  # seconds a nbf or iat may lie in the future
REFRESH_INTERVAL = 10.0  # at most one fetch of the keys per this many seconds
FETCH_TIMEOUT = 10.0
MAX_DOCUMENT = 1 << 20
MIN_RSA_BITS = 2048
DISCOVERY_PATH = "/.well-known/openid-configuration"
_B64URL = re.compile(r"^[A-Za-z0-9_-]*$")
_HASHES: dict[str, type[hashes.HashAlgorithm]] = {
    "256": hashes.SHA256,
    "384": hashes.SHA384,
    "512": hashes.SHA512,
}
# ES algorithm: (JWK crv, curve class, bytes of r and of s)
_CURVES: dict[str, tuple[str, type[ec.EllipticCurve], int]] = {
    "ES256": ("P-256", ec.SECP256R1, 32),
    "ES384": ("P-384", ec.SECP384R1, 48),
    "ES512": ("P-521", ec.SECP521R1, 66),
}
_CRV = {crv: curve for crv, curve, _ in _CURVES.values()}

PublicKey = rsa.RSAPublicKey | ec.EllipticCurvePublicKey


class TokenRefused(Exception):
    """A token of our issuer that is not valid: the reason (never the token) is what the caller and the
    log are told. Cached like a TokenReview's "not authenticated"."""

    def __init__(self, reason: str, *, final: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.final = final  # False: the next request may fare better (keys not fetched again yet)


class IssuerUnavailable(Exception):
    """The issuer's keys could not be had (unreachable, not HTTPS-valid, a bad document): the token could
    not be judged. Never cached."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class OIDCConfig:
    issuer: str
    client_id: str
    username_claim: str = "sub"
    username_prefix: str = ""  # "" : kube-apiserver's default (ISSUER# unless the claim is email); "-": none
    groups_claim: str = ""
    groups_prefix: str = ""
    required_claims: tuple[tuple[str, str], ...] = ()
    signing_algs: tuple[str, ...] = DEFAULT_SIGNING_ALGS
    ca_file: Path | None = None

    @property
    def user_prefix(self) -> str:
        if self.username_prefix == "-":
            return ""
        if self.username_prefix:
            return self.username_prefix
        # kube-apiserver: claims other than email could clash with other authenticators' names
        return "" if self.username_claim == "email" else self.issuer + "#"


@dataclass(frozen=True)
class Verified:
    user: str  # prefixed
    groups: tuple[str, ...]  # prefixed
    expires: float  # the token's exp (unix time): no cache may keep it longer


@dataclass(frozen=True)
class JWK:
    kid: str | None
    alg: str | None
    key: PublicKey


def parse_required_claim(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` (--oidc-required-claim)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"{text!r} is not KEY=VALUE")
    return key, value


def _b64url(text: str, what: str) -> bytes:
    """Base64url without padding, strictly (RFC 7515 2): any other character is a malformed token, not
    something to skip over."""
    if not _B64URL.match(text) or len(text) % 4 == 1:
        raise TokenRefused(f"the token's {what} is not base64url")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise TokenRefused(f"the token's {what} is not base64url") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data, object_pairs_hook=_no_duplicates)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TokenRefused(f"the token's {what} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise TokenRefused(f"the token's {what} is not a JSON object")
    return value


def _split(token: str) -> tuple[str, str, str]:
    parts = token.split(".")
    if len(parts) != 3:
        raise TokenRefused("not a JWS (header.payload.signature)")
    return parts[0], parts[1], parts[2]


def unverified_issuer(token: str) -> str | None:
    """The ``iss`` of a token that looks like a JWS, unverified (to pick the authenticator only)."""
    try:
        _, payload, _ = _split(token)
        iss = _json_object(_b64url(payload, "payload"), "payload").get("iss")
    except TokenRefused:
        return None
    return iss if isinstance(iss, str) else None


def _load_jwk(jwk: dict[str, Any]) -> PublicKey | None:
    """An RSA (at least MIN_RSA_BITS) or EC (P-256/384/521) public key; None for anything else, symmetric
    keys first of all."""
    kty = jwk.get("kty")
    try:
        if kty == "RSA":
            n = int.from_bytes(_b64url(str(jwk["n"]), "n"), "big")
            e = int.from_bytes(_b64url(str(jwk["e"]), "e"), "big")
            key = rsa.RSAPublicNumbers(e, n).public_key()
            return key if key.key_size >= MIN_RSA_BITS else None
        if kty == "EC" and jwk.get("crv") in _CRV:
            curve = _CRV[jwk["crv"]]()
            size = (curve.key_size + 7) // 8
            x, y = _b64url(str(jwk["x"]), "x"), _b64url(str(jwk["y"]), "y")
            if len(x) != size or len(y) != size:
                return None
            # from_encoded_point checks that the point lies on the curve
            return ec.EllipticCurvePublicKey.from_encoded_point(curve, b"\x04" + x + y)
    except (KeyError, TokenRefused, ValueError):
        return None
    return None


def load_jwks(document: Any) -> list[JWK]:
    """The signing keys of a JWKS (RFC 7517 5): keys for another use, symmetric or unusable ones
    skipped."""
    keys: list[JWK] = []
    entries = document.get("keys") if isinstance(document, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or entry.get("use", "sig") != "sig":
            continue
        key = _load_jwk(entry)
        if key is not None:
            kid, alg = entry.get("kid"), entry.get("alg")
            keys.append(
                JWK(kid if isinstance(kid, str) else None, alg if isinstance(alg, str) else None, key)
            )
    return keys


def _fits(alg: str, key: PublicKey) -> bool:
    if alg[:2] in ("RS", "PS"):
        return isinstance(key, rsa.RSAPublicKey)
    return isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, _CURVES[alg][1])


def verify_signature(alg: str, key: PublicKey, signing_input: bytes, signature: bytes) -> bool:
    """RFC 7518 3.3-3.5 with ``cryptography``; ``alg`` one of SUPPORTED_ALGS."""
    digest = _HASHES[alg[2:]]()
    try:
        if alg.startswith("RS") and isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, signing_input, padding.PKCS1v15(), digest)
            return True
        if alg.startswith("PS") and isinstance(key, rsa.RSAPublicKey):
            pss = padding.PSS(mgf=padding.MGF1(_HASHES[alg[2:]]()), salt_length=digest.digest_size)
            key.verify(signature, signing_input, pss, digest)
            return True
        if alg.startswith("ES") and isinstance(key, ec.EllipticCurvePublicKey):
            size = _CURVES[alg][2]
            if len(signature) != 2 * size:  # JWS ECDSA: r and s, fixed width (not DER)
                return False
            r, s = int.from_bytes(signature[:size], "big"), int.from_bytes(signature[size:], "big")
            key.verify(encode_dss_signature(r, s), signing_input, ec.ECDSA(digest))
            return True
    except InvalidSignature:
        return False
    return False


def _number(claims: dict[str, Any], name: str) -> float | None:
    value = claims.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TokenRefused(f"claim {name!r} is not a number")
    return float(value)


def check_claims(config: OIDCConfig, claims: dict[str, Any], now: float) -> Verified:
    """The claims of a token whose signature was checked: the user and groups, or TokenRefused."""
    if claims.get("iss") != config.issuer:
        raise TokenRefused(f"iss {claims.get('iss')!r} is not the issuer {config.issuer!r}")
    aud = claims.get("aud")
    audiences = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
    if config.client_id not in audiences:
        raise TokenRefused(
            f"aud {aud!r} does not contain the client id {config.client_id!r} (--oidc-client-id)"
        )
    exp = _number(claims, "exp")
    if exp is None:
        raise TokenRefused("the token has no exp")
    if now >= exp:
        raise TokenRefused(f"the token expired {now - exp:.0f}s ago")
    for name in ("nbf", "iat"):
        at = _number(claims, name)
        if at is not None and at > now + SKEW:
            raise TokenRefused(f"the token's {name} is {at - now:.0f}s in the future")
    for key, value in config.required_claims:
        if claims.get(key) != value:
            raise TokenRefused(f"claim {key!r} is not {value!r} (--oidc-required-claim)")
    username = claims.get(config.username_claim)
    if not isinstance(username, str) or not username:
        raise TokenRefused(
            f"claim {config.username_claim!r} (--oidc-username-claim) is missing or not a string"
        )
    if config.username_claim == "email" and claims.get("email_verified", True) is not True:
        raise TokenRefused("email_verified is not true")
    groups: tuple[str, ...] = ()
    if config.groups_claim:
        claimed = claims.get(config.groups_claim)
        if isinstance(claimed, str):
            groups = (claimed,)
        elif isinstance(claimed, list) and all(isinstance(g, str) for g in claimed):
            groups = tuple(claimed)
        elif claimed is not None:
            raise TokenRefused(
                f"claim {config.groups_claim!r} (--oidc-groups-claim) is not a string or a list of them"
            )
    return Verified(config.user_prefix + username, tuple(config.groups_prefix + g for g in groups), exp)


Fetch = Callable[[str], Awaitable[Any]]  # an https URL -> its JSON


async def fetch_json(url: str, ca_file: Path | None, timeout: float = FETCH_TIMEOUT) -> Any:
    """GET ``url`` (https, no redirects) with the project's HTTP/1.1 client (http1client) over TLS
    checked with ``ca_file`` (read again at each fetch: a rotated CA applies at once) or the system's
    roots. IssuerUnavailable on any failure."""
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise IssuerUnavailable(f"{url!r} is not an https URL")
    port = parts.port or 443
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
        context.set_alpn_protocols(["http/1.1"])
        with trio.fail_after(timeout):
            stream = await http1client.connect(parts.hostname, port, tls=context)
            try:
                host = parts.netloc.rpartition("@")[2]
                # kube-apiserver's /openid/v1/jwks answers 406 to application/json alone
                accept = "application/json, application/jwk-set+json"
                response = await http1client.request(
                    stream, "GET", target, host, headers=[("Accept", accept)], max_body=MAX_DOCUMENT
                )
            finally:
                await trio.aclose_forcefully(stream)
    except trio.TooSlowError:
        raise IssuerUnavailable(f"{url}: no answer within {timeout:g}s") from None
    except (OSError, ssl.SSLError, trio.BrokenResourceError, http1client.HTTPClientError) as exc:
        raise IssuerUnavailable(f"{url}: {exc}") from None
    if response.status != 200:
        raise IssuerUnavailable(f"{url}: {http1client.HTTPStatusError(response)}")
    try:
        return response.json()
    except ValueError:
        raise IssuerUnavailable(f"{url}: the answer is not JSON") from None


@dataclass
class _Keys:
    keys: list[JWK] = field(default_factory=list)
    fetched: float | None = None  # monotonic time of the last fetch, done or failed
    error: str = ""  # the last fetch's failure


class OIDCVerifier:
    """``verify(token)``: None when the token is not this issuer's; its user and groups; or TokenRefused
    and IssuerUnavailable. ``fetch``, ``clock`` (unix time) and ``monotonic`` are injectable for tests."""

    def __init__(
        self,
        config: OIDCConfig,
        fetch: Fetch | None = None,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        refresh_interval: float = REFRESH_INTERVAL,
    ) -> None:
        self.config = config
        self.fetch = fetch or (lambda url: fetch_json(url, config.ca_file))
        self.clock = clock
        self.monotonic = monotonic
        self.refresh_interval = refresh_interval
        self.log = get_logger("cluster-gateway")
        self._keys = _Keys()
        self._lock = trio.Lock()

    def is_ours(self, token: str) -> bool:
        return unverified_issuer(token) == self.config.issuer

    async def refresh(self) -> None:
        """Fetch the discovery document and the key set, unless that was done within refresh_interval
        (then the keys held, or the last failure, stand). One fetch at a time."""
        async with self._lock:
            last = self._keys.fetched
            if last is not None and self.monotonic() - last < self.refresh_interval:
                return
            self._keys.fetched = self.monotonic()
            try:
                keys, jwks_uri = await self._fetch_keys()
            except IssuerUnavailable as exc:
                self._keys.error = exc.reason
                self.log.warning("oidc_keys_failed", issuer=self.config.issuer, reason=exc.reason)
                return
            self._keys.keys, self._keys.error = keys, ""
            self.log.info(
                "oidc_keys_fetched",
                issuer=self.config.issuer,
                jwks_uri=jwks_uri,
                kids=[k.kid for k in keys],
            )

    async def _fetch_keys(self) -> tuple[list[JWK], str]:
        discovery = await self.fetch(self.config.issuer.rstrip("/") + DISCOVERY_PATH)
        if not isinstance(discovery, dict) or discovery.get("issuer") != self.config.issuer:
            found = discovery.get("issuer") if isinstance(discovery, dict) else None
            raise IssuerUnavailable(
                f"the discovery document names issuer {found!r}, not {self.config.issuer!r} (--oidc-issuer-url "
                "must be the issuer exactly, as its tokens' iss)"
            )
        jwks_uri = discovery.get("jwks_uri")
        if not isinstance(jwks_uri, str) or not jwks_uri.startswith("https://"):
            raise IssuerUnavailable(f"the discovery document's jwks_uri {jwks_uri!r} is not an https URL")
        keys = load_jwks(await self.fetch(jwks_uri))
        if not keys:
            raise IssuerUnavailable(f"{jwks_uri} holds no RSA or EC signing key we can use")
        return keys, jwks_uri

    def _candidates(self, kid: str | None, alg: str) -> list[JWK]:
        return [
            k
            for k in self._keys.keys
            if (kid is None or k.kid == kid) and (k.alg is None or k.alg == alg) and _fits(alg, k.key)
        ]

    async def verify(self, token: str) -> Verified | None:
        if not self.is_ours(token):
            return None
        head, payload, sig = _split(token)
        header = _json_object(_b64url(head, "header"), "header")
        alg = header.get("alg")
        if not isinstance(alg, str) or alg.lower() == "none":
            raise TokenRefused("alg none: an unsigned token is never accepted")
        if alg.startswith("HS"):
            raise TokenRefused(f"alg {alg}: HMAC is never accepted (the issuer's keys are public)")
        if alg not in self.config.signing_algs:
            raise TokenRefused(
                f"alg {alg!r} is not one of --oidc-signing-algs {','.join(self.config.signing_algs)}"
            )
        if "crit" in header:
            raise TokenRefused(f"the header's crit {header['crit']!r} names extensions we do not understand")
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise TokenRefused("the header's kid is not a string")
        claims = _json_object(_b64url(payload, "payload"), "payload")
        signature = _b64url(sig, "signature")
        candidates = self._candidates(kid, alg)
        if not candidates:
            await self.refresh()  # new keys, or the first use
            candidates = self._candidates(kid, alg)
        if not candidates:
            if not self._keys.keys:
                raise IssuerUnavailable(
                    f"no keys of issuer {self.config.issuer} yet: {self._keys.error or 'not fetched'}"
                )
            # not cached: a key rotated in within the refresh interval is fetched on a later request
            raise TokenRefused(f"the issuer has no {alg} key with kid {kid!r}", final=False)
        signing_input = f"{head}.{payload}".encode("ascii")
        if not any(verify_signature(alg, k.key, signing_input, signature) for k in candidates):
            raise TokenRefused("the signature does not match the issuer's key")
        return check_claims(self.config, claims, self.clock())
