"""Client policy: which hub clients (by certificate) may reach which clusters.

The policy is a JSON file (``--client-policy FILE``)::

    {
      "rules": [
        {"subject": "CN=alice", "clusters": ["cluster1"]},
        {"subject": "O=ops", "clusters": ["prod-*", "staging"]},
        {"san": "URI:spiffe://hub/ops", "clusters": ["*"]}
      ],
      "default": "deny"
    }

- A rule matches a client certificate when every attribute of its ``subject`` (RFC 4514, e.g.
  ``CN=alice,O=ops``) is in the certificate's subject (other attributes may be there too), and its
  ``san`` (``URI:...``, ``DNS:...``, ``IP:...``, ``email:...``) is one of the certificate's SANs. A rule
  names ``subject``, ``san`` or both (then both must match). Values and cluster names may use shell
  wildcards (``*``, ``?``, ``[...]``).
- A client matched by one or more rules may reach the union of their ``clusters``, and nothing else.
- A client matched by no rule gets ``default``: ``"deny"`` (the default) or ``"allow"`` (every cluster).

Without a policy every client with a valid certificate reaches every cluster. A refusal is a 403
whose reason names the client and the cluster. :class:`PolicyFile` re-reads the file when it changes
(checked at most once a second); a broken edit is logged and the last good policy stays in force.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from cryptography import x509

from clusterproxy_protocol import ConfigError, get_logger, peer_identity

__all__ = ["ClientIdentity", "ClientPolicy", "Decision", "PolicyFile", "Rule", "load_policy", "parse_policy"]

_SAN_TYPES = {"uri": "URI", "dns": "DNS", "ip": "IP", "email": "email"}
_RULE_KEYS = {"subject", "san", "clusters", "comment"}
_POLICY_KEYS = {"rules", "default", "comment"}


# --- the client ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientIdentity:
    """A client certificate as the policy sees it; ``peer`` is :func:`pki.peer_identity`'s summary."""

    peer: dict[str, Any]
    attributes: frozenset[tuple[str, str]]  # (OID dotted string, value) of every subject attribute

    @classmethod
    def from_cert(cls, cert: x509.Certificate) -> ClientIdentity:
        attributes = frozenset((a.oid.dotted_string, str(a.value)) for a in cert.subject)
        return cls(peer_identity(cert), attributes)

    @property
    def name(self) -> str:
        """The common name (what the logs call the client), else the subject."""
        return str(self.peer.get("common_name") or self.subject)

    @property
    def subject(self) -> str:
        return str(self.peer.get("subject") or "")

    @property
    def sans(self) -> list[str]:
        return [str(s) for s in self.peer.get("sans") or []]

    def describe(self) -> str:
        """How a refusal names the client: its subject, else its first SAN."""
        if self.subject:
            return self.subject
        return self.sans[0] if self.sans else "(a certificate without subject or SAN)"


# --- rules -----------------------------------------------------------------------------------------------


def _parse_subject(text: str, where: str) -> tuple[tuple[str, str], ...]:
    try:
        name = x509.Name.from_rfc4514_string(text)
    except ValueError as exc:
        raise ConfigError(
            f"{where}: invalid subject {text!r}: {exc} (expected e.g. CN=alice,O=ops)"
        ) from None
    attributes = tuple((a.oid.dotted_string, str(a.value)) for a in name)
    if not attributes:
        raise ConfigError(f"{where}: empty subject")
    return attributes


def _parse_san(text: str, where: str) -> tuple[str, str]:
    kind, sep, value = text.partition(":")
    canonical = _SAN_TYPES.get(kind.strip().lower())
    if not sep or canonical is None or not value:
        raise ConfigError(
            f"{where}: invalid san {text!r}: expected TYPE:VALUE with TYPE one of URI, DNS, IP, email "
            "(e.g. URI:spiffe://hub/ops)"
        )
    return canonical, value


@dataclass(frozen=True)
class Rule:
    subject: tuple[tuple[str, str], ...] = ()  # (OID, value pattern)
    san: tuple[str, str] | None = None  # (type, value pattern)
    clusters: tuple[str, ...] = ()
    text: str = ""  # the rule as written, for logs

    def matches(self, client: ClientIdentity) -> bool:
        for oid, pattern in self.subject:
            if not any(o == oid and fnmatchcase(v, pattern) for o, v in client.attributes):
                return False
        if self.san is not None:
            kind, pattern = self.san
            found = False
            for san in client.sans:
                k, _, v = san.partition(":")
                if k.lower() == kind.lower() and fnmatchcase(v, pattern):
                    found = True
                    break
            if not found:
                return False
        return True

    def allows(self, cluster: str) -> bool:
        return any(fnmatchcase(cluster, pattern) for pattern in self.clusters)


