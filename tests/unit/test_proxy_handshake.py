"""The local proxy's handshakes, sans-IO (clusterproxy_cli.proxy_handshake): SOCKS5 and HTTP/1.1 on
one port, malformed input answered and closed, the answers to the hub's refusals; the listen check
and the kubectl command's kubeconfig."""

from __future__ import annotations

import argparse
import base64
import os
import struct
from pathlib import Path

import pytest
import yaml

from clusterproxy_cli.kubectl import KubeAccess, access_from_args, proxied_kubeconfig, temporary_kubeconfig
from clusterproxy_cli.main import build_parser, main
from clusterproxy_cli.proxy import is_loopback
from clusterproxy_cli.proxy_handshake import Handshake, Refusal, Reply, Request, Route, route, socks_reply
from clusterproxy_protocol.config import ConfigError, parse_args_or_exit


def feed_all(handshake: Handshake, *chunks: bytes) -> tuple[bytes, Request | Refusal | None]:
    sent = b""
    decision = None
    for chunk in chunks:
        out, decision = handshake.feed(chunk)
        sent += out
        if decision is not None:
            break
    return sent, decision


def domain_request(host: str, port: int, command: int = 1) -> bytes:
    return bytes([5, command, 0, 3, len(host)]) + host.encode() + struct.pack("!H", port)


def user(name: str, password: str = "") -> bytes:
    return bytes([1, len(name)]) + name.encode() + bytes([len(password)]) + password.encode()


# --- SOCKS5 --------------------------------------------------------------------------------------------


def test_socks5_user_name_names_the_cluster() -> None:
    handshake = Handshake()
    sent, decision = feed_all(
        handshake, b"\x05\x02\x00\x02", user("cluster1", "ignored"), domain_request("svc.ns", 8080)
    )
    assert sent == b"\x05\x02" + b"\x01\x00"  # user name/password chosen (over no-auth), accepted
    assert decision == Request("socks5", "cluster1", "svc.ns", 8080, b"")
    assert handshake.opened() == socks_reply(Reply.SUCCEEDED) == b"\x05\x00\x00\x01\x00\x00\x00\x00\x00\x00"


def test_socks5_byte_by_byte_with_early_data() -> None:
    handshake = Handshake()
    data = b"\x05\x01\x02" + user("cluster1") + domain_request("cluster1", 443) + b"\x16\x03\x01"
    sent = b""
    decision = None
    for i in range(len(data)):
        out, decision = handshake.feed(data[i : i + 1])
        sent += out
        if decision is not None:
            break
    assert sent == b"\x05\x02\x01\x00"
    assert decision == Request("socks5", "cluster1", "cluster1", 443, b"")
    handshake = Handshake()
    _, decision = feed_all(handshake, data)  # all at once: bytes after the request are the target's
    assert isinstance(decision, Request) and decision.first_bytes == b"\x16\x03\x01"


def test_socks5_no_auth_ipv4_and_ipv6() -> None:
    handshake = Handshake()
    sent, decision = feed_all(handshake, b"\x05\x01\x00", b"\x05\x01\x00\x01\x0a\x00\x00\x05\x00\x50")
    assert sent == b"\x05\x00"
    assert decision == Request("socks5", None, "10.0.0.5", 80, b"")
    handshake = Handshake()
    v6 = bytes([5, 1, 0, 4]) + bytes(15) + b"\x01" + struct.pack("!H", 443)
    _, decision = feed_all(handshake, b"\x05\x01\x00" + v6)
    assert decision == Request("socks5", None, "::1", 443, b"")
    assert decision.target == "[::1]:443"


@pytest.mark.parametrize(("command", "name"), [(2, "BIND"), (3, "UDP ASSOCIATE")])
def test_socks5_bind_and_udp_associate_are_not_supported(command: int, name: str) -> None:
    sent, decision = feed_all(Handshake(), b"\x05\x01\x00", domain_request("svc", 80, command))
    assert sent == b"\x05\x00"
    assert isinstance(decision, Refusal)
    assert decision.reply == socks_reply(Reply.COMMAND_NOT_SUPPORTED) and decision.reply[1] == 0x07
    assert name in decision.reason


