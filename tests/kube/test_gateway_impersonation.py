"""Issue 15, point 4: the hub user's identity carried into the managed cluster (caller mode).

A gateway as tests/kube/test_gateway.py runs it (tests/support/gateway_rig.py: the addon's stack, cluster1's
API server joined as the ManagedCluster ``cluster1-<tag>``, the gateway behind the hub's aggregator).
Here:

- on the hub, four users with RBAC on ``clustergateways/proxy``: alice, bob, carol and dan; dan may also
  impersonate alice and mallory on the hub (``kubectl --as``), carol may not;
- in cluster1, alice may list Secrets in ``kube-system`` (a Role), bob may not; the gateway's
  ServiceAccount may impersonate the users alice and bob (and the group system:authenticated), not
  mallory: the per-user grants are the managed cluster's say on which hub users the gateway carries;
- cluster1's ManagedCluster has the annotation ``cluster-gateway.open-cluster-management.io/identity:
  caller`` (per-cluster mode); the request header ``X-Cluster-Gateway-Identity`` (per-request mode) is
  tested with the annotation set to ``service-account``.

Every Forbidden is checked for whom it names: the hub user in caller mode, the ServiceAccount otherwise.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from tests.support.gateway_rig import (
    SA_NAME,
    SA_NAMESPACE,
    SA_USER,
    Gateway,
    _cluster_kubeconfig,
    _hub_user,
    _kubectl,
    running_gateway,
)
from tests.support.kubeapi import KubeClusters
from tests.support.waiting import poll_until

pytestmark = pytest.mark.slow

IDENTITY_ANNOTATION = "cluster-gateway.open-cluster-management.io/identity"
IDENTITY_HEADER = "X-Cluster-Gateway-Identity"
RBAC = "rbac.authorization.k8s.io"


@pytest.fixture(scope="module")
def gateway(kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """cluster1's API server joined as ManagedCluster ``cluster1-<tag>`` (tests/support/gateway_rig.py)."""
    with running_gateway(kube_clusters, tmp_path_factory.mktemp("impersonation"), ("cluster1",)) as gw:
        yield gw


@dataclass
class Users:
    gateway: Gateway
    names: dict[str, str]  # alice -> alice-<tag>
    hub_configs: dict[str, Path]  # the hub kubeconfig of each
    cluster1_configs: dict[str, Path]  # `cluster-proxy kubeconfig cluster1` from each one's hub kubeconfig
    secret: str  # a Secret in cluster1's kube-system

    def context(self, who: str) -> ssl.SSLContext:
        """TLS to the hub as ``who`` (the client certificate of the hub kubeconfig)."""
        user = yaml.safe_load(self.hub_configs[who].read_text())["users"][0]["user"]
        context = ssl.create_default_context(cafile=str(self.gateway.hub.ca_path))
        context.load_cert_chain(user["client-certificate"], user["client-key"])
        return context


def _user_subject(name: str) -> dict[str, str]:
    return {"kind": "User", "name": name, "apiGroup": RBAC}


def _bind_cluster_role(rbac: client.RbacAuthorizationV1Api, name: str, rules: list, subjects: list) -> None:
    rbac.create_cluster_role({"metadata": {"name": name}, "rules": rules})
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": name},
            "subjects": subjects,
        }
    )


def _annotate(gateway: Gateway, cluster: str, value: str | None) -> None:
    with gateway.hub.api_client() as admin:
        client.CustomObjectsApi(admin).patch_cluster_custom_object(
            "cluster.open-cluster-management.io",
            "v1",
            "managedclusters",
            cluster,
            {"metadata": {"annotations": {IDENTITY_ANNOTATION: value}}},
        )


