"""Certificates from the cert-signer, as real processes: an agent goes from a bootstrap token to a
working tunnel; reused, expired and foreign tokens are refused with a clear error; an agent
certificate for one cluster cannot register as another; the client policy answers 403 with a reason
on both frontends; the CA private key never leaves the signer's store."""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from clusterproxy_protocol import certclient
from clusterproxy_protocol.pki import agent_identity_from_cert
from clusterproxy_sdk import Forbidden
from tests.support.certs import ClientParty, SignedHub, SignerProcess, count_events
from tests.support.procs import BIN
from tests.support.traffic import Traffic, serve_bye_echo, serve_sized
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

POLICY = {
    "rules": [
        {"subject": "CN=test-admin", "clusters": ["*"]},
        {"subject": "CN=alice", "clusters": ["cluster1"]},
    ],
    "default": "deny",
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SignedHub]:
    """A signer, a server with a client policy, an agent for cluster1 bootstrapped from a token."""
    root = Path(tmp_path_factory.mktemp("certs"))
    policy = root / "policy.json"
    policy.write_text(json.dumps(POLICY))
    hub = SignedHub(None, root, signer=SignerProcess(root / "signer", root))  # type: ignore[arg-type]

    async def start() -> None:
        assert hub.signer is not None
        await hub.signer.start()
        await hub.start_server("--client-policy", str(policy), "--known-clusters", "cluster2")
        hub.start_agent("cluster1", "agent-a")
        await hub.wait_agent("cluster1", "agent-a")

    try:
        trio.run(start)
        yield hub
    finally:
        hub.stop()


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


async def test_agent_goes_from_a_bootstrap_token_to_a_working_tunnel(
    hub: SignedHub, tmp_path: Path, nursery: trio.Nursery
) -> None:
    assert hub.signer is not None and hub.server is not None
    agent = hub.agents["agent-cluster1-agent-a"]
    files = hub.files["agent-cluster1-agent-a"]
    bootstrapped = await agent.wait_event("cert_bootstrapped")
    await agent.wait_event("tunnel_connected")
    cert = _cert(files.cert)
    assert agent_identity_from_cert(cert) == ("cluster1", "agent-a")
    assert format(cert.serial_number, "x") == bootstrapped["serial"].lstrip("0")
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
    assert count_events(hub.server, "cert_bootstrapped") == 1

    # a hub client from a token too; a transfer through the tunnel on each frontend
    client = await ClientParty.bootstrap(hub.signer, tmp_path / "client", "test-admin")
    traffic = Traffic(
        hub.client_port, "cluster1", await serve_sized(nursery), await serve_bye_echo(nursery),
        client.h2, client.h1,
    )  # fmt: skip
    for frontend in ("h2", "http1"):
        await traffic.transfer(frontend)
    assert traffic.ok == {"h2": 1, "http1": 1}

    # a restart needs no new token: the files hold a valid certificate
    agent.stop()
    await hub.wait_agent("cluster1", "agent-a", present=False)
    again = hub.start_agent(
        "cluster1", "agent-a", token=None, name="agent-cluster1-agent-a-again", files=files
    )
    await hub.wait_agent("cluster1", "agent-a")
    assert count_events(again, "cert_bootstrapped") == 0
    await traffic.transfer("h2")


async def _refused(hub: SignedHub, name: str, cluster: str, token: str) -> str:
    """Start an agent with ``token`` on empty files; it must exit 1: the error it logged."""
    process = hub.start_agent(cluster, "agent-x", token=token, name=name)
    assert await process.wait_exit(timeout=30) == 1
    failed = [e for e in process.events() if e.get("event") == "agent_failed"]
    assert failed, process.tail()
    assert not hub.files[name].cert.exists()
    return str(failed[0]["error"])


async def test_reused_expired_and_foreign_tokens_are_refused_with_a_clear_error(hub: SignedHub) -> None:
    assert hub.signer is not None
    signer = hub.signer

    token = signer.agent_token("cluster1")
    first = hub.start_agent("cluster1", "agent-r", token=token, name="agent-reuse-1")
    await hub.wait_agent("cluster1", "agent-r")
    first.stop()
    error = await _refused(hub, "agent-reuse-2", "cluster1", token)
    print(f"token reuse:     {error}")
    assert "already used" in error and "token_used" in error and "HTTP 409" in error

    expired = signer.agent_token("cluster1", ttl=dt.timedelta(seconds=1))
    record = signer.store.get_token(expired.split(".", 1)[0])
    assert record is not None
    await wait_until(
        lambda: dt.datetime.now(dt.UTC) > record.expires_at,
        timeout=10,
        what="the token to expire",
        interval=0.1,
    )
    error = await _refused(hub, "agent-expired", "cluster1", expired)
    print(f"expired token:   {error}")
    assert "expired" in error and "token_expired" in error and "HTTP 410" in error

    foreign = signer.agent_token("cluster1")
    error = await _refused(hub, "agent-foreign", "cluster2", foreign)
    print(f"foreign token:   {error}")
    assert "cluster1" in error and "cluster2" in error and "cluster_mismatch" in error and "HTTP 403" in error

    # none of the refused attempts used the token up, nor registered an agent
    clusters = {(a["cluster"], a["agent_id"]) for a in hub.agents_connected()}
    assert ("cluster2", "agent-x") not in clusters and ("cluster1", "agent-x") not in clusters


