"""The real ``cluster-proxy-agent`` process: startup validation, JSON logs, tunnel, SIGTERM drain."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from clusterproxy_protocol.pki import DevCA, PemPair
from tests.support.agent_hub import Hub, admin_get, echo_once
from tests.support.targets import serve_echo
from tests.support.waiting import wait_until

AGENT = Path(sys.executable).parent / "cluster-proxy-agent"


@pytest.fixture(scope="module")
def tunnel_pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    directory = tmp_path_factory.mktemp("process-pki")
    ca = DevCA.create_or_load(directory / "ca")
    return {
        "ca": ca.ca_path,
        "server": ca.issue_server("hub", ["localhost", "127.0.0.1"], directory),
        "agent": ca.issue_agent("cluster1", "agent-a", directory),
    }


def agent_argv(pki: dict[str, object], port: int, *extra: str) -> list[str]:
    agent: PemPair = pki["agent"]  # type: ignore[assignment]
    return [
        str(AGENT),
        "--server",
        f"127.0.0.1:{port}",
        "--server-name",
        "localhost",
        "--cluster",
        "cluster1",
        "--agent-id",
        "agent-a",
        "--ca",
        str(pki["ca"]),
        "--cert",
        str(agent.cert),
        "--key",
        str(agent.key),
        "--admin-listen",
        "127.0.0.1:0",
        "--allow",
        "127.0.0.0/8",
        "--log-format",
        "json",
        *extra,
    ]


def events(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


async def wait_event(log: Path, process: trio.Process, name: str, timeout: float = 15) -> dict[str, Any]:

    def logged() -> dict[str, Any] | None:
        for record in events(log):
            if record.get("event") == name:
                return record
        if process.returncode is not None:
            raise AssertionError(f"agent exited {process.returncode} before {name}:\n{log.read_text()}")
        return None

    return await wait_until(logged, timeout=timeout, what=f"the agent to log {name}", interval=0.02)


def test_bad_flag_exits_2_naming_the_value(tunnel_pki) -> None:
    result = subprocess.run(
        agent_argv(tunnel_pki, 1, "--dial-timeout", "soonish"), capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "--dial-timeout" in result.stderr
    assert "'soonish'" in result.stderr


def test_admin_port_in_use_exits_1_with_the_reason(tunnel_pki) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = agent_argv(tunnel_pki, 1, "--admin-listen", f"127.0.0.1:{port}")
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    failed = [json.loads(line) for line in result.stderr.splitlines() if '"agent_failed"' in line]
    assert failed, result.stderr
    assert failed[0]["error"] == f"cannot listen on --admin-listen 127.0.0.1:{port}: Address already in use"


@pytest.mark.slow
async def test_process_serves_the_tunnel_and_drains_on_sigterm(
    tunnel_pki, tmp_path: Path, nursery: trio.Nursery
) -> None:
    hub = await Hub(tunnel_pki).start(nursery)
    echo_port = (await serve_echo(nursery)).port
    log = tmp_path / "agent.log"
    with log.open("wb") as sink:
        process = await trio.lowlevel.open_process(
            agent_argv(tunnel_pki, hub.port, "--drain-timeout", "20s"), stdout=sink, stderr=sink
        )
    try:
        starting = await wait_event(log, process, "agent_starting")
        assert starting["server"] == f"127.0.0.1:{hub.port}"
        assert starting["egress"]["allow"] == ["127.0.0.0/8"]
        assert "BEGIN" not in log.read_text()  # paths only, never key material
        started = await wait_event(log, process, "agent_started")
        admin = started["admin_port"]

        mux = await hub.next_tunnel()
        await wait_event(log, process, "tunnel_connected")
        assert (await admin_get(admin, "/readyz"))[0] == 200
        assert await echo_once(mux, echo_port, b"x" * 100_000) == b"x" * 100_000

        stream = await mux.open_connect(f"127.0.0.1:{echo_port}")
        process.send_signal(signal.SIGTERM)
        await wait_until(lambda: mux.peer_draining, timeout=10, what="the hub to see the drain")
        assert process.returncode is None  # still serving the open stream
        await stream.send_all(b"still here")
        await stream.send_eof()
        assert await stream.receive_some() == b"still here"
        await stream.aclose()
        with trio.fail_after(10):
            code = await process.wait()
        assert code == 0
        names = [e.get("event") for e in events(log)]
        assert names.index("shutdown_requested") < names.index("draining") < names.index("agent_stopped")
        assert "tunnel_disconnected" in names
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
