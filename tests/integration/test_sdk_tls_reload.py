"""The SDK follows its client certificate files: after they are replaced, the next TLS handshake
presents the new certificate (seen by the fake server), while a live connection keeps its session.

Real TLS over loopback against ``clusterproxy_sdk.testing``'s fake proxy, which records the client
certificate of every handshake it accepts.
"""

from __future__ import annotations

import io
import os
import shutil
import ssl
from pathlib import Path

import pytest
import trio
from cryptography import x509

from clusterproxy_cli.portforward import PortForward, run_port_forward
from clusterproxy_protocol.pki import DevCA
from clusterproxy_sdk import (
    ProxyConnectionError,
    ReloadingTLSFiles,
    SharedTunnel,
    TLSFiles,
    Tunnel,
    open_shared_tunnel,
    open_tunnel,
)
from clusterproxy_sdk.testing import FakeProxy, open_fake_proxy
from tests.support.waiting import wait_until

DEADLINE = 10.0


def serial(cert: x509.Certificate | None) -> int:
    assert cert is not None
    return cert.serial_number


def client_files(fake: FakeProxy, directory: Path) -> TLSFiles:
    """A private copy of the fake's client files, for the test to replace."""
    directory.mkdir()
    files = TLSFiles(directory / "ca.crt", directory / "client.crt", directory / "client.key")
    shutil.copyfile(fake.ca, files.ca)
    shutil.copyfile(fake.client_cert, files.cert)  # type: ignore[arg-type]
    shutil.copyfile(fake.client_key, files.key)  # type: ignore[arg-type]
    return files


def renew(fake: FakeProxy, files: TLSFiles, staging: Path, *, cert: bool = True, key: bool = True) -> int:
    """Replace the files with a new certificate and key from the fake's CA, as a renewer does (each
    file renamed into place); ``cert=False`` / ``key=False`` leaves that one (a renewer caught between
    its two renames). Returns the new certificate's serial."""
    pair = DevCA.create_or_load(fake.ca.parent).issue_client("test-client", staging)
    new_serial = x509.load_pem_x509_certificate(pair.cert.read_bytes()).serial_number
    if key:
        os.replace(pair.key, files.key)  # type: ignore[arg-type]
    if cert:
        os.replace(pair.cert, files.cert)  # type: ignore[arg-type]
    return new_serial


async def echo(tunnel: SharedTunnel | Tunnel, payload: bytes) -> bytes:
    """One stream: send ``payload`` and EOF, return what the fake echoed back."""
    stream = await tunnel.connect("cluster1", "svc", 80)
    async with stream:
        await stream.send_all(payload)
        await stream.send_eof()
        received = b""
        while data := await stream.receive_some():
            received += data
    return received


async def run_fake(directory: Path, *, task_status: trio.TaskStatus[FakeProxy]) -> None:
    async with open_fake_proxy(directory) as fake:
        task_status.started(fake)
        await trio.sleep_forever()


async def until_dead(shared: SharedTunnel) -> None:
    await wait_until(
        lambda: shared.current is None or not shared.current.is_alive,
        timeout=DEADLINE,
        what="the shared connection to die",
    )