@pytest.mark.parametrize(
    ("chunks", "sent", "reply", "reason"),
    [
        ([b"\x05\x00"], b"", b"\x05\xff", "no methods"),
        ([b"\x05\x01\x01"], b"", b"\x05\xff", "no acceptable SOCKS5 method among 0x01"),
        ([b"\x05\x01\x02", b"\x02\x01a\x00"], b"\x05\x02", b"\x01\x01", "version 2"),
        ([b"\x05\x01\x02", b"\x01\x00\x00"], b"\x05\x02", b"\x01\x01", "user name '' is not a cluster name"),
        (
            [b"\x05\x01\x02", user("Not_A_Cluster")],
            b"\x05\x02",
            b"\x01\x01",
            "'Not_A_Cluster' is not a cluster",
        ),
        (
            [b"\x05\x01\x00", b"\x04\x01\x00\x01"],
            b"\x05\x00",
            socks_reply(Reply.GENERAL_FAILURE),
            "version 4",
        ),
        (
            [b"\x05\x01\x00", b"\x05\x01\x00\x09"],
            b"\x05\x00",
            socks_reply(Reply.ADDRESS_TYPE_NOT_SUPPORTED),
            "0x09",
        ),
        (
            [b"\x05\x01\x00", b"\x05\x01\x00\x03\x00\x00\x50"],
            b"\x05\x00",
            socks_reply(Reply.HOST_UNREACHABLE),
            "domain",
        ),
        (
            [b"\x05\x01\x00", b"\x05\x01\x00\x03\x02a b\x00\x50"[:7] + b"\x00\x50"],
            b"\x05\x00",
            socks_reply(Reply.HOST_UNREACHABLE),
            "domain",
        ),
        (
            [b"\x05\x01\x00", domain_request("svc", 0)],
            b"\x05\x00",
            socks_reply(Reply.GENERAL_FAILURE),
            "port 0",
        ),
        ([b"\x05\x01\x00", b"\x05\x01"], b"\x05\x00", b"", "closed during the SOCKS5 request"),
    ],
)
def test_malformed_socks5_is_answered_and_closed(
    chunks: list[bytes], sent: bytes, reply: bytes, reason: str
) -> None:
    out, decision = feed_all(Handshake(), *chunks, b"")
    assert out == sent
    assert isinstance(decision, Refusal), decision
    assert decision.reply == reply and decision.protocol == "socks5"
    assert reason in decision.reason


def test_socks4_is_refused_in_its_own_words() -> None:
    _, decision = Handshake().feed(b"\x04\x01\x00\x50\x0a\x00\x00\x01\x00")
    assert isinstance(decision, Refusal) and decision.reply == b"\x00\x5b" + bytes(6)
    assert "SOCKS5" in decision.reason


def test_a_client_that_sends_nothing_is_closed_silently() -> None:
    _, decision = Handshake().feed(b"")
    assert isinstance(decision, Refusal) and decision.reply == b"" and decision.protocol is None


@pytest.mark.parametrize(
    ("status", "code"),
    [(400, 0x01), (403, 0x02), (404, 0x03), (429, 0x01), (502, 0x05), (503, 0x03), (504, 0x06), (418, 0x01)],
)
def test_hub_refusals_map_to_socks_replies(status: int, code: int) -> None:
    handshake = Handshake()
    feed_all(handshake, b"\x05\x01\x00", domain_request("svc", 80))
    assert handshake.refused(status, "why") == bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])
    assert handshake.no_cluster("why")[1] == Reply.NOT_ALLOWED
    assert handshake.hub_unavailable("why")[1] == Reply.GENERAL_FAILURE


# --- HTTP ----------------------------------------------------------------------------------------------


def basic(user_name: str) -> str:
    return "Basic " + base64.b64encode(f"{user_name}:".encode()).decode()


