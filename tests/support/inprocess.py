"""A proxy-server running in the test's own trio nursery, on loopback ports chosen by the OS, a
minimal agent written against the wire protocol only, and the settings of a real agent
(``clusterproxy_agent``'s ``Service``) dialing such servers."""

from __future__ import annotations

import json
from typing import Any

import trio

from clusterproxy_agent.config import AgentSettings
from clusterproxy_agent.egress import parse_rule
from clusterproxy_protocol import tls
from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import IncomingRequest, open_mux
from clusterproxy_protocol.relay import relay_streams
from clusterproxy_server.app import ProxyServer, ServerConfig
from tests.support.pki import PkiFiles


async def start_server(nursery: trio.Nursery, pki: PkiFiles, **overrides: Any) -> tuple[ProxyServer, Any]:
    """The server with ``pki``'s server certificate and any ``ServerConfig`` field overridden; returns
    it and its bound addresses (``.agent``, ``.client``, ``.admin``) once it listens."""
    config = ServerConfig(
        ca=pki.ca,
        cert=pki.server.cert,
        key=pki.server.key,
        agent_listen=("127.0.0.1", 0),
        client_listen=("127.0.0.1", 0),
        admin_listen=("127.0.0.1", 0),
        **overrides,
    )
    server = ProxyServer(config)
    bound = await nursery.start(server.run)
    return server, bound


async def run_wire_agent(
    port: int,
    pki: PkiFiles,
    cluster: str,
    agent_id: str,
    *,
    claim: str | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Dial the agent port and serve CONNECTs by dialing loopback targets; ``claim`` overrides the cluster."""
    pair = pki.agent(cluster, agent_id)
    context = tls.client_context(pair.cert, pair.key, pki.ca, alpn=["h2"])
    stream = trio.SSLStream(
        await trio.open_tcp_stream("127.0.0.1", port), context, server_hostname="localhost"
    )

    async def handle(request: IncomingRequest) -> None:
        if request.path == "/v1/info":
            body = json.dumps({"cluster": claim or cluster, "agent_id": agent_id, "version": "test"}).encode()
            await request.respond(200, body)
            return
        host, _, target_port = request.authority.rpartition(":")
        target = await trio.open_tcp_stream(host, int(target_port))
        await relay_streams(client=await request.accept(), target=target)

    async with open_mux(stream, Role.ACCEPTOR, handler=handle) as mux:
        task_status.started(mux)
        await mux.closed.wait()


def agent_settings(pki: PkiFiles, servers: list[tuple[str, int]], cluster: str = "cluster1") -> AgentSettings:
    pair = pki.agent(cluster, "agent-a")
    return AgentSettings(
        server=servers[0],
        servers=servers,
        server_name="localhost",
        cluster=cluster,
        agent_id="agent-a",
        ca=pki.ca,
        cert=pair.cert,
        key=pair.key,
        admin_listen=("127.0.0.1", 0),
        allow=[parse_rule("127.0.0.0/8")],
        backoff_initial=0.05,
        backoff_max=0.2,
    )
