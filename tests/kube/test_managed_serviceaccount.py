"""Managed service accounts (issue 15 point 2) against real hub and cluster1 API servers.

The addon's stack runs as in test_gateway (addon-manager, cert-signer and proxy-server from the
Deployments it wrote, the agent from its ManifestWork in cluster1, with the RBAC that ManifestWork
grants it there and its pod's own ServiceAccount token). The ManagedServiceAccount CRD is on the hub;
the cluster-gateway runs with ``--managed-serviceaccounts`` behind the hub's aggregator, with a client
certificate named ``cluster-gateway`` (the proxy-server's default ``--control-client``). No Secret and no
ServiceAccount is made by hand: the addon-manager creates the gateway's own ManagedServiceAccount, the
gateway asks cluster1's agent for its token through the tunnel and writes the hub Secret.

Rotation: TokenRequest's shortest validity is 10 minutes. The gateway here renews at 5 % of a token's
life (``--serviceaccount-renew-fraction=0.05``: a 10-minute token every 30 s) instead of 80 %, so that
the rotation test sees several renewals in about a minute; that the rotated-out token stops working
when it expires takes its real 10 minutes. So that this wait overlaps the other kube tests instead of
adding to them, this module runs first in the session (``kube_early``) and the expiry test last
(``kube_last``; tests/kube/conftest.py orders them). Only one addon stack may run at a time
(the addon-managers would fight over the ClusterManagementAddOn and every ManagedClusterAddOn, the
gateways over the APIService), so the stack stops after the module's other tests and a fresh one is
started for the expiry test; what crosses over is :class:`RotatedOut` (session-scoped), and the
gateway's ManagedServiceAccount of the first stack is left in place so that cluster1's ServiceAccount,
and with it the rotated-out token, lives on until the token expires.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import secrets
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
from kubernetes import client

from clusterproxy_protocol.agent_control import CONTROL_HOST, CONTROL_PORT
from clusterproxy_protocol.errors import ConnectRefused
from clusterproxy_sdk import TLSFiles, open_shared_tunnel
from tests.support import require
from tests.support.addonstack import AddonStack
from tests.support.gateway_rig import GROUP_PATH, SA_NAMESPACE, running_gateway
from tests.support.kubeapi import KubeCluster, KubeClusters, install_crds
from tests.support.procs import BIN, Process
from tests.support.waiting import poll_until

pytestmark = [pytest.mark.slow, pytest.mark.kube_early]

GROUP, VERSION, PLURAL = "authentication.open-cluster-management.io", "v1beta1", "managedserviceaccounts"
CRDS = Path(__file__).parent / "crds" / "authentication"
GATEWAY_MSA = "cluster-gateway"
RENEW_FRACTION = 0.05


@dataclass
class RotatedOut:
    """The gateway's first 10-minute token, rotated out by the rotation test, for the expiry test."""

    token: str
    expires: dt.datetime
    cluster: str  # the ManagedCluster (hub namespace) whose Secret held it
    checked: bool = False  # the expiry test has run: the gateway's MSA may go


@dataclass
class Handover:
    """What the rotation test hands to the expiry test across the session (see the module's docstring)."""

    rotated_out: RotatedOut | None = None


@dataclass
class Stack:
    stack: AddonStack
    hub: KubeCluster
    managed: KubeCluster  # cluster1's API server
    cluster: str  # the ManagedCluster's name (its namespace on the hub)
    gateway: Process
    directory: Path
    handover: Handover = field(default_factory=Handover)

    def msa(self, name: str) -> dict[str, Any] | None:
        with self.hub.api_client() as admin:
            try:
                return client.CustomObjectsApi(admin).get_namespaced_custom_object(
                    GROUP, VERSION, self.cluster, PLURAL, name
                )
            except client.exceptions.ApiException as exc:
                if exc.status == 404:
                    return None
                raise

    def secret(self, name: str, cluster: str | None = None) -> dict[str, str] | None:
        """The hub Secret ``name`` of ``cluster`` (this stack's by default), its keys decoded."""
        with self.hub.api_client() as admin:
            try:
                found = client.CoreV1Api(admin).read_namespaced_secret(name, cluster or self.cluster)
            except client.exceptions.ApiException as exc:
                if exc.status == 404:
                    return None
                raise
        return {k: base64.b64decode(v).decode() for k, v in (found.data or {}).items()}

    def serviceaccount_exists(self, name: str) -> bool:
        with self.managed.api_client() as admin:
            try:
                client.CoreV1Api(admin).read_namespaced_service_account(name, SA_NAMESPACE)
            except client.exceptions.ApiException as exc:
                if exc.status == 404:
                    return False
                raise
        return True

    def review(self, token: str) -> dict[str, Any]:
        """cluster1's TokenReview of ``token``: its status (authenticated, user)."""
        with self.managed.api_client() as admin:
            answer = client.AuthenticationV1Api(admin).create_token_review({"spec": {"token": token}})
        return answer.status.to_dict()

    def wait_reported(
        self, name: str, *, expiring_before: dt.datetime | None = None, timeout: float = 60
    ) -> dict[str, Any]:
        """The MSA once its TokenReported condition is True (with a token expiring before
        ``expiring_before`` when given)."""

        def reported() -> dict[str, Any] | None:
            msa = self.msa(name)
            status = (msa or {}).get("status") or {}
            conditions = {c["type"]: c for c in status.get("conditions") or []}
            if conditions.get("TokenReported", {}).get("status") != "True":
                return None
            if expiring_before is not None and _expiration(msa) > expiring_before:
                return None
            return msa

        try:
            return poll_until(reported, timeout=timeout, what=f"ManagedServiceAccount {name} reported")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {self.msa(name)}\n--- gateway\n{self.gateway.tail()}") from None


