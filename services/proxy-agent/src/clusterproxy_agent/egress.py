"""Egress policy of the agent: which targets the hub may reach through this cluster's tunnel.

Pure: parsing and evaluation only, no I/O. The caller resolves names and hands the addresses in.

Rule syntax (``--allow`` / ``--deny``)::

    10.0.0.0/8            CIDR (IPv4 or IPv6), any port
    10.1.2.3              a bare address (a /32 or /128)
    ::1/128  fd00::/8     IPv6 without ports needs no brackets
    *.svc                 host pattern: ``*`` matches any run of characters (dots included),
    kubernetes.default.svc    case-insensitive, on DNS names only (never on IP literals)
    *.svc:443             ... optionally followed by ``:PORTS``
    10.0.0.0/8:8000-9000  PORTS is a port, a range, or a comma-separated list of both: 80,443,8000-9000
    [fd00::/8]:443        IPv6 with ports goes in brackets

Evaluation (:meth:`EgressPolicy.evaluate`): deny rules first, matched against the requested host name
*and* every address it resolved to (an allowed-looking name that resolves to a metadata endpoint is
still denied: DNS rebinding). Then allow rules: a host rule matching the name allows every resolved
address; otherwise only the addresses inside an allowed CIDR may be dialled. Nothing allowed: denied.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from clusterproxy_protocol import (
    EXPECTED_HOSTPORT,
    InvalidValue,
    MalformedAddress,
    format_authority,
    port_number,
    split_hostport,
)

__all__ = [
    "BUILTIN_DENY",
    "Decision",
    "EgressPolicy",
    "EgressRuleError",
    "IPAddress",
    "Rule",
    "Target",
    "TargetError",
    "default_allow_rules",
    "normalize_name",
    "parse_ports",
    "parse_rule",
    "parse_target",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
PortRanges = tuple[tuple[int, int], ...]

MAX_NAME = 253
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_PATTERN_CHARS = re.compile(r"^[a-z0-9*._-]+$")
_IPISH_PATTERN = re.compile(r"^[0-9.*]*[0-9][0-9.*]*$")
_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")


class EgressRuleError(InvalidValue):
    """An egress rule that does not parse; the message names the rule."""


class TargetError(ValueError):
    """A CONNECT target (``:authority``) that is not ``host:port``."""


# --- names, addresses, ports ------------------------------------------------------------------------


def normalize_name(name: str) -> str:
    """Lower case, without the trailing dot of a fully qualified name."""
    name = name.strip().lower()
    return name[:-1] if name.endswith(".") else name


def _embedded_v4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address inside an IPv4-mapped (``::ffff:a.b.c.d``) or NAT64 (``64:ff9b::/96``) address."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def parse_ports(text: str) -> PortRanges:
    """``443``, ``8000-9000``, ``80,443,8000-9000`` -> sorted, merged ``((lo, hi), ...)``."""
    ranges: list[tuple[int, int]] = []
    for part in text.split(","):
        part = part.strip()
        lo_text, dash, hi_text = part.partition("-")
        try:
            lo = _port(lo_text)
            hi = _port(hi_text) if dash else lo
        except ValueError:
            raise ValueError(
                f"bad port list {text!r}: expected ports 1-65535 such as 443, 8000-9000 or 80,443"
            ) from None
        if lo > hi:
            raise ValueError(f"bad port range {part!r}: the first port is larger than the last")
        ranges.append((lo, hi))
    ranges.sort()
    merged: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def _port(text: str) -> int:
    text = text.strip()
    port = port_number(text)
    if port is None:
        raise ValueError(text)
    return port


def _format_ports(ports: PortRanges) -> str:
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ports)


# --- rules --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One allow or deny rule: a CIDR or a host pattern, and optionally ports."""

    text: str
    network: IPNetwork | None = None
    pattern: str | None = None
    ports: PortRanges | None = None
    label: str = ""
    _regex: re.Pattern[str] | None = field(default=None, repr=False, compare=False)

    @property
    def description(self) -> str:
        """How the rule is named in decisions: ``--deny 10.0.0.0/8``, ``built-in rule link-local ...``."""
        return self.label or f"rule {self.text}"

    def matches_port(self, port: int) -> bool:
        return self.ports is None or any(lo <= port <= hi for lo, hi in self.ports)

    def matches_name(self, name: str) -> bool:
        """Host patterns only: does the (normalized) DNS name match?"""
        return self._regex is not None and self._regex.fullmatch(normalize_name(name)) is not None

    def matches_address(self, address: IPAddress) -> bool:
        """CIDR rules only: is the address (or the IPv4 address embedded in it) inside?"""
        if self.network is None:
            return False
        if address.version == self.network.version and address in self.network:
            return True
        inner = _embedded_v4(address)
        return inner is not None and self.network.version == 4 and inner in self.network

    def with_label(self, label: str) -> Rule:
        return Rule(self.text, self.network, self.pattern, self.ports, label, self._regex)


