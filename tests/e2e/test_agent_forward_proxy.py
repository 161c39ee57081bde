"""Agents behind real forward proxies (seed 003): tinyproxy as an HTTP proxy, squid as an HTTPS proxy with
its own CA and as a proxy demanding basic auth, proxies that refuse (407, 403) and are then fixed,
NO_PROXY exempting the hub, and the agent's calls to the cert-signer through the same proxy.

Every transfer is 16 MiB each way through the hub's client port and the proxied agent's tunnel, checked
by sha256. What each proxy saw is read from its own log: only ``CONNECT`` requests to the hub's agent
port (and to the signer's port); the mTLS runs end to end inside them, so a certificate for another
cluster is still refused by the proxy-server.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from clusterproxy_cli.commands import SignerFlags
from clusterproxy_protocol.certclient import CertFiles
from clusterproxy_protocol.pki import DevCA
from tests.support import require
from tests.support.certs import ClientParty, SignedHub, SignerProcess
from tests.support.clients import transfer
from tests.support.pki import PkiFiles
from tests.support.procs import BIN, Hub, Process, running_hub
from tests.support.proxies import (
    ForwardProxyProcess,
    Request,
    binary,
    missing,
    start_squid,
    start_tinyproxy,
)
from tests.support.targets import serve_digest

pytestmark = pytest.mark.slow

SIZE = 16 << 20
NO_PROXY_ENV = {"HTTPS_PROXY": "", "https_proxy": "", "NO_PROXY": "", "no_proxy": ""}  # what the runner had
FIXED_WITHIN = 5.0  # a proxy that allows it again: the agent is back within (backoff max 1 s + connect)


@pytest.fixture(autouse=True)
def _proxies_installed() -> None:
    require(binary("tinyproxy") is not None, missing("tinyproxy"))
    require(binary("squid") is not None, missing("squid"))


@pytest.fixture(scope="module")
def hub(pki: PkiFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """One proxy-server for the module; each test brings its own proxies and agents."""
    with running_hub(pki, tmp_path_factory.mktemp("logs")) as hub:
        yield hub


def launch_agent(
    hub: Hub,
    cluster: str,
    *extra: str,
    cert_for: str | None = None,
    env: dict[str, str] | None = None,
    signer: SignerFlags | None = None,
    files: CertFiles | None = None,
) -> Process:
    """An agent of ``cluster`` (a certificate for ``cert_for`` instead, when given) allowed to reach
    loopback targets; the runner's own proxy variables are blanked, ``env`` sets others."""
    if files is None:
        ca = DevCA.create_or_load(hub.pki.ca.parent)
        pair = ca.issue_agent(cert_for or cluster, "agent-a", hub.log_dir / "leaves")
        files = CertFiles(pair.cert, pair.key, hub.pki.ca)
    argv = hub.agent_argv(
        files, cluster, "agent-a", log_level="debug", allow=["127.0.0.0/8"], signer=signer, options=extra
    )
    name = f"agent-{cluster}" + (f"-with-{cert_for}-cert" if cert_for else "")
    process = Process(name, argv, hub.log_dir, env={**NO_PROXY_ENV, **(env or {})})
    hub.agents[name] = process
    return process


def only_connects_to(proxy: ForwardProxyProcess, *ports: int) -> list[Request]:
    """The proxy's logged requests, asserting each is a CONNECT to 127.0.0.1 on one of ``ports``."""
    requests = proxy.requests()
    allowed = {f"127.0.0.1:{port}" for port in ports}
    strays = [r for r in requests if r.method != "CONNECT" or r.target not in allowed]
    assert not strays, f"{proxy.kind} logged requests other than CONNECT to {sorted(allowed)}: {strays}"
    return requests


