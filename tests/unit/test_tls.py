"""TLS 1.3 mutual authentication with DevCA certificates, and readable configuration errors."""

from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trio.testing
from cryptography import x509

from clusterproxy_protocol import tls, workarounds
from clusterproxy_protocol.config import ConfigError
from clusterproxy_protocol.pki import DevCA, PemPair, peer_identity
from clusterproxy_protocol.tls import client_context, load_cert_chain, server_context


@dataclass
class Certs:
    ca: DevCA
    server: PemPair
    agent: PemPair
    client: PemPair


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    ca = DevCA.create_or_load(tmp_path / "ca")
    return Certs(
        ca=ca,
        server=ca.issue_server("proxy-server", ["localhost", "127.0.0.1"], tmp_path / "server"),
        agent=ca.issue_agent("cluster1", "agent-1", tmp_path / "agent"),
        client=ca.issue_client("alice", tmp_path / "client"),
    )


async def handshake(
    server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, hostname: str = "localhost"
) -> tuple[trio.SSLStream, trio.SSLStream]:
    """Handshake both ends over an in-memory stream pair, then exchange one message each way."""
    client_raw, server_raw = trio.testing.memory_stream_pair()
    server = trio.SSLStream(server_raw, server_ctx, server_side=True)
    client = trio.SSLStream(client_raw, client_ctx, server_hostname=hostname)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.do_handshake)
            nursery.start_soon(client.do_handshake)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.send_all, b"ping")
            assert await server.receive_some(4) == b"ping"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.send_all, b"pong")
            assert await client.receive_some(4) == b"pong"
    return server, client


async def test_mutual_tls_handshake_with_alpn_and_agent_identity(certs: Certs) -> None:
    server_ctx = server_context(certs.server.cert, certs.server.key, certs.ca.ca_path, alpn=["h2"])
    client_ctx = client_context(certs.agent.cert, certs.agent.key, certs.ca.ca_path, alpn=["h2"])
    server, client = await handshake(server_ctx, client_ctx)
    assert server.selected_alpn_protocol() == "h2"
    assert client.selected_alpn_protocol() == "h2"
    assert server.version() == "TLSv1.3"
    ident = peer_identity(server.getpeercert(binary_form=True))
    assert ident["agent"] == {"cluster": "cluster1", "agent_id": "agent-1"}
    server_ident = peer_identity(client.getpeercert(binary_form=True))
    assert server_ident["sans"] == ["DNS:localhost", "IP:127.0.0.1", "URI:cluster-proxy://hub/server"]


async def test_client_from_another_ca_is_refused(certs: Certs, tmp_path: Path) -> None:
    other = DevCA.create_or_load(tmp_path / "other-ca")
    rogue = other.issue_agent("cluster1", "agent-1", tmp_path / "rogue")
    server_ctx = server_context(certs.server.cert, certs.server.key, certs.ca.ca_path, alpn=["h2"])
    # the rogue trusts the real CA, so only the server's check can stop it
    client_ctx = client_context(rogue.cert, rogue.key, certs.ca.ca_path, alpn=["h2"])
    await _expect_server_refusal(server_ctx, client_ctx, "certificate")


async def test_client_without_certificate_is_refused(certs: Certs) -> None:
    server_ctx = server_context(certs.server.cert, certs.server.key, certs.ca.ca_path, alpn=["h2"])
    client_ctx = client_context(None, None, certs.ca.ca_path, alpn=["h2"])
    await _expect_server_refusal(server_ctx, client_ctx, "certificate")


async def _expect_server_refusal(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, word: str) -> None:
    client_raw, server_raw = trio.testing.memory_stream_pair()
    server = trio.SSLStream(server_raw, server_ctx, server_side=True)
    client = trio.SSLStream(client_raw, client_ctx, server_hostname="localhost")
    server_error: list[BaseException] = []

    async def serve() -> None:
        try:
            await server.do_handshake()
        except trio.BrokenResourceError as exc:
            server_error.append(exc)
        await server_raw.aclose()

    async def connect() -> None:
        # In TLS 1.3 the client may finish its handshake before the server has judged its
        # certificate; the refusal then shows on the first read.
        with pytest.raises(trio.BrokenResourceError):
            await client.do_handshake()
            await client.receive_some(1)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            nursery.start_soon(connect)
    assert len(server_error) == 1
    cause = server_error[0].__cause__
    assert isinstance(cause, ssl.SSLError)
    assert word in str(cause).lower()


