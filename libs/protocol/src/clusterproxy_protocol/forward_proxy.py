"""Reaching the hub through an HTTP(S) forward proxy, sans-IO: proxy URLs, ``NO_PROXY``, ``CONNECT``.

Nothing here touches a socket (the trio dialer is :mod:`clusterproxy_protocol.forward_proxy_trio`):

- :class:`ProxyURL`: ``http://[USER[:PASSWORD]@]HOST[:PORT]`` or ``https://...``; SOCKS and other
  schemes are refused with a message saying so. The password never appears in :attr:`ProxyURL.redacted`.
- :class:`NoProxy`: the exemptions of ``NO_PROXY``, as Go's ``net/http`` (and so client-go, gRPC and
  kubectl) reads them: ``*``; a domain (``example.com`` matches it and its subdomains, ``.example.com``
  and ``*.example.com`` its subdomains only); an IP address; a CIDR block (``10.0.0.0/8``, matching
  IP-address hosts only: names are not resolved to decide); each but ``*`` and CIDRs optionally with a
  ``:PORT`` that must match too. Unlike Go, loopback addresses and ``localhost`` are not exempt by
  themselves: list them when they must be.
- :class:`ProxySettings`: which proxy applies to a TLS destination, from the agent's flags or the
  environment (``HTTPS_PROXY``, ``https_proxy``; ``NO_PROXY``, ``no_proxy``), and why.
- :class:`ConnectExchange`: the ``CONNECT`` request and the proxy's answer (h11, itself sans-IO);
  anything but 2xx is :class:`ProxyRefused` with the proxy, its status and what to do.
"""

from __future__ import annotations

import base64
import ipaddress
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar
from urllib.parse import unquote, urlsplit

import h11

from clusterproxy_protocol.config import InvalidValue
from clusterproxy_protocol.wire import format_authority, port_number

__all__ = [
    "HTTPS_PROXY_VARIABLES",
    "HTTP_PROXY_VARIABLES",
    "NO_PROXY_VARIABLES",
    "without_proxy_variables",
    "ConnectAnswer",
    "ConnectExchange",
    "ForwardProxyError",
    "NoProxy",
    "NoProxyEntry",
    "ProxyRefused",
    "ProxySettings",
    "ProxyURL",
    "Route",
]

# Environment variables, in the order they are read (the first one set and not empty wins), as Go reads
# them. Both the hub's agent port and the cert-signer are TLS destinations: HTTPS_PROXY applies to them,
# HTTP_PROXY (plain-HTTP destinations) does not.
HTTPS_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy")
HTTP_PROXY_VARIABLES = ("HTTP_PROXY", "http_proxy")
NO_PROXY_VARIABLES = ("NO_PROXY", "no_proxy")


def without_proxy_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the proxy variables: for children that dial only loopback (local mode, the
    tests), which a developer's corporate ``HTTPS_PROXY`` must not send through that proxy."""
    dropped = {*HTTPS_PROXY_VARIABLES, *HTTP_PROXY_VARIABLES, *NO_PROXY_VARIABLES}
    return {k: v for k, v in environ.items() if k not in dropped}


DEFAULT_PORTS = {"http": 80, "https": 443}
SOCKS_SCHEMES = frozenset({"socks", "socks4", "socks4a", "socks5", "socks5h"})
MAX_ANSWER_HEAD = 16 << 10  # a CONNECT answer's status line and headers; proxies send a few hundred bytes

_HOST = re.compile(r"^[a-z0-9_-]+(\.[a-z0-9_-]+)*$")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _normal_host(host: str) -> str:
    return host.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")


