"""The proxy-server's client policy (authz.py): parsing, matching, decisions and reload on change."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cryptography.x509.oid import NameOID

from clusterproxy_protocol.config import ConfigError
from clusterproxy_protocol.pki import DevCA
from clusterproxy_server.authz import ClientIdentity, PolicyFile, load_policy, parse_policy

CN = NameOID.COMMON_NAME.dotted_string
O = NameOID.ORGANIZATION_NAME.dotted_string  # noqa: E741


def identity(cn: str | None = None, org: str | None = None, sans: list[str] | None = None) -> ClientIdentity:
    attributes = set()
    parts = []
    if org:
        attributes.add((O, org))
        parts.append(f"O={org}")
    if cn:
        attributes.add((CN, cn))
        parts.append(f"CN={cn}")
    peer = {"subject": ",".join(parts), "common_name": cn, "sans": sans or []}
    return ClientIdentity(peer, frozenset(attributes))


POLICY = {
    "rules": [
        {"subject": "CN=alice", "clusters": ["cluster1"]},
        {"subject": "O=ops", "clusters": ["prod-*", "staging"]},
        {"subject": "CN=team-*", "clusters": ["dev"]},
        {"san": "URI:spiffe://hub/ops", "clusters": ["*"]},
        {"subject": "CN=carol", "san": "DNS:carol.example", "clusters": ["cluster3"]},
    ],
    "default": "deny",
}


@pytest.mark.parametrize(
    ("who", "cluster", "allowed"),
    [
        (identity("alice"), "cluster1", True),
        (identity("alice"), "cluster2", False),
        # a rule's subject is a subset: CN=alice also matches a certificate with an O
        (identity("alice", org="dev"), "cluster1", True),
        (identity("bob", org="ops"), "prod-eu", True),
        (identity("bob", org="ops"), "staging", True),
        (identity("bob", org="ops"), "cluster1", False),
        # rules add up: alice in O=ops reaches both sets
        (identity("alice", org="ops"), "prod-us", True),
        (identity("alice", org="ops"), "cluster1", True),
        (identity("team-blue"), "dev", True),
        (identity("team-blue"), "prod-eu", False),
        (identity("robot", sans=["URI:spiffe://hub/ops"]), "anything", True),
        (identity("robot", sans=["URI:spiffe://hub/dev"]), "anything", False),
        # subject and san in one rule: both must match
        (identity("carol", sans=["DNS:carol.example"]), "cluster3", True),
        (identity("carol"), "cluster3", False),
        # no rule matches: the default
        (identity("mallory"), "cluster1", False),
    ],
)
def test_decisions(who: ClientIdentity, cluster: str, allowed: bool) -> None:
    assert parse_policy(POLICY).decide(who, cluster).allowed is allowed


def test_refusal_reason_names_the_client_and_the_cluster() -> None:
    policy = parse_policy(POLICY, "client policy /etc/policy.json")
    decision = policy.decide(identity("alice"), "cluster2")
    assert not decision.allowed
    assert "'CN=alice'" in decision.reason and "'cluster2'" in decision.reason
    assert "cluster1 only" in decision.reason
    nobody = policy.decide(identity("mallory"), "cluster1")
    assert "'CN=mallory'" in nobody.reason and "'cluster1'" in nobody.reason
    assert "no rule" in nobody.reason and "default is deny" in nobody.reason


def test_default_allow_lets_unmatched_clients_in_but_still_restricts_matched_ones() -> None:
    policy = parse_policy({"rules": [{"subject": "CN=alice", "clusters": ["cluster1"]}], "default": "allow"})
    assert policy.decide(identity("mallory"), "cluster2").allowed
    assert not policy.decide(identity("alice"), "cluster2").allowed


def test_default_is_deny_and_an_empty_policy_refuses_everyone() -> None:
    assert not parse_policy({"rules": []}).decide(identity("alice"), "cluster1").allowed
    assert not parse_policy({}).decide(identity("alice"), "cluster1").allowed


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ([], "JSON object"),
        ({"rules": {}}, '"rules" must be a list'),
        ({"rules": [], "default": "maybe"}, '"default" must be'),
        ({"rules": [], "extra": 1}, "unknown key(s) extra"),
        ({"rules": ["CN=alice"]}, "rule 1: a rule must be an object"),
        ({"rules": [{"clusters": ["a"]}]}, 'needs "subject" or "san"'),
        ({"rules": [{"subject": "CN=a"}]}, '"clusters" must be a list'),
        ({"rules": [{"subject": "CN=a", "clusters": "a"}]}, '"clusters" must be a list'),
        ({"rules": [{"subject": "CN=a", "clusters": [""]}]}, '"clusters" must be a list'),
        ({"rules": [{"subject": "NOPE=a", "clusters": ["a"]}]}, "invalid subject 'NOPE=a'"),
        ({"rules": [{"san": "spiffe://x", "clusters": ["a"]}]}, "invalid san"),
        ({"rules": [{"san": "FTP:x", "clusters": ["a"]}]}, "invalid san 'FTP:x'"),
        ({"rules": [{"subject": "CN=a", "cluster": ["a"]}]}, "unknown key(s) cluster"),
        ({"rules": [{"subject": 5, "clusters": ["a"]}]}, '"subject" must be a string'),
    ],
)
def test_bad_policies_are_refused_with_a_reason(data: object, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_policy(data)
    assert needle in str(info.value)


def test_load_policy_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read client policy"):
        load_policy(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"bad.json is not valid JSON"):
        load_policy(tmp_path / "bad.json")


def test_identity_from_a_real_certificate(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path / "ca")
    pair = ca.issue_client("alice", tmp_path, organization="ops")
    from cryptography import x509

    who = ClientIdentity.from_cert(x509.load_pem_x509_certificate(pair.cert.read_bytes()))
    assert who.name == "alice"
    assert who.describe() == "O=ops,CN=alice"
    policy = parse_policy({"rules": [{"subject": "CN=alice,O=ops", "clusters": ["c1"]}]})
    assert policy.decide(who, "c1").allowed


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _write(path: Path, data: object, mtime: int) -> None:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    os.utime(path, ns=(mtime * 10**9, mtime * 10**9))


def test_policy_file_follows_changes_and_keeps_the_last_good_policy(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    _write(path, {"rules": [{"subject": "CN=alice", "clusters": ["cluster1"]}]}, 1000)
    clock = Clock()
    follow = PolicyFile(path, interval=1.0, clock=clock)
    alice = identity("alice")
    assert not follow.decide(alice, "cluster2").allowed

    _write(path, {"rules": [{"subject": "CN=alice", "clusters": ["cluster1", "cluster2"]}]}, 1001)
    assert not follow.decide(alice, "cluster2").allowed  # checked at most once per interval
    clock.now += 1.5
    assert follow.decide(alice, "cluster2").allowed
    assert follow.reloads == 1

    _write(path, "{broken", 1002)  # a broken edit: the last good policy stays
    clock.now += 1.5
    assert follow.decide(alice, "cluster2").allowed
    assert follow.reloads == 1

    path.unlink()  # a vanished file too
    clock.now += 1.5
    assert follow.decide(alice, "cluster2").allowed

    _write(path, {"rules": [], "default": "deny"}, 1003)  # fixed: applies
    clock.now += 1.5
    assert not follow.decide(alice, "cluster1").allowed
    assert follow.reloads == 2


def test_policy_file_must_be_valid_at_start(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text('{"rules": [{"subject": "CN=a"}]}')
    with pytest.raises(ConfigError, match="clusters"):
        PolicyFile(path)
