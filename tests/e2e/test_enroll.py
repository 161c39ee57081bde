"""``cluster-proxy enroll`` against a real cert-signer and proxy-server: a client token becomes a hub
client certificate that curl uses through the tunnel; every refusal is a clear message and exit 1."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from cryptography import x509

from clusterproxy_protocol.certclient import CertFiles
from clusterproxy_protocol.pki import CertRole, RoleCheck, certificate_role
from tests.support import require
from tests.support.certs import SignedHub, SignerProcess, curl_proxy_argv
from tests.support.targets import serve_http

pytestmark = pytest.mark.slow

CLI = str(
    Path(os.environ.get("VIRTUAL_ENV", Path(__file__).resolve().parents[2] / ".venv"))
    / "bin"
    / "cluster-proxy"
)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SignedHub]:
    root = Path(tmp_path_factory.mktemp("enroll"))
    hub = SignedHub(None, root, signer=SignerProcess(root / "signer", root))  # type: ignore[arg-type]

    async def start() -> None:
        assert hub.signer is not None
        await hub.signer.start()
        await hub.start_server()
        hub.start_agent("cluster1", "agent-a")
        await hub.wait_agent("cluster1", "agent-a")

    try:
        trio.run(start)
        yield hub
    finally:
        hub.stop()


async def enroll(hub: SignedHub, out: Path, token: str, *extra: str) -> trio.CompletedProcess:  # type: ignore[name-defined]
    assert hub.signer is not None
    ca = out.parent / "hub-ca.crt"
    ca.write_text(hub.signer.bundle_pem())
    argv = [CLI, "enroll", "--signer", hub.signer.url, "--server-name", "localhost", "--ca", str(ca)]
    argv += ["--out", str(out), *extra]
    return await trio.run_process(
        argv,
        env={**os.environ, "CLUSTER_PROXY_ENROLL_TOKEN": token},
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


async def test_a_client_token_becomes_a_certificate_that_reaches_a_cluster(
    hub: SignedHub, tmp_path: Path, nursery: trio.Nursery
) -> None:
    require(shutil.which("curl") is not None, "the curl binary")
    assert hub.signer is not None
    token = hub.signer.client_token("alice")
    out = tmp_path / "alice"
    done = await enroll(hub, out, token, "--name", "alice")
    assert done.returncode == 0, done.stderr.decode()
    assert b"enrolled as client 'alice'" in done.stdout
    files = CertFiles(out / "client.crt", out / "client.key", out / "ca.crt")
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    assert certificate_role(cert) == RoleCheck(CertRole.CLIENT, None)
    assert (files.key.stat().st_mode & 0o777) == 0o600
    assert token.encode() not in done.stdout + done.stderr

    body = os.urandom(256 * 1024)
    target = await serve_http(nursery, body)
    fetched = await trio.run_process(
        curl_proxy_argv(hub, files, "cluster1", f"http://{target.address}/"), capture_stdout=True
    )
    assert hashlib.sha256(fetched.stdout).hexdigest() == hashlib.sha256(body).hexdigest()

    # a valid certificate is not replaced by accident; the token was single-use anyway
    again = await enroll(hub, out, token, "--name", "alice")
    assert again.returncode == 1 and b"holds a valid certificate" in again.stderr
    forced = await enroll(hub, out, token, "--name", "alice", "--force")
    assert forced.returncode == 1 and b"token_used" in forced.stderr, forced.stderr
    assert x509.load_pem_x509_certificate(files.cert.read_bytes()).serial_number == cert.serial_number


async def test_refusals_name_the_reason(hub: SignedHub, tmp_path: Path) -> None:
    assert hub.signer is not None
    wrong_name = await enroll(hub, tmp_path / "a", hub.signer.client_token("bob"), "--name", "mallory")
    assert wrong_name.returncode == 1 and b"name_mismatch" in wrong_name.stderr, wrong_name.stderr
    unknown = await enroll(
        hub, tmp_path / "b", "0123456789ab.not-a-real-secret-0000000000000000000000", "--name", "x"
    )
    assert unknown.returncode == 1 and b"invalid_token" in unknown.stderr, unknown.stderr
    agent_token = hub.signer.agent_token("cluster1")
    wrong_kind = await enroll(hub, tmp_path / "c", agent_token, "--name", "agent-a")
    # an agent's token asks for an agent CSR: the signer says so
    assert wrong_kind.returncode == 1 and b"an agent CSR needs" in wrong_kind.stderr, wrong_kind.stderr
    assert not (tmp_path / "a" / "client.key").exists() and not (tmp_path / "c" / "client.crt").exists()
