"""Certificate roles in a running proxy-server (in-process, real TLS, real agents), with certificates
the cert-signer issued over its HTTPS API: an agent's certificate on the client port reaches no
cluster (issue 10, finding 1: cluster1's agent certificate opened a stream into cluster2), nor does
the hub's own server certificate; client and server certificates cannot register a tunnel on the
agent port; a certificate without a role is refused on both; each refusal is logged with the role
found and the port, and counted. The signer renews all three roles, each with its own certificate."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from structlog.testing import capture_logs

from clusterproxy_agent.app import Service
from clusterproxy_agent.config import AgentSettings
from clusterproxy_agent.egress import parse_rule
from clusterproxy_certsigner.testing import RunningSigner, start_signer
from clusterproxy_protocol import certclient
from clusterproxy_protocol.certclient import CertFiles, SignerRequestError
from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import IncomingRequest, open_mux
from clusterproxy_protocol.errors import TunnelClosed
from clusterproxy_protocol.pki import SERVER_ROLE_URI, CertRole, DevCA, certificate_role
from clusterproxy_protocol.tls import client_context
from clusterproxy_sdk import open_tunnel
from clusterproxy_server.app import ProxyServer, ServerConfig
from tests.support.clients import h1_connect
from tests.support.pki import PkiFiles
from tests.support.targets import Target, serve_echo
from tests.support.waiting import wait_until

HOSTS = ("localhost", "127.0.0.1")
CLUSTERS = ("cluster1", "cluster2")


@dataclass
class SignedParties:
    """Every party's files, bootstrapped from tokens at one in-process signer."""

    signer: RunningSigner
    server: CertFiles
    agents: dict[str, CertFiles]  # cluster -> its agent's files
    client: CertFiles

    def context(self, files: CertFiles, alpn: list[str]):  # type: ignore[no-untyped-def]
        return client_context(files.cert, files.key, files.ca, alpn=alpn)


def _files(directory: Path, bundle: Path) -> CertFiles:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ca.crt").write_bytes(bundle.read_bytes())
    return CertFiles(directory / "tls.crt", directory / "tls.key", directory / "ca.crt")


async def bootstrap_parties(nursery: trio.Nursery, root: Path) -> SignedParties:
    signer = await start_signer(nursery, root / "signer")
    server = _files(root / "server", signer.bundle)
    await certclient.bootstrap_files(
        signer.endpoint(),
        signer.server_token("proxy-server", HOSTS),
        server,
        lambda key: certclient.server_csr(key, "proxy-server", HOSTS),
    )
    agents = {}
    for cluster in CLUSTERS:
        agents[cluster] = _files(root / f"agent-{cluster}", signer.bundle)
        await certclient.bootstrap_files(
            signer.endpoint(),
            signer.agent_token(cluster),
            agents[cluster],
            lambda key, cluster=cluster: certclient.agent_csr(key, cluster, "agent-a"),  # type: ignore[misc]
        )
    client = _files(root / "alice", signer.bundle)
    await certclient.bootstrap_files(
        signer.endpoint(),
        signer.client_token("alice"),
        client,
        lambda key: certclient.client_csr(key, "alice"),
    )
    return SignedParties(signer, server, agents, client)


@dataclass
class RunningHub:
    server: ProxyServer
    agent_port: int
    client_port: int
    echo: Target


async def start_hub(
    nursery: trio.Nursery, ca: Path, server: CertFiles, agents: dict[str, CertFiles]
) -> RunningHub:
    proxy = ProxyServer(
        ServerConfig(
            ca=ca,
            cert=server.cert,
            key=server.key,
            agent_listen=("127.0.0.1", 0),
            client_listen=("127.0.0.1", 0),
            admin_listen=("127.0.0.1", 0),
        )
    )
    bound = await nursery.start(proxy.run)
    for cluster, files in agents.items():
        settings = AgentSettings(
            server=bound.agent,
            server_name="localhost",
            cluster=cluster,
            agent_id="agent-a",
            ca=files.ca,
            cert=files.cert,
            key=files.key,
            admin_listen=("127.0.0.1", 0),
            allow=[parse_rule("127.0.0.0/8")],
        )
        await nursery.start(Service(settings).run)
    await wait_until(lambda: all(proxy.registry.tunnels(cluster) for cluster in agents))
    return RunningHub(proxy, bound.agent[1], bound.client[1], await serve_echo(nursery))


def rejected(hub: RunningHub, port: str, reason: str = "certificate_role") -> float:
    value = hub.server.metrics.registry.get_sample_value(
        "cluster_proxy_server_rejected_connections_total", {"port": port, "reason": reason}
    )
    return value or 0.0


def refusals(logs: list[dict[str, object]], port: str) -> list[dict[str, object]]:
    return [e for e in logs if e.get("event") == "tls_peer_refused" and e.get("port") == port]


