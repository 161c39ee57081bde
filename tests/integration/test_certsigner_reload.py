"""Hot reload over real TCP: a trio TLS server on a ReloadingContext keeps its established connections
(and the data flowing on them) across a reload, while new handshakes see the new certificate."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from cryptography import x509

from clusterproxy_certsigner.testing import EchoClient, serve_tls_echo
from clusterproxy_protocol.pki import DevCA
from clusterproxy_protocol.reloader import ReloadingContext
from clusterproxy_protocol.tls import client_context


def _serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


async def test_live_connection_survives_reload_and_new_handshakes_see_the_new_cert(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    ca = DevCA.create_or_load(tmp_path / "ca")
    server = ca.issue_server("server", ["localhost"], tmp_path / "server", stem="server")
    client = ca.issue_client("client", tmp_path / "client")
    reloading = ReloadingContext.server(server.cert, server.key, ca.ca_path, alpn=[])
    port = await serve_tls_echo(nursery, reloading)
    client_ctx = client_context(client.cert, client.key, ca.ca_path, alpn=[])

    old_serial = _serial(server.cert)
    live = await EchoClient.connect(port, client_ctx)
    assert live.peer.serial_number == old_serial

    # a stream keeps flowing on the live connection while the certificate changes underneath
    sent = 0
    reloaded_at: int | None = None
    warm, done = trio.Event(), trio.Event()

    async def pump() -> None:
        nonlocal sent
        while reloaded_at is None or sent < reloaded_at + 50:
            payload = b"%08d" % sent
            assert await live.echo(payload) == payload
            sent += 1
            if sent == 50:
                warm.set()
        done.set()

    with trio.fail_after(20):
        async with trio.open_nursery() as flows:
            flows.start_soon(pump)
            await warm.wait()  # traffic is flowing
            ca.issue_server("server", ["localhost"], tmp_path / "server", stem="server")  # renewed on disk
            new_serial = _serial(server.cert)
            assert new_serial != old_serial
            assert reloading.reload() == "reloaded"
            reloaded_at = sent
            await done.wait()

    assert reloaded_at is not None and reloaded_at >= 50 and sent >= reloaded_at + 50
    assert await live.echo(b"still here") == b"still here"
    assert live.peer.serial_number == old_serial  # the established session keeps its certificate
    fresh = await EchoClient.connect(port, client_ctx)
    assert fresh.peer.serial_number == new_serial
    assert await live.echo(b"and after a new handshake") == b"and after a new handshake"
    await fresh.aclose()
    await live.aclose()


async def test_retiring_a_ca_refuses_its_new_handshakes_but_keeps_its_live_connections(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    old_ca = DevCA.create_or_load(tmp_path / "old", name="old-ca")
    new_ca = DevCA.create_or_load(tmp_path / "new", name="new-ca")
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes(old_ca.ca_path.read_bytes() + new_ca.ca_path.read_bytes())
    server = new_ca.issue_server("server", ["localhost"], tmp_path / "server")
    old_client = old_ca.issue_client("old-client", tmp_path / "oc")
    new_client = new_ca.issue_client("new-client", tmp_path / "nc")
    reloading = ReloadingContext.server(server.cert, server.key, bundle, alpn=[])
    port = await serve_tls_echo(nursery, reloading)
    old_ctx = client_context(old_client.cert, old_client.key, bundle, alpn=[])
    new_ctx = client_context(new_client.cert, new_client.key, bundle, alpn=[])

    live_old = await EchoClient.connect(port, old_ctx)
    bundle.write_bytes(new_ca.ca_path.read_bytes())  # the old CA leaves the bundle
    before = reloading.context
    assert reloading.reload() == "rebuilt"
    assert reloading.context is not before

    with pytest.raises(trio.BrokenResourceError):
        await EchoClient.connect(port, old_ctx)
    fresh = await EchoClient.connect(port, new_ctx)
    assert await live_old.echo(b"old but alive") == b"old but alive"
    await fresh.aclose()
    await live_old.aclose()
