"""The HTTPS endpoint's OIDC verifier (clusterproxy_gateway.oidc; docs/cluster-gateway.md, "Who the caller
is"), with keys made here: every algorithm it accepts, every reason it refuses a token, the keys fetched
again for an unknown kid at most once per interval, kube-apiserver's prefix rules, and its place between
the managed cluster's TokenReview and the hub's, cached no longer than the token lives."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from clusterproxy_gateway import main as gateway_main
from clusterproxy_gateway.oidc import (
    SUPPORTED_ALGS,
    IssuerUnavailable,
    OIDCConfig,
    OIDCVerifier,
    TokenRefused,
    Verified,
)
from clusterproxy_gateway.tokenreview import Caller, Reviewed, TokenAuthenticator

ISSUER = "https://issuer.example"
JWKS_URI = "https://keys.example/jwks"
NOW = 1_700_000_000.0
_RSA: dict[int, rsa.RSAPrivateKey] = {}


def rsa_key(index: int = 0) -> rsa.RSAPrivateKey:
    if index not in _RSA:  # 2048-bit keys take a while: one each per session
        _RSA[index] = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return _RSA[index]


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _int(value: int, size: int | None = None) -> str:
    return b64(value.to_bytes(size or (value.bit_length() + 7) // 8, "big"))


def jwk(key: Any, kid: str | None, **extra: Any) -> dict[str, Any]:
    public = key.public_key()
    if isinstance(public, rsa.RSAPublicKey):
        numbers = public.public_numbers()
        entry = {"kty": "RSA", "n": _int(numbers.n), "e": _int(numbers.e)}
    else:
        numbers = public.public_numbers()
        size = (public.curve.key_size + 7) // 8
        crv = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}[public.curve.name]
        entry = {"kty": "EC", "crv": crv, "x": _int(numbers.x, size), "y": _int(numbers.y, size)}
    if kid is not None:
        entry["kid"] = kid
    return {**entry, **extra}


def sign(alg: str, key: Any, signing_input: bytes) -> bytes:
    digest = {"256": hashes.SHA256, "384": hashes.SHA384, "512": hashes.SHA512}[alg[2:]]()
    if alg.startswith("RS"):
        return key.sign(signing_input, padding.PKCS1v15(), digest)
    if alg.startswith("PS"):
        return key.sign(signing_input, padding.PSS(padding.MGF1(digest), digest.digest_size), digest)
    r, s = decode_dss_signature(key.sign(signing_input, ec.ECDSA(digest)))
    size = (key.curve.key_size + 7) // 8
    return r.to_bytes(size, "big") + s.to_bytes(size, "big")


def token(
    claims: dict[str, Any] | None = None,
    *,
    key: Any = None,
    alg: str = "RS256",
    kid: str | None = "k1",
    header: dict[str, Any] | None = None,
    raw_payload: bytes | None = None,
) -> str:
    head = {"alg": alg, "typ": "JWT", **({"kid": kid} if kid is not None else {}), **(header or {})}
    body = {
        "iss": ISSUER,
        "aud": "cluster-proxy",
        "sub": "alice",
        "exp": NOW + 600,
        "iat": NOW,
        **(claims or {}),
    }
    signing_input = f"{b64(json.dumps(head).encode())}.{b64(raw_payload or json.dumps(body).encode())}"
    signature = sign(alg, key or rsa_key(), signing_input.encode())
    return f"{signing_input}.{b64(signature)}"


class Issuer:
    """The fetches the verifier makes, answered from memory and counted."""

    def __init__(self, *keys: dict[str, Any], issuer: str = ISSUER, jwks_uri: str = JWKS_URI) -> None:
        self.keys = list(keys)
        self.discovery = {"issuer": issuer, "jwks_uri": jwks_uri}
        self.fetched: list[str] = []

    async def fetch(self, url: str) -> Any:
        self.fetched.append(url)
        if url == ISSUER + "/.well-known/openid-configuration":
            return self.discovery
        if url == JWKS_URI:
            return {"keys": self.keys}
        raise IssuerUnavailable(f"{url}: HTTP 404")


def verifier(issuer: Issuer, clock: list[float] | None = None, **config: Any) -> OIDCVerifier:
    mono = clock or [0.0]
    settings = {"issuer": ISSUER, "client_id": "cluster-proxy", **config}
    # one clock: the verifier's unix time is NOW plus the monotonic seconds gone by
    return OIDCVerifier(
        OIDCConfig(**settings), issuer.fetch, clock=lambda: NOW + mono[0], monotonic=lambda: mono[0]
    )


def _ec_key(alg: str) -> ec.EllipticCurvePrivateKey:
    curve = {"ES256": ec.SECP256R1, "ES384": ec.SECP384R1, "ES512": ec.SECP521R1}[alg]()
    return ec.generate_private_key(curve)


@pytest.mark.parametrize("alg", SUPPORTED_ALGS)
async def test_every_algorithm_kube_apiserver_accepts_verifies_when_configured(alg: str) -> None:
    key = _ec_key(alg) if alg.startswith("ES") else rsa_key()
    oidc = verifier(Issuer(jwk(key, "k1")), signing_algs=(alg,), groups_claim="groups", groups_prefix="oidc:")
    verified = await oidc.verify(token({"groups": ["dev", "ops"]}, key=key, alg=alg))
    assert verified == Verified(f"{ISSUER}#alice", ("oidc:dev", "oidc:ops"), NOW + 600)


async def test_a_token_of_another_issuer_or_not_a_jws_is_not_the_verifiers_business() -> None:
    oidc = verifier(Issuer(jwk(rsa_key(), "k1")))
    assert await oidc.verify(token({"iss": "https://other.example"})) is None
    assert await oidc.verify("opaque-token") is None
    assert await oidc.verify("a.b.c.d.e") is None  # a JWE
    # duplicate keys: two parsers could read two issuers; not ours, the hub's TokenReview decides
    duplicated = (
        b'{"iss": "https://other.example", "iss": "' + ISSUER.encode() + b'", "aud": "cluster-proxy"}'
    )
    assert await oidc.verify(token(raw_payload=duplicated)) is None


def _hs256_with_the_public_key() -> str:
    """The confusion attack: HMAC keyed with the issuer's public key, which anyone has."""
    secret = (
        rsa_key()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    head = b64(json.dumps({"alg": "HS256", "kid": "k1"}).encode())
    body = b64(json.dumps({"iss": ISSUER, "aud": "cluster-proxy", "sub": "eve", "exp": NOW + 60}).encode())
    mac = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64(mac)}"


