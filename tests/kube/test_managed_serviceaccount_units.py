"""The managed service accounts' pure parts (fast): durations and renewal times, the proxy-server's
control allow-list, the agent's refusal of a stream the proxy-server did not mark, and the RBAC the
addon's ManifestWork grants the agent."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
import trio

from clusterproxy_addon_manager import reconcile_cluster, render, render_agent, render_serviceaccounts
from clusterproxy_addon_manager.config import Endpoints, ProxySettings, parse_mpc
from clusterproxy_agent.control import ControlEndpoint, is_control_target
from clusterproxy_gateway.serviceaccounts import (
    FINALIZER as GATEWAY_FINALIZER,
    ManagedServiceAccounts,
    parse_go_duration,
    renewal_due,
)
from clusterproxy_protocol.agent_control import CONTROL_AUTHORITY, CONTROL_CLIENT_HEADER
from clusterproxy_protocol.errors import Forbidden, NoAgentConnected
from clusterproxy_server.authz import ClientIdentity
from clusterproxy_server.control import ControlAccess


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10m", 600.0), ("8640h0m0s", 8640 * 3600.0), ("1h30m", 5400.0), ("90s", 90.0), ("1.5h", 5400.0)],
)
def test_go_durations(text: str, seconds: float) -> None:
    assert parse_go_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "10", "ten minutes", "10m junk", "-5m"])
def test_bad_durations_say_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration like 10m"):
        parse_go_duration(text)


def _msa(
    *, generation: int = 1, observed: int = 1, enabled: bool = True, reported: str = "True"
) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "spec": {"rotation": {"enabled": enabled, "validity": "10m"}},
        "status": {
            "tokenSecretRef": {"name": "x", "lastRefreshTimestamp": "2026-11-24T04:00:00Z"},
            "expirationTimestamp": "2026-11-24T04:10:00Z",
            "conditions": [{"type": "TokenReported", "status": reported, "observedGeneration": observed}],
        },
    }


def test_renewal_is_at_the_fraction_of_the_tokens_life() -> None:
    assert renewal_due(_msa(), 0.8) == dt.datetime(2026, 11, 24, 4, 8, tzinfo=dt.UTC)
    assert renewal_due(_msa(), 0.05) == dt.datetime(2026, 11, 24, 4, 0, 30, tzinfo=dt.UTC)


def test_a_token_is_due_now_when_missing_failed_or_for_an_older_spec() -> None:
    epoch = dt.datetime.fromtimestamp(0, dt.UTC)
    assert renewal_due({"metadata": {"generation": 1}}, 0.8) == epoch
    assert renewal_due(_msa(reported="False"), 0.8) == epoch
    assert renewal_due(_msa(generation=2, observed=1), 0.8) == epoch


def test_a_token_without_rotation_is_never_renewed() -> None:
    assert renewal_due(_msa(enabled=False), 0.8) is None


def _client(common_name: str) -> ClientIdentity:
    return ClientIdentity({"common_name": common_name, "subject": f"CN={common_name}"}, frozenset())


def test_only_clients_of_the_allow_list_reach_the_control_target() -> None:
    access = ControlAccess(("cluster-gateway",))
    assert access.headers_for(_client("cluster-gateway"), CONTROL_AUTHORITY, "c1") == [
        (CONTROL_CLIENT_HEADER, "cluster-gateway")
    ]
    with pytest.raises(Forbidden, match="only the hub clients named by the proxy-server's --control-client"):
        access.headers_for(_client("alice"), CONTROL_AUTHORITY, "c1")
    with pytest.raises(Forbidden, match=r"\(none\)"):
        ControlAccess(()).headers_for(_client("cluster-gateway"), CONTROL_AUTHORITY, "c1")
    # any port and a trailing dot are the same reserved host; other targets are nobody's business here
    with pytest.raises(Forbidden):
        access.headers_for(_client("alice"), "AGENT-CONTROL.cluster-proxy.invalid.:443", "c1")
    assert access.headers_for(_client("alice"), "c1:443", "c1") == []
    assert access.headers_for(_client("alice"), "kubernetes.default.svc:443", "c1") == []


class _Request:
    """What the agent's handler reads of a tunnel stream's request, and the refusal it writes."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers
        self.refused: tuple[int, str] | None = None
        self.accepted = False

    async def refuse(self, status: int, reason: str) -> None:
        self.refused = (status, reason)

    async def accept(self) -> Any:
        self.accepted = True
        raise AssertionError("an unmarked stream must not be accepted")


