"""Every malformed HTTP/1.1 request gets an answer: the status h11 hints (400; 431 for a head over
the limit) with the reason in its body, then the connection is closed cleanly. On the proxy-server's
client port over mTLS (the CONNECT frontend and the plain-HTTP forward path), its admin port (the
shared admin-style server, also the cert-signer's API), its agent WebSocket port and the agent's
control endpoint (issue 32, point 4). Bytes that are no HTTP/1.x request line stay closed with
nothing sent (tests/unit/test_sniff.py, tests/e2e/test_h2spec.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import trio
import trio.testing

from clusterproxy_agent.control import ControlEndpoint
from tests.support.clients import client_context
from tests.support.inprocess import start_server
from tests.support.pki import PkiFiles

LONG = 17 << 10  # over every server's 16 KiB head limit; sent without its end, so all of it is read


@dataclass(frozen=True)
class Malformed:
    name: str
    request: bytes
    status: int = 400
    reason: bytes = b"malformed HTTP request"  # in the body


def _connect(line: bytes = b"CONNECT cluster1:443 HTTP/1.1", *headers: bytes) -> bytes:
    return b"\r\n".join([line, b"Host: cluster1:443", *headers]) + b"\r\n\r\n"


CASES = [
    Malformed("nul-in-target", _connect(b"CONNECT cluster1\x00:443 HTTP/1.1")),
    Malformed("control-byte-in-target", _connect(b"CONNECT cluster\x011:443 HTTP/1.1")),
    Malformed("space-in-target", _connect(b"CONNECT cluster 1:443 HTTP/1.1")),
    Malformed("bare-cr-in-target", _connect(b"CONNECT cluster1\r:443 HTTP/1.1")),
    Malformed("nul-in-forward-target", b"GET http://echo.cluster1/\x00 HTTP/1.1\r\nHost: echo\r\n\r\n"),
    Malformed("invalid-version", _connect(b"CONNECT cluster1:443 HTTP/1.x")),
    Malformed("nul-in-header-value", _connect(b"CONNECT a:1 HTTP/1.1", b"X-A: a\x00b")),
    Malformed(
        "control-byte-in-header-value", _connect(b"CONNECT a:1 HTTP/1.1", b"X-A: a\x01b"), reason=b"0x01"
    ),
    Malformed("del-in-header-value", _connect(b"CONNECT a:1 HTTP/1.1", b"X-A: a\x7fb"), reason=b"0x7f"),
    Malformed("bare-cr-in-header-value", _connect(b"CONNECT a:1 HTTP/1.1", b"X-A: a\rb")),
    Malformed("space-in-header-name", _connect(b"CONNECT a:1 HTTP/1.1", b"X A: b")),
    Malformed("space-before-colon", _connect(b"CONNECT a:1 HTTP/1.1", b"X-A : b")),
    Malformed("header-without-colon", _connect(b"CONNECT a:1 HTTP/1.1", b"X-A")),
    Malformed("obs-fold", _connect(b"CONNECT a:1 HTTP/1.1", b"X-A: b", b" c"), reason=b"line folding"),
    Malformed("bad-content-length", b"POST http://echo/ HTTP/1.1\r\nHost: e\r\nContent-Length: 1x\r\n\r\n"),
    Malformed("over-long-request-line", b"CONNECT " + b"a" * LONG, status=431),
    Malformed(
        "over-long-header-block", b"CONNECT a:1 HTTP/1.1\r\n" + b"X-A: b\r\n" * (LONG // 8), status=431
    ),
]


async def exchange(stream: trio.abc.Stream, request: bytes) -> bytes:
    """Send ``request``, read until the server's clean end (a reset fails the test), return it all."""
    await stream.send_all(request)
    answer = b""
    with trio.fail_after(10):
        while data := await stream.receive_some(65536):
            answer += data
    return answer


def assert_answered(answer: bytes, case: Malformed) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % case.status), answer[:300]
    assert case.reason in body, answer[:500]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
async def test_client_port_answers_a_malformed_request(
    nursery: trio.Nursery, pki: PkiFiles, case: Malformed
) -> None:
    _, bound = await start_server(nursery, pki)
    tcp = await trio.open_tcp_stream("127.0.0.1", bound.client[1])
    stream = trio.SSLStream(tcp, client_context(pki, alpn=["http/1.1"]), server_hostname="localhost")
    assert_answered(await exchange(stream, case.request), case)
    await stream.aclose()


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
async def test_admin_port_answers_a_malformed_request(
    nursery: trio.Nursery, pki: PkiFiles, case: Malformed
) -> None:
    _, bound = await start_server(nursery, pki)
    stream = await trio.open_tcp_stream("127.0.0.1", bound.admin[1])
    assert_answered(await exchange(stream, case.request), case)
    await stream.aclose()


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
async def test_agent_websocket_port_answers_a_malformed_request(
    nursery: trio.Nursery, pki: PkiFiles, case: Malformed
) -> None:
    _, bound = await start_server(nursery, pki, agent_websocket_listen=("127.0.0.1", 0))
    stream = await trio.open_tcp_stream("127.0.0.1", bound.agent_websocket[1])
    assert_answered(await exchange(stream, case.request), case)
    await stream.aclose()


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
async def test_agent_control_endpoint_answers_a_malformed_request(case: Malformed) -> None:
    """The control endpoint reads a tunnel stream (no socket of its own): a memory stream stands in."""
    endpoint = ControlEndpoint("cluster1", ("kubernetes.default.svc", 443), None)
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(endpoint._serve, server, "hub-client")
        assert_answered(await exchange(client, case.request), case)