def _unsigned() -> str:
    head = b64(json.dumps({"alg": "none"}).encode())
    body = b64(json.dumps({"iss": ISSUER, "aud": "cluster-proxy", "sub": "eve", "exp": NOW + 60}).encode())
    return f"{head}.{body}."


def _tampered() -> str:
    head, _, signature = token().split(".")
    body = b64(json.dumps({"iss": ISSUER, "aud": "cluster-proxy", "sub": "root", "exp": NOW + 60}).encode())
    return f"{head}.{body}.{signature}"


def _es256_in_der() -> str:
    key = _ec_key("ES256")
    head = b64(json.dumps({"alg": "ES256", "kid": "ec"}).encode())
    body = b64(json.dumps({"iss": ISSUER, "aud": "cluster-proxy", "sub": "a", "exp": NOW + 60}).encode())
    der = key.sign(f"{head}.{body}".encode(), ec.ECDSA(hashes.SHA256()))
    _EC_KEYS["ec"] = key
    return f"{head}.{body}.{b64(der)}"


_EC_KEYS: dict[str, ec.EllipticCurvePrivateKey] = {}

REFUSALS: list[tuple[str, Any, dict[str, Any], str]] = [
    ("alg none", _unsigned, {}, "alg none"),
    ("HMAC with the public key", _hs256_with_the_public_key, {}, "HMAC is never accepted"),
    (
        "an alg not configured",
        lambda: token(key=_ec_key("ES256"), alg="ES256"),
        {},
        "not one of --oidc-signing-algs",
    ),
    ("another key, same kid", lambda: token(key=rsa_key(1)), {}, "signature does not match"),
    ("a payload changed", _tampered, {}, "signature does not match"),
    ("an unknown kid", lambda: token(kid="k9"), {}, "no RS256 key with kid 'k9'"),
    ("crit", lambda: token(header={"crit": ["exp"]}), {}, "crit"),
    ("kid not a string", lambda: token(kid=None, header={"kid": 7}), {}, "kid is not a string"),
    ("another audience", lambda: token({"aud": "kubernetes"}), {}, "does not contain the client id"),
    ("audiences without ours", lambda: token({"aud": ["a", "b"]}), {}, "does not contain the client id"),
    ("expired", lambda: token({"exp": NOW - 1}), {}, "expired 1s ago"),
    ("expires now", lambda: token({"exp": NOW}), {}, "expired 0s ago"),
    ("no exp", lambda: token({"exp": None}), {}, "no exp"),
    ("exp not a number", lambda: token({"exp": "soon"}), {}, "'exp' is not a number"),
    ("exp a boolean", lambda: token({"exp": True}), {}, "'exp' is not a number"),
    ("nbf ahead", lambda: token({"nbf": NOW + 61}), {}, "nbf is 61s in the future"),
    ("iat ahead", lambda: token({"iat": NOW + 3600}), {}, "iat is 3600s in the future"),
    ("no user", lambda: token({"sub": None}), {}, "'sub' (--oidc-username-claim) is missing"),
    ("user not a string", lambda: token({"sub": ["a"]}), {}, "is missing or not a string"),
    (
        "email unverified",
        lambda: token({"email": "a@b", "email_verified": False}),
        {"username_claim": "email"},
        "email_verified is not true",
    ),
    (
        "groups of numbers",
        lambda: token({"groups": [1]}),
        {"groups_claim": "groups"},
        "not a string or a list",
    ),
    (
        "required claim",
        lambda: token({"tier": "dev"}),
        {"required_claims": (("tier", "prod"),)},
        "'tier' is not 'prod'",
    ),
    ("padding", lambda: token().replace(".", "=.", 1), {}, "header is not base64url"),
    ("not base64url", lambda: token()[:-2] + "+/", {}, "signature is not base64url"),
    ("header not JSON", lambda: b64(b"{alg") + "." + token().split(".", 1)[1], {}, "header is not JSON"),
    ("ECDSA in DER", _es256_in_der, {"signing_algs": ("ES256",)}, "signature does not match"),
]