async def test_client_rejects_server_from_another_ca(certs: Certs, tmp_path: Path) -> None:
    other = DevCA.create_or_load(tmp_path / "other-ca")
    server_ctx = server_context(certs.server.cert, certs.server.key, certs.ca.ca_path, alpn=["h2"])
    client_ctx = client_context(certs.client.cert, certs.client.key, other.ca_path, alpn=["h2"])
    client_raw, server_raw = trio.testing.memory_stream_pair()
    server = trio.SSLStream(server_raw, server_ctx, server_side=True)
    client = trio.SSLStream(client_raw, client_ctx, server_hostname="localhost")

    async def serve() -> None:
        with pytest.raises(trio.BrokenResourceError):
            await server.do_handshake()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            with pytest.raises(trio.BrokenResourceError) as info:
                await client.do_handshake()
            assert isinstance(info.value.__cause__, ssl.SSLCertVerificationError)
            await client_raw.aclose()


async def test_client_checks_the_host_name(certs: Certs) -> None:
    server_ctx = server_context(certs.server.cert, certs.server.key, certs.ca.ca_path, alpn=["h2"])
    client_ctx = client_context(certs.client.cert, certs.client.key, certs.ca.ca_path, alpn=["h2"])
    client_raw, server_raw = trio.testing.memory_stream_pair()
    server = trio.SSLStream(server_raw, server_ctx, server_side=True)
    client = trio.SSLStream(client_raw, client_ctx, server_hostname="evil.example.com")

    async def serve() -> None:
        with pytest.raises(trio.BrokenResourceError):
            await server.do_handshake()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            with pytest.raises(trio.BrokenResourceError) as info:
                await client.do_handshake()
            assert "evil.example.com" in str(info.value.__cause__)
            await client_raw.aclose()


def test_contexts_require_tls13_and_verification(certs: Certs) -> None:
    server_ctx = server_context(certs.server.cert, certs.server.key, certs.ca.ca_path, alpn=["h2"])
    client_ctx = client_context(
        certs.client.cert, certs.client.key, certs.ca.ca_path, alpn=["h2", "http/1.1"]
    )
    assert server_ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert client_ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert server_ctx.verify_mode == ssl.CERT_REQUIRED
    assert client_ctx.verify_mode == ssl.CERT_REQUIRED
    assert client_ctx.check_hostname is True
    # only our CA is trusted, not the system store
    assert len(client_ctx.get_ca_certs()) == 1


async def test_tls12_only_client_is_refused(certs: Certs) -> None:
    server_ctx = server_context(certs.server.cert, certs.server.key, certs.ca.ca_path, alpn=["h2"])
    client_ctx = client_context(certs.client.cert, certs.client.key, certs.ca.ca_path, alpn=["h2"])
    client_ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    client_ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    client_raw, server_raw = trio.testing.memory_stream_pair()
    server = trio.SSLStream(server_raw, server_ctx, server_side=True)
    client = trio.SSLStream(client_raw, client_ctx, server_hostname="localhost")

    async def serve() -> None:
        with pytest.raises(trio.BrokenResourceError):
            await server.do_handshake()
        await server_raw.aclose()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            with pytest.raises(trio.BrokenResourceError):
                await client.do_handshake()


async def test_reloading_the_certificate_affects_new_handshakes_only(certs: Certs, tmp_path: Path) -> None:
    server_ctx = server_context(certs.server.cert, certs.server.key, certs.ca.ca_path, alpn=["h2"])
    client_ctx = client_context(certs.client.cert, certs.client.key, certs.ca.ca_path, alpn=["h2"])
    _, old_client = await handshake(server_ctx, client_ctx)
    old_serial = x509.load_der_x509_certificate(old_client.getpeercert(binary_form=True)).serial_number

    renewed = certs.ca.issue_server("proxy-server", ["localhost"], tmp_path / "renewed")
    load_cert_chain(server_ctx, renewed.cert, renewed.key)
    _, new_client = await handshake(server_ctx, client_ctx)
    new_serial = x509.load_der_x509_certificate(new_client.getpeercert(binary_form=True)).serial_number
    assert new_serial != old_serial
    assert new_serial == x509.load_pem_x509_certificate(renewed.cert.read_bytes()).serial_number
    # the old connection still reports (and uses) the old certificate
    assert (
        x509.load_der_x509_certificate(old_client.getpeercert(binary_form=True)).serial_number == old_serial
    )


async def test_loopback_tcp_handshake(certs: Certs) -> None:
    server_ctx = server_context(certs.server.cert, certs.server.key, certs.ca.ca_path, alpn=["h2"])
    client_ctx = client_context(certs.agent.cert, certs.agent.key, certs.ca.ca_path, alpn=["h2"])
    seen: list[dict[str, object]] = []

    async def handler(stream: trio.SSLStream) -> None:
        await stream.do_handshake()
        seen.append(peer_identity(stream.getpeercert(binary_form=True)))
        await stream.send_all(await stream.receive_some(100))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            serve = functools.partial(trio.serve_ssl_over_tcp, host="127.0.0.1")
            listeners = await nursery.start(serve, handler, 0, server_ctx)
            port = listeners[0].transport_listener.socket.getsockname()[1]
            stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", port, ssl_context=client_ctx)
            await stream.send_all(b"hello")
            assert await stream.receive_some(100) == b"hello"
            assert stream.selected_alpn_protocol() == "h2"
            await stream.aclose()
            nursery.cancel_scope.cancel()
    assert seen[0]["agent"] == {"cluster": "cluster1", "agent_id": "agent-1"}