def _glob_regex(pattern: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")), re.IGNORECASE)


def _parse_network(text: str, rule: str) -> IPNetwork:
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        if "has host bits set" in str(exc):
            loose = ipaddress.ip_network(text, strict=False)
            raise EgressRuleError(
                f"invalid egress rule {rule!r}: {text} has host bits set (did you mean {loose}?)"
            ) from None
        raise EgressRuleError(f"invalid egress rule {rule!r}: {text!r} is not a valid CIDR: {exc}") from None


def _looks_like_network(text: str) -> bool:
    head = text.split("/", 1)[0]
    if ":" in head:
        return True
    return bool(re.fullmatch(r"[0-9.]+", head)) and ("/" in text or head.count(".") == 3)


def parse_rule(text: str) -> Rule:
    """Parse one rule (see the module docstring); raises :class:`EgressRuleError` naming the rule."""
    rule = text
    text = text.strip()
    if not text:
        raise EgressRuleError(f"invalid egress rule {rule!r}: the rule is empty")
    if any(c.isspace() for c in text):
        raise EgressRuleError(f"invalid egress rule {rule!r}: spaces are not allowed inside a rule")
    ports: PortRanges | None = None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise EgressRuleError(f"invalid egress rule {rule!r}: missing ']'")
        host, rest = text[1:end], text[end + 1 :]
        if rest:
            if not rest.startswith(":") or len(rest) == 1:
                raise EgressRuleError(f"invalid egress rule {rule!r}: expected ':PORTS' after ']'")
            ports = _rule_ports(rest[1:], rule)
        if ":" not in host:
            raise EgressRuleError(
                f"invalid egress rule {rule!r}: brackets are for IPv6 addresses, e.g. [fd00::/8]:443"
            )
        return Rule(rule, network=_parse_network(host, rule), ports=ports)
    # A bare IPv6 address or CIDR (no brackets, so no ports).
    if text.count(":") > 1:
        return Rule(rule, network=_parse_network(text, rule))
    host, colon, port_text = text.partition(":")
    if colon:
        if not port_text:
            raise EgressRuleError(f"invalid egress rule {rule!r}: nothing after ':' (expected ports)")
        ports = _rule_ports(port_text, rule)
    if not host:
        raise EgressRuleError(f"invalid egress rule {rule!r}: missing host or CIDR before ':'")
    if _looks_like_network(host):
        return Rule(rule, network=_parse_network(host, rule), ports=ports)
    pattern = normalize_name(host)
    if not _PATTERN_CHARS.match(pattern) or ".." in pattern or pattern.startswith("."):
        raise EgressRuleError(
            f"invalid egress rule {rule!r}: {host!r} is neither a CIDR nor a host pattern "
            "(letters, digits, '.', '-', '_' and '*' globs, e.g. *.svc or kubernetes.default.svc)"
        )
    if _IPISH_PATTERN.match(pattern):
        raise EgressRuleError(
            f"invalid egress rule {rule!r}: host patterns match DNS names, not addresses; "
            "use a CIDR such as 10.0.0.0/16"
        )
    if len(pattern) > MAX_NAME:
        raise EgressRuleError(f"invalid egress rule {rule!r}: host pattern longer than {MAX_NAME} characters")
    return Rule(rule, pattern=pattern, ports=ports, _regex=_glob_regex(pattern))


def _rule_ports(text: str, rule: str) -> PortRanges:
    try:
        return parse_ports(text)
    except ValueError as exc:
        raise EgressRuleError(f"invalid egress rule {rule!r}: {exc}") from None


def _builtin(text: str, what: str) -> Rule:
    return parse_rule(text).with_label(f"built-in rule {what} {text}")


BUILTIN_DENY: tuple[Rule, ...] = (
    _builtin("169.254.0.0/16", "link-local"),
    _builtin("fe80::/10", "link-local"),
    _builtin("169.254.169.254", "cloud metadata"),
    _builtin("fd00:ec2::254", "cloud metadata"),
    _builtin("100.100.100.200", "cloud metadata"),
    _builtin("metadata.google.internal", "cloud metadata"),
    _builtin("metadata", "cloud metadata"),
)


# --- targets ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A parsed CONNECT target. ``host`` is a normalized DNS name or the text of an IP address."""

    host: str
    port: int
    ip: IPAddress | None = None

    def __str__(self) -> str:
        return format_authority(self.host, self.port)


def parse_target(authority: str) -> Target:
    """``host:port`` or ``[ipv6]:port`` -> :class:`Target`; raises :class:`TargetError` with the reason."""
    shown = repr(authority[:300])
    if not authority:
        raise TargetError(f"empty target: {EXPECTED_HOSTPORT}")
    try:
        host, port_text = split_hostport(authority)
    except MalformedAddress as exc:
        raise TargetError(f"malformed target {shown}: {exc}") from None
    if authority.startswith("["):
        if "%" in host:
            raise TargetError(f"malformed target {shown}: IPv6 zone ids are not supported")
        try:
            ip: IPAddress | None = ipaddress.IPv6Address(host)
        except ValueError:
            raise TargetError(f"malformed target {shown}: {host!r} is not an IPv6 address") from None
    else:
        try:
            ip = ipaddress.IPv4Address(host)
        except ValueError:
            ip = None
            host = normalize_name(host)
            if not _valid_name(host):
                raise TargetError(
                    f"malformed target {shown}: {host[:300]!r} is not a valid host name"
                ) from None
    try:
        port = _port(port_text)
    except ValueError:
        raise TargetError(
            f"malformed target {shown}: port {port_text[:20]!r} is not an integer 1-65535"
        ) from None
    return Target(str(ip) if ip is not None else host, port, ip)


def _valid_name(name: str) -> bool:
    if not name or len(name) > MAX_NAME or not name.isascii():
        return False
    return all(_LABEL.match(label) for label in name.split("."))


# --- the policy ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """The policy's answer. ``addresses``: the resolved addresses that may be dialled (allowed only)."""

    allowed: bool
    reason: str
    addresses: tuple[IPAddress, ...] = ()
    rule: Rule | None = None


def default_allow_rules(kube_apiserver: tuple[str, int]) -> tuple[Rule, ...]:
    """The allow rules used when no ``--allow`` is given: the kube-apiserver and in-cluster services."""
    host, port = kube_apiserver
    try:
        text = format_authority(str(ipaddress.ip_address(host)), port)
    except ValueError:
        text = format_authority(host, port)
    return (
        parse_rule(text).with_label(f"default allow rule kube-apiserver {text}"),
        parse_rule("*.svc").with_label("default allow rule *.svc"),
        parse_rule("*.svc.cluster.local").with_label("default allow rule *.svc.cluster.local"),
    )


def _label_all(rules: Iterable[Rule | str], flag: str) -> tuple[Rule, ...]:
    out = []
    for r in rules:
        rule = parse_rule(r) if isinstance(r, str) else r
        out.append(rule if rule.label else rule.with_label(f"{flag} {rule.text}"))
    return tuple(out)


@dataclass(frozen=True)
class EgressPolicy:
    allow: tuple[Rule, ...]
    deny: tuple[Rule, ...]

    @classmethod
    def build(
        cls,
        allow: Sequence[Rule | str] = (),
        deny: Sequence[Rule | str] = (),
        *,
        default_deny: bool = True,
        kube_apiserver: tuple[str, int] = ("kubernetes.default.svc", 443),
    ) -> EgressPolicy:
        """The policy from the flags: built-in denies (unless ``default_deny=False``) then ``deny``;
        ``allow``, or the default allow rules when ``allow`` is empty."""
        denies = (BUILTIN_DENY if default_deny else ()) + _label_all(deny, "--deny")
        allows = _label_all(allow, "--allow") if allow else default_allow_rules(kube_apiserver)
        return cls(allow=allows, deny=denies)

    def describe(self) -> dict[str, list[str]]:
        """The rules as written, for the startup log."""
        return {"allow": [r.text for r in self.allow], "deny": [r.text for r in self.deny]}

    def _denied(self, target: Target, addresses: Sequence[IPAddress]) -> Decision | None:
        for rule in self.deny:
            if not rule.matches_port(target.port):
                continue
            if target.ip is None and rule.matches_name(target.host):
                return Decision(False, f"target {target} denied by {rule.description}", rule=rule)
            for address in addresses:
                if rule.matches_address(address):
                    via = "" if address == target.ip else f" (resolves to {address})"
                    return Decision(False, f"target {target}{via} denied by {rule.description}", rule=rule)
        return None

    def _not_allowed(self, target: Target, addresses: Sequence[IPAddress]) -> Decision:
        via = ""
        if target.ip is None and addresses:
            shown = ", ".join(map(str, addresses[:4])) + (", ..." if len(addresses) > 4 else "")
            via = f" (resolves to {shown})"
        rules = ", ".join(r.text for r in self.allow) or "none"
        return Decision(False, f"target {target}{via} is not allowed by any allow rule (allowed: {rules})")

    def precheck(self, target: Target) -> Decision | None:
        """Before resolving: a denial decided by the name alone (or an IP literal), else ``None``.

        Saves a DNS lookup for names that can never pass; the full check is :meth:`evaluate`.
        """
        addresses = (target.ip,) if target.ip is not None else ()
        denied = self._denied(target, addresses)
        if denied is not None:
            return denied
        if target.ip is None:
            name_allowed = any(
                r.matches_port(target.port) and r.matches_name(target.host) for r in self.allow
            )
            cidr_possible = any(r.network is not None and r.matches_port(target.port) for r in self.allow)
            if not name_allowed and not cidr_possible:
                return self._not_allowed(target, ())
        return None

    def evaluate(self, target: Target, addresses: Sequence[IPAddress] = ()) -> Decision:
        """Decide on ``target`` given the addresses its name resolved to (an IP target is its own address)."""
        addrs: list[IPAddress] = []
        for address in ((target.ip,) if target.ip is not None else ()) + tuple(addresses):
            if address not in addrs:
                addrs.append(address)
        denied = self._denied(target, addrs)
        if denied is not None:
            return denied
        if target.ip is None:
            for rule in self.allow:
                if rule.matches_port(target.port) and rule.matches_name(target.host):
                    return Decision(
                        True, f"target {target} allowed by {rule.description}", tuple(addrs), rule
                    )
        allowed: list[IPAddress] = []
        first: Rule | None = None
        for address in addrs:
            for rule in self.allow:
                if rule.matches_port(target.port) and rule.matches_address(address):
                    allowed.append(address)
                    first = first or rule
                    break
        if not allowed:
            return self._not_allowed(target, addrs)
        assert first is not None
        return Decision(True, f"target {target} allowed by {first.description}", tuple(allowed), first)