def _seconds(record: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(str(record["timestamp"]).replace("Z", "+00:00")).timestamp()


# --- tinyproxy: an HTTP proxy -----------------------------------------------------------------------------


async def test_agent_behind_tinyproxy_carries_16_mib_and_the_proxy_sees_only_the_connect(
    hub: Hub, tmp_path: Path, nursery: trio.Nursery
) -> None:
    proxy = await start_tinyproxy(hub.log_dir, "tinyproxy-plain")
    target = await serve_digest(nursery)
    try:
        agent = launch_agent(hub, "behind-tinyproxy", "--proxy-url", proxy.url())
        await hub.wait_agent("behind-tinyproxy", "agent-a")
        connected = await agent.wait_event("tunnel_connected")
        assert connected["proxy"] == proxy.url()
        starting = (await agent.wait_event("agent_starting"))["proxy_to_server"]
        assert starting == f"through {proxy.url()} (from --proxy-url)"

        seconds = await transfer(hub, "behind-tinyproxy", target)
        print(
            f"\n16 MiB each way through tinyproxy: {seconds:.2f} s ({2 * SIZE * 8 / seconds / 1e6:.0f} Mbit/s)"
        )
        assert only_connects_to(proxy, hub.agent_port) == [Request("CONNECT", f"127.0.0.1:{hub.agent_port}")]

        # mTLS end to end through the proxy: a cluster1 certificate claiming another cluster is refused by
        # the proxy-server (the proxy only relays ciphertext; the identity is checked at the hub)
        assert hub.server is not None
        before = len(hub.server.named("agent_refused"))
        impostor = launch_agent(hub, "behind-tinyproxy-2", "--proxy-url", proxy.url(), cert_for="cluster1")
        refused = (await hub.server.wait_count("agent_refused", before + 1))[before]
        assert "claims cluster 'behind-tinyproxy-2'" in refused["error"], refused
        assert "certificate is for cluster 'cluster1'" in refused["error"], refused
        impostor.stop()
        assert all(a["cluster"] != "behind-tinyproxy-2" for a in hub.agents_connected())
        requests = only_connects_to(proxy, hub.agent_port)
        assert len(requests) >= 2  # the impostor's tunnel went through it too

        # the tunnel lives in the proxy: stopping the proxy ends it, and every later attempt names it. An
        # attempt made while tinyproxy was shutting down may be accepted and then reset; the one after it
        # starts once the process is gone and finds nothing listening.
        proxy.stop()
        await agent.wait_event("tunnel_disconnected")
        await hub.wait_agent("behind-tinyproxy", "agent-a", present=False)
        after_stop = len(agent.named("tunnel_connect_failed"))
        failures = await agent.wait_count("tunnel_connect_failed", after_stop + 2)
        for failure in failures:
            assert failure["error"].startswith(
                (
                    f"cannot connect to forward proxy {proxy.url()}: ",
                    f"forward proxy {proxy.url()} dropped the connection during CONNECT ",
                )
            ), failure
        assert failures[-1]["error"].startswith(f"cannot connect to forward proxy {proxy.url()}: ")
        assert agent.popen.poll() is None
    finally:
        proxy.stop()


# --- squid: an HTTPS proxy with its own CA ----------------------------------------------------------------


async def test_agent_behind_squid_as_an_https_proxy_with_its_own_ca(
    hub: Hub, tmp_path: Path, nursery: trio.Nursery
) -> None:
    proxy_ca = DevCA.create_or_load(tmp_path / "proxy-ca", name="corp-proxy-ca")
    proxy_cert = proxy_ca.issue_server("corp-proxy", ["127.0.0.1", "localhost"], tmp_path / "proxy-cert")
    proxy = await start_squid(hub.log_dir, "squid-https", tls=(proxy_cert.cert, proxy_cert.key))
    target = await serve_digest(nursery)
    try:
        # without the proxy's CA: a TLS failure with the proxy, one line naming it, then backoff
        untrusting = launch_agent(hub, "behind-squid-no-ca", "--proxy-url", proxy.url())
        failures = await untrusting.wait_count("tunnel_connect_failed", 2)
        for failure in failures:
            assert failure["proxy"] == proxy.url()
            assert failure["error"].startswith(f"TLS with forward proxy {proxy.url()} failed: "), failure
            assert "certificate verify failed" in failure["error"]
            assert "(give the proxy's CA with --proxy-ca-file)" in failure["error"]
        untrusting.stop()

        agent = launch_agent(
            hub, "behind-squid", "--proxy-url", proxy.url(), "--proxy-ca-file", str(proxy_ca.ca_path)
        )
        await hub.wait_agent("behind-squid", "agent-a")
        seconds = await transfer(hub, "behind-squid", target)
        print(f"\n16 MiB each way through squid (HTTPS proxy): {seconds:.2f} s")

        # squid logs a tunnel when it ends: its byte counts show the transfer went through it
        agent.stop()
        requests = await proxy.wait_requests(1)
        assert only_connects_to(proxy, hub.agent_port) == requests
        assert [r.status for r in requests] == [200]
        assert requests[0].bytes_from_client is not None and requests[0].bytes_to_client is not None
        assert requests[0].bytes_from_client > SIZE and requests[0].bytes_to_client > SIZE
        print(f"squid's log: {requests[0]}")
    finally:
        proxy.stop()


# --- refusing proxies, then fixed -------------------------------------------------------------------------

ProxyStart = Callable[[Hub, str, int | None], Awaitable[ForwardProxyProcess]]


async def _squid_with_password(password: str, hub: Hub, name: str, port: int | None) -> ForwardProxyProcess:
    return await start_squid(hub.log_dir, name, port=port, basic_auth=("agent", password))


async def _tinyproxy_allowing(
    ports: tuple[int, ...], hub: Hub, name: str, port: int | None
) -> ForwardProxyProcess:
    return await start_tinyproxy(hub.log_dir, name, port=port, connect_ports=ports)


REFUSALS = {
    # name: (refusing proxy, fixed proxy, the proxy's answer, the agent's credentials)
    "407-basic-auth": (
        lambda hub, name, port: _squid_with_password("other-password", hub, name, port),
        lambda hub, name, port: _squid_with_password("s3cret-pw", hub, name, port),
        "407 Proxy Authentication Required",
        ("agent", "s3cret-pw"),
    ),
    "403-forbidden-port": (
        lambda hub, name, port: _tinyproxy_allowing((443,), hub, name, port),
        lambda hub, name, port: _tinyproxy_allowing((), hub, name, port),
        "403 Access violation",
        None,
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
async def test_a_refusing_proxy_is_one_line_per_attempt_then_backoff_then_the_agent_connects_by_itself(
    hub: Hub, nursery: trio.Nursery, case: str
) -> None:
    refusing, fixed, answer, credentials = REFUSALS[case]
    proxy = await refusing(hub, f"{case}-refusing", None)
    cluster = f"refused-{case}"
    replacement: ForwardProxyProcess | None = None
    try:
        url = proxy.url(*credentials) if credentials else proxy.url()
        shown = proxy.url(credentials[0], "***") if credentials else proxy.url()
        agent = launch_agent(hub, cluster, "--proxy-url", url)
        failures = await agent.wait_count("tunnel_connect_failed", 4)
        expected = f"forward proxy {shown} answered CONNECT 127.0.0.1:{hub.agent_port} with {answer}: "
        for failure in failures:
            assert failure["proxy"] == shown and failure["level"] == "warning"
            assert failure["error"].startswith(expected), failure["error"]
        # one line per refusal: in one snapshot of the log, every line carrying the answer is a
        # tunnel_connect_failed, one per attempt made (the last may still be under way); no traceback
        log = agent.log_path.read_text()
        records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        answered = [r for r in records if answer in json.dumps(r)]
        attempts = [r for r in records if r["event"] == "tunnel_connecting"]
        assert {r["event"] for r in answered} == {"tunnel_connect_failed"}
        assert len(attempts) - 1 <= len(answered) <= len(attempts)
        assert not agent.named("tunnel_error") and "Traceback" not in log
        if credentials:
            assert credentials[1] not in log, "the proxy password is in the agent's log"
        assert agent.popen.poll() is None
        gaps = [_seconds(b) - _seconds(a) for a, b in itertools.pairwise(failures)]
        delays = [e["delay"] for e in agent.named("tunnel_reconnect_scheduled")[: len(gaps)]]
        print(f"\n{case}: {answer!r} x{len(failures)}, backoff delays {delays} s, attempt gaps "
              f"{[round(g, 3) for g in gaps]} s")  # fmt: skip
        assert all(0 <= d <= 1.0 for d in delays)  # jittered, under the tests' --backoff-max 1s

        # the proxy's administrator fixes it (a new process on the same port): the agent connects by itself
        port = proxy.port
        proxy.stop()
        replacement = await fixed(hub, f"{case}-fixed", port)
        fixed_at = trio.current_time()
        await hub.wait_agent(cluster, "agent-a", timeout=FIXED_WITHIN)
        back = trio.current_time() - fixed_at
        print(f"{case}: connected {back:.2f} s after the fixed proxy was up")
        seconds = await transfer(hub, cluster, await serve_digest(nursery))
        print(f"{case}: 16 MiB each way through the fixed proxy: {seconds:.2f} s")
        refused_requests = only_connects_to(proxy, hub.agent_port)
        assert len(refused_requests) >= 4
        if proxy.kind == "squid":
            assert {r.status for r in refused_requests} == {407}
        assert agent.popen.poll() is None
        agent.stop()
        allowed = await replacement.wait_requests(1)
        assert only_connects_to(replacement, hub.agent_port) == allowed
        if replacement.kind == "squid":
            assert [r.status for r in allowed] == [200]
    finally:
        proxy.stop()
        if replacement is not None:
            replacement.stop()


# --- NO_PROXY ---------------------------------------------------------------------------------------------


async def test_no_proxy_exempts_the_hub_and_the_agent_dials_directly(hub: Hub, nursery: trio.Nursery) -> None:
    proxy = await start_tinyproxy(hub.log_dir, "tinyproxy-bypassed")
    probes = proxy.connections()  # the readiness probe
    try:
        agent = launch_agent(
            hub,
            "exempt-from-proxy",
            env={"HTTPS_PROXY": proxy.url(), "NO_PROXY": ".corp.example,127.0.0.0/8"},
        )
        await hub.wait_agent("exempt-from-proxy", "agent-a")
        starting = await agent.wait_event("agent_starting")
        assert starting["proxy_to_server"] == "direct: NO_PROXY entry '127.0.0.0/8' matches"
        assert "proxy" not in await agent.wait_event("tunnel_connected")
        seconds = await transfer(hub, "exempt-from-proxy", await serve_digest(nursery))
        print(f"\n16 MiB each way, direct (NO_PROXY): {seconds:.2f} s")
        assert proxy.requests() == [] and proxy.connections() == probes, proxy.tail()
    finally:
        proxy.stop()


# --- the cert-signer through the proxy --------------------------------------------------------------------


async def test_bootstrap_and_renewal_with_the_signer_go_through_the_proxy(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """HTTPS_PROXY from the environment applies to the signer too: the bootstrap (a token for a first
    certificate), the trust refreshes and the renewals (certificates of 6 s, renewed at ~4.8 s) all
    CONNECT through tinyproxy, and the tunnel stays up across the renewals."""
    signer = SignerProcess(tmp_path / "signer", tmp_path, "--cert-ttl", "6s")
    hub = SignedHub(None, tmp_path, signer=signer)  # type: ignore[arg-type]
    proxy: ForwardProxyProcess | None = None
    try:
        await signer.start()
        await hub.start_server()
        proxy = await start_tinyproxy(tmp_path, "tinyproxy-signer")
        files = signer.party(tmp_path / "agent-files")
        flags = SignerFlags(signer.url, "2s", signer.agent_token("signed-behind-proxy"))
        agent = launch_agent(
            hub, "signed-behind-proxy", env={"HTTPS_PROXY": proxy.url()}, signer=flags, files=files
        )
        bootstrapped = await agent.wait_event("cert_bootstrapped", timeout=30)
        await hub.wait_agent("signed-behind-proxy", "agent-a")
        starting = await agent.wait_event("agent_starting")
        assert starting["proxy_to_signer"] == f"through {proxy.url()} (from HTTPS_PROXY)"
        renewed = await agent.wait_event("cert_renewed", timeout=30)
        assert renewed["serial"] != bootstrapped["serial"]
        client = await ClientParty.bootstrap(signer, tmp_path / "client", "test-admin")
        await transfer(hub, "signed-behind-proxy", await serve_digest(nursery), size=1 << 20, tls=client.h2())
        requests = only_connects_to(proxy, signer.port, hub.agent_port)
        to_signer = [r for r in requests if r.target == f"127.0.0.1:{signer.port}"]
        to_hub = [r for r in requests if r.target == f"127.0.0.1:{hub.agent_port}"]
        print(f"\ntinyproxy saw {len(to_signer)} CONNECTs to the signer, {len(to_hub)} to the hub")
        assert len(to_signer) >= 2 and len(to_hub) == 1  # bootstrap + renewal (+ trust refreshes); one tunnel
        assert not agent.named("tunnel_disconnected")
        assert (
            signer.issued()["renew"] >= 1 and signer.issued()["bootstrap"] >= 2
        )  # the agent's and the server's
    finally:
        if proxy is not None:
            proxy.stop()
        hub.stop()


# --- bad settings stop the agent at start -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--proxy-url", "http://proxy.corp:3128/some/path"], "--proxy-url: malformed proxy URL"),
        (["--proxy-url", "socks5://proxy.corp:1080"], "--proxy-url: SOCKS proxies are not supported"),
        (["--proxy-ca-file", "/nonexistent/proxy-ca.pem"], "--proxy-ca-file: file not found"),
    ],
)
def test_bad_proxy_settings_stop_the_agent_at_start_with_a_clear_error(
    pki: PkiFiles, flags: list[str], says: str
) -> None:
    pair = pki.agent("cluster1", "agent-a")
    result = subprocess.run(
        [
            str(BIN / "cluster-proxy-agent"),
            *("--server", "127.0.0.1:1", "--cluster", "cluster1", "--ca", str(pki.ca)),
            *("--cert", str(pair.cert), "--key", str(pair.key), *flags),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result
    assert says in result.stderr, result.stderr
