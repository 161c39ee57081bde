"""``cluster-proxy local up --servers N --proxied-cluster NAME``: proxy-server replicas behind a real
haproxy, one cluster's agent behind a real tinyproxy, the printed commands run as printed, a replica
SIGKILLed under them, and ``local down`` leaving nothing behind.

The fast tests check the pieces on their own: the port plan, the configuration haproxy itself accepts
(``haproxy -c``), its statistics parsed, each replica's command line and certificate party, the restart
policy, and the clear errors (a missing program, an unknown cluster, nothing to stop).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from clusterproxy_cli.haproxy import parse_stats_csv
from clusterproxy_cli.local_down import local_down
from clusterproxy_cli.local_pki import issue_certificates
from clusterproxy_cli.local_plan import (
    SERVER_NAME,
    SignerPlan,
    local_agent_argv,
    local_server_argv,
    plan_ports,
    signer_certificates,
    signer_parties,
)
from clusterproxy_cli.local_proxies import (
    down_replicas,
    find_program,
    haproxy_config,
    tinyproxy_config,
)
from clusterproxy_cli.local_supervise import Child
from clusterproxy_cli.main import main
from clusterproxy_cli.state import api_url, proxy_settings
from clusterproxy_protocol import http1client
from clusterproxy_protocol.config import ConfigError
from clusterproxy_protocol.pki import PemPair
from clusterproxy_protocol.restart_policy import RestartPolicy
from clusterproxy_sdk import TLSFiles, open_tunnel
from tests.support import require
from tests.support.localup import LocalUp, wait_gone
from tests.support.procs import BIN, alive, client_tls, http_get, json_records
from tests.support.proxies import binary
from tests.support.waiting import wait_until

CLUSTERS = ("cluster1", "cluster2")
TINYPROXY_REQUEST = re.compile(r"Request \(file descriptor \d+\): (\S+) (\S+)")


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# --- the pieces --------------------------------------------------------------------------------------


def test_port_plan_with_replicas_and_a_forward_proxy() -> None:
    fixed = plan_ports(20000, CLUSTERS, servers=3, forward_proxy=True)
    assert fixed.balanced
    assert (fixed.client, fixed.agent, fixed.admin, fixed.forward_proxy) == (20000, 20001, 20002, 20017)
    assert [(s.name, s.client, s.agent, s.admin) for s in fixed.servers] == [
        ("proxy-server-1", 20020, 20021, 20022),
        ("proxy-server-2", 20023, 20024, 20025),
        ("proxy-server-3", 20026, 20027, 20028),
    ]
    assert fixed.signer not in range(20000, 20029)
    assert len(fixed.all()) == len(set(fixed.all())) == 3 + 2 + 2 + 1 + 9 + 1

    free = plan_ports(0, CLUSTERS, servers=2, forward_proxy=True)
    assert len(free.all()) == len(set(free.all())) == 3 + 2 + 2 + 1 + 6 + 1

    single = plan_ports(20000, CLUSTERS)  # as before: one server on the hub's ports, no tinyproxy
    assert not single.balanced and single.forward_proxy is None
    assert [(s.name, s.client, s.agent, s.admin) for s in single.servers] == [
        (SERVER_NAME, 20000, 20001, 20002)
    ]
    assert plan_ports(65507, CLUSTERS, servers=3).servers[-1].admin == 65535
    with pytest.raises(ConfigError, match=r"65508\.\.65536"):
        plan_ports(65508, CLUSTERS, servers=3)
    with pytest.raises(ConfigError, match="1 to 9"):
        plan_ports(0, CLUSTERS, servers=10)


def test_each_replica_has_its_id_the_count_and_a_certificate_of_its_own(tmp_path: Path) -> None:
    ports = plan_ports(20000, CLUSTERS, servers=2, forward_proxy=True)
    names = [s.name for s in ports.servers]
    certs = signer_certificates(tmp_path / "pki", CLUSTERS, names)
    plan = SignerPlan(tmp_path / "store", "https://127.0.0.1:20100", tokens={"proxy-server-2": "t2"})
    first, second = (local_server_argv(ports, certs, CLUSTERS, plan, server) for server in ports.servers)
    assert flag(first, "--server-id") == "proxy-server-1" and flag(second, "--server-id") == "proxy-server-2"
    assert flag(first, "--server-count") == flag(second, "--server-count") == "2"
    assert flag(second, "--client-listen") == "127.0.0.1:20023"
    assert flag(second, "--agent-listen") == "127.0.0.1:20024"
    assert flag(second, "--admin-listen") == "127.0.0.1:20025"
    assert flag(first, "--cert") != flag(second, "--cert")  # two renewers never share files
    assert "--bootstrap-token" not in first and flag(second, "--bootstrap-token") == "t2"
    parties = {p.name: p.binding for p in signer_parties(certs, CLUSTERS)}
    assert parties["proxy-server-1"][:2] == parties["proxy-server-2"][:2] == ("--server", SERVER_NAME)

    direct = local_agent_argv("cluster1", ports, certs, plan)
    proxied = local_agent_argv("cluster2", ports, certs, plan, proxy_url="http://127.0.0.1:20017")
    assert flag(direct, "--server") == flag(proxied, "--server") == "127.0.0.1:20001"  # haproxy
    assert "--proxy-url" not in direct and flag(proxied, "--proxy-url") == "http://127.0.0.1:20017"

    static = issue_certificates(tmp_path / "static", CLUSTERS, names)
    assert static.servers["proxy-server-1"].cert != static.servers["proxy-server-2"].cert
    single = local_server_argv(
        plan_ports(20000, CLUSTERS), issue_certificates(tmp_path / "one", CLUSTERS), CLUSTERS
    )
    assert "--server-id" not in single and "--server-count" not in single


def test_haproxy_accepts_the_configuration(tmp_path: Path) -> None:
    haproxy = binary("haproxy")
    require(haproxy is not None, "haproxy (Debian package haproxy; scripts/bootstrap.sh installs it)")
    ports = plan_ports(20000, CLUSTERS, servers=3)
    text = haproxy_config(ports.servers, ports.client, ports.agent, ports.admin)
    for server in ports.servers:
        assert f"server {server.name} 127.0.0.1:{server.agent} check port {server.admin}" in text
        assert f"server {server.name} 127.0.0.1:{server.client} check port {server.admin}" in text
    assert text.count("option httpchk GET /readyz") == 2
    assert "bind 127.0.0.1:20000" in text and "bind 127.0.0.1:20001" in text
    config = tmp_path / "haproxy.cfg"
    config.write_text(text)
    checked = subprocess.run([str(haproxy), "-c", "-f", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "WARNING" not in checked.stdout + checked.stderr  # not even a warning


def test_haproxy_statistics_are_read_per_backend_and_replica() -> None:
    ports = plan_ports(0, CLUSTERS, servers=2)
    csv = (
        "# pxname,svname,qcur,status,\n"
        "agents,FRONTEND,,OPEN,\n"
        "agents,proxy-server-1,0,UP,\n"
        "agents,proxy-server-2,0,DOWN 1/2,\n"
        "agents,BACKEND,0,UP,\n"
        "clients,proxy-server-1,0,UP,\n"
        "clients,proxy-server-2,0,UP,\n"
    )
    states = parse_stats_csv(csv)
    assert states[("agents", "proxy-server-2")] == "DOWN"
    assert ("agents", "FRONTEND") not in states
    assert down_replicas(states, ports.servers) == ["proxy-server-2"]
    assert down_replicas(None, ports.servers) == ["proxy-server-1", "proxy-server-2"]


def test_tinyproxy_lets_connect_reach_only_the_hub() -> None:
    text = tinyproxy_config(20017, [20001, 41000])
    lines = text.splitlines()
    assert "Port 20017" in lines and "Listen 127.0.0.1" in lines
    assert [line for line in lines if line.startswith("ConnectPort")] == [
        "ConnectPort 20001",
        "ConnectPort 41000",
    ]


def test_a_replica_is_restarted_until_it_crashes_in_a_loop() -> None:
    child = Child("proxy-server-1", [], Path("x.log"), restart=RestartPolicy(delay=1, limit=2, window=60))
    assert child.may_restart(100.0)
    child.restarted_at.extend([100.0, 101.0])
    assert not child.may_restart(102.0)  # two restarts within the minute: a crash loop
    assert child.may_restart(161.5)  # the first one left the window
    assert not Child("cluster1-agent", [], Path("y.log")).may_restart(0.0)  # no policy: never


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["--servers", "2", "--haproxy", "no-such-haproxy"],
            "no-such-haproxy not found on PATH or in /usr/sbin, /sbin: --servers 2 runs the proxy-server "
            "replicas behind haproxy (or use --servers 1); install Debian's haproxy package",
        ),
        (
            ["--proxied-cluster", "cluster2", "--tinyproxy", "/no/such/tinyproxy"],
            "/no/such/tinyproxy is not an executable file: --proxied-cluster cluster2 sends that cluster's "
            "agent through tinyproxy; install Debian's tinyproxy package",
        ),
        (["--proxied-cluster", "cluster9"], "--proxied-cluster cluster9: not one of the clusters"),
    ],
)
def test_a_missing_program_or_an_unknown_cluster_is_one_clear_error(
    argv: list[str],
    needle: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["local", "up", *argv])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("cluster-proxy local up: ") and needle in err and err.count("\n") == 1
    assert not (tmp_path / ".state").exists()  # nothing was started or written


def test_find_program_searches_the_sbin_folders(monkeypatch: pytest.MonkeyPatch) -> None:
    haproxy = binary("haproxy")
    require(haproxy is not None, "haproxy (Debian package haproxy; scripts/bootstrap.sh installs it)")
    monkeypatch.setenv("PATH", "/nonexistent")  # a user's PATH without /usr/sbin
    assert find_program("haproxy", "haproxy", "x", "--haproxy") == haproxy


def test_local_down_with_nothing_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert local_down(tmp_path, 5.0) == 0
    assert "not running" in capsys.readouterr().out


# --- the whole thing ---------------------------------------------------------------------------------


def _printed_curl_commands(text: str) -> list[list[str]]:
    return [shlex.split(line.strip()) for line in text.splitlines() if line.strip().startswith("curl ")]


async def _run_curl(argv: list[str], body: Path) -> bytes:
    result = await trio.run_process(
        [*argv, "--data-binary", f"@{body}", "--silent", "--show-error", "--fail", "--max-time", "20"],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 0, f"{shlex.join(argv)}: {result.stderr.decode()}"
    return result.stdout


def _agents_on(admin_url: str, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A replica's agents: its admin port over mutual TLS, as the hub client of local.json."""
    proxy = doc["proxy"]
    hub = client_tls(PemPair(Path(proxy["cert"]), Path(proxy["key"])), Path(proxy["ca"]))
    status, body = http_get(f"{api_url(admin_url)}/api/v1/agents", context=hub)
    assert status == 200, body
    return json.loads(body)


