"""Failures from outside: a killed agent, and hostile bytes on both ports."""

from __future__ import annotations

import hashlib
import os
import re
import signal
from pathlib import Path

import pytest
import trio

from clusterproxy_protocol.errors import ConnectRefused
from clusterproxy_sdk import TLSFiles, open_tunnel
from tests.support.hostile_connections import attack as hostile_connection
from tests.support.pki import PkiFiles
from tests.support.procs import Hub, http_get
from tests.support.targets import Blackhole, pattern_digest, serve_digest, serve_source
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow
MiB = 1 << 20


@pytest.fixture
async def own_hub(pki: PkiFiles, tmp_path: Path):
    """A hub of its own, because these tests kill its agent."""
    hub = Hub(pki, tmp_path)
    try:
        await hub.start_server("--dial-timeout", "60s")
        yield hub
    finally:
        hub.stop()


AGENT_ARGS = ("--allow", "127.0.0.0/8", "--dial-timeout", "60s")


async def test_sigkill_of_agent_fails_its_streams_fast_and_it_comes_back(
    own_hub: Hub, pki: PkiFiles, nursery: trio.Nursery
) -> None:
    hub = own_hub
    agent = hub.start_agent("cluster1", "agent-a", *AGENT_ARGS)
    await hub.wait_agent("cluster1", "agent-a")
    source = await serve_source(nursery)
    hole = Blackhole()
    files = TLSFiles(pki.ca, pki.client.cert, pki.client.key)
    outcomes: dict[str, str] = {}
    async with open_tunnel(f"127.0.0.1:{hub.client_port}", files, server_hostname="localhost") as tunnel:
        flowing = await tunnel.connect("cluster1", source.host, source.port)
        assert await flowing.receive_some(1024)

        async def pending_dial() -> None:
            try:
                await tunnel.connect("cluster1", "127.0.0.1", hole.port)
                outcomes["dial"] = "connected?!"
            except ConnectRefused as exc:
                outcomes["dial"] = f"{exc.status} {exc.reason}"

        async def keep_reading() -> None:
            try:
                while await flowing.receive_some(64 << 10):
                    pass
                outcomes["stream"] = "clean EOF"
            except trio.BrokenResourceError as exc:
                outcomes["stream"] = f"broken: {exc}"

        async with trio.open_nursery() as inner:
            inner.start_soon(pending_dial)
            inner.start_soon(keep_reading)
            # The dial is pending at the agent (blackholed target, 60s dial timeout) when we kill it.
            while "dial" not in outcomes and not _agent_is_dialing(agent, hole.port):
                await trio.sleep(0.02)
            killed_at = trio.current_time()
            agent.kill(signal.SIGKILL)
            await wait_until(  # "within a few seconds, never hang"
                lambda: len(outcomes) >= 2, timeout=5, what="both streams to fail", interval=0.02
            )
            elapsed = trio.current_time() - killed_at
    hole.close()
    assert outcomes["stream"].startswith("broken"), outcomes
    assert outcomes["dial"].startswith("502") and "disconnected while dialing" in outcomes["dial"], outcomes
    assert elapsed < 5
    print(f"\nstreams failed {elapsed:.2f}s after SIGKILL of the agent")

    # Restarted, the agent reconnects by itself and new streams work.
    hub.start_agent("cluster1", "agent-a", *AGENT_ARGS, name="agent-cluster1-agent-a-restarted")
    await hub.wait_agent("cluster1", "agent-a")
    target = await serve_digest(nursery)
    async with open_tunnel(f"127.0.0.1:{hub.client_port}", files, server_hostname="localhost") as tunnel:
        stream = await tunnel.connect("cluster1", target.host, target.port)
        await stream.send_all(b"after-restart 1000\nabc")
        await stream.send_eof()
        data = b""
        while chunk := await stream.receive_some():
            data += chunk
    assert hashlib.sha256(data).hexdigest() == pattern_digest("after-restart", 1000)
    assert target.received["after-restart"] == hashlib.sha256(b"abc").hexdigest()


def _agent_is_dialing(agent, port: int) -> bool:
    """True once the agent process has a TCP socket in SYN_SENT toward ``port`` (from /proc/net/tcp)."""
    wanted = f":{port:04X}"
    inodes = set()
    for fd in Path(f"/proc/{agent.pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[2].endswith(wanted) and fields[3] == "02" and fields[9] in inodes:
            return True
    return False


async def test_hostile_connections_are_refused_and_live_streams_go_on(
    own_hub: Hub, pki: PkiFiles, nursery: trio.Nursery
) -> None:
    hub = own_hub
    hub.start_agent("cluster1", "agent-a", *AGENT_ARGS)
    await hub.wait_agent("cluster1", "agent-a")
    target = await serve_digest(nursery)
    files = TLSFiles(pki.ca, pki.client.cert, pki.client.key)
    kinds = ["garbage", "plain-http", "tls-no-cert", "tls-foreign-ca"]
    results: dict[tuple[str, str], str] = {}
    async with open_tunnel(f"127.0.0.1:{hub.client_port}", files, server_hostname="localhost") as tunnel:
        live = await tunnel.connect("cluster1", target.host, target.port)
        size = 8 * MiB
        await live.send_all(f"live {size}\n".encode())
        got = b""
        got += await live.receive_some(65536)  # the live stream is flowing before the attacks

        async def attack(port_name: str, port: int, kind: str) -> None:
            results[(port_name, kind)] = await hostile_connection(port, kind, pki)

        async with trio.open_nursery() as attacks:
            for port_name, port in (("agent", hub.agent_port), ("client", hub.client_port)):
                for kind in kinds:
                    attacks.start_soon(attack, port_name, port, kind)
        await live.send_eof()
        with trio.fail_after(60):
            while chunk := await live.receive_some(1 << 18):
                got += chunk
    assert len(results) == 8 and all(r == "closed" or r.startswith("refused") for r in results.values()), (
        results
    )
    assert hashlib.sha256(got).hexdigest() == pattern_digest("live", size), "live stream corrupted"
    assert target.received["live"] == hashlib.sha256(b"").hexdigest()
    status, body = await trio.to_thread.run_sync(http_get, f"http://127.0.0.1:{hub.admin_port}/metrics")
    assert status == 200
    rejected = sum(
        float(v)
        for v in re.findall(rb"^cluster_proxy_server_rejected_connections_total\{[^}]*\} (\S+)$", body, re.M)
    )
    assert rejected >= 8, body.decode()
    assert hub.server.popen.poll() is None, "the server died"