async def test_an_agent_certificate_for_cluster1_cannot_register_as_cluster2(hub: SignedHub) -> None:
    assert hub.server is not None
    files = hub.files["agent-cluster1-agent-a"]  # a valid certificate for cluster1/agent-a
    before = count_events(hub.server, "agent_refused")
    impostor = hub.start_agent("cluster2", "agent-a", token=None, files=files, name="agent-impostor")
    await wait_until(
        lambda: count_events(hub.server, "agent_refused") != before,
        timeout=20,
        what="the impostor to be refused",
        interval=0.05,
    )
    refused = [e for e in hub.server.events() if e.get("event") == "agent_refused"][before]
    print(f"agent refused:   {refused['error']}")
    assert "claims cluster 'cluster2'" in refused["error"]
    assert "certificate is for cluster 'cluster1'" in refused["error"]
    assert all(a["cluster"] != "cluster2" for a in hub.agents_connected())
    assert count_events(impostor, "cert_bootstrapped") == 0  # it used the files, not a token
    impostor.stop()


async def test_client_policy_refuses_a_client_with_403_and_a_reason(
    hub: SignedHub, tmp_path: Path, nursery: trio.Nursery
) -> None:
    assert hub.signer is not None
    alice = await ClientParty.bootstrap(hub.signer, tmp_path / "alice", "alice")
    sized, echo = await serve_sized(nursery), await serve_bye_echo(nursery)
    allowed = Traffic(hub.client_port, "cluster1", sized, echo, alice.h2, alice.h1)
    for frontend in ("h2", "http1"):
        await allowed.transfer(frontend)

    refused = Traffic(hub.client_port, "cluster2", sized, echo, alice.h2, alice.h1)
    with pytest.raises(Forbidden) as info:
        await refused.transfer("h2")
    print(f"403 (HTTP/2):    {info.value.reason}")
    assert "'CN=alice'" in info.value.reason and "'cluster2'" in info.value.reason
    with pytest.raises(AssertionError) as h1_info:
        await refused.transfer("http1")
    assert (
        "403" in str(h1_info.value) and "CN=alice" in str(h1_info.value) and "cluster2" in str(h1_info.value)
    )
    print(f"403 (HTTP/1.1):  {h1_info.value}")


async def test_the_ca_private_key_never_leaves_the_signer_store(hub: SignedHub) -> None:
    """Every file outside ``STORE/ca`` (party files, logs, the signer's own TLS folder) and every API
    answer is searched for the CA key in its PEM and DER forms and its raw private scalar."""
    assert hub.signer is not None
    store = hub.signer.store_dir
    keys = sorted((store / "ca").glob("*.key"))
    assert keys, "no CA key in the store"
    needles: list[bytes] = []
    for path in keys:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        der = key.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        scalar = key.private_numbers().private_value.to_bytes(32, "big")  # type: ignore[union-attr]
        pem_body = b"".join(path.read_bytes().splitlines()[1:-1])  # the base64, whatever the line breaks
        needles += [der, scalar, scalar.hex().encode(), pem_body, base64.b64encode(scalar)]
    assert stat.S_IMODE(store.stat().st_mode) == 0o700

    scanned = 0
    for path in hub.log_dir.rglob("*"):
        if not path.is_file() or path.parent == store / "ca":
            continue
        data = path.read_bytes()
        data += b"".join(data.splitlines())  # PEM with its line breaks removed too
        scanned += 1
        for needle in needles:
            assert needle not in data, f"CA key material found in {path}"
    assert scanned > 10

    # what the API hands out: certificates only (the trust bundle, with and without a client cert)
    files = hub.files["proxy-server"]
    endpoint = hub.signer.endpoint(files.ca)
    for kwargs in ({}, {"cert": files.cert, "key": files.key}):
        answer = await certclient.request_json(endpoint, "GET", "/v1/trust-bundle", **kwargs)
        text = json.dumps(answer).encode()
        assert b"PRIVATE KEY" not in text and all(n not in text for n in needles)

    # and the CLI that reads the store prints no key either
    out = subprocess.run(
        [str(BIN / "cluster-proxy"), "certs", "status", "--json", "--store", str(store)],
        capture_output=True,
        check=True,
        env={**os.environ},
    ).stdout
    assert b"PRIVATE KEY" not in out and all(n not in out for n in needles)
    assert json.loads(out)["phase"] == "stable"