def test_http_connect_with_the_proxy_user() -> None:
    handshake = Handshake()
    head = (
        f"CONNECT svc.ns:443 HTTP/1.1\r\nHost: svc.ns:443\r\nProxy-Authorization: {basic('cluster1')}\r\n\r\n"
    )
    sent, decision = feed_all(handshake, head[:10].encode(), head[10:].encode() + b"early")
    assert sent == b""
    assert decision == Request("http-connect", "cluster1", "svc.ns", 443, b"early")
    assert handshake.opened() == b"HTTP/1.1 200 Connection Established\r\n\r\n"
    refused = handshake.refused(404, "unknown cluster 'x'")
    assert (
        refused.startswith(b"HTTP/1.1 404 Not Found\r\n")
        and b"cluster-proxy-reason: unknown cluster 'x'" in refused
    )


def test_http_forward_request_is_rewritten_to_origin_form() -> None:
    handshake = Handshake()
    head = (
        b"POST http://10.0.0.5:8080/a?b=1 HTTP/1.1\r\nHost: 10.0.0.5:8080\r\n"
        b"Proxy-Authorization: " + basic("cluster2").encode() + b"\r\nProxy-Connection: keep-alive\r\n"
        b"Content-Length: 4\r\n\r\nbody"
    )
    _, decision = feed_all(handshake, head)
    assert isinstance(decision, Request)
    assert (decision.protocol, decision.cluster, decision.host, decision.port) == (
        "http-forward",
        "cluster2",
        "10.0.0.5",
        8080,
    )
    assert decision.first_bytes.startswith(b"POST /a?b=1 HTTP/1.1\r\nHost: 10.0.0.5:8080\r\n")
    assert b"roxy-" not in decision.first_bytes and decision.first_bytes.endswith(
        b"connection: close\r\n\r\nbody"
    )
    assert handshake.opened() == b""


def test_http_without_a_cluster_gets_407_with_the_realm() -> None:
    handshake = Handshake()
    _, decision = feed_all(handshake, b"CONNECT 10.0.0.5:443 HTTP/1.1\r\nHost: 10.0.0.5:443\r\n\r\n")
    assert isinstance(decision, Request) and route(decision, None) is None
    answer = handshake.no_cluster("no cluster named")
    assert answer.startswith(b"HTTP/1.1 407 Proxy Authentication Required\r\n")
    assert b'Proxy-Authenticate: Basic realm="cluster-proxy: user name = cluster"\r\n' in answer


@pytest.mark.parametrize(
    ("data", "status", "reason"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 400, "use CONNECT, or an absolute http:// URL"),
        (b"GET https://x/ HTTP/1.1\r\nHost: x\r\n\r\n", 400, "absolute http:// URL"),
        (b"CONNECT nonsense HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed CONNECT target 'nonsense'"),
        (
            b"CONNECT a:1 HTTP/1.1\r\nHost: x\r\nProxy-Authorization: Basic !!!\r\n\r\n",
            400,
            "not valid base64",
        ),
        (b"GARBAGE\x00\r\n\r\n", 400, "malformed HTTP request"),
        (b"CONNECT a:1 HTTP/1.1\r\nHost: a:1\r\nX: a\x01b\r\n\r\n", 400, "control byte"),
        (b"CONNECT a:1 HTTP/1.1\r\nX: " + b"a" * (20 << 10), 431, "malformed HTTP request"),
        (b"CONNECT a:1 HTTP/1.1\r\nHost", 400, "peer unexpectedly closed connection"),
    ],
)
def test_malformed_http_is_answered_and_closed(data: bytes, status: int, reason: str) -> None:
    handshake = Handshake()
    _, decision = handshake.feed(data)
    if decision is None:
        _, decision = handshake.feed(b"")
    assert isinstance(decision, Refusal), decision
    assert decision.reply.startswith(f"HTTP/1.1 {status} ".encode()), decision.reply[:80]
    assert b"connection: close" in decision.reply
    assert reason in decision.reason


# --- routing ---------------------------------------------------------------------------------------------


def test_route_order_user_then_default_then_bare_cluster_name() -> None:
    named = Request("socks5", "cluster1", "cluster2", 443, b"")
    bare = Request("socks5", None, "cluster2", 443, b"")
    ip = Request("socks5", None, "10.0.0.5", 443, b"")
    assert route(named, "cluster3") == Route("cluster1", "proxy-user")
    assert route(bare, "cluster3") == Route("cluster3", "default")
    assert route(bare, None) == Route("cluster2", "bare-cluster-name")
    assert route(ip, None) is None
    assert route(ip, "cluster3") == Route("cluster3", "default")