def _every_agent_on_every_replica(doc: dict[str, Any]) -> bool:
    for server in doc["servers"]:
        try:
            agents = _agents_on(server["admin_url"], doc)
        except OSError:
            return False
        held = {(a["cluster"], a["server_id"]) for a in agents}
        if held != {(cluster, server["server_id"]) for cluster in CLUSTERS}:
            return False
    return True


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def _every_address(doc: dict[str, Any]) -> list[str]:
    """Every address local up listens on: the hub's, haproxy's page, each replica's, tinyproxy's, the
    signer's, the echo services' and the agents' admin ports."""
    addresses = [doc["proxy"]["client_url"].removeprefix("https://"), doc["proxy"]["agent_address"]]
    addresses.append(doc["balancer"]["stats_url"].removeprefix("http://").rstrip("/"))
    for server in doc["servers"]:
        addresses += [server["client"], server["agent"], server["admin_url"].removeprefix("http://")]
    addresses.append(doc["forward_proxy"]["url"].removeprefix("http://"))
    addresses.append(doc["signer"]["url"].removeprefix("https://"))
    for info in doc["clusters"].values():
        addresses += [info["targets"][0]["address"], info["agent_admin_url"].removeprefix("http://")]
    if "health" in doc:  # the health-collector, when its package is installed
        addresses.append(doc["health"]["url"].removeprefix("http://"))
    return addresses