# --- proxy URLs ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProxyURL:
    """A forward proxy that speaks HTTP ``CONNECT``: over plain TCP (``http``) or TLS (``https``)."""

    scheme: Literal["http", "https"]
    host: str  # IPv6 without brackets
    port: int
    username: str | None = None  # percent-decoded
    password: str | None = None

    @classmethod
    def parse(cls, text: str) -> ProxyURL:
        """``http://HOST:PORT``, ``https://USER:PASSWORD@HOST:PORT``, ``HOST:PORT`` (http), ... The
        port defaults to 80 (http) or 443 (https); user and password are percent-decoded. Raises
        :class:`~clusterproxy_protocol.config.InvalidValue` saying what is wrong and what to write."""
        raw = text.strip()
        form = "use http://[USER:PASSWORD@]HOST:PORT or https://[USER:PASSWORD@]HOST:PORT"
        if not raw:
            raise InvalidValue(f"empty proxy URL: {form}")
        if "://" not in raw:
            raw = "http://" + raw  # as Go and curl read a bare HOST:PORT
        shown = _redact_text(text.strip())
        try:
            parts = urlsplit(raw)
            port = parts.port
        except ValueError as exc:
            raise InvalidValue(f"malformed proxy URL {shown!r} ({exc}): {form}") from None
        scheme = parts.scheme.lower()
        if scheme in SOCKS_SCHEMES:
            raise InvalidValue(
                f"SOCKS proxies are not supported (proxy URL {shown!r}): the agent reaches the hub "
                "through an HTTP or HTTPS proxy that supports CONNECT; use an http:// or https:// "
                "proxy URL"
            )
        if scheme not in DEFAULT_PORTS:
            raise InvalidValue(f"unsupported proxy scheme {parts.scheme!r} in {shown!r}: {form}")
        host = _normal_host(parts.hostname or "")
        if not host:
            raise InvalidValue(f"malformed proxy URL {shown!r}: no host; {form}")
        if _ip(host) is None and not _HOST.match(host):
            raise InvalidValue(f"malformed proxy URL {shown!r}: {host!r} is not a host name or IP address")
        if ":" in host and not parts.netloc.rpartition("@")[2].startswith("["):
            raise InvalidValue(f"malformed proxy URL {shown!r}: put an IPv6 address in brackets")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise InvalidValue(f"malformed proxy URL {shown!r}: a proxy URL has no path or query; {form}")
        if port == 0:
            raise InvalidValue(f"malformed proxy URL {shown!r}: port 0 cannot be dialed")
        username = unquote(parts.username) if parts.username is not None else None
        password = unquote(parts.password) if parts.password is not None else None
        return cls(
            "https" if scheme == "https" else "http",
            host,
            port if port is not None else DEFAULT_PORTS[scheme],
            username or None,
            password,
        )

    @property
    def authority(self) -> str:
        return format_authority(self.host, self.port)

    @property
    def redacted(self) -> str:
        """The URL for logs and messages: the user name stays, the password is ``***``."""
        user = ""
        if self.username is not None:
            user = self.username + (":***" if self.password else "") + "@"
        return f"{self.scheme}://{user}{self.authority}"

    def __str__(self) -> str:
        return self.redacted

    def __repr__(self) -> str:
        return f"ProxyURL({self.redacted!r})"

    @property
    def has_credentials(self) -> bool:
        return self.username is not None

    def proxy_authorization(self) -> str | None:
        """``Basic base64(user:password)`` (RFC 7617, UTF-8) when the URL has user info."""
        if self.username is None:
            return None
        pair = f"{self.username}:{self.password or ''}".encode()
        return "Basic " + base64.b64encode(pair).decode("ascii")


