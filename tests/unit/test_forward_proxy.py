"""Forward proxies, sans-IO and the thin trio dialer: proxy URLs, NO_PROXY (Go's rules: suffixes,
CIDRs, ``*``, ports), where each setting comes from, the CONNECT exchange, and the agent's flags."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from hypothesis import given, strategies as st

from clusterproxy_agent.main import parse_settings
from clusterproxy_protocol.config import InvalidValue
from clusterproxy_protocol.forward_proxy import (
    MAX_ANSWER_HEAD,
    ConnectExchange,
    ForwardProxyError,
    NoProxy,
    ProxyRefused,
    ProxySettings,
    ProxyURL,
    without_proxy_variables,
)
from clusterproxy_protocol.forward_proxy_trio import ForwardProxy
from clusterproxy_protocol.pki import DevCA
from tests.support.targets import closed_port

# --- proxy URLs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "scheme", "host", "port"),
    [
        ("http://proxy.corp:3128", "http", "proxy.corp", 3128),
        ("http://proxy.corp", "http", "proxy.corp", 80),
        ("https://proxy.corp", "https", "proxy.corp", 443),
        ("HTTPS://Proxy.Corp:8443/", "https", "proxy.corp", 8443),
        ("proxy.corp:3128", "http", "proxy.corp", 3128),  # as Go and curl read a bare HOST:PORT
        ("http://10.0.0.1:3128", "http", "10.0.0.1", 3128),
        ("http://[fd00::1]:3128", "http", "fd00::1", 3128),
        ("  http://proxy:1  ", "http", "proxy", 1),
    ],
)
def test_proxy_url_forms(text: str, scheme: str, host: str, port: int) -> None:
    url = ProxyURL.parse(text)
    assert (url.scheme, url.host, url.port) == (scheme, host, port)
    assert url.username is None and url.proxy_authorization() is None


def test_proxy_url_credentials_are_decoded_sent_as_basic_and_never_shown() -> None:
    url = ProxyURL.parse("http://al%40ice:p%3Ass%2Fw0rd@proxy:3128")
    assert (url.username, url.password) == ("al@ice", "p:ss/w0rd")
    assert url.proxy_authorization() == "Basic " + base64.b64encode(b"al@ice:p:ss/w0rd").decode()
    assert url.redacted == "http://al@ice:***@proxy:3128"
    assert "w0rd" not in str(url) and "w0rd" not in repr(url)
    user_only = ProxyURL.parse("http://bob@proxy:3128")
    assert user_only.proxy_authorization() == "Basic " + base64.b64encode(b"bob:").decode()
    assert user_only.redacted == "http://bob@proxy:3128"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty proxy URL"),
        ("socks5://proxy:1080", "SOCKS proxies are not supported"),
        ("socks5h://user:secret@proxy:1080", "SOCKS proxies are not supported"),
        ("socks4://proxy:1080", "SOCKS proxies are not supported"),
        ("ftp://proxy:21", "unsupported proxy scheme 'ftp'"),
        ("http://proxy:99999", "malformed proxy URL"),
        ("http://proxy:port", "malformed proxy URL"),
        ("http://:3128", "no host"),
        ("http://proxy:3128/some/path", "has no path"),
        ("http://proxy:3128/?x=1", "has no path"),
        ("http://pro xy:3128", "not a host name"),
        ("http://proxy:0", "port 0"),
    ],
)
def test_bad_proxy_urls_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(InvalidValue) as info:
        ProxyURL.parse(text)
    assert message in str(info.value)
    assert "secret" not in str(info.value)


# --- NO_PROXY --------------------------------------------------------------------------------------------

NO_PROXY_CASES = [
    # entry, host, port, exempt
    ("*", "anything.example", 443, True),
    ("example.com", "example.com", 443, True),
    ("example.com", "hub.example.com", 443, True),
    ("example.com", "a.b.example.com", 8091, True),
    ("example.com", "badexample.com", 443, False),
    ("example.com", "example.com.evil", 443, False),
    (".example.com", "hub.example.com", 443, True),
    (".example.com", "example.com", 443, False),  # a leading dot: subdomains only (Go)
    ("*.example.com", "hub.example.com", 443, True),
    ("*.example.com", "example.com", 443, False),
    ("Example.COM.", "HUB.example.com.", 443, True),  # case and a trailing dot do not matter
    ("example.com:8091", "hub.example.com", 8091, True),
    ("example.com:8091", "hub.example.com", 443, False),
    ("10.0.0.0/8", "10.1.2.3", 8091, True),
    ("10.0.0.0/8", "11.1.2.3", 8091, False),
    ("10.0.0.0/8", "ten.example.com", 8091, False),  # names are not resolved to match a CIDR
    ("127.0.0.1", "127.0.0.1", 8091, True),
    ("127.0.0.1", "127.0.0.2", 8091, False),
    ("127.0.0.1:8091", "127.0.0.1", 8091, True),
    ("127.0.0.1:8091", "127.0.0.1", 8092, False),
    ("127.0.0.1", "localhost", 8091, False),
    ("fd00::/8", "fd00::1", 443, True),
    ("[fd00::1]", "fd00::1", 443, True),
    ("[fd00::1]:443", "[fd00::1]", 443, True),
    ("[fd00::1]:443", "fd00::1", 80, False),
    ("::1", "::1", 443, True),
    ("1.2.3.4", "hub.example.com", 443, False),  # an IP entry never matches a name
]


@pytest.mark.parametrize(("entry", "host", "port", "exempt"), NO_PROXY_CASES)
def test_no_proxy_entries(entry: str, host: str, port: int, exempt: bool) -> None:
    assert (NoProxy.parse(entry).match(host, port) is not None) is exempt


def test_no_proxy_lists_take_commas_and_spaces_and_report_the_entry_that_matched() -> None:
    rules = NoProxy.parse(" .svc, .cluster.local 10.0.0.0/8,,hub.corp:8091 ")
    assert [e.text for e in rules.entries] == [".svc", ".cluster.local", "10.0.0.0/8", "hub.corp:8091"]
    match = rules.match("hub.corp", 8091)
    assert match is not None and match.text == "hub.corp:8091"
    assert rules.match("hub.corp", 443) is None
    assert NoProxy.parse("").match("anything", 1) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("10.0.0.0/33", "is not a CIDR block"),
        ("hub.corp:99999", "the port must be 1-65535"),
        ("hub.corp:x", "the port must be 1-65535"),
        ("[fd00::1", "expected [IPv6]"),
        ("bad!host", "neither a host name"),
    ],
)
def test_bad_no_proxy_entries_are_refused(text: str, message: str) -> None:
    with pytest.raises(InvalidValue) as info:
        NoProxy.parse(text)
    assert message in str(info.value) and repr(text) in str(info.value)


LABEL = st.from_regex(r"[a-z]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)


@given(st.lists(LABEL, min_size=1, max_size=4), st.lists(LABEL, min_size=1, max_size=3))
def test_a_domain_entry_matches_every_subdomain_and_only_dot_separated_ones(
    domain: list[str], sub: list[str]
) -> None:
    name = ".".join(domain)
    host = ".".join(sub) + "." + name
    assert NoProxy.parse(name).match(host, 443) is not None
    assert NoProxy.parse("." + name).match(host, 443) is not None
    assert NoProxy.parse(name).match(name, 443) is not None
    assert NoProxy.parse(name).match(sub[-1] + name, 443) is None  # "x" + name, no dot between


@given(st.ip_addresses(v=4), st.integers(0, 32))
def test_a_cidr_entry_matches_exactly_its_addresses(address: object, prefix: int) -> None:
    import ipaddress

    network = ipaddress.ip_network(f"{address}/{prefix}", strict=False)
    rules = NoProxy.parse(str(network))
    assert rules.match(str(address), 443) is not None
    outside = int(network.network_address) - 1
    if outside >= 0:
        assert rules.match(str(ipaddress.IPv4Address(outside)), 443) is None


# --- where the settings come from ------------------------------------------------------------------------


def test_https_proxy_from_the_environment_upper_case_first_empty_is_unset() -> None:
    settings = ProxySettings.resolve(
        environ={"HTTPS_PROXY": "http://upper:1", "https_proxy": "http://lower:2"}
    )
    assert settings.proxy == ProxyURL.parse("http://upper:1") and settings.proxy_source == "HTTPS_PROXY"
    settings = ProxySettings.resolve(environ={"HTTPS_PROXY": " ", "https_proxy": "http://lower:2"})
    assert settings.proxy_source == "https_proxy"
    route = settings.route("hub.corp", 8091)
    assert route.proxy == ProxyURL.parse("http://lower:2")
    assert route.why == "through http://lower:2 (from https_proxy)"


def test_the_flag_wins_over_the_environment_and_no_proxy_still_applies() -> None:
    settings = ProxySettings.resolve(
        proxy_url=ProxyURL.parse("http://flag:1"),
        environ={"HTTPS_PROXY": "http://env:2", "NO_PROXY": ".corp"},
    )
    assert settings.proxy == ProxyURL.parse("http://flag:1")
    assert settings.route("hub.corp", 8091).why == "direct: NO_PROXY entry '.corp' matches"
    assert settings.route("hub.example", 8091).proxy == ProxyURL.parse("http://flag:1")
    overridden = ProxySettings.resolve(
        proxy_url=ProxyURL.parse("http://flag:1"), no_proxy=NoProxy.parse(""), environ={"NO_PROXY": ".corp"}
    )
    assert overridden.route("hub.corp", 8091).proxy is not None  # --no-proxy "" empties NO_PROXY
    off = ProxySettings.resolve(no_proxy=NoProxy.parse("*"), environ={"HTTPS_PROXY": "http://env:2"})
    assert off.route("hub.corp", 8091).why == "direct: --no-proxy entry '*' matches"


def test_http_proxy_alone_is_not_used_for_tls_destinations_and_says_so() -> None:
    settings = ProxySettings.resolve(environ={"http_proxy": "http://plain:3128"})
    assert settings.proxy is None
    assert settings.route("hub", 8091).why == "direct: no proxy configured"
    assert len(settings.notes) == 1 and "http_proxy is set but not used" in settings.notes[0]
    assert "set HTTPS_PROXY or --proxy-url" in settings.notes[0]


def test_bad_environment_values_name_the_variable() -> None:
    with pytest.raises(InvalidValue, match=r"environment variable https_proxy: SOCKS proxies are not"):
        ProxySettings.resolve(environ={"https_proxy": "socks5://p:1080"})
    with pytest.raises(InvalidValue, match=r"environment variable NO_PROXY: NO_PROXY entry '10/99'"):
        ProxySettings.resolve(environ={"NO_PROXY": "10/99"})


# --- the CONNECT exchange --------------------------------------------------------------------------------

PROXY = ProxyURL.parse("http://agent:s3cret@proxy.corp:3128")


def test_the_connect_request_names_the_target_and_carries_basic_credentials() -> None:
    request = ConnectExchange(PROXY, "hub.example.com", 8091, user_agent="ua/1").request().decode()
    lines = request.split("\r\n")
    assert lines[0] == "CONNECT hub.example.com:8091 HTTP/1.1"
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    assert headers["host"] == "hub.example.com:8091"
    assert headers["proxy-authorization"] == "Basic " + base64.b64encode(b"agent:s3cret").decode()
    assert headers["user-agent"] == "ua/1"
    assert request.endswith("\r\n\r\n")
    bare = ConnectExchange(ProxyURL.parse("http://proxy:1"), "fd00::1", 443).request().decode()
    assert bare.startswith("CONNECT [fd00::1]:443 HTTP/1.1\r\n") and "proxy-authorization" not in bare.lower()


@given(st.lists(st.integers(1, 40), max_size=20))
def test_the_answer_is_read_however_it_is_split(cuts: list[int]) -> None:
    answer = b"HTTP/1.0 200 Connection established\r\nProxy-agent: tinyproxy/1.11.1\r\n\r\n\x16\x03\x03"
    exchange = ConnectExchange(PROXY, "hub", 8091)
    exchange.request()
    pieces = []
    position = 0
    for cut in cuts:
        pieces.append(answer[position : position + cut])
        position += cut
    pieces = [p for p in pieces if p]
    if position < len(answer):
        pieces.append(answer[position:])
    fed = 0
    for piece in pieces:
        fed += len(piece)
        result = exchange.receive_data(piece)
        if result is not None:
            break
    assert result is not None
    assert (result.status, result.reason) == (200, "Connection established")
    # bytes of the destination that came in the same read as the answer are handed on, none lost
    assert result.leftover == answer[answer.index(b"\r\n\r\n") + 4 : fed]


def test_informational_answers_are_skipped() -> None:
    exchange = ConnectExchange(PROXY, "hub", 8091)
    exchange.request()
    result = exchange.receive_data(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\n")
    assert result is not None and result.status == 200 and result.leftover == b""


@pytest.mark.parametrize(
    ("proxy", "answer", "status", "says"),
    [
        (
            PROXY,
            b'HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm="corp"\r\n'
            b"Content-Length: 5\r\n\r\ndenied",
            407,
            'it refused the user and password of the proxy URL: check them (it asks for Basic realm="corp")',
        ),
        (
            ProxyURL.parse("http://proxy.corp:3128"),
            b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n",
            407,
            "it wants credentials: put them in the proxy URL",
        ),
        (PROXY, b"HTTP/1.0 401 Unauthorized\r\n\r\n", 401, "it refused the user and password"),
        (
            PROXY,
            b"HTTP/1.0 403 Access violation\r\n\r\n",
            403,
            "ask its administrator to allow CONNECT to hub:8091",
        ),
        (PROXY, b"HTTP/1.1 502 Bad Gateway\r\n\r\n", 502, "the proxy could not reach hub:8091"),
        (PROXY, b"HTTP/1.1 301 Moved\r\nLocation: /x\r\n\r\n", 301, "expected 200"),
    ],
)
def test_refusals_name_the_proxy_the_status_and_what_to_do(
    proxy: ProxyURL, answer: bytes, status: int, says: str
) -> None:
    exchange = ConnectExchange(proxy, "hub", 8091)
    exchange.request()
    with pytest.raises(ProxyRefused) as info:
        exchange.receive_data(answer)
    message = str(info.value)
    assert info.value.status == status
    assert message.startswith(f"forward proxy {proxy.redacted} answered CONNECT hub:8091 with {status} ")
    assert says in message
    assert "s3cret" not in message
    assert isinstance(info.value, OSError)  # retried like any network failure


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "closed the connection before answering the CONNECT"),
        (b"SSH-2.0-OpenSSH_9.2\r\n", "closed the connection before answering the CONNECT (after b'SSH-2.0"),
        (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "something that is not HTTP/1.x"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_ANSWER_HEAD, "something that is not HTTP/1.x"),
    ],
)
def test_answers_that_are_not_http_are_errors_naming_the_proxy(data: bytes, says: str) -> None:
    exchange = ConnectExchange(PROXY, "hub", 8091)
    exchange.request()
    with pytest.raises(ForwardProxyError) as info:
        if exchange.receive_data(data) is None:
            exchange.receive_data(b"")
    assert str(info.value).startswith("forward proxy http://agent:***@proxy.corp:3128 ")
    assert says in str(info.value)


def test_the_sans_io_module_does_not_import_trio() -> None:
    code = "import sys, clusterproxy_protocol.forward_proxy; sys.exit('trio' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# --- the trio dialer against a tiny in-process proxy -----------------------------------------------------


async def _fake_proxy(nursery: trio.Nursery, answer: bytes, then: bytes = b"") -> tuple[int, list[bytes]]:
    """A loopback listener that reads a request head, answers ``answer + then`` at once, then echoes."""
    heads: list[bytes] = []

    async def serve(stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            head += await stream.receive_some(4096)
            if not head.startswith(b"CONNECT"[: len(head)]):  # a TLS hello, say
                await stream.send_all(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                return
        heads.append(head)
        await stream.send_all(answer + then)
        while data := await stream.receive_some(4096):
            await stream.send_all(data)

    listeners = await nursery.start(trio.serve_tcp, serve, 0)
    return listeners[0].socket.getsockname()[1], heads


async def test_the_dialer_hands_on_destination_bytes_that_came_with_the_answer(nursery: trio.Nursery) -> None:
    port, heads = await _fake_proxy(nursery, b"HTTP/1.1 200 OK\r\n\r\n", then=b"hello from the target")
    stream = await ForwardProxy(ProxyURL.parse(f"http://u:p@127.0.0.1:{port}")).open("hub.corp", 8091)
    assert heads[0].startswith(b"CONNECT hub.corp:8091 HTTP/1.1\r\n")
    assert await stream.receive_some(5) == b"hello"
    assert await stream.receive_some() == b" from the target"
    await stream.send_all(b"echo")
    assert await stream.receive_some() == b"echo"
    await stream.aclose()


async def test_the_dialer_reports_an_unreachable_proxy_and_a_refusal(nursery: trio.Nursery) -> None:
    closed = closed_port()
    with pytest.raises(
        ForwardProxyError, match=rf"cannot connect to forward proxy http://127.0.0.1:{closed}: "
    ):
        await ForwardProxy(ProxyURL.parse(f"http://127.0.0.1:{closed}")).open("hub", 1)
    port, _ = await _fake_proxy(nursery, b"HTTP/1.1 403 Forbidden\r\n\r\n")
    with pytest.raises(ProxyRefused) as info:
        await ForwardProxy(ProxyURL.parse(f"http://127.0.0.1:{port}")).open("hub", 1)
    assert info.value.status == 403


async def test_the_dialer_reports_a_tls_failure_with_the_proxy(nursery: trio.Nursery, tmp_path: Path) -> None:
    port, _ = await _fake_proxy(nursery, b"HTTP/1.1 200 OK\r\n\r\n")  # speaks no TLS
    proxy = ForwardProxy(ProxyURL.parse(f"https://127.0.0.1:{port}"), DevCA.create_or_load(tmp_path).ca_path)
    with pytest.raises(ForwardProxyError) as info:
        with trio.fail_after(10):
            await proxy.open("hub", 1)
    assert str(info.value).startswith(f"TLS with forward proxy https://127.0.0.1:{port} failed: ")


# --- the agent's flags -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("agent-pki")
    ca = DevCA.create_or_load(directory / "ca")
    agent = ca.issue_agent("cluster1", "agent-a", directory)
    return {"ca": ca.ca_path, "cert": agent.cert, "key": agent.key}


def _args(certs: dict[str, Path], *extra: str) -> list[str]:
    return [
        *("--server", "hub.example.com:8091", "--cluster", "cluster1", "--ca", str(certs["ca"])),
        *("--cert", str(certs["cert"]), "--key", str(certs["key"]), *extra),
    ]


def _exit_message(capsys: pytest.CaptureFixture[str], argv: list[str], environ: dict[str, str]) -> str:
    with pytest.raises(SystemExit) as info:
        parse_settings(argv, environ=environ)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_agent_proxy_flags_and_their_twins(certs: dict[str, Path]) -> None:
    settings = parse_settings(
        _args(certs, "--proxy-url", "https://agent:pw@proxy.corp:3129", "--proxy-ca-file", str(certs["ca"])),
        environ={"HTTPS_PROXY": "http://ignored:1", "NO_PROXY": ".internal"},
    )
    proxy, route = settings.forward_proxy(*settings.server)
    assert proxy is not None and proxy.url == ProxyURL.parse("https://agent:pw@proxy.corp:3129")
    assert proxy.ca_file == certs["ca"]
    assert route.why == "through https://agent:***@proxy.corp:3129 (from --proxy-url)"
    assert settings.summary()["proxy_to_server"] == route.why
    assert "pw" not in str(settings.summary())

    twins = parse_settings(
        _args(certs),
        environ={
            "CLUSTER_PROXY_AGENT_PROXY_URL": "http://twin:3128",
            "CLUSTER_PROXY_AGENT_NO_PROXY": "example.com",
            "NO_PROXY": "*",
        },
    )
    assert (
        twins.forward_proxy("hub.example.com", 8091)[1].why
        == "direct: --no-proxy entry 'example.com' matches"
    )
    assert twins.forward_proxy("hub.other", 8091)[0] is not None


def test_agent_takes_https_proxy_and_no_proxy_from_the_environment(certs: dict[str, Path]) -> None:
    settings = parse_settings(
        _args(certs, "--signer", "https://signer.example.com:8443"),
        environ={"https_proxy": "http://proxy.corp:3128", "no_proxy": "signer.example.com"},
    )
    assert settings.forward_proxy(*settings.server)[0] is not None
    assert settings.signer_endpoint().proxy is None  # the signer is exempt, the hub is not
    assert settings.summary()["proxy_to_signer"] == "direct: no_proxy entry 'signer.example.com' matches"
    plain = parse_settings(_args(certs), environ={"HTTP_PROXY": "http://plain:3128"})
    assert plain.forward_proxy(*plain.server)[0] is None
    assert any("HTTP_PROXY is set but not used" in note for note in plain.proxy_notes())


@pytest.mark.parametrize(
    ("extra", "environ", "says"),
    [
        (["--proxy-url", "socks5://proxy:1080"], {}, "--proxy-url: SOCKS proxies are not supported"),
        (["--proxy-url", "http://proxy:3128/path"], {}, "--proxy-url: malformed proxy URL"),
        (["--proxy-url", "gopher://proxy:70"], {}, "unsupported proxy scheme 'gopher'"),
        (
            [],
            {"HTTPS_PROXY": "socks5h://proxy:1080"},
            "environment variable HTTPS_PROXY: SOCKS proxies are not",
        ),
        ([], {"CLUSTER_PROXY_AGENT_PROXY_URL": "http://"}, "CLUSTER_PROXY_AGENT_PROXY_URL (--proxy-url)"),
        (["--proxy-ca-file", "/nonexistent/proxy-ca.pem"], {}, "--proxy-ca-file: file not found"),
        (["--no-proxy", "10.0.0.0/40"], {}, "--no-proxy: NO_PROXY entry '10.0.0.0/40' is not a CIDR"),
    ],
)
def test_agent_refuses_bad_proxy_settings_at_start(
    certs: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    environ: dict[str, str],
    says: str,
) -> None:
    assert says in _exit_message(capsys, _args(certs, *extra), environ)


def test_agent_refuses_a_proxy_ca_file_without_a_certificate(
    certs: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    junk = tmp_path / "proxy-ca.pem"
    junk.write_text("not a certificate\n")
    message = _exit_message(capsys, _args(certs, "--proxy-ca-file", str(junk)), {})
    assert f"--proxy-ca-file: CA bundle {junk} holds no valid PEM certificate" in message


def test_an_unused_proxy_ca_file_is_reported(certs: dict[str, Path]) -> None:
    settings = parse_settings(
        _args(certs, "--proxy-url", "http://proxy:3128", "--proxy-ca-file", str(certs["ca"])), environ={}
    )
    assert any(
        "--proxy-ca-file" in note and "no https:// proxy applies" in note for note in settings.proxy_notes()
    )


def test_children_dialing_loopback_get_no_proxy_variables() -> None:
    env = {
        "HTTPS_PROXY": "http://corp:3128",
        "https_proxy": "x",
        "HTTP_PROXY": "x",
        "no_proxy": "y",
        "PATH": "/bin",
    }
    assert without_proxy_variables(env) == {"PATH": "/bin"}