def test_the_agent_refuses_a_control_stream_the_proxy_server_did_not_mark() -> None:
    assert is_control_target(CONTROL_AUTHORITY) and is_control_target("agent-control.cluster-proxy.invalid:1")
    assert not is_control_target("kubernetes.default.svc:443")
    endpoint = ControlEndpoint("c1", ("kubernetes.default.svc", 443), None)
    request = _Request({"cluster-proxy-cluster": "c1"})
    trio.run(endpoint.handle, request)  # type: ignore[arg-type]
    assert request.refused is not None and request.refused[0] == 403
    assert "only streams the proxy-server authorized" in request.refused[1]
    assert not request.accepted


def test_the_agent_gets_exactly_its_serviceaccount_rights_in_one_namespace() -> None:
    namespace, role, binding = render_serviceaccounts.serviceaccount_manifests("agents")
    assert namespace["metadata"]["name"] == render.SERVICEACCOUNT_NAMESPACE
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == render.SERVICEACCOUNT_NAMESPACE
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["get", "create", "delete"]},
        {"apiGroups": [""], "resources": ["serviceaccounts/token"], "verbs": ["create"]},
    ]
    assert (
        binding["kind"] == "RoleBinding"
        and binding["metadata"]["namespace"] == render.SERVICEACCOUNT_NAMESPACE
    )
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "cluster-proxy", "namespace": "agents"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


def test_the_gateways_own_msa_is_owned_by_the_addon() -> None:
    msa = render_serviceaccounts.gateway_managed_serviceaccount("c1", "uid-1")
    assert msa["apiVersion"] == "authentication.open-cluster-management.io/v1beta1"
    assert (msa["metadata"]["name"], msa["metadata"]["namespace"]) == ("cluster-gateway", "c1")
    assert msa["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert msa["spec"] == {"rotation": {"enabled": True}}


def test_the_serviceaccount_namespace_outlives_the_addons_work() -> None:
    """Its ServiceAccounts belong to the hub's MSAs: the work agent leaves the namespace in place when the
    work goes (OCM's SelectivelyOrphan) and deletes the agent's Role and RoleBinding with the rest."""
    cfg = parse_mpc(
        {
            "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
            "kind": "ManagedProxyConfiguration",
            "metadata": {"name": "cluster-proxy", "uid": "u"},
            "spec": {"proxyServer": {"entrypoint": {"type": "Hostname", "hostname": {"value": "hub"}}}},
        },
        default_namespace="ns",
    )
    inputs = render_agent.AgentInputs(
        cfg=cfg,
        cluster="c1",
        namespace="agents",
        endpoints=Endpoints("hub", 8091, "hub", 8443),
        ca_bundle_pem="",
        token="t",
        proxy=ProxySettings(),
        addon_uid="a",
    )
    option = render_agent.agent_manifest_work(inputs)["spec"]["deleteOption"]
    assert option == {
        "propagationPolicy": "SelectivelyOrphan",
        "selectivelyOrphans": {
            "orphaningRules": [
                {"group": "", "resource": "namespaces", "name": render.SERVICEACCOUNT_NAMESPACE}
            ]
        },
    }


def test_the_service_proxy_gets_reviews_and_impersonation_only() -> None:
    """The service proxy's ServiceAccount (the gateway's HTTPS endpoint, docs/cluster-gateway.md): create
    TokenReviews and SubjectAccessReviews, impersonate users, groups and ServiceAccounts; no read, no
    write, no uids or userextras. It rides in the agent's ManifestWork, beside the agent's own rights."""
    role, binding = render_serviceaccounts.service_proxy_rbac()
    assert role["kind"] == "ClusterRole" and role["metadata"]["name"] == render.SERVICE_PROXY_ROLE
    assert role["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
        {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["users", "groups", "serviceaccounts"], "verbs": ["impersonate"]},
    ]
    assert binding["kind"] == "ClusterRoleBinding" and binding["roleRef"]["name"] == render.SERVICE_PROXY_ROLE
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": "cluster-proxy-service-proxy",
            "namespace": render.SERVICEACCOUNT_NAMESPACE,
        }
    ]
    msa = render_serviceaccounts.gateway_managed_serviceaccount(
        "c1", "uid-1", render.SERVICE_PROXY_SERVICEACCOUNT
    )
    assert (msa["metadata"]["name"], msa["metadata"]["namespace"]) == ("cluster-proxy-service-proxy", "c1")
    assert render.GATEWAY_SERVICEACCOUNTS == ("cluster-gateway", "cluster-proxy-service-proxy")