# --- the listen check and the command line -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("example.com", False),
    ],
)
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_non_loopback_listen_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = [tmp_path / name for name in ("ca.crt", "c.crt", "c.key")]
    for file in files:
        file.write_text("x")
    argv = ["proxy", "--listen", "0.0.0.0:1080", "--proxy", "hub:8090"]
    argv += [f"--ca={files[0]}", f"--cert={files[1]}", f"--key={files[2]}"]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--listen 0.0.0.0:1080 is not a loopback address" in err and "--allow-remote" in err


def _kubectl_args(*argv: str) -> argparse.Namespace:
    return parse_args_or_exit(build_parser(), ["kubectl", "cluster1", *argv], environ={})


def test_kubectl_arguments_after_the_double_dash_are_kubectls() -> None:
    args = _kubectl_args("--insecure", "--", "exec", "pod", "--", "ls", "-l")
    assert (
        args.cluster == "cluster1"
        and args.insecure
        and args.kubectl_args == ["exec", "pod", "--", "ls", "-l"]
    )


def test_kubectl_kubeconfig_from_flags(tmp_path: Path) -> None:
    ca, token = tmp_path / "ca.crt", tmp_path / "token"
    ca.write_text("x")
    token.write_text("t")
    access = access_from_args(_kubectl_args(f"--cluster-ca={ca}", f"--token-file={token}"))
    document = proxied_kubeconfig("cluster1", ("127.0.0.1", 40123), access)
    cluster = document["clusters"][0]["cluster"]
    assert cluster == {
        "server": "https://cluster1",
        "proxy-url": "socks5://cluster1@127.0.0.1:40123",
        "certificate-authority": str(ca),
        "tls-server-name": "kubernetes.default.svc",
    }
    assert document["users"][0]["user"] == {"tokenFile": str(token)}
    insecure = access_from_args(_kubectl_args("--insecure", "--token=abc"))
    assert insecure == KubeAccess({"insecure-skip-tls-verify": True}, {"token": "abc"})
    with pytest.raises(ConfigError, match="--cluster-ca FILE"):
        access_from_args(_kubectl_args("--token=abc"))


def test_kubectl_kubeconfig_from_a_context(tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_text("x")
    source = tmp_path / "managed.kubeconfig"
    source.write_text(
        yaml.safe_dump(
            {
                "clusters": [
                    {
                        "name": "m",
                        "cluster": {
                            "server": "https://10.0.0.1:6443",
                            "certificate-authority": "ca.crt",
                            "proxy-url": "http://old:3128",
                        },
                    }
                ],
                "users": [{"name": "admin", "user": {"client-certificate": "a.crt", "client-key": "a.key"}}],
                "contexts": [{"name": "ctx", "context": {"cluster": "m", "user": "admin"}}],
                "current-context": "ctx",
            }
        )
    )
    access = access_from_args(_kubectl_args(f"--kubeconfig={source}"))
    assert access.cluster == {
        "certificate-authority": str(tmp_path / "ca.crt"),
        "tls-server-name": "kubernetes.default.svc",
    }
    assert access.user == {
        "client-certificate": str(tmp_path / "a.crt"),
        "client-key": str(tmp_path / "a.key"),
    }
    overridden = access_from_args(
        _kubectl_args(f"--kubeconfig={source}", "--token=abc", "--tls-server-name=api.m")
    )
    assert overridden.user == {"token": "abc"} and overridden.cluster["tls-server-name"] == "api.m"
    with pytest.raises(ConfigError, match="no context named 'nope'"):
        access_from_args(_kubectl_args(f"--kubeconfig={source}", "--context=nope"))


def test_the_temporary_kubeconfig_is_private_and_removed() -> None:
    with temporary_kubeconfig({"kind": "Config", "users": [{"user": {"token": "secret"}}]}) as path:
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert yaml.safe_load(path.read_text())["users"][0]["user"]["token"] == "secret"
    assert not path.exists()