def _parse_rule(data: Any, where: str) -> Rule:
    if not isinstance(data, dict):
        raise ConfigError(
            f'{where}: a rule must be an object like {{"subject": "CN=alice", "clusters": [...]}}'
        )
    unknown = set(data) - _RULE_KEYS
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))} (a rule has subject, san, clusters)"
        )
    subject, san = data.get("subject"), data.get("san")
    if subject is None and san is None:
        raise ConfigError(f'{where}: a rule needs "subject" or "san" (or both)')
    for key, value in (("subject", subject), ("san", san)):
        if value is not None and not isinstance(value, str):
            raise ConfigError(f'{where}: "{key}" must be a string')
    clusters = data.get("clusters")
    if not isinstance(clusters, list) or not all(isinstance(c, str) and c.strip() for c in clusters):
        raise ConfigError(f'{where}: "clusters" must be a list of cluster names or patterns ("*" for all)')
    text = ", ".join(f"{k}={data[k]!r}" for k in ("subject", "san") if data.get(k) is not None)
    return Rule(
        subject=_parse_subject(subject, where) if subject is not None else (),
        san=_parse_san(san, where) if san is not None else None,
        clusters=tuple(c.strip().lower() for c in clusters),
        text=text,
    )


# --- the policy ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str  # why (for a refusal: the 403 reason)
    rules: tuple[str, ...] = ()  # the matching rules, as written


@dataclass(frozen=True)
class ClientPolicy:
    rules: tuple[Rule, ...] = ()
    default_allow: bool = False
    source: str = "client policy"

    def decide(self, client: ClientIdentity, cluster: str) -> Decision:
        who = client.describe()
        matched = [rule for rule in self.rules if rule.matches(client)]
        if not matched:
            if self.default_allow:
                return Decision(True, "no rule matches; the default is allow")
            return Decision(
                False,
                f"client {who!r} may not reach cluster {cluster!r}: no rule of the {self.source} "
                "matches this client and the default is deny",
            )
        texts = tuple(rule.text for rule in matched)
        if any(rule.allows(cluster) for rule in matched):
            return Decision(True, "allowed by a rule", texts)
        allowed = sorted({c for rule in matched for c in rule.clusters})
        return Decision(
            False,
            f"client {who!r} may not reach cluster {cluster!r}: the {self.source} allows it "
            f"{', '.join(allowed) or 'no cluster'} only",
            texts,
        )


def parse_policy(data: Any, source: str = "client policy") -> ClientPolicy:
    """A :class:`ClientPolicy` from decoded JSON; :class:`ConfigError` naming the problem."""
    if not isinstance(data, dict):
        raise ConfigError(f'{source}: expected a JSON object with "rules" and "default"')
    unknown = set(data) - _POLICY_KEYS
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(sorted(unknown))} (expected rules, default)")
    rules = data.get("rules", [])
    if not isinstance(rules, list):
        raise ConfigError(f'{source}: "rules" must be a list')
    default = data.get("default", "deny")
    if default not in ("allow", "deny"):
        raise ConfigError(f'{source}: "default" must be "allow" or "deny", not {default!r}')
    parsed = tuple(_parse_rule(rule, f"{source}: rule {i + 1}") for i, rule in enumerate(rules))
    return ClientPolicy(parsed, default_allow=default == "allow", source=source)


def load_policy(path: Path) -> ClientPolicy:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read client policy {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"client policy {path} is not valid JSON: {exc}") from None
    return parse_policy(data, f"client policy {path}")


def _signature(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)


@dataclass
class PolicyFile:
    """A policy file followed on change: :meth:`current` re-reads it (at most every ``interval``
    seconds) when its mtime, size or inode changed. The first load must succeed (:class:`ConfigError`);
    a later broken edit or a vanished file is logged and the last good policy stays."""

    path: Path
    interval: float = 1.0
    clock: Callable[[], float] = time.monotonic
    policy: ClientPolicy = field(init=False)
    reloads: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.log = get_logger("proxy-server", component="client-policy")
        self._signature = _signature(self.path)
        self.policy = load_policy(self.path)
        self._checked = self.clock()
        self._failed_signature: tuple[int, int, int, int] | None = None

    def current(self) -> ClientPolicy:
        now = self.clock()
        if now - self._checked >= self.interval:
            self._checked = now
            self._maybe_reload()
        return self.policy

    def _maybe_reload(self) -> None:
        signature = _signature(self.path)
        if signature == self._signature or signature == self._failed_signature:
            return
        if signature is None:
            self._failed_signature = None
            self.log.warning(
                "client_policy_missing", path=str(self.path), hint="keeping the last good policy"
            )
            self._signature = None
            return
        try:
            policy = load_policy(self.path)
        except ConfigError as exc:
            self._failed_signature = signature
            self.log.error(
                "client_policy_invalid",
                path=str(self.path),
                error=str(exc),
                hint="keeping the last good policy",
            )
            return
        self.policy, self._signature, self._failed_signature = policy, signature, None
        self.reloads += 1
        self.log.info(
            "client_policy_reloaded",
            path=str(self.path),
            rules=len(policy.rules),
            default="allow" if policy.default_allow else "deny",
        )

    def decide(self, client: ClientIdentity, cluster: str) -> Decision:
        return self.current().decide(client, cluster)
