"""Issue 35, point 1: the HTTPS endpoint's own OIDC verifier (``--oidc-issuer-url``; docs/cluster-gateway.md,
"Who the caller is"), against a real issuer: the hub kube-apiserver, whose ServiceAccount tokens are OIDC
ID tokens of its ``--service-account-issuer`` (tests/support/kubeapi.py: ``https://127.0.0.1:PORT``, the
discovery document and ``/openid/v1/jwks`` served by it, readable anonymously once the ClusterRole
``system:service-account-issuer-discovery`` is bound to ``system:unauthenticated``, as a cluster that
publishes its issuer does).

The gateway of tests/support/gateway_rig.py runs with ``--no-service-proxy-hub-tokens``: the hub's
TokenReview is out of the way, so a token that gets in was verified by the endpoint itself (and its
request log says ``source: oidc``); a hub token of the default audience, which the hub's TokenReview
would take, is 401 here.
"""

from __future__ import annotations

import base64
import contextlib
import json
import secrets
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from kubernetes import client

from tests.support.gateway_rig import Gateway, _bind, _user, running_gateway
from tests.support.kubeapi import KubeCluster, KubeClusters
from tests.support.waiting import poll_until

pytestmark = pytest.mark.slow

RBAC = "rbac.authorization.k8s.io"


@dataclass
class OIDCRig:
    gateway: Gateway
    hub: KubeCluster
    cluster: str  # the ManagedCluster
    namespace: str  # in cluster1 (the grants) and on the hub (the ServiceAccount)
    issuer: str
    audience: str
    user: str  # the ServiceAccount's name as the verifier names it, prefixed

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.gateway.service_proxy_port}"

    def call(self, path: str, token: str) -> tuple[int, dict[str, str], Any]:
        assert self.gateway.ca_bundle is not None
        context = ssl.create_default_context(cafile=str(self.gateway.ca_bundle))
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, context=context, timeout=30) as answer:
                return answer.status, dict(answer.headers), json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), json.loads(exc.read())

    def mint(self, audiences: list[str] | None, name: str = "robot") -> str:
        """A TokenRequest on the hub for ServiceAccount ``name`` (None: the hub's default audience)."""
        spec: dict[str, Any] = {"expirationSeconds": 600}
        if audiences is not None:
            spec["audiences"] = audiences
        with self.hub.api_client() as admin:
            return (
                client.CoreV1Api(admin)
                .create_namespaced_service_account_token(name, self.namespace, {"spec": spec})
                .status.token
            )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _part(token: str, index: int) -> dict[str, Any]:
    text = token.split(".")[index]
    return json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))


def _forge(header: dict[str, Any], claims: dict[str, Any], key: rsa.RSAPrivateKey | None) -> str:
    """A JWS with these claims, signed RS256 by ``key`` (None: alg none, no signature)."""
    head = _b64(json.dumps(header).encode())
    body = _b64(json.dumps(claims).encode())
    if key is None:
        return f"{head}.{body}."
    signature = key.sign(f"{head}.{body}".encode(), padding.PKCS1v15(), hashes.SHA256())
    return f"{head}.{body}.{_b64(signature)}"


@pytest.fixture(scope="module")
def rig(kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OIDCRig]:
    directory = tmp_path_factory.mktemp("service-proxy-oidc")
    tag = secrets.token_hex(3)
    namespace = f"oidc-{tag}"
    hub, cluster1 = kube_clusters["hub"], kube_clusters["cluster1"]
    issuer = f"https://127.0.0.1:{hub.port}"
    audience = f"cluster-proxy-{tag}"
    discovery = f"oidc-discovery-{tag}"
    with hub.api_client() as admin:
        core = client.CoreV1Api(admin)
        core.create_namespace({"metadata": {"name": namespace}})
        core.create_namespaced_service_account(namespace, {"metadata": {"name": "robot"}})
        # what a cluster that publishes its issuer does: discovery and keys readable by anyone
        client.RbacAuthorizationV1Api(admin).create_cluster_role_binding(
            {
                "metadata": {"name": discovery},
                "roleRef": {
                    "apiGroup": RBAC,
                    "kind": "ClusterRole",
                    "name": "system:service-account-issuer-discovery",
                },
                "subjects": [{"kind": "Group", "name": "system:unauthenticated", "apiGroup": RBAC}],
            }
        )
    with cluster1.api_client() as admin:
        client.CoreV1Api(admin).create_namespace({"metadata": {"name": namespace}})
    try:
        with running_gateway(
            kube_clusters,
            directory,
            ("cluster1",),
            service_proxy=True,
            extra_args=[
                f"--oidc-issuer-url={issuer}",
                f"--oidc-client-id={audience}",
                f"--oidc-ca-file={hub.ca_path}",
                "--no-service-proxy-hub-tokens",
                f"--audit-log={directory / 'audit.jsonl'}",
            ],
        ) as gateway:
            fetched = poll_until(
                lambda: (
                    gateway.process.named("oidc_keys_fetched") or gateway.process.named("oidc_keys_failed")
                ),
                timeout=30,
                what="the gateway's first fetch of the issuer's keys",
            )
            assert fetched[0]["event"] == "oidc_keys_fetched", fetched
            assert fetched[0]["jwks_uri"] == f"{issuer}/openid/v1/jwks"
            yield OIDCRig(
                gateway,
                hub,
                gateway.clusters["cluster1"].name,
                namespace,
                issuer,
                audience,
                f"{issuer}#system:serviceaccount:{namespace}:robot",
            )
    finally:
        with hub.api_client() as admin, contextlib.suppress(client.exceptions.ApiException):
            client.RbacAuthorizationV1Api(admin).delete_cluster_role_binding(discovery)
        for api in (hub, cluster1):
            with api.api_client() as admin, contextlib.suppress(client.exceptions.ApiException):
                client.CoreV1Api(admin).delete_namespace(namespace)