@pytest.fixture(scope="module")
def users(gateway: Gateway) -> Iterator[Users]:
    tag = gateway.stack.tag
    names = {who: f"{who}-{tag}" for who in ("alice", "bob", "carol", "dan", "mallory")}
    hub_configs = {who: _hub_user(gateway, names[who]) for who in ("alice", "bob", "carol", "dan")}
    proxy_role = f"gw-proxy-{tag}"
    hub_impersonator = f"gw-hub-impersonator-{tag}"
    reader = f"gw-secret-reader-{tag}"
    impersonator = f"gw-impersonator-{tag}"
    secret = f"gw-secret-{tag}"
    cluster1 = gateway.clusters["cluster1"].api
    managed = gateway.clusters["cluster1"].name  # the ManagedCluster
    with gateway.hub.api_client() as admin:
        rbac = client.RbacAuthorizationV1Api(admin)
        _bind_cluster_role(
            rbac,
            proxy_role,
            [
                {
                    "apiGroups": ["cluster.core.oam.dev"],
                    "resources": ["clustergateways/proxy"],
                    "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
                }
            ],
            # mallory never calls herself, but with --as the hub authorizes the impersonated user
            [_user_subject(names[who]) for who in ("alice", "bob", "carol", "dan", "mallory")],
        )
        # kubectl --as on the hub: dan may act as alice and mallory there, nobody else may impersonate
        _bind_cluster_role(
            rbac,
            hub_impersonator,
            [
                {
                    "apiGroups": [""],
                    "resources": ["users"],
                    "verbs": ["impersonate"],
                    "resourceNames": [names["alice"], names["mallory"]],
                }
            ],
            [_user_subject(names["dan"])],
        )
    with cluster1.api_client() as admin:
        client.CoreV1Api(admin).create_namespaced_secret(
            "kube-system", {"metadata": {"name": secret}, "stringData": {"in": "cluster1"}}
        )
        rbac = client.RbacAuthorizationV1Api(admin)
        rbac.create_namespaced_role(
            "kube-system",
            {
                "metadata": {"name": reader},
                "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]}],
            },
        )
        rbac.create_namespaced_role_binding(
            "kube-system",
            {
                "metadata": {"name": reader},
                "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": reader},
                "subjects": [_user_subject(names["alice"])],
            },
        )
        # the gateway's ServiceAccount may carry these hub users (and their one group) into cluster1
        _bind_cluster_role(
            rbac,
            impersonator,
            [
                {
                    "apiGroups": [""],
                    "resources": ["users"],
                    "verbs": ["impersonate"],
                    "resourceNames": [names["alice"], names["bob"]],
                },
                {
                    "apiGroups": [""],
                    "resources": ["groups"],
                    "verbs": ["impersonate"],
                    "resourceNames": ["system:authenticated"],
                },
            ],
            [{"kind": "ServiceAccount", "name": SA_NAME, "namespace": SA_NAMESPACE}],
        )
    _annotate(gateway, managed, "caller")
    try:
        yield Users(
            gateway,
            names,
            hub_configs,
            {who: _cluster_kubeconfig(gateway, managed, path) for who, path in hub_configs.items()},
            secret,
        )
    finally:
        with contextlib.suppress(Exception):
            _annotate(gateway, managed, None)
        with gateway.hub.api_client() as admin:
            rbac = client.RbacAuthorizationV1Api(admin)
            for name in (proxy_role, hub_impersonator):
                for delete in (rbac.delete_cluster_role_binding, rbac.delete_cluster_role):
                    with contextlib.suppress(client.exceptions.ApiException):
                        delete(name)
        with cluster1.api_client() as admin:
            rbac = client.RbacAuthorizationV1Api(admin)
            for delete in (
                lambda: client.CoreV1Api(admin).delete_namespaced_secret(secret, "kube-system"),
                lambda: rbac.delete_namespaced_role_binding(reader, "kube-system"),
                lambda: rbac.delete_namespaced_role(reader, "kube-system"),
                lambda: rbac.delete_cluster_role_binding(impersonator),
                lambda: rbac.delete_cluster_role(impersonator),
            ):
                with contextlib.suppress(client.exceptions.ApiException):
                    delete()


def _secrets(users: Users, who: str, *extra: str) -> tuple[int, str, str]:
    done = _kubectl(users.cluster1_configs[who], "get", "secrets", "-n", "kube-system", "-o", "name", *extra)
    return done.returncode, done.stdout, done.stderr


def _until_listed(users: Users, who: str, *extra: str) -> tuple[int, str, str]:
    """``who``'s list of cluster1's kube-system Secrets once it succeeds (the gateway reads the
    ManagedCluster's annotation within its cache TTL); AssertionError with the last answer."""
    last: list[tuple[int, str, str]] = []

    def listed() -> tuple[int, str, str] | None:
        last[:] = [_secrets(users, who, *extra)]
        return last[0] if last[0][0] == 0 else None

    try:
        return poll_until(listed, timeout=15, what=f"{who}'s list of Secrets in cluster1's kube-system")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the last answer: {last}\n{users.gateway.process.tail()}") from None


def _forbidden_to_list_secrets(user: str) -> str:
    return f'User "{user}" cannot list resource "secrets" in API group "" in the namespace "kube-system"'


def test_two_hub_users_get_their_own_answers_from_cluster1(users: Users) -> None:
    """The same `kubectl get secrets -n kube-system` through the gateway: cluster1's RBAC decides per hub
    user, alice is allowed, bob is refused by name (not the gateway's ServiceAccount)."""
    code, out, err = _until_listed(users, "alice")
    assert f"secret/{users.secret}" in out.split(), out  # cluster1's Secret: the answer is cluster1's
    print(f"\nalice: {out.strip()}")
    code, out, err = _secrets(users, "bob")
    assert code != 0
    assert "Error from server (Forbidden)" in err and _forbidden_to_list_secrets(users.names["bob"]) in err, (
        err
    )
    assert SA_USER not in err
    print(f"bob: {err.strip()}")