def _redact_text(text: str) -> str:
    """A URL as the user wrote it with any password replaced (for the messages about bad URLs)."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    userinfo, at, hostpart = rest.rpartition("@")
    if not at:
        return text
    user, colon, _password = userinfo.partition(":")
    return f"{scheme}{sep}{user}{':***' if colon else ''}@{hostpart}"


# --- NO_PROXY --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NoProxyEntry:
    """One exemption. ``kind``: ``all`` (``*``), ``network`` (CIDR), ``ip``, ``domain``."""

    text: str
    kind: Literal["all", "network", "ip", "domain"]
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None
    domain: str = ""  # with its leading dot: ".example.com"
    apex_too: bool = False  # the domain itself matches too (written without a leading dot or *.)
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> NoProxyEntry:
        entry = text.strip().lower()
        if entry == "*":
            return cls(entry, "all")
        if "/" in entry:
            try:
                return cls(entry, "network", network=ipaddress.ip_network(entry, strict=False))
            except ValueError as exc:
                raise InvalidValue(
                    f"NO_PROXY entry {text!r} is not a CIDR block ({exc}); write e.g. 10.0.0.0/8"
                ) from None
        host, port = entry, None
        if entry.startswith("["):
            end = entry.find("]")
            rest = entry[end + 1 :] if end > 0 else "?"
            if rest and not rest.startswith(":"):
                raise InvalidValue(f"NO_PROXY entry {text!r}: expected [IPv6] or [IPv6]:PORT")
            host, port = entry[1:end], _entry_port(text, rest[1:]) if rest else None
        elif _ip(entry) is None and ":" in entry:
            host, _, port_text = entry.rpartition(":")
            port = _entry_port(text, port_text)
        host = host.rstrip(".")
        address = _ip(host)
        if address is not None:
            return cls(entry, "ip", network=ipaddress.ip_network(address), port=port)
        apex_too = True
        if host.startswith("*."):
            host, apex_too = host[1:], False
        elif host.startswith("."):
            apex_too = False
        name = host.removeprefix(".")
        if not name or not _HOST.match(name):
            raise InvalidValue(
                f"NO_PROXY entry {text!r} is neither a host name, an IP address, a CIDR block nor *"
            )
        return cls(entry, "domain", domain="." + name, apex_too=apex_too, port=port)

    def matches(self, host: str, port: int) -> bool:
        """Whether a dial to ``host:port`` (``host`` as written: a name is not resolved) is exempt."""
        if self.kind == "all":
            return True
        if self.port is not None and self.port != port:
            return False
        name = _normal_host(host)
        address = _ip(name)
        if self.kind in ("network", "ip"):
            return address is not None and self.network is not None and address in self.network
        if address is not None:
            return False
        return name.endswith(self.domain) or (self.apex_too and name == self.domain[1:])


def _entry_port(text: str, port_text: str) -> int:
    port = port_number(port_text)
    if port is None:
        raise InvalidValue(f"NO_PROXY entry {text!r}: the port must be 1-65535, not {port_text!r}")
    return port


@dataclass(frozen=True)
class NoProxy:
    """A ``NO_PROXY`` list: entries separated by commas (and/or spaces)."""

    entries: tuple[NoProxyEntry, ...] = ()

    @classmethod
    def parse(cls, text: str) -> NoProxy:
        return cls(tuple(NoProxyEntry.parse(item) for item in re.split(r"[,\s]+", text) if item.strip()))

    def match(self, host: str, port: int) -> NoProxyEntry | None:
        """The first entry exempting ``host:port``, or None."""
        return next((entry for entry in self.entries if entry.matches(host, port)), None)

    def __str__(self) -> str:
        return ",".join(entry.text for entry in self.entries)


# --- which proxy applies ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """How to reach one destination: ``proxy`` None is a direct dial; ``why`` says so for the log."""

    proxy: ProxyURL | None
    why: str


@dataclass(frozen=True)
class ProxySettings:
    """The agent's proxy settings and where each came from.

    Precedence, each setting on its own: the flag, then its ``CLUSTER_PROXY_AGENT_*`` twin (folded in
    by the flag parser), then the standard variables (``HTTPS_PROXY`` before ``https_proxy``,
    ``NO_PROXY`` before ``no_proxy``; an empty value counts as unset). So ``NO_PROXY`` from the
    environment also exempts hosts from a ``--proxy-url``, and ``--no-proxy '*'`` turns every proxy off.
    """

    proxy: ProxyURL | None = None
    proxy_source: str | None = None
    no_proxy: NoProxy = NoProxy()
    no_proxy_source: str | None = None
    notes: tuple[str, ...] = ()  # settings that were found and not used, for a warning at start

    @classmethod
    def resolve(
        cls,
        *,
        proxy_url: ProxyURL | None = None,
        proxy_url_source: str = "--proxy-url",
        no_proxy: NoProxy | None = None,
        no_proxy_source: str = "--no-proxy",
        environ: Mapping[str, str],
    ) -> ProxySettings:
        """Fill what the flags left unset from ``environ``; InvalidValue names the variable at fault."""
        notes: list[str] = []
        source: str | None = proxy_url_source if proxy_url is not None else None
        if proxy_url is None:
            source, proxy_url = _parse_first_set(environ, HTTPS_PROXY_VARIABLES, ProxyURL.parse)
            plain = _first_set(environ, HTTP_PROXY_VARIABLES)
            if proxy_url is None and plain is not None:
                notes.append(
                    f"{plain[0]} is set but not used: it is for plain-HTTP destinations, and the "
                    "hub's agent port and the cert-signer are TLS; set HTTPS_PROXY or --proxy-url"
                )
        exemptions_source: str | None = no_proxy_source if no_proxy is not None else None
        if no_proxy is None:
            exemptions_source, no_proxy = _parse_first_set(environ, NO_PROXY_VARIABLES, NoProxy.parse)
        return cls(proxy_url, source, no_proxy or NoProxy(), exemptions_source, tuple(notes))

    def route(self, host: str, port: int) -> Route:
        """The proxy for a TLS connection to ``host:port``, if any, and why."""
        if self.proxy is None:
            return Route(None, "direct: no proxy configured")
        exempt = self.no_proxy.match(host, port)
        if exempt is not None:
            return Route(None, f"direct: {self.no_proxy_source} entry {exempt.text!r} matches")
        return Route(self.proxy, f"through {self.proxy.redacted} (from {self.proxy_source})")


def _first_set(environ: Mapping[str, str], names: Sequence[str]) -> tuple[str, str] | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


_Parsed = TypeVar("_Parsed")


def _parse_first_set(
    environ: Mapping[str, str], names: Sequence[str], parse: Callable[[str], _Parsed]
) -> tuple[str | None, _Parsed | None]:
    """(the first of ``names`` set, its value parsed), or (None, None); InvalidValue names the variable."""
    found = _first_set(environ, names)
    if found is None:
        return None, None
    name, text = found
    try:
        return name, parse(text)
    except InvalidValue as exc:
        raise InvalidValue(f"environment variable {name}: {exc}") from None


# --- the CONNECT exchange --------------------------------------------------------------------------------


class ForwardProxyError(ConnectionError):
    """Reaching a destination through a forward proxy failed: the proxy was unreachable, its TLS
    failed, it answered something that is not HTTP, or it refused (:class:`ProxyRefused`). The message
    names the proxy (its redacted URL) and says what happened. An :class:`OSError`, so callers that
    retry network failures retry these too."""

    def __init__(self, proxy: ProxyURL, message: str) -> None:
        super().__init__(message)
        self.proxy = proxy

    def __str__(self) -> str:
        return str(self.args[0])


class ProxyRefused(ForwardProxyError):
    """The proxy answered the ``CONNECT`` with a status other than 2xx."""

    def __init__(self, proxy: ProxyURL, target: str, status: int, reason: str, challenge: str | None) -> None:
        self.status = status
        self.reason = reason
        self.challenge = challenge
        super().__init__(proxy, _refusal_message(proxy, target, status, reason, challenge))


def _refusal_message(proxy: ProxyURL, target: str, status: int, reason: str, challenge: str | None) -> str:
    head = f"forward proxy {proxy.redacted} answered CONNECT {target} with {status} {reason}".rstrip()
    if status in (401, 407):  # tinyproxy answers wrong credentials with 401
        if proxy.has_credentials:
            hint = "it refused the user and password of the proxy URL: check them"
        else:
            hint = "it wants credentials: put them in the proxy URL, http://USER:PASSWORD@HOST:PORT"
        if challenge:
            hint += f" (it asks for {challenge})"
    elif status == 403:
        hint = (
            f"its policy forbids this destination: ask its administrator to allow CONNECT to {target}, "
            "or exempt the destination with NO_PROXY / --no-proxy if it is reachable directly"
        )
    elif status in (502, 503, 504):
        hint = f"the proxy could not reach {target}"
    else:
        hint = "expected 200"
    return f"{head}: {hint}"


@dataclass(frozen=True)
class ConnectAnswer:
    """The proxy's 2xx: the tunnel is open. ``leftover``: bytes after the answer's head (from the
    destination; a TLS server sends none before the client's hello)."""

    status: int
    reason: str
    headers: tuple[tuple[str, str], ...]
    leftover: bytes


class ConnectExchange:
    """One ``CONNECT HOST:PORT`` through ``proxy``: :meth:`request` is the bytes to send, then feed the
    proxy's bytes to :meth:`receive_data` until it returns the :class:`ConnectAnswer` (``b""`` is the
    end of the stream). Raises :class:`ProxyRefused` for a non-2xx answer and
    :class:`ForwardProxyError` for an answer that is not HTTP, too long, or missing."""

    def __init__(
        self, proxy: ProxyURL, host: str, port: int, *, user_agent: str = "cluster-proxy-agent"
    ) -> None:
        self.proxy = proxy
        self.target = format_authority(host, port)
        self.user_agent = user_agent
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_ANSWER_HEAD)
        self._head = b""  # the answer's first bytes, for the message when it is cut short

    def request(self) -> bytes:
        headers = [("Host", self.target), ("User-Agent", self.user_agent)]
        authorization = self.proxy.proxy_authorization()
        if authorization is not None:
            headers.append(("Proxy-Authorization", authorization))
        data = self._h11.send(h11.Request(method="CONNECT", target=self.target, headers=headers))
        return data + (self._h11.send(h11.EndOfMessage()) or b"")

    def receive_data(self, data: bytes | bytearray) -> ConnectAnswer | None:
        if not data:  # an answer already read returned before: this end came first
            seen = f" (after {self._head[:60]!r})" if self._head else ""
            raise self._failure(f"closed the connection before answering the CONNECT{seen}")
        if len(self._head) < 60:
            self._head += data[: 60 - len(self._head)]
        try:
            self._h11.receive_data(data)  # type: ignore[arg-type]  # h11 declares bytes but appends it to a bytearray: any bytes-like does
            while True:
                event = self._h11.next_event()
                if event is h11.NEED_DATA:
                    return None
                if isinstance(event, h11.InformationalResponse):
                    continue
                if isinstance(event, h11.Response):
                    return self._answer(event)
                raise self._failure(f"answered the CONNECT with {type(event).__name__}, not a response")
        except h11.RemoteProtocolError as exc:
            raise self._failure(f"answered the CONNECT with something that is not HTTP/1.x ({exc})") from None

    def _answer(self, response: h11.Response) -> ConnectAnswer:
        reason = response.reason.decode("latin-1", "replace")
        headers = tuple((k.decode("latin-1"), v.decode("latin-1", "replace")) for k, v in response.headers)
        if not 200 <= response.status_code < 300:
            challenge = next((v for k, v in headers if k == "proxy-authenticate"), None)
            raise ProxyRefused(self.proxy, self.target, response.status_code, reason, challenge)
        leftover, _closed = self._h11.trailing_data
        return ConnectAnswer(response.status_code, reason, headers, bytes(leftover))

    def _failure(self, what: str) -> ForwardProxyError:
        return ForwardProxyError(self.proxy, f"forward proxy {self.proxy.redacted} {what}")
