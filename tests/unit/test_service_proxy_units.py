"""The hub HTTPS endpoint's pure parts (docs/cluster-gateway.md, "The HTTPS endpoint"): upstream's naming
of hub identities, the bounded review cache keyed by a token's digest, the allow-list's format and its
refusals, the service spec, and the addon-manager's --hub-server (the endpoint's server token)."""

from __future__ import annotations

import trio

from clusterproxy_addon_manager import main as manager_main
from clusterproxy_addon_manager.identity import server_binding
from clusterproxy_gateway.allowlist import AllowList, Entry, ServiceTarget, _Loaded, parse_entries
from clusterproxy_gateway.service_proxy import parse_service
from clusterproxy_gateway.tokenreview import (
    Caller,
    ReviewCache,
    Reviewed,
    TokenAuthenticator,
    hub_username,
    reviewed_from,
    token_digest,
)


def test_hub_serviceaccounts_get_upstreams_prefix_and_other_users_keep_their_name() -> None:
    assert hub_username("system:serviceaccount:apps:robot") == "cluster:hub:system:serviceaccount:apps:robot"
    assert hub_username("alice") == "alice"
    assert reviewed_from({"status": {"authenticated": False, "error": "invalid bearer token"}}) is None
    assert reviewed_from({"status": {"authenticated": True, "user": {"username": "a", "groups": ["g"]}}}) == (
        Reviewed("a", ("g",))
    )


def test_managed_first_then_hub_cached_by_digest_with_a_bound() -> None:
    calls: list[tuple[str, str]] = []
    now = [0.0]

    async def managed(cluster: str, token: str) -> Reviewed | None:
        calls.append(("managed", cluster))
        return Reviewed("system:serviceaccount:ns:own", ("system:authenticated",)) if token == "own" else None

    async def hub(token: str) -> Reviewed | None:
        calls.append(("hub", ""))
        return (
            Reviewed("system:serviceaccount:apps:robot", ("system:serviceaccounts",))
            if token == "hubby"
            else None
        )

    auth = TokenAuthenticator(managed, hub, ttl=10, max_entries=8, clock=lambda: now[0])

    async def main() -> None:
        assert await auth.authenticate("c1", "own") == Caller(
            "managed", "system:serviceaccount:ns:own", ("system:authenticated",)
        )
        robot = await auth.authenticate("c1", "hubby")
        assert robot == Caller(
            "hub",
            "cluster:hub:system:serviceaccount:apps:robot",
            ("system:serviceaccounts", "system:authenticated"),
            "system:serviceaccount:apps:robot",
        )
        assert await auth.authenticate("c1", "nobody") is None
        before = len(calls)
        assert await auth.authenticate("c1", "hubby") == robot  # both steps' answers cached
        assert len(calls) == before
        now[0] = 11  # past the TTL: asked again
        await auth.authenticate("c1", "hubby")
        assert len(calls) == before + 2

    trio.run(main)
    assert len(auth.cache) <= 8  # bounded
    assert all("hubby" not in key and "own" not in key for keys in auth.cache._entries for key in keys)
    assert token_digest("x") == token_digest("x") != token_digest("y")


def test_the_cache_drops_the_oldest_beyond_its_bound_and_keeps_nothing_at_ttl_zero() -> None:
    cache = ReviewCache(ttl=10, max_entries=2, clock=lambda: 0.0)
    for name in ("a", "b", "c"):
        cache.put(("hub", "", name), None)
    assert [key[2] for key in cache._entries] == ["b", "c"]
    off = ReviewCache(ttl=0, max_entries=2)
    off.put(("hub", "", "a"), None)
    assert len(off) == 0


def test_the_allow_list_format_and_what_a_fault_grants() -> None:
    entries = parse_entries(
        "k", "- {namespace: m, service: prom, port: '9090', protocol: https, clusters: [c1]}"
    )
    assert entries == [Entry("m", "prom", "9090", "https", ("c1",))]
    target = ServiceTarget("c1", "m", "prom", "9090", "https")
    assert entries[0].matches(target)
    assert not entries[0].matches(ServiceTarget("c2", "m", "prom", "9090", "https"))
    assert not entries[0].matches(ServiceTarget("c1", "m", "prom", "9091", "https"))
    for raw, fault in (
        ("- {service: x}", "namespace and service are required"),
        ("- {namespace: a, service: b, prot: http}", "unknown field(s) ['prot']"),
        ("{namespace: a}", "not a YAML list"),
        ("- {namespace: a, service: b, protocol: ftp}", "is not http or https"),
    ):
        try:
            parse_entries("k", raw)
        except ValueError as exc:
            assert fault in str(exc), exc
        else:
            raise AssertionError(f"{raw!r} was accepted")
    listed = AllowList(None, "ns/list")
    listed._loaded = (
        float("inf"),
        _Loaded((), ("key 'k', entry 0: namespace and service are required",), ""),
    )
    listed.ttl = float("inf")
    reason = listed.decide(target)
    assert reason is not None and "ConfigMap ns/list" in reason and "ignored: key 'k'" in reason
    assert "no allow-list is configured" in (AllowList(None, "").decide(target) or "")


