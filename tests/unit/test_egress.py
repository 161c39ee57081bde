"""Egress policy: rule parsing, evaluation (deny first, resolved addresses too) and target parsing."""

from __future__ import annotations

import ipaddress
import re

import pytest
from hypothesis import assume, given, strategies as st

from clusterproxy_agent.egress import (
    EgressPolicy,
    EgressRuleError,
    Target,
    TargetError,
    parse_ports,
    parse_rule,
    parse_target,
)
from clusterproxy_protocol.config import InvalidValue

ip = ipaddress.ip_address


def target(text: str) -> Target:
    return parse_target(text)


# --- rule parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "network", "pattern", "ports"),
    [
        ("10.0.0.0/8", "10.0.0.0/8", None, None),
        ("10.1.2.3", "10.1.2.3/32", None, None),
        ("::1/128", "::1/128", None, None),
        ("::1", "::1/128", None, None),
        ("fd00::/8", "fd00::/8", None, None),
        ("[fd00::/8]:443", "fd00::/8", None, ((443, 443),)),
        ("[::1]:80,443", "::1/128", None, ((80, 80), (443, 443))),
        ("10.0.0.0/8:8000-9000", "10.0.0.0/8", None, ((8000, 9000),)),
        ("*.svc", None, "*.svc", None),
        ("*.SVC.Cluster.Local", None, "*.svc.cluster.local", None),
        ("kubernetes.default.svc:443", None, "kubernetes.default.svc", ((443, 443),)),
        ("*.svc:80,443,8000-9000", None, "*.svc", ((80, 80), (443, 443), (8000, 9000))),
        ("metadata", None, "metadata", None),
        ("*", None, "*", None),
    ],
)
def test_rules_parse(text: str, network: str | None, pattern: str | None, ports) -> None:
    rule = parse_rule(text)
    assert rule.text == text
    assert rule.network == (ipaddress.ip_network(network) if network else None)
    assert rule.pattern == pattern
    assert rule.ports == ports


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("", "empty"),
        ("10.0.0.0/33", "not a valid CIDR"),
        ("10.0.0.1/8", "host bits set (did you mean 10.0.0.0/8?)"),
        ("300.1.1.1", "not a valid CIDR"),
        ("*.svc:0", "bad port list"),
        ("*.svc:65536", "bad port list"),
        ("*.svc:http", "bad port list"),
        ("*.svc:9000-8000", "first port is larger"),
        ("*.svc:", "nothing after ':'"),
        (":443", "missing host"),
        ("[fd00::/8", "missing ']'"),
        ("[fd00::/8]443", "expected ':PORTS'"),
        ("[10.0.0.0/8]:443", "brackets are for IPv6"),
        ("foo bar", "spaces"),
        ("a..b", "neither a CIDR nor a host pattern"),
        ("host/path", "neither a CIDR nor a host pattern"),
        ("10.0.*.*", "use a CIDR"),
        ("x" * 254, "longer than 253"),
    ],
)
def test_bad_rules_name_the_rule(text: str, complaint: str) -> None:
    with pytest.raises(EgressRuleError) as info:
        parse_rule(text)
    assert repr(text) in str(info.value)
    assert complaint in str(info.value)
    # usable directly as an argparse converter and caught as ValueError
    assert isinstance(info.value, InvalidValue)
    assert isinstance(info.value, ValueError)


def test_port_lists_merge_and_sort() -> None:
    assert parse_ports("443,80,81-90,85,91") == ((80, 91), (443, 443))


@given(st.lists(st.tuples(st.integers(1, 65535), st.integers(0, 300)), min_size=1, max_size=6))
def test_port_list_matches_exactly_its_ports(parts: list[tuple[int, int]]) -> None:
    ranges = [(lo, min(65535, lo + width)) for lo, width in parts]
    text = ",".join(f"{lo}-{hi}" if hi != lo else str(lo) for lo, hi in ranges)
    rule = parse_rule(f"*.svc:{text}")
    wanted = {p for lo, hi in ranges for p in range(lo, hi + 1)}
    probes = {p for lo, hi in ranges for p in (lo - 1, lo, hi, hi + 1)} | {1, 65535}
    for port in probes:
        if 1 <= port <= 65535:
            assert rule.matches_port(port) == (port in wanted), port


# --- matching ----------------------------------------------------------------------------------------


@given(st.ip_addresses(v=4), st.integers(0, 32), st.ip_addresses(v=4))
def test_ipv4_cidr_matches_like_ipaddress(base, prefix: int, probe) -> None:
    network = ipaddress.ip_network(f"{base}/{prefix}", strict=False)
    rule = parse_rule(str(network))
    assert rule.matches_address(probe) == (probe in network)
    # The same IPv4 address, IPv4-mapped into IPv6, matches the same way.
    assert rule.matches_address(ip(f"::ffff:{probe}")) == (probe in network)


@given(st.ip_addresses(v=6), st.integers(0, 128), st.ip_addresses(v=6))
def test_ipv6_cidr_matches_like_ipaddress(base, prefix: int, probe) -> None:
    network = ipaddress.ip_network(f"{base}/{prefix}", strict=False)
    assume(probe.ipv4_mapped is None)
    rule = parse_rule(f"[{network}]:1-65535")
    assert rule.matches_address(probe) == (probe in network)