# --- uninstall: nobody leaves an MSA held by the gateway's finalizer ----------------------------------


class _NoTunnel:
    async def connect(self, cluster: str, host: str, port: int) -> Any:
        raise NoAgentConnected("no agent of that cluster")


class _Hub(ManagedServiceAccounts):
    """The gateway's controller with the hub played in memory: ``gone`` is what
    :meth:`_agent_gone_for_good` answers."""

    def __init__(self, gone: str | None) -> None:
        super().__init__(api=None, tunnel=_NoTunnel())
        self.gone = gone
        self.patched: list[dict[str, Any]] = []
        self.secrets_deleted: list[str] = []

    def _agent_gone_for_good(self, cluster: str) -> str | None:
        return self.gone

    def _patch(self, namespace: str, name: str, body: Any) -> None:
        self.patched.append(body)

    def _delete_secret(self, namespace: str, name: str) -> None:
        self.secrets_deleted.append(name)


def _deleting_msa() -> dict[str, Any]:
    return {
        "metadata": {
            "name": "cluster-gateway",
            "namespace": "cluster1",
            "resourceVersion": "7",
            "deletionTimestamp": "2026-01-01T00:00:00Z",
            "finalizers": ["other/keep", GATEWAY_FINALIZER],
        }
    }


@pytest.mark.parametrize("reason", ["the addon is disabled on the cluster", "the managed cluster is gone"])
def test_the_gateway_lets_its_finalizer_go_when_no_agent_will_come_back(reason: str) -> None:
    hub = _Hub(gone=reason)
    trio.run(hub.reconcile, _deleting_msa())
    assert hub.patched == [{"metadata": {"finalizers": ["other/keep"], "resourceVersion": "7"}}]
    assert hub.secrets_deleted == ["cluster-gateway"]


def test_the_gateway_keeps_its_finalizer_while_the_agent_is_only_disconnected() -> None:
    hub = _Hub(gone=None)
    trio.run(hub.reconcile, _deleting_msa())
    assert hub.patched == [] and hub.secrets_deleted == []


class _ManagerKube:
    def __init__(self, finalizers: list[str], gateway: bool) -> None:
        self.msa = {"metadata": {"resourceVersion": "3", "finalizers": finalizers}}
        self.gateway = gateway
        self.patches: list[tuple[str, Any, str | None]] = []

    def delete(self, resource: Any, name: str, namespace: str | None = None) -> bool:
        return True

    def get_or_none(self, resource: Any, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        if resource is reconcile_cluster.GATEWAY_APISERVICE:
            return {"metadata": {"name": name}} if self.gateway else None
        return self.msa

    def request(self, method: str, resource: Any, **kwargs: Any) -> dict[str, Any]:
        self.patches.append((kwargs["name"], kwargs["body"], kwargs.get("content_type")))
        return {}


class _Log:
    def __init__(self) -> None:
        self.events: list[str] = []

    def info(self, event: str, **_: Any) -> None:
        self.events.append(event)

    warning = info


def _manager(kube: _ManagerKube) -> Any:
    return type("Ctl", (), {"kube": kube, "log": _Log()})()


def test_the_manager_takes_the_gateways_finalizer_off_when_no_gateway_is_installed() -> None:
    assert reconcile_cluster.GATEWAY_FINALIZER == GATEWAY_FINALIZER  # one finalizer, named twice
    kube = _ManagerKube([GATEWAY_FINALIZER], gateway=False)
    reconcile_cluster._delete_gateway_serviceaccounts(_manager(kube), "cluster1")
    assert [name for name, _, _ in kube.patches] == list(render.GATEWAY_SERVICEACCOUNTS)
    assert all(
        body == {"metadata": {"finalizers": [], "resourceVersion": "3"}}
        and kind == "application/merge-patch+json"
        for _, body, kind in kube.patches
    )


def test_the_manager_leaves_the_finalizer_to_an_installed_gateway() -> None:
    kube = _ManagerKube([GATEWAY_FINALIZER], gateway=True)
    reconcile_cluster._delete_gateway_serviceaccounts(_manager(kube), "cluster1")
    assert kube.patches == []
