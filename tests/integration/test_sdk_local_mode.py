"""``cluster-proxy local up`` as real processes, used through the SDK, port-forward and curl.

The whole local system: a cert-signer, a proxy-server, two agents and two echo services, all
subprocesses on loopback. Readiness is the ``local.json`` file plus the "Press Ctrl-C" line, with a
deadline (:class:`tests.support.localup.LocalUp`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import trio

from clusterproxy_cli.portforward import PortForward, run_port_forward
from clusterproxy_cli.state import proxy_settings
from clusterproxy_protocol import http1client
from clusterproxy_sdk import Forbidden, TLSFiles, UnknownCluster, open_tunnel
from tests.support.localup import LocalUp, wait_gone
from tests.support.procs import alive

pytestmark = pytest.mark.slow


async def _get_through(tunnel, cluster: str, host: str, port: int, path: str) -> dict:  # type: ignore[no-untyped-def]
    stream = await tunnel.connect(cluster, host, port)
    async with stream:
        response = await http1client.request(stream, "GET", path, f"{host}:{port}")
    assert response.status == 200
    return json.loads(response.body)


async def test_local_up_serves_sdk_curl_and_port_forward_then_stops_cleanly(tmp_path: Path) -> None:
    local = await LocalUp.start(tmp_path / "state", tmp_path / "local-up.out")
    try:
        doc = local.description()
        assert set(doc["clusters"]) == {"cluster1", "cluster2"}
        pids = list(doc["pids"].values())
        # local up, the signer, the server, 2 agents, 2 echoes, and the health-collector (installed by
        # scripts/bootstrap.sh: local up runs it)
        assert set(doc["pids"]) == {
            "cluster-proxy",
            "cert-signer",
            "proxy-server",
            "cluster1-agent",
            "cluster2-agent",
            "cluster1-echo",
            "cluster2-echo",
            "health-collector",
        }
        assert all(alive(pid) for pid in pids)
        proxy = proxy_settings(doc)
        for key in ("ca", "cert", "key"):
            assert Path(doc["proxy"][key]).is_absolute() and Path(doc["proxy"][key]).is_file()
        echo = {name: info["targets"][0]["address"].rsplit(":", 1) for name, info in doc["clusters"].items()}
        assert "self-test through the proxy OK" in local.text()

        # The SDK: one connection, streams into both clusters, the bare-name route, refusals.
        tls = TLSFiles(proxy.ca, proxy.cert, proxy.key)
        async with open_tunnel((proxy.host, proxy.port), tls) as tunnel:
            for cluster, (host, port) in echo.items():
                info = await _get_through(tunnel, cluster, host, int(port), f"/from-sdk/{cluster}")
                assert (info["service"], info["cluster"], info["path"]) == (
                    f"{cluster}-echo",
                    cluster,
                    f"/from-sdk/{cluster}",
                )
            stream = await tunnel.connect_kube_apiserver("cluster2")
            async with stream:
                response = await http1client.request(stream, "GET", "/api", "cluster2:443")
            assert json.loads(response.body)["cluster"] == "cluster2"
            host1, port1 = echo["cluster1"]
            with pytest.raises(Forbidden) as refused:  # cluster2's agent allows only its own echo
                await tunnel.connect("cluster2", host1, int(port1))
            assert port1 in refused.value.reason
            with pytest.raises(UnknownCluster):
                await tunnel.connect("cluster9", host1, int(port1))

        # port-forward with the settings from local.json.
        pf = PortForward("cluster1", host1, int(port1), "127.0.0.1", 0, (proxy.host, proxy.port), tls)
        async with trio.open_nursery() as nursery:
            [(_, local_port)] = await nursery.start(
                lambda task_status: run_port_forward(pf, out=open(os.devnull, "w"), task_status=task_status)  # noqa: SIM115
            )
            response = await http1client.get("127.0.0.1", local_port, "/via-port-forward")
            assert json.loads(response.body)["path"] == "/via-port-forward"
            nursery.cancel_scope.cancel()

        # The curl commands printed for users, run as printed.
        if shutil.which("curl"):
            commands = [
                line.strip() for line in local.text().splitlines() if line.strip().startswith("curl ")
            ]
            assert len(commands) == 4  # two by proxy user name, one by header, one bare cluster name
            for command in commands:
                result = subprocess.run(
                    [*shlex.split(command), "-sS", "--max-time", "10"], capture_output=True, timeout=20
                )
                assert result.returncode == 0, result.stderr
                assert b"hello from cluster" in result.stdout

        # A second `local up` on the same state folder refuses to start.
        again = await LocalUp.spawn(local.state, tmp_path / "second.out")
        assert await again.wait_exit() == 1
        assert "already running" in again.text()
        assert (local.state / "local.json").exists()  # the refused start left the running one alone

        assert await local.stop(signal.SIGTERM) == 0
        assert not (local.state / "local.json").exists()
        await wait_gone(pids)
        assert "did not stop" not in local.text()
    finally:
        local.dump()
        await local.stop()


async def test_a_child_dying_stops_everything_with_status_1(tmp_path: Path) -> None:
    local = await LocalUp.start(tmp_path / "state", tmp_path / "local-up.out")
    try:
        doc = local.description()
        pids = doc["pids"]
        # an echo service has no restart policy (a replica or an agent is restarted: test_local_ha.py,
        # test_health_local.py): its death stops everything
        os.kill(pids["cluster2-echo"], signal.SIGKILL)
        assert await local.wait_exit() == 1
        text = local.text()
        assert "error: cluster2-echo killed by SIGKILL" in text
        assert "cluster2-echo.log" in text and "  | " in text  # its last log lines
        assert not (local.state / "local.json").exists()
        await wait_gone([pid for name, pid in pids.items() if name != "cluster-proxy"])
    finally:
        local.dump()
        await local.stop()
