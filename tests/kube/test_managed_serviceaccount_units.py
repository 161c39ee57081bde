"""The managed service accounts' pure parts (fast): durations and renewal times, the proxy-server's
control allow-list, the agent's refusal of a stream the proxy-server did not mark, and the RBAC the
addon's ManifestWork grants the agent."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
import trio

from clusterproxy_addon_manager import render, render_agent, render_serviceaccounts
from clusterproxy_addon_manager.config import Endpoints, ProxySettings, parse_mpc
from clusterproxy_agent.control import ControlEndpoint, is_control_target
from clusterproxy_gateway.serviceaccounts import parse_go_duration, renewal_due
from clusterproxy_protocol.agent_control import CONTROL_AUTHORITY, CONTROL_CLIENT_HEADER
from clusterproxy_protocol.errors import Forbidden
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