@pytest.mark.parametrize(("case", "make", "config", "reason"), REFUSALS, ids=[r[0] for r in REFUSALS])
async def test_every_refusal_says_why(case: str, make: Any, config: dict[str, Any], reason: str) -> None:
    raw = make()
    keys = [jwk(rsa_key(), "k1")] + [jwk(k, kid) for kid, k in _EC_KEYS.items()]
    oidc = verifier(Issuer(*keys), **config)
    with pytest.raises(TokenRefused) as refused:
        await oidc.verify(raw)
    assert reason in refused.value.reason, refused.value.reason


async def test_claims_within_the_skew_and_audience_lists_pass() -> None:
    oidc = verifier(Issuer(jwk(rsa_key(), "k1")))
    assert await oidc.verify(token({"nbf": NOW + 59, "iat": NOW + 59, "aud": ["x", "cluster-proxy"]}))
    assert await oidc.verify(token(kid=None))  # no kid: every key of the right type is tried


async def test_the_key_set_never_lends_a_key_of_another_kind_use_or_alg() -> None:
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    keys = [
        {"kty": "oct", "kid": "k1", "k": b64(b"secret")},  # symmetric: never a verification key
        jwk(weak, "weak"),  # below 2048 bits
        jwk(rsa_key(), "enc", use="enc"),
        jwk(rsa_key(), "k1", alg="RS384"),  # this key signs RS384 only
    ]
    oidc = verifier(Issuer(*keys))
    for kid in ("k1", "enc"):
        with pytest.raises(TokenRefused, match="no RS256 key"):
            await oidc.verify(token(kid=kid))
    with pytest.raises(TokenRefused, match="no RS256 key"):
        await oidc.verify(token(key=weak, kid="weak"))


async def test_an_unknown_kid_fetches_the_keys_again_at_most_once_per_interval() -> None:
    clock = [0.0]
    issuer = Issuer(jwk(rsa_key(), "k1"))
    oidc = verifier(issuer, clock)
    assert await oidc.verify(token())
    assert len(issuer.fetched) == 2  # discovery, then the keys
    issuer.keys = [jwk(rsa_key(1), "k2")]  # the issuer rotates
    clock[0] = 3.0
    with pytest.raises(TokenRefused, match="kid 'k2'"):  # within 10 s of the last fetch: no fetch
        await oidc.verify(token(key=rsa_key(1), kid="k2"))
    assert len(issuer.fetched) == 2
    clock[0] = 10.5
    assert (await oidc.verify(token(key=rsa_key(1), kid="k2"))) is not None
    assert len(issuer.fetched) == 4
    for _ in range(5):  # made-up kids: one fetch per interval at most
        with pytest.raises(TokenRefused) as refused:
            await oidc.verify(token(kid="made-up"))
        assert not refused.value.final  # not cached: a later request may find it after a fetch
    assert len(issuer.fetched) == 4


async def test_an_issuer_whose_document_is_not_its_own_is_unavailable_not_trusted() -> None:
    for issuer in (
        Issuer(jwk(rsa_key(), "k1"), issuer="https://evil.example"),
        Issuer(jwk(rsa_key(), "k1"), jwks_uri="http://keys.example/jwks"),
        Issuer(),  # no usable key
    ):
        with pytest.raises(IssuerUnavailable):
            await verifier(issuer).verify(token())