async def test_shared_tunnel_redials_with_the_replaced_certificate(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    fake = await nursery.start(run_fake, tmp_path / "fake")
    files = client_files(fake, tmp_path / "client")
    original = x509.load_pem_x509_certificate(Path(files.cert).read_bytes()).serial_number  # type: ignore[arg-type]
    async with open_shared_tunnel(fake.address, files) as shared:
        with trio.fail_after(DEADLINE):
            assert await echo(shared, b"first") == b"first"
        assert [c.serial_number for c in fake.client_certificates] == [original]

        renewed = renew(fake, files, tmp_path / "staging")
        assert renewed != original
        # The live connection is untouched: a new stream on it needs no handshake.
        with trio.fail_after(DEADLINE):
            assert await echo(shared, b"second") == b"second"
        assert len(fake.client_certificates) == 1 and shared.connections_made == 1

        fake.drop_connections()
        await until_dead(shared)
        with trio.fail_after(DEADLINE):
            assert await echo(shared, b"third") == b"third"
        assert [c.serial_number for c in fake.client_certificates] == [original, renewed]
        assert shared.connections_made == 2
        assert serial(shared.current.client_certificate if shared.current else None) == renewed
        assert isinstance(shared.tls, ReloadingTLSFiles) and shared.tls.reloads == 1


async def test_context_is_rebuilt_only_when_the_files_change(tmp_path: Path, nursery: trio.Nursery) -> None:
    fake = await nursery.start(run_fake, tmp_path / "fake")
    files = client_files(fake, tmp_path / "client")
    tls = files.reloading()
    first = tls.current()
    assert tls.current() is first and tls() is first.context and tls.reloads == 0

    renewed = renew(fake, files, tmp_path / "staging")
    second = tls.current()
    assert second is not first and second.context is not first.context
    assert int(second.serial or "0", 16) == renewed and tls.reloads == 1
    async with open_tunnel(fake.address, tls) as tunnel:
        with trio.fail_after(DEADLINE):
            assert await echo(tunnel, b"x") == b"x"
        assert serial(tunnel.client_certificate) == renewed
    assert fake.client_certificates[-1].serial_number == renewed


async def test_half_replaced_pair_keeps_the_last_good_context(tmp_path: Path, nursery: trio.Nursery) -> None:
    fake = await nursery.start(run_fake, tmp_path / "fake")
    files = client_files(fake, tmp_path / "client")
    tls = ReloadingTLSFiles(files.ca, files.cert, files.key)
    original = tls.loaded.serial

    # The renewer has renamed the new key into place but not yet the certificate.
    pending = renew(fake, files, tmp_path / "staging", cert=False)
    assert tls.current().serial == original
    assert tls.failures == 1 and tls.last_error is not None and "does not match" in tls.last_error
    async with open_tunnel(fake.address, tls) as tunnel:
        with trio.fail_after(DEADLINE):
            assert await echo(tunnel, b"old") == b"old"
    assert format(fake.client_certificates[-1].serial_number, "x") == original

    os.replace(tmp_path / "staging" / "test-client.crt", files.cert)  # type: ignore[arg-type]
    async with open_tunnel(fake.address, tls) as tunnel:
        with trio.fail_after(DEADLINE):
            assert await echo(tunnel, b"new") == b"new"
    assert fake.client_certificates[-1].serial_number == pending
    assert tls.reloads == 1 and tls.last_error is None


async def test_a_ca_that_left_the_bundle_is_no_longer_trusted(tmp_path: Path, nursery: trio.Nursery) -> None:
    fake = await nursery.start(run_fake, tmp_path / "fake")
    files = client_files(fake, tmp_path / "client")
    other_ca = DevCA.create_or_load(tmp_path / "other-ca", "another-ca")
    async with open_shared_tunnel(fake.address, files) as shared:
        with trio.fail_after(DEADLINE):
            assert await echo(shared, b"a") == b"a"
        # A bundle holding both CAs, then one without the fake's: the context must forget it.
        both = Path(files.ca).read_bytes() + other_ca.ca_path.read_bytes()
        Path(files.ca).write_bytes(both)
        fake.drop_connections()
        await until_dead(shared)
        with trio.fail_after(DEADLINE):
            assert await echo(shared, b"b") == b"b"
        shutil.copyfile(other_ca.ca_path, files.ca)
        fake.drop_connections()
        await until_dead(shared)
        with (
            trio.fail_after(DEADLINE),
            pytest.raises(ProxyConnectionError, match="server certificate not accepted"),
        ):
            await echo(shared, b"c")
    assert len(fake.client_certificates) == 2


async def test_a_callable_gives_the_context_of_each_dial(tmp_path: Path, nursery: trio.Nursery) -> None:
    fake = await nursery.start(run_fake, tmp_path / "fake")
    calls: list[ssl.SSLContext] = []

    def context() -> ssl.SSLContext:
        calls.append(fake.client_tls.context())
        return calls[-1]

    async with open_shared_tunnel(fake.address, context) as shared:
        with trio.fail_after(DEADLINE):
            assert await echo(shared, b"1") == b"1"
            assert await echo(shared, b"2") == b"2"
        assert len(calls) == 1
        fake.drop_connections()
        await until_dead(shared)
        with trio.fail_after(DEADLINE):
            assert await echo(shared, b"3") == b"3"
        assert len(calls) == 2
        assert shared.current is not None and shared.current.client_certificate is None


async def test_port_forward_redials_with_the_renewed_certificate(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    fake = await nursery.start(run_fake, tmp_path / "fake")
    files = client_files(fake, tmp_path / "client")
    pf = PortForward("cluster1", "svc", 80, "127.0.0.1", 0, fake.address, files)
    [(_, port)] = await nursery.start(
        lambda task_status: run_port_forward(pf, out=io.StringIO(), task_status=task_status)
    )

    async def through_port_forward(payload: bytes) -> bytes:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(payload)
            await stream.send_eof()
            received = b""
            while data := await stream.receive_some():
                received += data
        return received

    with trio.fail_after(DEADLINE):
        assert await through_port_forward(b"before") == b"before"
    renewed = renew(fake, files, tmp_path / "staging")
    fake.drop_connections()
    with trio.fail_after(DEADLINE):  # both steps together, as before
        await wait_until(
            lambda: not fake.live_connections, timeout=DEADLINE, what="the dropped connection to go"
        )
        assert await through_port_forward(b"after") == b"after"
    assert len(fake.client_certificates) == 2
    assert fake.client_certificates[0].serial_number != renewed
    assert fake.client_certificates[1].serial_number == renewed