def test_as_passes_only_for_a_caller_allowed_to_impersonate(users: Users) -> None:
    """kubectl --as is done by the hub: it checks that the caller may impersonate there and sends the
    gateway the impersonated user, whom the gateway carries into cluster1."""
    alice = users.names["alice"]
    # carol may use the gateway but not impersonate: the hub refuses, the gateway never sees it
    code, out, err = _secrets(users, "carol", f"--as={alice}")
    assert code != 0
    assert (
        "Forbidden" in err and f'User "{users.names["carol"]}" cannot impersonate resource "users"' in err
    ), err
    print(f"\ncarol --as alice: {err.strip()}")
    # dan may impersonate alice on the hub: cluster1 answers as alice
    code, out, err = _until_listed(users, "dan", f"--as={alice}")
    assert f"secret/{users.secret}" in out.split(), out
    # without --as, dan is himself, and cluster1 lets the gateway carry only alice and bob
    code, out, err = _secrets(users, "dan")
    assert (
        code != 0 and f'users "{users.names["dan"]}" is forbidden: User "{SA_USER}" cannot impersonate' in err
    ), err
    print(f"dan as himself: {err.strip()}")


def test_impersonation_the_gateway_may_not_do_is_cluster1s_403(users: Users) -> None:
    """The hub lets dan act as mallory, but cluster1 does not let the gateway's ServiceAccount
    impersonate mallory: cluster1's own 403, passed through unchanged, naming the ServiceAccount."""
    code, _, err = _secrets(users, "dan", f"--as={users.names['mallory']}")
    assert code != 0
    assert "Error from server (Forbidden)" in err
    assert f'User "{SA_USER}" cannot impersonate resource "users" in API group ""' in err, err
    print(f"\ncluster1's 403 for mallory: {err.strip()}")


def _get(users: Users, who: str, path: str, identity: str | None) -> tuple[int, dict]:
    """GET ``path`` on the hub as ``who`` with the per-request header (or none); status and Status/body."""
    headers = {IDENTITY_HEADER: identity} if identity is not None else {}
    request = urllib.request.Request(f"{users.gateway.hub.url}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, context=users.context(who), timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_request_asks_for_the_callers_identity_with_a_header(users: Users) -> None:
    """Per request: on a service-account cluster, X-Cluster-Gateway-Identity: caller makes that one
    request the caller's; on a caller cluster, asking for the service account is refused (a request may
    narrow the identity, never widen it); an unknown value is a 400 in words."""
    gw = users.gateway
    managed = gw.clusters["cluster1"].name
    path = gw.proxy_path(managed, "/api/v1/namespaces/kube-system/secrets")
    bob = users.names["bob"]
    _annotate(gw, managed, "service-account")
    try:
        status, body = poll_until(
            lambda: (
                (done := _get(users, "bob", path, None))[0] == 403 and SA_USER in done[1]["message"] and done
            ),
            timeout=15,
            what="bob answered as the ServiceAccount once the annotation says service-account",
        )
        status, body = _get(users, "bob", path, "caller")
        assert status == 403 and f'User "{bob}" cannot list resource "secrets"' in body["message"], body
        status, body = _get(users, "alice", path, "caller")
        assert status == 200 and users.secret in [s["metadata"]["name"] for s in body["items"]], body
        status, body = _get(users, "alice", path, "nobody")
        assert status == 400 and "X-Cluster-Gateway-Identity: 'nobody' is not one of" in body["message"], body
    finally:
        _annotate(gw, managed, "caller")
    status, body = poll_until(
        lambda: (
            (done := _get(users, "alice", path, "service-account"))[0] == 403
            and "may not widen" in done[1]["message"]
            and done
        ),
        timeout=15,
        what="a request for the service account refused on a caller cluster",
    )
    assert body["reason"] == "Forbidden"
    assert IDENTITY_ANNOTATION in body["message"], body
    print(f"\nwiden refused: {body['message']}")


def test_an_unknown_annotation_value_is_refused_in_words(users: Users) -> None:
    managed = users.gateway.clusters["cluster1"].name
    _annotate(users.gateway, managed, "everyone")
    try:
        done = poll_until(
            lambda: (d := _secrets(users, "alice"))[0] != 0 and "everyone" in d[2] and d,
            timeout=15,
            what="the refusal naming the annotation's value",
        )
        assert "InternalError" in done[2] and IDENTITY_ANNOTATION in done[2], done[2]
        assert f"kubectl annotate managedcluster {managed}" in done[2], done[2]
    finally:
        _annotate(users.gateway, managed, "caller")