def test_kube_apiservers_username_prefix_rules() -> None:
    assert OIDCConfig(ISSUER, "a").user_prefix == ISSUER + "#"
    assert OIDCConfig(ISSUER, "a", username_claim="email").user_prefix == ""
    assert OIDCConfig(ISSUER, "a", username_prefix="-").user_prefix == ""
    assert OIDCConfig(ISSUER, "a", username_prefix="oidc:").user_prefix == "oidc:"


async def test_between_the_two_reviews_named_as_hub_users_cached_no_longer_than_the_token() -> None:
    calls: list[str] = []
    clock = [0.0]

    async def managed(cluster: str, token: str) -> Reviewed | None:
        calls.append("managed")
        return None

    async def hub(token: str) -> Reviewed | None:
        calls.append("hub")
        return (
            Reviewed("system:serviceaccount:apps:robot", ("system:authenticated",))
            if token == "hubby"
            else None
        )

    oidc = verifier(Issuer(jwk(rsa_key(), "k1")), clock, username_prefix="-", groups_claim="groups")
    auth = TokenAuthenticator(managed, hub, oidc=oidc, ttl=10, max_entries=8, clock=lambda: clock[0])
    # sub names a ServiceAccount and no prefix: the hub's rule applies (cluster:hub:), groups get system:authenticated
    sa = token({"sub": "system:serviceaccount:apps:robot", "groups": ["dev"], "exp": NOW + 4})
    assert await auth.authenticate("c1", sa) == Caller(
        "oidc",
        "cluster:hub:system:serviceaccount:apps:robot",
        ("dev", "system:authenticated"),
        "system:serviceaccount:apps:robot",
    )
    assert calls == ["managed"]  # never the hub's
    clock[0] = 3.0
    assert await auth.authenticate("c1", sa) is not None
    assert calls == ["managed"]  # cached
    clock[0] = 4.5  # past the token's exp (4 s), within the cache's 10 s: verified again, and expired
    why: list[str] = []
    assert await auth.authenticate("c1", sa, why) is None
    assert "expired" in why[0] and why[0].startswith(f"OIDC issuer {ISSUER}: ")
    assert calls == ["managed", "hub"]  # refused by the verifier: the hub is still asked
    # the refusal is cached too: a second try costs no verification, and the reason is kept
    again: list[str] = []
    assert await auth.authenticate("c1", sa, again) is None and again == why
    # another issuer's token goes to the hub untouched
    assert (await auth.authenticate("c1", "hubby")).source == "hub"  # type: ignore[union-attr]


async def test_an_issuer_out_of_reach_is_not_cached() -> None:
    issuer = Issuer(jwk(rsa_key(), "k1"), issuer="https://elsewhere.example")
    clock = [0.0]
    oidc = verifier(issuer, clock)

    async def nobody(*_: str) -> Reviewed | None:
        return None

    auth = TokenAuthenticator(nobody, None, oidc=oidc, ttl=10, clock=lambda: 0.0)
    why: list[str] = []
    assert await auth.authenticate("c1", token(), why) is None
    assert "could not be had" in why[0]
    issuer.discovery["issuer"] = ISSUER  # fixed
    clock[0] = 11.0
    assert await auth.authenticate("c1", token()) is not None


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--oidc-issuer-url=http://issuer.example", "--oidc-client-id=a"], "must be an https URL"),
        (["--oidc-issuer-url=https://issuer.example"], "needs --oidc-client-id"),
        (["--oidc-client-id=a"], "--oidc-client-id needs --oidc-issuer-url"),
        (
            ["--oidc-issuer-url=https://i.example", "--oidc-client-id=a", "--oidc-signing-algs=HS256"],
            "'HS256'",
        ),
        (
            ["--oidc-issuer-url=https://i.example", "--oidc-client-id=a", "--oidc-required-claim=x"],
            "KEY=VALUE",
        ),
    ],
)
def test_the_flags_refuse_what_kube_apiserver_would(
    flags: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = gateway_main.build_parser()
    base = [
        "--proxy-server=h:1",
        "--proxy-ca=a",
        "--proxy-cert=b",
        "--proxy-key=c",
        "--service-proxy-listen=127.0.0.1:0",
    ]
    args = parser.parse_args([*base, *flags])
    with pytest.raises(SystemExit):
        gateway_main.check_oidc_args(args, parser)
    assert error in capsys.readouterr().err
