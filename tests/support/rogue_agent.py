"""Agents for tests of the proxy-server against broken or hostile agents.

:class:`RogueAgent` registers on the agent port exactly as the real agent does (mutual TLS with an
agent certificate, the protocol library's Mux as the HTTP/2 acceptor, ``GET /v1/info`` answered with
its identity), then misbehaves on ``CONNECT`` as told; it can also write raw bytes into its TLS stream
between the Mux's own writes (garbage) and stop reading (a dead peer whose socket stays open).
:func:`start_real_agent` runs the real agent (``clusterproxy_agent``) in-process beside it, and
:func:`rogue_then_healthy` both, the rogue first; :func:`assert_echo` checks a stream through them.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os

import trio

from clusterproxy_agent.agent import Agent, AgentConfig
from clusterproxy_agent.egress import EgressPolicy
from clusterproxy_agent.tunnel import TunnelOptions, TunnelRunner, tls_opener
from clusterproxy_protocol import tls
from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import IncomingRequest, Mux, open_mux
from clusterproxy_protocol.relay import relay_streams
from clusterproxy_protocol.wire import INFO_PATH
from clusterproxy_sdk import TLSFiles
from clusterproxy_server.app import ProxyServer
from tests.support.pki import PkiFiles
from tests.support.waiting import wait_until


class Behaviour(enum.Enum):
    ANSWER_502 = "answer-502"  # every CONNECT: 502 with a reason, as a broken agent would
    BLACKHOLE = "blackhole"  # every CONNECT: never answered
    RELAY = "relay"  # every CONNECT: dialed and relayed, like a healthy agent


class _ControlledTransport(trio.abc.Stream):
    """The rogue's TLS stream, shared by the Mux and the test (one writer at a time), and freezable."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.frozen = False
        self._send_lock = trio.Lock()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        async with self._send_lock:
            await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.inner.receive_some(max_bytes)
        if self.frozen:
            await trio.sleep_forever()  # what arrives is never read: PINGs go unanswered
        return data

    async def aclose(self) -> None:
        await self.inner.aclose()


class RogueAgent:
    def __init__(self, pki: PkiFiles, cluster: str, agent_id: str, behaviour: Behaviour) -> None:
        self.pki = pki
        self.cluster = cluster
        self.agent_id = agent_id
        self.behaviour = behaviour
        self.connects = 0  # CONNECT streams the server opened toward this agent
        self.transport: _ControlledTransport | None = None
        self.mux: Mux | None = None

    async def run(
        self, port: int, *, task_status: trio.TaskStatus[RogueAgent] = trio.TASK_STATUS_IGNORED
    ) -> None:
        pair = self.pki.agent(self.cluster, self.agent_id)
        context = tls.client_context(pair.cert, pair.key, self.pki.ca, alpn=["h2"])
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        stream = trio.SSLStream(tcp, context, server_hostname="localhost")
        await stream.do_handshake()
        self.transport = _ControlledTransport(stream)
        async with open_mux(self.transport, Role.ACCEPTOR, handler=self._handle) as mux:
            self.mux = mux
            task_status.started(self)
            await mux.closed.wait()

    async def _handle(self, request: IncomingRequest) -> None:
        if request.path == INFO_PATH:
            body = json.dumps({"cluster": self.cluster, "agent_id": self.agent_id, "version": "rogue"})
            await request.respond(200, body.encode(), [("content-type", "application/json")])
            return
        self.connects += 1
        if self.behaviour is Behaviour.ANSWER_502:
            await request.refuse(
                502, "rogue agent: upstream connect error or disconnect/reset before headers"
            )
        elif self.behaviour is Behaviour.BLACKHOLE:
            await trio.sleep_forever()
        else:
            host, _, port = request.authority.rpartition(":")
            target = await trio.open_tcp_stream(host, int(port))
            await relay_streams(client=await request.accept(), target=target)

    async def send_raw(self, data: bytes) -> None:
        """Bytes straight into the TLS stream, outside HTTP/2 framing."""
        assert self.transport is not None
        await self.transport.send_all(data)

    def freeze(self) -> None:
        """Stop reading the connection, keeping it open: a peer that died without closing."""
        assert self.transport is not None
        self.transport.frozen = True


async def start_real_agent(
    nursery: trio.Nursery, port: int, pki: PkiFiles, cluster: str, agent_id: str, *, dial_timeout: float = 5.0
) -> Agent:
    """The real agent (its handler, tunnel runner and TLS opener) dialing ``port``, loopback targets allowed."""
    agent = Agent(
        AgentConfig(
            cluster=cluster,
            agent_id=agent_id,
            dial_timeout=dial_timeout,
            policy=EgressPolicy.build(["127.0.0.0/8"]),
        )
    )
    pair = pki.agent(cluster, agent_id)
    context = tls.client_context(pair.cert, pair.key, pki.ca, alpn=["h2"])
    options = TunnelOptions(server=("127.0.0.1", port), backoff_initial=0.05, backoff_max=0.2)
    runner = TunnelRunner(agent, options, tls_opener(options.server, context, "localhost"))
    await nursery.start(runner.run)
    return agent


def client_files(pki: PkiFiles) -> TLSFiles:
    return TLSFiles(pki.ca, pki.client.cert, pki.client.key)


async def echo_through(tunnel, cluster: str, port: int, payload: bytes) -> str:  # type: ignore[no-untyped-def]
    """One stream: send ``payload``, half-close, read the echo; its sha256."""
    stream = await tunnel.connect(cluster, "127.0.0.1", port)
    async with stream:
        await stream.send_all(payload)
        await stream.send_eof()
        echoed = bytearray()
        while data := await stream.receive_some():
            echoed += data
    return hashlib.sha256(echoed).hexdigest()


async def assert_echo(tunnel, port: int) -> None:  # type: ignore[no-untyped-def]
    payload = os.urandom(4096)
    assert await echo_through(tunnel, "cluster1", port, payload) == hashlib.sha256(payload).hexdigest()


async def rogue_then_healthy(
    nursery: trio.Nursery, server: ProxyServer, agent_port: int, pki: PkiFiles, behaviour: Behaviour
) -> tuple[RogueAgent, Agent]:
    """The rogue registers first (ties in load go to it), then a real agent of the same cluster."""
    rogue = await nursery.start(RogueAgent(pki, "cluster1", "agent-a", behaviour).run, agent_port)
    await wait_until(lambda: server.registry.find("cluster1", "agent-a"), what="the rogue registered")
    healthy = await start_real_agent(nursery, agent_port, pki, "cluster1", "agent-b")
    await wait_until(lambda: server.registry.find("cluster1", "agent-b"), what="the real agent registered")
    return rogue, healthy