async def _sdk_round_trip(doc: dict[str, Any], body: bytes) -> None:
    """POST ``body`` to each cluster's echo service, and to cluster1's kube-apiserver stand-in by its
    bare name, with the SDK through haproxy's client port; the echoed bytes have the same digest."""
    proxy = proxy_settings(doc)
    tls = TLSFiles(proxy.ca, proxy.cert, proxy.key)
    async with open_tunnel((proxy.host, proxy.port), tls, server_hostname="localhost") as tunnel:
        for cluster, info in doc["clusters"].items():
            host, port = info["targets"][0]["address"].rsplit(":", 1)
            stream = await tunnel.connect(cluster, host, int(port))
            async with stream:
                response = await http1client.request(
                    stream, "POST", "/sdk", f"{host}:{port}", body, max_body=len(body)
                )
            assert response.status == 200
            assert hashlib.sha256(response.body).hexdigest() == hashlib.sha256(body).hexdigest()
        stream = await tunnel.connect_kube_apiserver("cluster1")
        async with stream:
            response = await http1client.request(stream, "GET", "/api", "cluster1:443")
        assert json.loads(response.body)["cluster"] == "cluster1"


@pytest.mark.slow
async def test_local_up_with_replicas_behind_haproxy_and_a_cluster_behind_tinyproxy(tmp_path: Path) -> None:
    require(shutil.which("curl") is not None, "the curl binary")
    require(
        binary("haproxy") is not None, "haproxy (Debian package haproxy; scripts/bootstrap.sh installs it)"
    )
    require(
        binary("tinyproxy") is not None,
        "tinyproxy (Debian package tinyproxy; scripts/bootstrap.sh installs it)",
    )
    started = trio.current_time()
    local = await LocalUp.start(
        tmp_path / "state", tmp_path / "local-up.out", "--servers", "3", "--proxied-cluster", "cluster2"
    )
    ready_after = trio.current_time() - started
    state = local.state
    try:
        doc = local.description()
        text = local.text()
        hub_agent_port = doc["proxy"]["agent_address"]
        assert [s["server_id"] for s in doc["servers"]] == [
            "proxy-server-1",
            "proxy-server-2",
            "proxy-server-3",
        ]
        assert doc["balancer"]["client"] == doc["proxy"]["client_url"].removeprefix("https://")
        assert doc["forward_proxy"]["clusters"] == ["cluster2"]
        assert doc["clusters"]["cluster2"]["proxy_url"] == doc["forward_proxy"]["url"]
        assert "proxy_url" not in doc["clusters"]["cluster1"]
        pids = doc["pids"]
        assert {"haproxy", "tinyproxy", "proxy-server-1", "proxy-server-2", "proxy-server-3"} <= set(pids)
        assert all(alive(pid) for pid in pids.values())
        # What was printed: each replica's admin port, who goes through which proxy, the self-tests.
        for server in doc["servers"]:
            assert f"{server['name']}  admin {api_url(server['admin_url'])}/api/v1/agents" in text
        assert f"dials {hub_agent_port} through tinyproxy {doc['forward_proxy']['url']}" in text
        assert f"cluster1-agent-1 dials {hub_agent_port} directly" in text
        assert text.count("self-test through the proxy OK") == 2
        assert text.count("through each of the 3 proxy-servers OK") == 2

        # Every agent holds a tunnel to every replica: each replica's own view, and the agent's.
        assert _every_agent_on_every_replica(doc)
        for cluster in CLUSTERS:
            status, body = http_get(f"{doc['clusters'][cluster]['agent_admin_url']}/api/v1/servers")
            assert status == 200
            assert sorted(json.loads(body)["held_replicas"]) == [s["server_id"] for s in doc["servers"]]

        # The printed curl commands, as printed, with real bytes; the SDK through haproxy too.
        commands = _printed_curl_commands(text)
        assert len(commands) == 4  # by proxy user name (2), by header, by the bare cluster name
        assert all(
            f"127.0.0.1:{doc['proxy']['client_url'].rsplit(':', 1)[1]}" in " ".join(c) for c in commands
        )
        body_path = tmp_path / "body"
        body = os.urandom(2 << 20)
        body_path.write_bytes(body)
        digest = hashlib.sha256(body).hexdigest()
        for command in commands:
            assert hashlib.sha256(await _run_curl(command, body_path)).hexdigest() == digest
        await _sdk_round_trip(doc, body)

        # cluster2's agent went through tinyproxy, and tinyproxy saw only CONNECTs to the hub's agent
        # port (one tunnel per replica at least) and the signer's; cluster1's agent dialed directly.
        tinyproxy_log = (state / "logs" / "tinyproxy.log").read_text()
        requests = TINYPROXY_REQUEST.findall(tinyproxy_log)
        signer_address = doc["signer"]["url"].removeprefix("https://")
        assert {
            r for r in requests if r not in {("CONNECT", hub_agent_port), ("CONNECT", signer_address)}
        } == set()
        assert requests.count(("CONNECT", hub_agent_port)) >= 3
        via = [
            r.get("proxy") for r in json_records(state / "logs" / "cluster2-agent.log", "tunnel_connected")
        ]
        assert len(via) >= 3 and all(via)
        direct = json_records(state / "logs" / "cluster1-agent.log", "tunnel_connected")
        assert len(direct) >= 3 and not any(r.get("proxy") for r in direct)

        # SIGKILL a replica: the printed commands keep working through haproxy, local up restarts it
        # (a new pid in local.json), and every agent holds a tunnel to it again.
        victim = "proxy-server-2"  # one process: local up runs each replica with --workers 1
        os.kill(pids[victim], signal.SIGKILL)
        killed_at = trio.current_time()
        # A connection that reached the replica before it was gone dies with it, behind any TCP
        # balancer: the claim is about every connection after.
        await wait_gone([pids[victim]], timeout=10)
        first_ok_after: float | None = None
        rounds = 0
        while rounds < 5 or trio.current_time() - killed_at < 3:
            for command in commands:
                assert hashlib.sha256(await _run_curl(command, body_path)).hexdigest() == digest
                if first_ok_after is None:
                    first_ok_after = trio.current_time() - killed_at
            rounds += 1
        await wait_until(
            lambda: local.description()["pids"][victim] != pids[victim],
            timeout=20,
            what=f"{victim} restarted with its new pid in local.json",
        )
        assert f"{victim} killed by SIGKILL: restarting it" in local.text()
        assert f"Server clients/{victim} is DOWN" in (state / "logs" / "haproxy.log").read_text()
        await wait_until(
            lambda: _every_agent_on_every_replica(local.description()),
            timeout=30,
            what="every agent on every replica again",
        )
        await _sdk_round_trip(local.description(), body)
        print(
            f"\nlocal up --servers 3 ready in {ready_after:.1f}s; after SIGKILL of {victim}: first printed "
            f"curl command succeeded {first_ok_after:.2f}s after, {rounds * len(commands)} in all, 0 failed"
        )

        # local down: local up stops everything, haproxy and tinyproxy included; nothing listens.
        doc = local.description()
        addresses = _every_address(doc)
        down = await trio.run_process(
            [str(BIN / "cluster-proxy"), "local", "down", "--state-dir", str(state)],
            capture_stdout=True,
            check=False,
        )
        assert down.returncode == 0, down.stdout.decode()
        assert await local.wait_exit() == 0
        await wait_gone(list(doc["pids"].values()))
        assert not (state / "local.json").exists()
        still = [a for a in addresses if await trio.to_thread.run_sync(_listening, a)]
        assert still == [], f"still listening after local down: {still}"
    finally:
        local.dump()
        await local.stop()