async def sdk_transfer(port: int, context, cluster: str, echo: int, payload: bytes) -> bytes:  # type: ignore[no-untyped-def]
    async with open_tunnel(f"127.0.0.1:{port}", context, server_hostname="localhost") as tunnel:
        stream = await tunnel.connect(cluster, "127.0.0.1", echo)
        async with stream, trio.open_nursery() as nursery:
            nursery.start_soon(stream.send_all, payload)
            received = b""
            while len(received) < len(payload) and (chunk := await stream.receive_some()):
                received += chunk
    return received


async def refused_on_client_port(hub: RunningHub, context_h2, context_h1, cluster: str) -> None:  # type: ignore[no-untyped-def]
    """Both frontends: no stream opens into ``cluster`` and the target sees no connection."""
    # the connection is dropped: no answer at all (a ConnectRefused would mean the request was read)
    with trio.fail_after(10), pytest.raises((TunnelClosed, trio.BrokenResourceError)):
        await sdk_transfer(hub.client_port, context_h2, cluster, hub.echo.port, b"steal")
    with trio.fail_after(10):
        try:
            reply = await h1_connect(
                hub.client_port,
                context_h1,
                f"127.0.0.1:{hub.echo.port}",
                {"cluster-proxy-cluster": cluster},
            )
        except (trio.BrokenResourceError, AssertionError):
            reply = None  # closed before any answer: the refusal
    assert reply is None, f"the client port answered {reply.status}: {reply.head}"


async def test_an_agent_certificate_on_the_client_port_reaches_no_cluster(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    parties = await bootstrap_parties(nursery, tmp_path)
    with capture_logs() as logs:
        hub = await start_hub(nursery, parties.signer.bundle, parties.server, parties.agents)
        # the control: the hub client's certificate reaches cluster2, bytes intact
        payload = os.urandom(256 << 10)
        got = await sdk_transfer(
            hub.client_port, parties.context(parties.client, ["h2"]), "cluster2", hub.echo.port, payload
        )
        assert hashlib.sha256(got).hexdigest() == hashlib.sha256(payload).hexdigest()
        reached = hub.echo.connections

        # the attack: cluster1's agent certificate, as the hub client, into cluster2 (and its own)
        stolen = parties.agents["cluster1"]
        for cluster in ("cluster2", "cluster1"):
            await refused_on_client_port(
                hub, parties.context(stolen, ["h2"]), parties.context(stolen, ["http/1.1"]), cluster
            )
    assert hub.echo.connections == reached
    found = refusals(logs, "client")
    assert len(found) == 4 and rejected(hub, "client") == 4
    for event in found:
        assert event["role"] == "agent" and event["accepted"] == "client"
        assert event["error"] == (
            "a certificate with role agent is refused on the client port, which accepts client "
            "certificates only"
        )
        assert event["subject"] == "O=cluster-proxy-agents,CN=agent-a"
    # the agents' tunnels are untouched, and the hub client still gets through
    assert all(hub.server.registry.tunnels(cluster) for cluster in CLUSTERS)
    got = await sdk_transfer(
        hub.client_port, parties.context(parties.client, ["h2"]), "cluster1", hub.echo.port, payload
    )
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(payload).hexdigest()


async def test_the_hubs_own_server_certificate_is_refused_on_the_client_port(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    parties = await bootstrap_parties(nursery, tmp_path)
    server_cert = x509.load_pem_x509_certificate(parties.server.cert.read_bytes())
    # it carries clientAuth (it renews over mTLS): OpenSSL alone would let it in
    assert (
        ExtendedKeyUsageOID.CLIENT_AUTH
        in server_cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    )
    with capture_logs() as logs:
        hub = await start_hub(nursery, parties.signer.bundle, parties.server, parties.agents)
        await refused_on_client_port(
            hub,
            parties.context(parties.server, ["h2"]),
            parties.context(parties.server, ["http/1.1"]),
            "cluster2",
        )
    assert hub.echo.connections == 0
    found = refusals(logs, "client")
    assert [e["role"] for e in found] == ["server", "server"] and rejected(hub, "client") == 2
    assert "role server is refused on the client port" in str(found[0]["error"])


async def dial_agent_port(port: int, files: CertFiles, cluster: str) -> bool:
    """Dial the agent port as ``cluster``'s agent with ``files``; whether the tunnel got as far as
    the server's registration request (``GET /v1/info``)."""
    context = client_context(files.cert, files.key, files.ca, alpn=["h2"])
    stream = trio.SSLStream(
        await trio.open_tcp_stream("127.0.0.1", port), context, server_hostname="localhost"
    )
    asked = False

    async def handle(request: IncomingRequest) -> None:
        nonlocal asked
        asked = True
        await request.respond(200, json.dumps({"cluster": cluster, "agent_id": "agent-a"}).encode())

    with trio.fail_after(10):
        try:
            async with open_mux(stream, Role.ACCEPTOR, handler=handle) as mux:
                await mux.closed.wait()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    return asked


async def test_client_and_server_certificates_cannot_register_on_the_agent_port(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    parties = await bootstrap_parties(nursery, tmp_path)
    with capture_logs() as logs:
        hub = await start_hub(nursery, parties.signer.bundle, parties.server, {})
        for files in (parties.client, parties.server):
            assert not await dial_agent_port(hub.agent_port, files, "cluster1")
    assert not hub.server.registry.tunnels("cluster1")
    assert hub.server.metrics.tunnel_connects.collect()[0].samples == []
    found = refusals(logs, "agent")
    assert [e["role"] for e in found] == ["client", "server"] and rejected(hub, "agent") == 2
    assert found[0]["error"] == (
        "a certificate with role client is refused on the agent port, which accepts agent certificates only"
    )
    # the same port takes a real agent certificate
    nursery.start_soon(dial_agent_port, hub.agent_port, parties.agents["cluster1"], "cluster1")
    await wait_until(lambda: hub.server.registry.tunnels("cluster1"))


async def test_certificates_without_a_role_are_refused_on_both_ports(
    nursery: trio.Nursery, pki: PkiFiles, tmp_path: Path
) -> None:
    """Certificates from the hub's own CA as they were issued before roles (the EKU alone)."""
    ca = DevCA.create_or_load(pki.ca.parent)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test-admin")])
    old_client = ca.issue_custom(name, [], [ExtendedKeyUsageOID.CLIENT_AUTH], tmp_path, "old-client")
    server = CertFiles(pki.server.cert, pki.server.key, pki.ca)
    with capture_logs() as logs:
        hub = await start_hub(nursery, pki.ca, server, {})
        old = CertFiles(old_client.cert, old_client.key, pki.ca)
        await refused_on_client_port(
            hub,
            client_context(old.cert, old.key, pki.ca, alpn=["h2"]),
            client_context(old.cert, old.key, pki.ca, alpn=["http/1.1"]),
            "cluster1",
        )
        assert not await dial_agent_port(hub.agent_port, old, "cluster1")
    for port in ("client", "agent"):
        found = refusals(logs, port)
        assert found and all(e["role"] == "none" for e in found)
        assert "no role (the certificate has no cluster-proxy role URI SAN)" in str(found[0]["error"])
    assert rejected(hub, "client") == 2 and rejected(hub, "agent") == 1


async def test_an_agent_refuses_a_hub_without_the_server_role(
    nursery: trio.Nursery, pki: PkiFiles, tmp_path: Path
) -> None:
    ca = DevCA.create_or_load(pki.ca.parent)
    old_server = ca.issue_custom(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "proxy-server")]),
        [x509.DNSName("localhost")],
        [ExtendedKeyUsageOID.SERVER_AUTH],
        tmp_path,
        "old-server",
    )
    hub = await start_hub(nursery, pki.ca, CertFiles(old_server.cert, old_server.key, pki.ca), {})
    agent = pki.agent("cluster1", "agent-a")
    service = Service(
        AgentSettings(
            server=("127.0.0.1", hub.agent_port),
            server_name="localhost",
            cluster="cluster1",
            agent_id="agent-a",
            ca=pki.ca,
            cert=agent.cert,
            key=agent.key,
            admin_listen=("127.0.0.1", 0),
        )
    )
    await nursery.start(service.run)
    await wait_until(lambda: service.agent.last_error is not None)
    assert service.agent.last_error == (
        "the server presented a certificate with no role (the certificate has no cluster-proxy role "
        "URI SAN); a proxy-server's certificate has the server role"
    )
    assert not hub.server.registry.tunnels("cluster1") and service.agent.connected == 0