def test_service_specs() -> None:
    assert parse_service("c", "ns", "http:echo:8080") == ServiceTarget("c", "ns", "echo", "8080", "http")
    assert parse_service("c", "ns", "echo") == ServiceTarget("c", "ns", "echo", "443", "https")
    assert parse_service("c", "ns", "http:echo") == ServiceTarget("c", "ns", "echo", "80", "http")
    assert "not a number" in str(parse_service("c", "ns", "echo:metrics"))
    assert "not [http:|https:]SERVICE[:PORT]" in str(parse_service("c", "ns", "a:b:c"))


def test_the_addon_manager_keeps_a_server_token_for_the_endpoint() -> None:
    server = manager_main._hub_server(
        "cluster-proxy-service-proxy=cluster-gateway-service-proxy-bootstrap=a.ns.svc,b.ns.svc"
    )
    assert (server.name, server.secret, server.namespace, server.hosts) == (
        "cluster-proxy-service-proxy",
        "cluster-gateway-service-proxy-bootstrap",
        "",
        ("a.ns.svc", "b.ns.svc"),
    )
    assert server.group == "hub-server cluster-proxy-service-proxy"
    assert server_binding(server.name, list(server.hosts)).hosts == ("a.ns.svc", "b.ns.svc")
    try:
        manager_main._hub_server("name=secret")
    except Exception as exc:
        assert "NAME=[NAMESPACE/]SECRET=HOST" in str(exc)
    else:
        raise AssertionError("a server without hosts was accepted")


def test_the_hub_overlays_render_the_endpoint_its_port_and_its_certificates_names() -> None:
    """The gateway's second port and Service port; the names of its serving certificate are exactly the
    ones the addon-manager's server token binds (a mismatch: the signer refuses the CSR); the gateway may
    read its credential Secrets, the allow-list and ask the hub's TokenReview."""
    from tests.support.kustomize import KUSTOMIZE, deployments, render

    gateway_objects = render(KUSTOMIZE / "overlays" / "hub-gateway")
    (gateway,) = deployments(gateway_objects)
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert "--service-proxy-listen=0.0.0.0:9444" in args
    hosts = [a.split("=", 1)[1] for a in args if a.startswith("--service-proxy-host=")]
    assert {"name": "service-proxy", "containerPort": 9444} in container["ports"]
    env = {e["name"]: e for e in container["env"]}
    assert env["CLUSTER_PROXY_GATEWAY_SERVICE_PROXY_BOOTSTRAP_TOKEN"]["valueFrom"]["secretKeyRef"][
        "name"
    ] == ("cluster-gateway-service-proxy-bootstrap")
    (service,) = [o for o in gateway_objects if o["kind"] == "Service"]
    assert {"name": "service-proxy", "port": 9444, "targetPort": "service-proxy"} in service["spec"]["ports"]
    (role,) = [
        o for o in gateway_objects if o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith("gateway")
    ]
    assert {
        "apiGroups": ["authentication.k8s.io"],
        "resources": ["tokenreviews"],
        "verbs": ["create"],
    } in role["rules"]
    assert any("cluster-proxy-service-proxy" in r.get("resourceNames", []) for r in role["rules"])
    manager = next(
        d
        for d in deployments(render(KUSTOMIZE / "overlays" / "hub"))
        if "addon-manager" in d["metadata"]["name"]
    )
    manager_args = manager["spec"]["template"]["spec"]["containers"][0]["args"]
    (hub_server,) = [a.split("=", 1)[1] for a in manager_args if a.startswith("--hub-server=")]
    parsed = manager_main._hub_server(hub_server)
    assert (
        parsed.name == "cluster-proxy-service-proxy"
        and parsed.secret == "cluster-gateway-service-proxy-bootstrap"
    )
    assert list(parsed.hosts) == hosts