@pytest.mark.slow
async def test_local_down_stops_what_a_killed_local_up_left_running(tmp_path: Path) -> None:
    require(
        binary("haproxy") is not None, "haproxy (Debian package haproxy; scripts/bootstrap.sh installs it)"
    )
    require(
        binary("tinyproxy") is not None,
        "tinyproxy (Debian package tinyproxy; scripts/bootstrap.sh installs it)",
    )
    local = await LocalUp.start(
        tmp_path / "state", tmp_path / "local-up.out", "--servers", "2", "--proxied-cluster", "cluster1"
    )
    doc: dict[str, Any] = {"pids": {}}
    try:
        doc = local.description()
        addresses = _every_address(doc)
        local.process.kill()  # local up cannot stop its children: they run on, in their own sessions
        await local.wait_exit()
        children = {name: pid for name, pid in doc["pids"].items() if name != "cluster-proxy"}
        assert all(alive(pid) for pid in children.values())
        down = await trio.run_process(
            [str(BIN / "cluster-proxy"), "local", "down", "--state-dir", str(local.state)],
            capture_stdout=True,
            check=False,
        )
        out = down.stdout.decode()
        assert down.returncode == 0, out
        assert "local up is gone; stopping what it left running" in out
        assert "haproxy (pid" in out and "tinyproxy (pid" in out
        await wait_gone(list(children.values()))
        assert not (local.state / "local.json").exists()
        still = [a for a in addresses if await trio.to_thread.run_sync(_listening, a)]
        assert still == [], f"still listening after local down: {still}"
    finally:
        local.dump()
        for pid in doc["pids"].values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        await local.stop()