# --- the signer renews every role, each with its own certificate -----------------------------------------


async def test_the_signer_renews_each_role_over_mtls_and_keeps_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    parties = await bootstrap_parties(nursery, tmp_path)
    cases = [
        (parties.server, CertRole.SERVER),
        (parties.agents["cluster1"], CertRole.AGENT),
        (parties.client, CertRole.CLIENT),
    ]
    for files, role in cases:
        current = x509.load_pem_x509_certificate(files.cert.read_bytes())
        assert certificate_role(current).role is role
        renewed = await certclient.renew(
            parties.signer.endpoint(files.ca),
            files.cert,
            files.key,
            certclient.csr_like(current, certclient.generate_key()),
        )
        assert certificate_role(renewed.cert).role is role
        assert renewed.cert.subject == current.subject


async def test_the_signer_refuses_a_renewal_csr_for_another_role(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    parties = await bootstrap_parties(nursery, tmp_path)
    current = x509.load_pem_x509_certificate(parties.client.cert.read_bytes())
    key = certclient.generate_key()
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(current.subject)
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(SERVER_ROLE_URI)]), False)
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
        .decode()
    )
    with pytest.raises(SignerRequestError) as info:
        await certclient.renew(
            parties.signer.endpoint(parties.client.ca), parties.client.cert, parties.client.key, csr
        )
    assert (info.value.status, info.value.error) == (403, "role_mismatch")
    assert "the CSR asks for the server role" in info.value.reason
    # the refusal used nothing up: the client renews as a client
    renewed = await certclient.renew(
        parties.signer.endpoint(parties.client.ca),
        parties.client.cert,
        parties.client.key,
        certclient.csr_like(current, key),
    )
    assert certificate_role(renewed.cert).role is CertRole.CLIENT
