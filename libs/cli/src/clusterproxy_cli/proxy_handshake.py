"""The local proxy's handshakes, sans-IO: SOCKS5 (RFC 1928, user name and password of RFC 1929) and
HTTP/1.1 forward-proxy requests (``CONNECT host:port``, plain-HTTP requests in absolute form) on one
port, told apart by the client's first byte; bytes in, bytes to send and a decision out. The trio
driver is :mod:`clusterproxy_cli.proxy`.

The cluster is named by the proxy user name: SOCKS5's RFC 1929 user name (``socks5h://NAME@...``,
the password ignored) or HTTP's ``Proxy-Authorization: Basic base64("NAME:")`` (``http://NAME@...``).
Without one, :func:`route` takes the proxy's ``--cluster`` default, else a host that is a cluster name
(``https://cluster1``) reaches that cluster's kube-apiserver (the upstream convention).

Why SOCKS5 beside HTTP: kubectl, client-go and Go's ``net/http`` verify an ``https://`` proxy and the
target with one TLS configuration, and an ``http://`` proxy URL would carry the hub certificate over
no TLS at all; a ``socks5://`` proxy on loopback leaves kubectl's TLS to the API server its own, end
to end, while this process holds the hub certificate.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass
from enum import IntEnum

from clusterproxy_protocol import (
    CLUSTER_NAME,
    BadRequest,
    MalformedAddress,
    MalformedTarget,
    RequestHeadReader,
    cluster_from_proxy_authorization,
    error_response,
    established,
    format_authority,
    forward_form,
    parse_authority,
)

SOCKS5 = 0x05
SOCKS4 = 0x04
AUTH_VERSION = 0x01  # RFC 1929's sub-negotiation version
NO_AUTH = 0x00
USER_PASSWORD = 0x02
NO_ACCEPTABLE_METHOD = 0xFF
CMD_CONNECT = 0x01
ATYP_IPV4 = 0x01
ATYP_DOMAIN = 0x03
ATYP_IPV6 = 0x04
# Of the greeting, the user name sub-negotiation and the request, the longest possible is 513 bytes.
MAX_SOCKS_MESSAGE = 513
PROXY_REALM = "cluster-proxy: user name = cluster"
PROXY_AUTHENTICATE = ("Proxy-Authenticate", f'Basic realm="{PROXY_REALM}"')


class Reply(IntEnum):
    """RFC 1928 section 6's REP field."""

    SUCCEEDED = 0x00
    GENERAL_FAILURE = 0x01
    NOT_ALLOWED = 0x02
    NETWORK_UNREACHABLE = 0x03
    HOST_UNREACHABLE = 0x04
    CONNECTION_REFUSED = 0x05
    TTL_EXPIRED = 0x06
    COMMAND_NOT_SUPPORTED = 0x07
    ADDRESS_TYPE_NOT_SUPPORTED = 0x08


# The hub's refusal (HTTP status) -> the nearest SOCKS reply. SOCKS has no words, so the hub's reason
# goes to the proxy's log (connect_refused); docs/local-proxy.md has this table.
SOCKS_REPLY_FOR_STATUS = {
    400: Reply.GENERAL_FAILURE,  # malformed target
    403: Reply.NOT_ALLOWED,  # the agent's egress policy, or the client policy
    404: Reply.NETWORK_UNREACHABLE,  # unknown cluster: the cluster is the network
    429: Reply.GENERAL_FAILURE,  # too many dials waiting for agents
    502: Reply.CONNECTION_REFUSED,  # the target refused, reset or could not be routed to
    503: Reply.NETWORK_UNREACHABLE,  # no agent of the cluster connected: its network is out of reach
    504: Reply.TTL_EXPIRED,  # the target did not answer within the agent's dial timeout
}


def socks_reply(code: Reply) -> bytes:
    """A SOCKS5 reply; BND.ADDR and BND.PORT are 0.0.0.0:0: the stream's far end is in the cluster,
    and no client of a CONNECT uses them."""
    return bytes([SOCKS5, code, 0x00, ATYP_IPV4, 0, 0, 0, 0, 0, 0])


def socks_reply_for_status(status: int) -> Reply:
    return SOCKS_REPLY_FOR_STATUS.get(status, Reply.GENERAL_FAILURE)


@dataclass(frozen=True)
class Request:
    """The client asks for a stream to ``host:port``."""

    protocol: str  # "socks5", "http-connect" or "http-forward"
    cluster: str | None  # named by the client (the proxy user name), if it named one
    host: str
    port: int
    first_bytes: bytes  # for the target once the stream is open (bytes after the request; a rewritten head)

    @property
    def target(self) -> str:
        return format_authority(self.host, self.port)


@dataclass(frozen=True)
class Refusal:
    """Send ``reply`` (possibly nothing), then close: the request is malformed or not supported."""

    reply: bytes
    reason: str
    protocol: str | None