def _requests(rig: OIDCRig, path: str) -> list[dict[str, Any]]:
    return [r for r in rig.gateway.process.named("service_proxy_request") if r.get("path") == path]


def test_an_id_token_of_the_issuer_is_verified_here_and_gets_what_cluster1_grants_its_prefixed_name(
    rig: OIDCRig,
) -> None:
    token = rig.mint([rig.audience])
    configmaps = f"/{rig.cluster}/api/v1/namespaces/{rig.namespace}/configmaps"
    secrets_path = f"/{rig.cluster}/api/v1/namespaces/{rig.namespace}/secrets"
    status, _, body = rig.call(configmaps, token)
    assert status == 403, body
    assert f'User "{rig.user}" cannot list resource "configmaps"' in body["message"], body
    # the request's log line follows its answer
    [refused] = poll_until(lambda: _requests(rig, configmaps), timeout=10, what="the request's log line")
    # the endpoint's own verdict: the hub's TokenReview is off, and the log names the authenticator
    assert refused["source"] == "oidc" and refused["user"] == rig.user, refused

    with rig.gateway.clusters["cluster1"].api.api_client() as admin:
        _bind(
            admin,
            rig.namespace,
            f"oidc-reader-{rig.namespace}",
            [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}],
            _user(rig.user),
        )
    answered = poll_until(
        lambda: (lambda r: r if r[0] == 200 else None)(rig.call(configmaps, token)),
        timeout=30,
        what="cluster1's RoleBinding to reach its authorizer",
    )
    assert answered[2]["kind"] == "ConfigMapList"
    status, _, body = rig.call(secrets_path, token)  # exactly what the binding grants
    assert status == 403 and f'User "{rig.user}" cannot list resource "secrets"' in body["message"], body

    def granted() -> list[dict[str, Any]]:  # each record is written after its answer
        lines = (rig.gateway.directory / "audit.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["target"] == configmaps and r["status"] == 200]

    ok = poll_until(granted, timeout=10, what="the audit record of the granted request")
    assert ok[-1]["client"] == rig.user and ok[-1]["groups"] == ["system:authenticated"], ok


def test_tokens_the_verifier_refuses_are_401_with_the_reason(rig: OIDCRig) -> None:
    path = f"/{rig.cluster}/api/v1/namespaces/{rig.namespace}/configmaps"
    good = rig.mint([rig.audience])
    header, claims = _part(good, 0), _part(good, 1)
    hub_key = serialization.load_pem_private_key(
        (rig.hub.directory / "service-account.key").read_bytes(), password=None
    )
    assert isinstance(hub_key, rsa.RSAPrivateKey)
    now = int(time.time())
    cases = {
        # the hub's TokenReview would take this one (its own audience); here it is the verifier's to judge
        "the hub's default audience": (rig.mint(None), "does not contain the client id"),
        "another audience": (rig.mint(["someone-else"]), "does not contain the client id"),
        # signed with the issuer's real key, so only the expiry is wrong
        "expired": (
            _forge(header, {**claims, "iat": now - 700, "nbf": now - 700, "exp": now - 100}, hub_key),
            "expired",
        ),
        "signed by another key": (
            _forge(header, claims, rsa.generate_private_key(public_exponent=65537, key_size=2048)),
            "signature does not match",
        ),
        "alg none": (_forge({**header, "alg": "none"}, claims, None), "alg none"),
        "HMAC": (_forge({**header, "alg": "HS256"}, claims, hub_key)[:-5] + "AAAAA", "HMAC"),
    }
    for case, (token, reason) in cases.items():
        status, headers, body = rig.call(path, token)
        assert status == 401, (case, status, body)
        assert headers.get("WWW-Authenticate", "").startswith("Bearer"), case
        assert f"OIDC issuer {rig.issuer}: " in body["message"] and reason in body["message"], (case, body)
    # and the real one still passes the verifier (cluster1 decides: 403 or 200, never 401)
    assert rig.call(path, good)[0] in (200, 403)
