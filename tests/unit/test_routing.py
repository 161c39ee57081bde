"""How the proxy-server reads the cluster and target from a CONNECT."""

from __future__ import annotations

import base64

import pytest
from hypothesis import example, given, strategies as st

from clusterproxy_protocol.errors import MalformedTarget
from clusterproxy_protocol.wire import MalformedAddress, parse_authority
from clusterproxy_server.routing import resolve

KNOWN = {"cluster1", "cluster2"}


def basic(user: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:".encode()).decode()


def test_header_names_the_cluster() -> None:
    route = resolve("10.0.0.5:80", {"cluster-proxy-cluster": "cluster2"}, KNOWN)
    assert (route.cluster, route.authority, route.named_by) == ("cluster2", "10.0.0.5:80", "header")


def test_proxy_user_names_the_cluster() -> None:
    route = resolve("web.default.svc:8080", {"proxy-authorization": basic("cluster1")}, KNOWN)
    assert (route.cluster, route.named_by) == ("cluster1", "proxy-user")


def test_header_wins_over_proxy_user() -> None:
    headers = {"cluster-proxy-cluster": "cluster2", "proxy-authorization": basic("cluster1")}
    assert resolve("a:1", headers, KNOWN).cluster == "cluster2"


def test_bare_cluster_name_reaches_its_apiserver() -> None:
    route = resolve("cluster1:443", {}, KNOWN)
    assert (route.cluster, route.authority, route.named_by) == (
        "cluster1",
        "cluster1:443",
        "bare-cluster-name",
    )


def test_unknown_cluster_is_still_routed_so_the_registry_can_answer_404() -> None:
    assert resolve("a:1", {"cluster-proxy-cluster": "nope"}, KNOWN).cluster == "nope"


@pytest.mark.parametrize(
    ("authority", "headers", "fragment"),
    [
        ("10.0.0.5:80", {}, "no cluster named"),
        ("10.0.0.5", {"cluster-proxy-cluster": "cluster1"}, "expected HOST:PORT"),
        ("10.0.0.5:0", {"cluster-proxy-cluster": "cluster1"}, "port must be 1-65535"),
        ("[::1:80", {"cluster-proxy-cluster": "cluster1"}, "expected [IPv6]:PORT"),
        ("a:1", {"cluster-proxy-cluster": "Bad_Name"}, "invalid cluster name"),
        ("a:1", {"proxy-authorization": "Basic %%%"}, "not valid base64"),
    ],
)
def test_bad_requests_say_why(authority: str, headers: dict[str, str], fragment: str) -> None:
    with pytest.raises(MalformedTarget) as info:
        resolve(authority, headers, KNOWN)
    assert info.value.status == 400
    assert fragment in info.value.reason


def test_ipv6_authority() -> None:
    assert parse_authority("[fd00::1]:6443") == ("fd00::1", 6443)


@given(st.text(max_size=40))
@example("0:¹")  # a digit to str.isdigit, not to int()
def test_parse_authority_never_crashes(text: str) -> None:
    try:
        host, port = parse_authority(text)
    except MalformedAddress as exc:
        assert str(exc)
    else:
        assert host and 0 < port < 65536