def _expiration(msa: dict[str, Any] | None) -> dt.datetime:
    text = ((msa or {}).get("status") or {}).get("expirationTimestamp") or "9999-12-31T00:00:00Z"
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _create_msa(stack: Stack, name: str, validity: str | None = None) -> None:
    spec: dict[str, Any] = {"rotation": {"enabled": True, **({"validity": validity} if validity else {})}}
    with stack.hub.api_client() as admin:
        client.CustomObjectsApi(admin).create_namespaced_custom_object(
            GROUP,
            VERSION,
            stack.cluster,
            PLURAL,
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "ManagedServiceAccount",
                "metadata": {"name": name},
                "spec": spec,
            },
        )


def _delete_msas(stack: Stack, cluster: str, *, keep: frozenset[str] = frozenset()) -> None:
    """While the gateway and the agent still run: every MSA of ``cluster`` but ``keep`` deleted and gone,
    so that nothing of this module is left in cluster1 (its ServiceAccounts) or waits on a finalizer."""
    with stack.hub.api_client() as admin:
        custom = client.CustomObjectsApi(admin)

        def remaining() -> list[str]:
            listed = custom.list_namespaced_custom_object(GROUP, VERSION, cluster, PLURAL)["items"]
            return [i["metadata"]["name"] for i in listed if i["metadata"]["name"] not in keep]

        for name in remaining():
            with contextlib.suppress(client.exceptions.ApiException):
                custom.delete_namespaced_custom_object(GROUP, VERSION, cluster, PLURAL, name)
        try:
            poll_until(
                lambda: not remaining(), timeout=30, what=f"the ManagedServiceAccounts of {cluster} finalized"
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {remaining()}\n--- gateway\n{stack.gateway.tail()}") from None


@pytest.fixture(scope="session")
def handover() -> Handover:
    return Handover()


@pytest.fixture(scope="module")
def msa_stack(
    kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory, handover: Handover
) -> Iterator[Stack]:
    """The addon's stack with cluster1 joined and the gateway with ``--managed-serviceaccounts``. Set up
    twice in a whole run (module scope, and the expiry test runs last in the session): the second stack
    finalizes what the first left for the expiry test."""
    install_crds(kube_clusters["hub"], CRDS)
    with running_gateway(
        kube_clusters,
        tmp_path_factory.mktemp("msa"),
        ("cluster1",),
        managed_serviceaccounts=True,
        extra_args=["--serviceaccount-interval=1s", f"--serviceaccount-renew-fraction={RENEW_FRACTION}"],
    ) as gw:
        running = Stack(
            gw.stack,
            gw.hub,
            gw.clusters["cluster1"].api,
            gw.clusters["cluster1"].name,
            gw.process,
            gw.directory,
            handover,
        )
        yield running
        rotated = handover.rotated_out
        if rotated is not None and not rotated.checked:
            # the expiry test is still to come (last in the session): cluster1's ServiceAccount of the
            # gateway's MSA must outlive the rotated-out token, so that MSA stays (its stack stops)
            _delete_msas(running, running.cluster, keep=frozenset({GATEWAY_MSA}))
            return
        if rotated is not None and rotated.cluster != running.cluster:
            # left by the first stack: its ManagedCluster is gone, so this gateway drops the finalizer
            _delete_msas(running, rotated.cluster)
        _delete_msas(running, running.cluster)


# --- an MSA's whole life -----------------------------------------------------------------------------------


def test_an_msa_makes_a_serviceaccount_in_cluster1_and_a_working_token_on_the_hub(msa_stack: Stack) -> None:
    name = f"app-{msa_stack.stack.tag}"
    started = time.monotonic()
    _create_msa(msa_stack, name)
    msa = msa_stack.wait_reported(name)
    print(f"\nMSA created -> token in the hub Secret: {time.monotonic() - started:.2f}s")
    status = msa["status"]
    assert status["tokenSecretRef"]["name"] == name
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["SecretCreated"]["status"] == "True"
    expires = dt.datetime.fromisoformat(status["expirationTimestamp"].replace("Z", "+00:00"))
    assert expires > dt.datetime.now(dt.UTC) + dt.timedelta(days=300)  # the default validity, 8640h
    assert msa_stack.serviceaccount_exists(name)

    secret = msa_stack.secret(name)
    assert secret is not None and set(secret) == {"token", "ca.crt"}
    assert secret["ca.crt"] == msa_stack.managed.ca_path.read_text()
    review = msa_stack.review(secret["token"])
    assert review["authenticated"] is True, review
    assert review["user"]["username"] == f"system:serviceaccount:{SA_NAMESPACE}:{name}"
    # and a plain request to cluster1's API server with it (discovery: any authenticated user may)
    context = ssl.create_default_context(cafile=str(msa_stack.managed.ca_path))
    request = urllib.request.Request(
        f"{msa_stack.managed.url}/api", headers={"Authorization": f"Bearer {secret['token']}"}
    )
    with urllib.request.urlopen(request, context=context, timeout=10) as answer:
        assert answer.status == 200 and json.loads(answer.read())["kind"] == "APIVersions"

    # deleting the MSA removes the Secret and the ServiceAccount (and with it every token of it)
    with msa_stack.hub.api_client() as admin:
        client.CustomObjectsApi(admin).delete_namespaced_custom_object(
            GROUP, VERSION, msa_stack.cluster, PLURAL, name
        )
    poll_until(
        lambda: (
            msa_stack.msa(name) is None
            and msa_stack.secret(name) is None
            and not msa_stack.serviceaccount_exists(name)
        ),
        timeout=30,
        what=f"MSA {name}, its Secret and its ServiceAccount gone",
    )
    # kube-apiserver caches a token's successful authentication for 10 s
    poll_until(
        lambda: msa_stack.review(secret["token"])["authenticated"] is not True,
        timeout=30,
        what="the token of the deleted ServiceAccount rejected by cluster1",
    )


def test_the_gateway_reaches_cluster1_with_its_own_msa_and_no_secret_made_by_hand(msa_stack: Stack) -> None:
    msa = msa_stack.wait_reported(GATEWAY_MSA)  # created by the addon-manager with the addon
    owners = msa["metadata"].get("ownerReferences") or []
    assert [o["kind"] for o in owners] == ["ManagedClusterAddOn"]
    assert msa_stack.serviceaccount_exists(GATEWAY_MSA)
    done = msa_stack.hub.kubectl(
        "get", "--raw", f"{GROUP_PATH}/clustergateways/{msa_stack.cluster}/proxy/healthz"
    )
    assert done.returncode == 0, f"{done.stderr}\n--- gateway\n{msa_stack.gateway.tail()}"
    assert done.stdout.strip() == "ok"
    # cluster1's own answer: its RBAC names the MSA's ServiceAccount (nothing granted to it yet)
    denied = msa_stack.hub.kubectl(
        "get", "--raw", f"{GROUP_PATH}/clustergateways/{msa_stack.cluster}/proxy/api/v1/secrets"
    )
    assert denied.returncode != 0
    assert f"system:serviceaccount:{SA_NAMESPACE}:{GATEWAY_MSA}" in denied.stderr, denied.stderr


# --- who may ask for tokens --------------------------------------------------------------------------------


def test_an_ordinary_hub_client_and_a_direct_call_cannot_reach_the_control_endpoint(msa_stack: Stack) -> None:
    stack = msa_stack.stack
    ca, cert, key = stack.client_certificate(f"someone-{stack.tag}")

    async def attempt() -> tuple[ConnectRefused | None, bool]:
        async with open_shared_tunnel(f"127.0.0.1:{stack.ports.client}", TLSFiles(ca, cert, key)) as tunnel:
            reached_apiserver = False
            stream = await tunnel.connect(
                msa_stack.cluster, msa_stack.cluster, 443
            )  # allowed: its kube-apiserver
            reached_apiserver = True
            await stream.aclose()
            try:
                control = await tunnel.connect(msa_stack.cluster, CONTROL_HOST, CONTROL_PORT)
            except ConnectRefused as exc:
                return exc, reached_apiserver
            await control.aclose()
            return None, reached_apiserver

    refused, reached = trio.run(attempt)
    assert reached, (
        "the ordinary client must reach the cluster's kube-apiserver (the refusal is for the control target)"
    )
    assert refused is not None, "an ordinary hub client reached the agent's control endpoint"
    assert refused.status == 403
    assert "--control-client" in str(refused) and "cluster-gateway" in str(refused), str(refused)

    # the agent serves nothing of it on its only listening port (its admin port)
    agent = stack.members[msa_stack.cluster].agent
    assert agent is not None
    admin = next(e["admin_port"] for e in agent.container().events("agent_started"))
    request = urllib.request.Request(
        f"http://{admin}/v1/serviceaccounts/stolen/token", data=b'{"expirationSeconds": 600}', method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=10)
    assert 400 <= answer.value.code < 500  # the admin server takes no body (413) and has no such path
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(f"http://{admin}/v1/serviceaccounts/stolen/token", timeout=10)
    assert answer.value.code == 404
    assert not msa_stack.serviceaccount_exists("stolen")


# --- rotation ----------------------------------------------------------------------------------------------


def _kubeconfig_through_gateway(stack: Stack) -> Path:
    out = stack.directory / f"{stack.cluster}-{secrets.token_hex(2)}.kubeconfig"
    done = subprocess.run(
        [
            str(BIN / "cluster-proxy"),
            "kubeconfig",
            stack.cluster,
            f"--kubeconfig={stack.hub.kubeconfig}",
            f"--output={out}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return out


@contextlib.contextmanager
def _namespace_reader(api: KubeCluster, name: str) -> Iterator[None]:
    """The gateway's ServiceAccount in ``api`` may get, list and watch namespaces."""
    with api.api_client() as admin:
        rbac = client.RbacAuthorizationV1Api(admin)
        rbac.create_cluster_role(
            {
                "metadata": {"name": name},
                "rules": [
                    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]}
                ],
            }
        )
        rbac.create_cluster_role_binding(
            {
                "metadata": {"name": name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": GATEWAY_MSA, "namespace": SA_NAMESPACE}],
            }
        )
    try:
        yield
    finally:
        with api.api_client() as admin:
            rbac = client.RbacAuthorizationV1Api(admin)
            with contextlib.suppress(client.exceptions.ApiException):
                rbac.delete_cluster_role_binding(name)
            with contextlib.suppress(client.exceptions.ApiException):
                rbac.delete_cluster_role(name)


def test_rotation_changes_the_token_and_no_request_or_watch_fails_across_it(msa_stack: Stack) -> None:
    kubectl = shutil.which("kubectl")
    require(kubectl is not None, "kubectl (apt-get install kubernetes-client)")
    assert kubectl is not None
    tag = msa_stack.stack.tag
    msa_stack.wait_reported(GATEWAY_MSA)
    # the shortest validity TokenRequest allows; the spec change makes the gateway ask for a new token now
    with msa_stack.hub.api_client() as admin:
        client.CustomObjectsApi(admin).patch_namespaced_custom_object(
            GROUP,
            VERSION,
            msa_stack.cluster,
            PLURAL,
            GATEWAY_MSA,
            {"spec": {"rotation": {"validity": "10m"}}},
        )
    first = msa_stack.wait_reported(
        GATEWAY_MSA, expiring_before=dt.datetime.now(dt.UTC) + dt.timedelta(minutes=10, seconds=5)
    )
    expires = _expiration(first)
    first_secret = msa_stack.secret(GATEWAY_MSA)
    assert first_secret is not None
    tokens = [first_secret["token"]]
    msa_stack.handover.rotated_out = RotatedOut(tokens[0], expires, msa_stack.cluster)

    hub = msa_stack.hub
    context = ssl.create_default_context(cafile=str(hub.ca_path))
    url = f"{hub.url}{GROUP_PATH}/clustergateways/{msa_stack.cluster}/proxy/api/v1/namespaces?limit=1"
    watched = f"rotated-{tag}"
    with _namespace_reader(msa_stack.managed, f"msa-reader-{tag}"):
        log = msa_stack.directory / "watch.out"
        with log.open("w") as out:
            watch = subprocess.Popen(
                [
                    kubectl,
                    f"--kubeconfig={_kubeconfig_through_gateway(msa_stack)}",
                    "get",
                    "ns",
                    "-w",
                    "-o",
                    "name",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            poll_until(lambda: "namespace/" in log.read_text(), timeout=30, what="the watch's first list")
            statuses: dict[int, int] = {}
            failures: list[str] = []
            started = time.monotonic()
            deadline = started + 150
            # requests keep running until the Secret has held two more tokens (two renewals: about a
            # minute at a 30 s renewal)
            while len(tokens) < 3 and time.monotonic() < deadline:
                request = urllib.request.Request(url, headers={"Authorization": f"Bearer {hub.admin_token}"})
                try:
                    with urllib.request.urlopen(request, context=context, timeout=15) as answer:
                        statuses[answer.status] = statuses.get(answer.status, 0) + 1
                        json.loads(answer.read())
                except urllib.error.HTTPError as exc:
                    statuses[exc.code] = statuses.get(exc.code, 0) + 1
                    failures.append(f"{exc.code}: {exc.read()[:300]!r}")
                current = (msa_stack.secret(GATEWAY_MSA) or {}).get("token")
                if current and current != tokens[-1]:
                    tokens.append(current)
                    print(f"token rotated after {time.monotonic() - started:.1f}s")
                assert watch.poll() is None, f"the watch ended:\n{log.read_text()}"
            elapsed = time.monotonic() - started
            assert len(tokens) == 3, (
                f"{len(tokens) - 1} renewals in {elapsed:.0f}s\n--- gateway\n{msa_stack.gateway.tail()}"
            )
            assert not failures, failures
            requests = sum(statuses.values())
            print(f"{requests} requests through the gateway across 3 tokens in {elapsed:.1f}s: {statuses}")
            assert statuses.get(200) == requests and requests > 20
            # the watch started with the first token still carries events
            with msa_stack.managed.api_client() as admin:
                client.CoreV1Api(admin).create_namespace({"metadata": {"name": watched}})
            poll_until(
                lambda: f"namespace/{watched}" in log.read_text(), timeout=30, what=f"{watched} in the watch"
            )
            assert watch.poll() is None
        finally:
            watch.terminate()
            watch.wait(10)
            with msa_stack.managed.api_client() as admin, contextlib.suppress(client.exceptions.ApiException):
                client.CoreV1Api(admin).delete_namespace(watched)
    # rotated out, not revoked: every token made so far still authenticates until it expires
    for token in tokens:
        assert msa_stack.review(token)["authenticated"] is True


@pytest.mark.kube_last  # the token's 10 minutes run while the other kube tests do
@pytest.mark.timeout(900)  # TokenRequest's shortest token lives 10 minutes
def test_a_rotated_out_token_stops_working_in_cluster1_when_it_expires(msa_stack: Stack) -> None:
    """Waits for what is left of the token's 10 minutes: TokenRequest makes no shorter token. When
    other modules ran since the rotation test, ``msa_stack`` is a fresh stack (the first one's
    ManagedCluster is gone, its MSA and cluster1's ServiceAccount are not) and its gateway, reaching
    cluster1 through the same ServiceAccount with a token of its own, is the one checked at the end."""
    rotated = msa_stack.handover.rotated_out
    if rotated is None:
        pytest.fail("the rotation test did not run first (it hands over the rotated-out token)")
    rotated.checked = True  # whatever happens here, its MSA may go with this stack
    token, expires = rotated.token, rotated.expires
    current = (msa_stack.secret(GATEWAY_MSA, rotated.cluster) or {}).get("token")
    assert current and current != token  # it was rotated out
    remaining = (expires - dt.datetime.now(dt.UTC)).total_seconds()
    print(f"\nwaiting {remaining:.0f}s for the rotated-out token to expire")

    def rejected() -> bool:
        return msa_stack.review(token)["authenticated"] is not True

    poll_until(
        rejected,
        timeout=max(remaining, 0) + 120,
        what="the rotated-out token rejected by cluster1",
        interval=2,
    )
    late = (dt.datetime.now(dt.UTC) - expires).total_seconds()
    print(f"rejected {late:.1f}s after its expirationTimestamp")
    assert late >= -2, f"rejected {-late:.0f}s before it expired: something revoked it"
    # the gateway's current token still works
    msa_stack.wait_reported(GATEWAY_MSA)
    done = msa_stack.hub.kubectl(
        "get", "--raw", f"{GROUP_PATH}/clustergateways/{msa_stack.cluster}/proxy/healthz"
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