@dataclass(frozen=True)
class Route:
    cluster: str
    named_by: str  # "proxy-user", "default" or "bare-cluster-name"


def is_cluster_name(host: str) -> bool:
    """Whether ``host`` could be a cluster's name (a DNS name, not an IP address)."""
    try:
        ipaddress.ip_address(host)
        return False
    except ValueError:
        return bool(CLUSTER_NAME.match(host))


def route(request: Request, default_cluster: str | None) -> Route | None:
    """Which cluster: the proxy user name, else the proxy's default, else a host that is a cluster name
    (its kube-apiserver; the hub says whether such a cluster exists). None: no cluster named."""
    if request.cluster:
        return Route(request.cluster, "proxy-user")
    if default_cluster:
        return Route(default_cluster, "default")
    if is_cluster_name(request.host):
        return Route(request.host, "bare-cluster-name")
    return None


class _NeedData(Exception):
    pass


class _Refused(Exception):
    def __init__(self, reply: bytes, reason: str) -> None:
        super().__init__(reason)
        self.reply = reply
        self.reason = reason


class Handshake:
    """One client connection's handshake. Feed it what the client sends (``b""`` for its end of input)
    until :meth:`feed` returns a :class:`Request` or a :class:`Refusal`; then answer with
    :meth:`opened`, :meth:`refused` or :meth:`no_cluster`."""

    def __init__(self) -> None:
        self.protocol: str | None = None  # "socks5" or "http" once the first byte arrived
        self._buffer = bytearray()
        self._http: RequestHeadReader | None = None
        self._stage = "greeting"  # SOCKS5: greeting, auth, request
        self._user: str | None = None
        self._request: Request | None = None

    def feed(self, data: bytes) -> tuple[bytes, Request | Refusal | None]:
        """Bytes to send now, and the request or refusal once decided (None: more bytes needed)."""
        if self.protocol is None:
            if not data:
                return b"", Refusal(b"", "the client closed without sending anything", None)
            self.protocol = "socks5" if data[0] == SOCKS5 else "socks4" if data[0] == SOCKS4 else "http"
            if self.protocol == "http":
                self._http = RequestHeadReader()
            elif self.protocol == "socks4":
                # SOCKS4's "request rejected" (91), which every SOCKS4 client understands.
                return b"", Refusal(
                    b"\x00\x5b\x00\x00\x00\x00\x00\x00", "SOCKS4 is not supported: use SOCKS5", "socks4"
                )
        if self._http is not None:
            return b"", self._feed_http(data)
        return self._feed_socks(data)

    # -- HTTP ------------------------------------------------------------------------------------

    def _feed_http(self, data: bytes) -> Request | Refusal | None:
        assert self._http is not None
        try:
            head = self._http.feed(data)
            if head is None:
                return None
            cluster = cluster_from_proxy_authorization(head.headers.get("proxy-authorization"))
            if head.method == "CONNECT":
                try:
                    host, port = parse_authority(head.target)
                except MalformedAddress as exc:
                    raise BadRequest(400, f"malformed CONNECT target {head.target!r}: {exc}") from None
                self._request = Request("http-connect", cluster, host, port, head.early_data)
            else:
                authority, rewritten = forward_form(head)
                host, port = parse_authority(authority)
                self._request = Request("http-forward", cluster, host, port, rewritten + head.early_data)
        except BadRequest as exc:
            return Refusal(error_response(exc.status, exc.reason), exc.reason, "http")
        except MalformedTarget as exc:
            return Refusal(error_response(400, exc.reason), exc.reason, "http")
        return self._checked(self._request)

    # -- SOCKS5 ----------------------------------------------------------------------------------

    def _feed_socks(self, data: bytes) -> tuple[bytes, Request | Refusal | None]:
        if not data:
            return b"", Refusal(b"", f"the client closed during the SOCKS5 {self._stage}", "socks5")
        self._buffer += data
        out = bytearray()
        try:
            while True:
                if self._stage == "greeting":
                    out += self._greeting()
                elif self._stage == "auth":
                    out += self._auth()
                else:
                    request = self._socks_request()
                    return bytes(out), self._checked(request)
        except _NeedData:
            if len(self._buffer) > MAX_SOCKS_MESSAGE:  # cannot happen with valid lengths; bounded anyway
                return bytes(out), Refusal(b"", "SOCKS5 message too long", "socks5")
            return bytes(out), None
        except _Refused as exc:
            return bytes(out), Refusal(exc.reply, exc.reason, "socks5")

    def _take(self, count: int) -> bytes:
        if len(self._buffer) < count:
            raise _NeedData
        taken = bytes(self._buffer[:count])
        return taken

    def _consume(self, count: int) -> None:
        del self._buffer[:count]

    def _greeting(self) -> bytes:
        _version, methods_count = self._take(2)  # the first byte, 5, chose SOCKS5
        if methods_count == 0:
            raise _Refused(bytes([SOCKS5, NO_ACCEPTABLE_METHOD]), "malformed SOCKS5 greeting: no methods")
        methods = self._take(2 + methods_count)[2:]
        self._consume(2 + methods_count)
        # The user name names the cluster: prefer it when offered (Go and curl offer both methods
        # when the proxy URL has a user name).
        if USER_PASSWORD in methods:
            self._stage = "auth"
            return bytes([SOCKS5, USER_PASSWORD])
        if NO_AUTH in methods:
            self._stage = "request"
            return bytes([SOCKS5, NO_AUTH])
        offered = ", ".join(f"0x{m:02x}" for m in methods)
        raise _Refused(
            bytes([SOCKS5, NO_ACCEPTABLE_METHOD]),
            f"no acceptable SOCKS5 method among {offered}: offer 0x00 (none) or 0x02 (user name = cluster)",
        )

    def _auth(self) -> bytes:
        failure = bytes([AUTH_VERSION, 0x01])
        version, user_length = self._take(2)
        if version != AUTH_VERSION:
            raise _Refused(failure, f"malformed SOCKS5 user name/password: version {version}, expected 1")
        password_length = self._take(2 + user_length + 1)[-1]
        self._take(3 + user_length + password_length)
        user = bytes(self._buffer[2 : 2 + user_length])
        self._consume(3 + user_length + password_length)  # the password is ignored
        name = user.decode("ascii", "replace")
        if not is_cluster_name(name):
            raise _Refused(
                failure,
                f"SOCKS5 user name {name!r} is not a cluster name (the user name names the cluster: "
                "socks5h://CLUSTER@HOST:PORT)",
            )
        self._user = name
        self._stage = "request"
        return bytes([AUTH_VERSION, 0x00])

    def _socks_request(self) -> Request:
        version, command, _reserved, address_type = self._take(4)
        if version != SOCKS5:
            raise _Refused(socks_reply(Reply.GENERAL_FAILURE), f"malformed SOCKS5 request: version {version}")
        if command != CMD_CONNECT:
            name = {0x02: "BIND", 0x03: "UDP ASSOCIATE"}.get(command, f"0x{command:02x}")
            raise _Refused(
                socks_reply(Reply.COMMAND_NOT_SUPPORTED),
                f"SOCKS5 command {name} is not supported: CONNECT only",
            )
        if address_type == ATYP_IPV4:
            end = 4 + 4
            host = str(ipaddress.IPv4Address(self._take(end)[4:end]))
        elif address_type == ATYP_IPV6:
            end = 4 + 16
            host = str(ipaddress.IPv6Address(self._take(end)[4:end]))
        elif address_type == ATYP_DOMAIN:
            length = self._take(5)[4]
            end = 5 + length
            raw = self._take(end)[5:end]
            try:
                host = raw.decode("ascii")
            except UnicodeDecodeError:
                host = ""
            if not host or not host.isprintable() or " " in host:
                raise _Refused(
                    socks_reply(Reply.HOST_UNREACHABLE), f"malformed SOCKS5 domain name {raw[:64]!r}"
                )
        else:
            raise _Refused(
                socks_reply(Reply.ADDRESS_TYPE_NOT_SUPPORTED),
                f"SOCKS5 address type 0x{address_type:02x} unknown",
            )
        (port,) = struct.unpack("!H", self._take(end + 2)[end:])
        self._consume(end + 2)
        return Request("socks5", self._user, host.lower(), port, bytes(self._buffer))

    # -- answers ---------------------------------------------------------------------------------

    def _checked(self, request: Request) -> Request | Refusal:
        self._request = request
        if request.port == 0:
            return Refusal(
                self.refused(400, "port 0 cannot be dialed"), "port 0 cannot be dialed", self.protocol
            )
        return request

    def opened(self) -> bytes:
        """The answer once the stream to the target is open."""
        assert self._request is not None
        if self._request.protocol == "socks5":
            return socks_reply(Reply.SUCCEEDED)
        if self._request.protocol == "http-connect":
            return established()
        return b""  # a forwarded request: the target's answer is the answer

    def refused(self, status: int, reason: str) -> bytes:
        """The answer to a refusal with the hub's (or our) status and reason."""
        if self.protocol == "socks5":
            return socks_reply(socks_reply_for_status(status))
        return error_response(status, reason)

    def hub_unavailable(self, reason: str) -> bytes:
        """The answer when the hub cannot be reached (no tunnel to it): 502 Bad Gateway, as any forward
        proxy whose upstream failed; SOCKS5 "general failure"."""
        if self.protocol == "socks5":
            return socks_reply(Reply.GENERAL_FAILURE)
        return error_response(502, reason)

    def no_cluster(self, reason: str) -> bytes:
        """The answer when no cluster is named: HTTP 407 asking for the cluster as the user name (curl
        and browsers then know what to ask), SOCKS5 "not allowed"."""
        if self.protocol == "socks5":
            return socks_reply(Reply.NOT_ALLOWED)
        return error_response(407, reason, [PROXY_AUTHENTICATE])