_label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
_word = st.from_regex(r"[a-z]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)


@given(st.lists(_label, min_size=1, max_size=5), st.lists(_word, min_size=1, max_size=3))
def test_star_prefix_matches_any_name_with_that_suffix(prefix: list[str], suffix: list[str]) -> None:
    rule = parse_rule("*." + ".".join(suffix))
    name = ".".join(prefix + suffix)
    assert rule.matches_name(name)
    assert rule.matches_name(name.upper() + ".")  # case and the FQDN dot do not matter
    assert not rule.matches_name(".".join(suffix))  # "*." needs at least something before the dot
    assert not rule.matches_name(name + "x")


@given(st.text(alphabet="ab.*", min_size=1, max_size=8), st.text(alphabet="ab.", min_size=1, max_size=10))
def test_glob_agrees_with_a_reference_matcher(pattern: str, name: str) -> None:
    assume(".." not in pattern and not pattern.startswith(".") and pattern.strip("*."))
    assume(".." not in name and not name.startswith(".") and not name.endswith("."))
    try:
        rule = parse_rule(pattern)
    except EgressRuleError:
        return
    reference = re.fullmatch(".*".join(map(re.escape, pattern.rstrip(".").split("*"))), name)
    assert rule.matches_name(name) == (reference is not None)


def test_host_patterns_never_match_addresses_and_cidrs_never_match_names() -> None:
    assert not parse_rule("*").matches_address(ip("10.0.0.1"))
    assert not parse_rule("0.0.0.0/0").matches_name("example.com")


# --- policy ------------------------------------------------------------------------------------------


DEFAULT = EgressPolicy.build()


@pytest.mark.parametrize(
    ("text", "addresses", "rule"),
    [
        ("169.254.169.254:80", [], "built-in rule link-local 169.254.0.0/16"),
        ("169.254.1.1:443", [], "built-in rule link-local 169.254.0.0/16"),
        ("[fe80::1]:80", [], "built-in rule link-local fe80::/10"),
        ("[fd00:ec2::254]:80", [], "built-in rule cloud metadata fd00:ec2::254"),
        ("100.100.100.200:80", [], "built-in rule cloud metadata 100.100.100.200"),
        ("metadata.google.internal:80", [], "built-in rule cloud metadata metadata.google.internal"),
        ("METADATA.google.internal.:80", [], "built-in rule cloud metadata metadata.google.internal"),
        ("metadata:80", [], "built-in rule cloud metadata metadata"),
        ("[::ffff:169.254.169.254]:80", [], "built-in rule link-local 169.254.0.0/16"),
        ("[64:ff9b::a9fe:a9fe]:80", [], "built-in rule link-local 169.254.0.0/16"),
        # DNS rebinding: an allowed name resolving to a metadata address.
        ("evil.ns.svc:80", ["10.0.0.1", "169.254.169.254"], "built-in rule link-local 169.254.0.0/16"),
        ("evil.ns.svc:80", ["100.100.100.200"], "built-in rule cloud metadata 100.100.100.200"),
    ],
)
def test_builtin_denies(text: str, addresses: list[str], rule: str) -> None:
    everything = EgressPolicy.build(["0.0.0.0/0", "::/0", "*"])
    decision = everything.evaluate(target(text), [ip(a) for a in addresses])
    assert not decision.allowed
    assert rule in decision.reason
    assert decision.reason.startswith(f"target {target(text)}")
    if addresses:
        assert "resolves to" in decision.reason


def test_reason_format_matches_the_design() -> None:
    decision = DEFAULT.evaluate(target("169.254.169.254:80"))
    assert decision.reason == "target 169.254.169.254:80 denied by built-in rule link-local 169.254.0.0/16"


def test_no_default_deny_turns_builtins_off() -> None:
    policy = EgressPolicy.build(["169.254.0.0/16"], default_deny=False)
    assert policy.evaluate(target("169.254.169.254:80")).allowed


def test_default_allow() -> None:
    assert DEFAULT.evaluate(target("kubernetes.default.svc:443"), [ip("10.96.0.1")]).allowed
    assert DEFAULT.evaluate(target("kubernetes.default.svc.cluster.local:443"), [ip("10.96.0.1")]).allowed
    assert DEFAULT.evaluate(target("web.shop.svc:8080"), [ip("10.1.2.3")]).allowed
    assert DEFAULT.evaluate(target("web.shop.svc.cluster.local:8080"), [ip("10.1.2.3")]).allowed
    denied = DEFAULT.evaluate(target("example.com:443"), [ip("93.184.216.34")])
    assert not denied.allowed
    assert "not allowed by any allow rule" in denied.reason
    assert "*.svc" in denied.reason


def test_default_allow_follows_the_configured_apiserver() -> None:
    policy = EgressPolicy.build(kube_apiserver=("10.0.0.1", 6443))
    assert policy.evaluate(target("10.0.0.1:6443")).allowed
    assert not policy.evaluate(target("10.0.0.1:443")).allowed
    v6 = EgressPolicy.build(kube_apiserver=("fd00::1", 6443))
    assert v6.evaluate(target("[fd00::1]:6443")).allowed


def test_explicit_allow_replaces_the_default() -> None:
    policy = EgressPolicy.build(["10.0.0.0/8:443"])
    assert not policy.evaluate(target("web.shop.svc:443"), [ip("192.168.0.1")]).allowed
    assert policy.evaluate(target("web.shop.svc:443"), [ip("10.1.1.1")]).allowed
    assert not policy.evaluate(target("10.1.1.1:80")).allowed


def test_cidr_allow_dials_only_the_allowed_addresses() -> None:
    policy = EgressPolicy.build(["10.0.0.0/8"])
    decision = policy.evaluate(target("mixed.example:80"), [ip("192.0.2.1"), ip("10.0.0.7")])
    assert decision.allowed
    assert decision.addresses == (ip("10.0.0.7"),)


def test_name_allow_dials_every_resolved_address() -> None:
    decision = DEFAULT.evaluate(target("a.b.svc:80"), [ip("10.0.0.1"), ip("fd00::1")])
    assert decision.addresses == (ip("10.0.0.1"), ip("fd00::1"))


def test_user_deny_beats_allow_and_is_named() -> None:
    policy = EgressPolicy.build(["*.svc", "10.0.0.0/8"], ["secret.*.svc", "10.9.0.0/16:5432"])
    decision = policy.evaluate(target("secret.db.svc:5432"), [ip("10.1.1.1")])
    assert not decision.allowed
    assert "--deny secret.*.svc" in decision.reason
    decision = policy.evaluate(target("pg.db.svc:5432"), [ip("10.9.1.1")])
    assert "--deny 10.9.0.0/16:5432" in decision.reason
    assert policy.evaluate(target("pg.db.svc:5433"), [ip("10.9.1.1")]).allowed


def test_precheck_refuses_before_resolving() -> None:
    assert DEFAULT.precheck(target("metadata.google.internal:80")) is not None
    assert DEFAULT.precheck(target("example.com:443")) is not None  # no allow rule could ever match
    assert DEFAULT.precheck(target("web.svc:80")) is None
    assert EgressPolicy.build(["10.0.0.0/8"]).precheck(target("example.com:443")) is None  # DNS decides


@given(st.integers(0, 0xFFFF))
def test_link_local_is_denied_whatever_the_allow_rules(low: int) -> None:
    address = ipaddress.IPv4Address(0xA9FE0000 + low)  # 169.254.0.0/16
    everything = EgressPolicy.build(["0.0.0.0/0", "::/0", "*"])
    assert not everything.evaluate(target(f"{address}:80")).allowed
    assert not everything.evaluate(target("x.svc:80"), [address]).allowed
    assert not everything.evaluate(target("x.svc:80"), [ip(f"::ffff:{address}")]).allowed


# --- targets -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "host", "port", "shown"),
    [
        ("kubernetes.default.svc:443", "kubernetes.default.svc", 443, "kubernetes.default.svc:443"),
        ("Web.Shop.SVC.:80", "web.shop.svc", 80, "web.shop.svc:80"),
        ("10.0.0.1:8080", "10.0.0.1", 8080, "10.0.0.1:8080"),
        ("[::1]:443", "::1", 443, "[::1]:443"),
        ("[FD00:0::1]:1", "fd00::1", 1, "[fd00::1]:1"),
        ("cluster1:443", "cluster1", 443, "cluster1:443"),
        ("_srv.example:65535", "_srv.example", 65535, "_srv.example:65535"),
    ],
)
def test_targets_parse(text: str, host: str, port: int, shown: str) -> None:
    t = parse_target(text)
    assert (t.host, t.port, str(t)) == (host, port, shown)


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("", "empty target"),
        ("host", "expected HOST:PORT"),
        (":443", "expected HOST:PORT"),
        ("host:", "port ''"),
        ("host:0", "port '0'"),
        ("host:65536", "port '65536'"),
        ("host:+80", "port '+80'"),
        ("::1:443", "brackets"),
        ("[::1]443", "expected [IPv6]:PORT"),
        ("[nothex]:443", "not an IPv6 address"),
        ("[fe80::1%eth0]:443", "zone ids"),
        ("a b:80", "not a valid host name"),
        ("user@host:80", "not a valid host name"),
        ("-bad-.com:80", "not a valid host name"),
        ("a..b:80", "not a valid host name"),
        ("x" * 64 + ".com:80", "not a valid host name"),
    ],
)
def test_bad_targets(text: str, complaint: str) -> None:
    with pytest.raises(TargetError) as info:
        parse_target(text)
    assert complaint in str(info.value)


@given(st.text(max_size=80))
def test_target_parsing_never_crashes(text: str) -> None:
    try:
        t = parse_target(text)
    except TargetError as exc:
        assert str(exc)
        return
    assert 1 <= t.port <= 65535
    assert parse_target(str(t)) == t  # the canonical form parses back to itself