# --- configuration errors ------------------------------------------------------------------------------


def test_missing_file_names_the_path(certs: Certs, tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "server.crt"
    with pytest.raises(ConfigError, match=r"certificate file not found: .*nope/server\.crt"):
        server_context(missing, certs.server.key, certs.ca.ca_path, alpn=["h2"])
    with pytest.raises(ConfigError, match=r"private key file not found: .*nope/server\.crt"):
        client_context(certs.client.cert, missing, certs.ca.ca_path, alpn=["h2"])
    with pytest.raises(ConfigError, match=r"CA bundle file not found: .*nope/server\.crt"):
        client_context(certs.client.cert, certs.client.key, missing, alpn=["h2"])


def test_key_that_does_not_match_the_certificate(certs: Certs) -> None:
    with pytest.raises(ConfigError) as info:
        server_context(certs.server.cert, certs.client.key, certs.ca.ca_path, alpn=["h2"])
    message = str(info.value)
    assert "does not match" in message
    assert str(certs.client.key) in message
    assert str(certs.server.cert) in message


def test_a_pair_caught_between_a_renewals_two_renames_is_read_again(
    certs: Certs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal in another process replaces the key, then the certificate: a reader in between
    meets the new key with the old certificate, and must wait for the pair, not refuse it."""
    live = tmp_path / "live"
    live.mkdir()
    cert, key = live / "tls.crt", live / "tls.key"
    renewed = certs.ca.issue_client("alice", tmp_path / "renewed")
    cert.write_bytes(certs.client.cert.read_bytes())
    key.write_bytes(renewed.key.read_bytes())  # the renewal's first rename is done, not its second
    pauses: list[float] = []

    def pause(seconds: float) -> None:  # the writer's second rename happens during the first pause
        pauses.append(seconds)
        cert.write_bytes(renewed.cert.read_bytes())

    monkeypatch.setattr(tls.time, "sleep", pause)
    client_context(cert, key, certs.ca.ca_path, alpn=["h2"])
    assert pauses == [tls.PAIR_SETTLE_PAUSES[0]]
    # a pair that stays mismatched is refused, after a fraction of a second at most
    pauses.clear()
    monkeypatch.setattr(tls.time, "sleep", pauses.append)
    with pytest.raises(ConfigError, match="does not match"):
        client_context(certs.server.cert, certs.client.key, certs.ca.ca_path, alpn=["h2"])
    assert pauses == list(tls.PAIR_SETTLE_PAUSES) and sum(pauses) < 0.25


def test_garbage_and_empty_files(certs: Certs, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n")
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"garbage\.pem"):
        server_context(garbage, certs.server.key, certs.ca.ca_path, alpn=["h2"])
    with pytest.raises(ConfigError, match=r"private key .*garbage\.pem"):
        server_context(certs.server.cert, garbage, certs.ca.ca_path, alpn=["h2"])
    with pytest.raises(ConfigError, match=r"empty: .*empty\.pem"):
        server_context(certs.server.cert, certs.server.key, empty, alpn=["h2"])
    with pytest.raises(ConfigError, match="directory"):
        server_context(tmp_path, certs.server.key, certs.ca.ca_path, alpn=["h2"])


def test_client_certificate_needs_both_files(certs: Certs) -> None:
    with pytest.raises(ConfigError, match="both"):
        client_context(certs.client.cert, None, certs.ca.ca_path, alpn=["h2"])


async def test_server_issues_no_session_tickets(certs: Certs) -> None:
    """A TLS 1.3 ticket costs the server ~0.16 ms per handshake (OpenSSL 3.0 serializes the session with
    the client's certificate) and none of the hub's clients resumes; so our servers send none."""

    async def session_after_handshake(server_ctx: ssl.SSLContext) -> ssl.SSLSession:
        client_ctx = client_context(certs.client.cert, certs.client.key, certs.ca.ca_path, alpn=["h2"])
        _, client = await handshake(server_ctx, client_ctx)
        return workarounds.ssl_object_of(client).session

    plain = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # OpenSSL's default: two tickets after the handshake
    plain.load_cert_chain(certs.server.cert, certs.server.key)
    assert (await session_after_handshake(plain)).has_ticket
    ours = server_context(certs.server.cert, certs.server.key, certs.ca.ca_path, alpn=["h2"])
    assert not (await session_after_handshake(ours)).has_ticket
