"""The SDK against a real TLS + HTTP/2 CONNECT acceptor on loopback (clusterproxy_sdk.testing).

Everything is real but the proxy-server's routing: TCP, TLS 1.3 with client certificates from a dev
CA, ALPN, the tunnel's HTTP/2 acceptor, error statuses with reasons.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import trio

from clusterproxy_protocol.driver import IncomingRequest
from clusterproxy_protocol.pki import DevCA
from clusterproxy_sdk import (
    CLUSTER_HEADER,
    ALPNError,
    ConnectRefused,
    DialTimeout,
    Forbidden,
    MalformedTarget,
    NoAgentConnected,
    ProxyConnectionError,
    TargetUnreachable,
    TLSFiles,
    TooManyRequests,
    TunnelClosed,
    UnknownCluster,
    open_shared_tunnel,
    open_tunnel,
)
from clusterproxy_sdk.testing import echo_handler, open_fake_proxy, refuse_handler
from tests.support.waiting import wait_until


async def _roundtrip(stream: trio.abc.HalfCloseableStream, payload: bytes) -> bytes:
    """Send ``payload`` then EOF while reading everything back (half-close keeps the read side)."""
    received = bytearray()

    async def sender() -> None:
        view = memoryview(payload)
        for offset in range(0, len(view), 100_000):
            await stream.send_all(view[offset : offset + 100_000])
        await stream.send_eof()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        while data := await stream.receive_some():
            received += data
    return bytes(received)


async def test_connect_sends_authority_and_cluster_header_and_round_trips(tmp_path: Path) -> None:
    payload = os.urandom(3 << 20)
    async with open_fake_proxy(tmp_path) as fake, open_tunnel(fake.address, fake.client_tls) as tunnel:
        stream = await tunnel.connect("cluster1", "10.1.2.3", 8080)
        with trio.fail_after(20):
            echoed = await _roundtrip(stream, payload)
        await stream.aclose()
    assert hashlib.sha256(echoed).hexdigest() == hashlib.sha256(payload).hexdigest()
    [seen] = fake.requests
    assert seen.method == "CONNECT"
    assert seen.authority == "10.1.2.3:8080"
    assert seen.cluster == "cluster1"


async def test_ipv6_target_is_bracketed(tmp_path: Path) -> None:
    async with open_fake_proxy(tmp_path) as fake, open_tunnel(fake.url, fake.client_tls) as tunnel:
        stream = await tunnel.connect("c2", "fd00::17", 443)
        await stream.aclose()
    assert fake.requests[0].authority == "[fd00::17]:443"


async def test_kube_apiserver_uses_bare_cluster_name_without_header(tmp_path: Path) -> None:
    async with open_fake_proxy(tmp_path) as fake, open_tunnel(fake.address, fake.client_tls) as tunnel:
        stream = await tunnel.connect_kube_apiserver("cluster1")
        await stream.send_all(b"ping")
        assert await stream.receive_some() == b"ping"
        await stream.aclose()
    [seen] = fake.requests
    assert seen.authority == "cluster1:443"
    assert CLUSTER_HEADER not in seen.headers


@pytest.mark.parametrize(
    ("status", "exc_type"),
    [
        (400, MalformedTarget),
        (403, Forbidden),
        (404, UnknownCluster),
        (429, TooManyRequests),
        (502, TargetUnreachable),
        (503, NoAgentConnected),
        (504, DialTimeout),
    ],
)
async def test_refusals_raise_typed_errors_with_reason(
    tmp_path: Path, status: int, exc_type: type[ConnectRefused]
) -> None:
    reason = f"refused for the test with {status}"
    async with (
        open_fake_proxy(tmp_path, refuse_handler(status, reason)) as fake,
        open_tunnel(fake.address, fake.client_tls) as tunnel,
    ):
        with pytest.raises(exc_type) as info:
            await tunnel.connect("cluster1", "svc", 80)
        # The connection survives a refusal: the next stream works.
        fake.handler = echo_handler
        stream = await tunnel.connect("cluster1", "svc", 80)
        await stream.aclose()
    assert info.value.status == status
    assert info.value.reason == reason
    assert len(fake.connections) == 1


async def test_unlisted_status_is_plain_connect_refused(tmp_path: Path) -> None:
    async with (
        open_fake_proxy(tmp_path, refuse_handler(418, "short and stout")) as fake,
        open_tunnel(fake.address, fake.client_tls) as tunnel,
    ):
        with pytest.raises(ConnectRefused) as info:
            await tunnel.connect("cluster1", "svc", 80)
    assert type(info.value) is ConnectRefused
    assert (info.value.status, info.value.reason) == (418, "short and stout")


async def test_many_concurrent_streams_share_one_connection(tmp_path: Path) -> None:
    results: dict[int, bool] = {}
    async with open_fake_proxy(tmp_path) as fake, open_tunnel(fake.address, fake.client_tls) as tunnel:

        async def one(i: int) -> None:
            payload = os.urandom(20_000 + i)
            stream = await tunnel.connect("cluster1", f"svc-{i}", 1000 + i)
            results[i] = await _roundtrip(stream, payload) == payload
            await stream.aclose()

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for i in range(50):
                    nursery.start_soon(one, i)
    assert results == {i: True for i in range(50)}
    assert len(fake.connections) == 1
    assert sorted(r.authority for r in fake.requests) == sorted(f"svc-{i}:{1000 + i}" for i in range(50))


async def test_server_without_h2_gives_alpn_error(tmp_path: Path) -> None:
    async with open_fake_proxy(tmp_path, alpn=["http/1.1"]) as fake:
        with pytest.raises(ALPNError, match="did not agree to HTTP/2"):
            async with open_tunnel(fake.address, fake.client_tls):
                pass


async def test_server_certificate_from_another_ca_is_rejected(tmp_path: Path) -> None:
    other = DevCA.create_or_load(tmp_path / "other", name="other-ca")
    async with open_fake_proxy(tmp_path / "fake") as fake:
        tls = TLSFiles(other.ca_path, fake.client_cert, fake.client_key)
        with pytest.raises(ProxyConnectionError, match=r"TLS handshake .* failed"):
            async with open_tunnel(fake.address, tls):
                pass


async def test_wrong_server_name_is_rejected(tmp_path: Path) -> None:
    async with open_fake_proxy(tmp_path) as fake:
        with pytest.raises(ProxyConnectionError, match="certificate"):
            async with open_tunnel(fake.address, fake.client_tls, server_hostname="not-the-proxy.example"):
                pass


async def test_nothing_listening_gives_proxy_connection_error(tmp_path: Path) -> None:
    async with open_fake_proxy(tmp_path) as fake:
        tls = fake.client_tls
    # The fake is gone: its port refuses now.
    with pytest.raises(ProxyConnectionError, match=f"127.0.0.1:{fake.address[1]}"):
        async with open_tunnel(fake.address, tls):
            pass


async def test_silent_server_hits_connect_timeout(tmp_path: Path) -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    ca = DevCA.create_or_load(tmp_path)
    client = ca.issue_client("c", tmp_path)
    async with listener:  # accepts at the TCP level (backlog) but never answers TLS
        with trio.fail_after(10), pytest.raises(ProxyConnectionError, match=r"within 0\.3s"):
            async with open_tunnel(
                ("127.0.0.1", port), TLSFiles(ca.ca_path, client.cert, client.key), connect_timeout=0.3
            ):
                pass


async def test_dropped_connection_fails_streams_and_connect(tmp_path: Path) -> None:
    async with open_fake_proxy(tmp_path) as fake, open_tunnel(fake.address, fake.client_tls) as tunnel:
        stream = await tunnel.connect("cluster1", "svc", 80)
        fake.drop_connections()
        with trio.fail_after(5):
            await tunnel.wait_closed()
        assert not tunnel.is_alive
        with pytest.raises(trio.BrokenResourceError):
            await stream.receive_some()
        with pytest.raises(TunnelClosed):
            await tunnel.connect("cluster1", "svc", 80)


async def test_exception_in_block_is_not_wrapped_in_a_group(tmp_path: Path) -> None:
    async with open_fake_proxy(tmp_path) as fake:
        with pytest.raises(KeyError, match="mine"):
            async with open_tunnel(fake.address, fake.client_tls):
                raise KeyError("mine")


async def test_shared_tunnel_redials_after_the_connection_dies(tmp_path: Path) -> None:
    async with open_fake_proxy(tmp_path) as fake, open_shared_tunnel(fake.address, fake.client_tls) as shared:
        assert shared.current is None  # lazy: nothing dialed yet
        first = await shared.connect("cluster1", "svc", 80)
        second = await shared.connect("cluster1", "svc", 81)
        assert len(fake.connections) == 1
        fake.drop_connections()
        await wait_until(
            lambda: shared.current is None or not shared.current.is_alive,
            timeout=5,
            what="the shared connection to die",
        )
        with pytest.raises(trio.BrokenResourceError):
            await first.receive_some()
        third = await shared.connect("cluster1", "svc", 82)
        await third.send_all(b"after redial")
        assert await third.receive_some() == b"after redial"
        for stream in (first, second, third):
            await stream.aclose()
    assert shared.connections_made == 2
    assert len(fake.connections) == 2


async def test_shared_tunnel_dials_once_for_concurrent_callers(tmp_path: Path) -> None:
    async with open_fake_proxy(tmp_path) as fake, open_shared_tunnel(fake.address, fake.client_tls) as shared:
        streams = []

        async def one(i: int) -> None:
            streams.append(await shared.connect("cluster1", "svc", 1000 + i))

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(one, i)
        for stream in streams:
            await stream.aclose()
    assert len(streams) == 20
    assert shared.connections_made == 1
    assert len(fake.connections) == 1


async def test_handler_sees_half_close(tmp_path: Path) -> None:
    """EOF from the client reaches the far end, which can still answer (no upstream-style hang)."""

    async def count_then_answer(request: IncomingRequest) -> None:
        stream = await request.accept()
        total = 0
        while data := await stream.receive_some():
            total += len(data)
        await stream.send_all(f"got {total}".encode())
        await stream.send_eof()

    async with (
        open_fake_proxy(tmp_path, count_then_answer) as fake,
        open_tunnel(fake.address, fake.client_tls) as tunnel,
    ):
        stream = await tunnel.connect("cluster1", "svc", 80)
        with trio.fail_after(5):
            answer = await _roundtrip(stream, b"z" * 12345)
    assert answer == b"got 12345"


async def test_shared_tunnel_moves_off_a_draining_connection(tmp_path: Path) -> None:
    async with open_fake_proxy(tmp_path) as fake, open_shared_tunnel(fake.address, fake.client_tls) as shared:
        old_stream = await shared.connect("cluster1", "svc", 80)
        old = shared.current
        assert old is not None
        fake.drain_connections()
        await wait_until(lambda: not old.accepts_streams, timeout=5, what="the old connection to drain")
        new_stream = await shared.connect("cluster1", "svc", 81)
        assert shared.current is not old
        assert len(fake.connections) == 2
        # The draining connection still carries its stream...
        await old_stream.send_all(b"still here")
        assert await old_stream.receive_some() == b"still here"
        assert old.is_alive
        # ...and is closed once that stream ends.
        await old_stream.aclose()
        with trio.fail_after(5):
            await old.wait_closed()
        await new_stream.send_all(b"new")
        assert await new_stream.receive_some() == b"new"
        await new_stream.aclose()
