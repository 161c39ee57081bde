"""Real clients through real processes: curl, the SDK, and every error status on both frontends."""

from __future__ import annotations

import shutil

import pytest
import trio

from clusterproxy_protocol.errors import ConnectRefused
from clusterproxy_sdk import TLSFiles, open_tunnel
from tests.support import require
from tests.support.clients import client_context, h1_connect
from tests.support.pki import PkiFiles
from tests.support.procs import Hub
from tests.support.targets import Blackhole, closed_port, serve_digest, serve_http

pytestmark = pytest.mark.slow


def curl_argv(
    hub: Hub, pki: PkiFiles, url: str, *, proxy_user: str | None, header: str | None = None
) -> list[str]:
    user = f"{proxy_user}@" if proxy_user else ""
    argv = [
        "curl",
        "--silent",
        "--show-error",
        "--max-time",
        "20",
        "--proxy",
        f"https://{user}127.0.0.1:{hub.client_port}",
        "--proxy-cacert",
        str(pki.ca),
        "--proxy-cert",
        str(pki.client.cert),
        "--proxy-key",
        str(pki.client.key),
    ]
    if header:
        argv += ["--proxy-header", header]
    return [*argv, url]


@pytest.mark.parametrize("naming", ["proxy-user", "header"])
async def test_curl_reaches_http_target_in_cluster(
    hub: Hub, pki: PkiFiles, nursery: trio.Nursery, naming: str
) -> None:
    require(shutil.which("curl") is not None, "the curl binary")
    target = await serve_http(nursery, b"hello from inside cluster1\n")
    argv = curl_argv(
        hub,
        pki,
        f"http://{target.address}/some/path",
        proxy_user="cluster1" if naming == "proxy-user" else None,
        header="cluster-proxy-cluster: cluster1" if naming == "header" else None,
    )
    result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout == b"hello from inside cluster1\n"
    assert target.connections == 1


async def test_curl_shows_the_reason_of_a_refusal(hub: Hub, pki: PkiFiles) -> None:
    require(shutil.which("curl") is not None, "the curl binary")
    argv = curl_argv(hub, pki, "http://127.0.0.1:80/", proxy_user="no-such-cluster")
    result = await trio.run_process(
        [argv[0], "--verbose", "--proxytunnel", *argv[1:]],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode != 0
    assert b"CONNECT tunnel failed, response 404" in result.stderr
    assert b"unknown cluster 'no-such-cluster'" in result.stderr


async def test_sdk_reaches_http_target(hub: Hub, pki: PkiFiles, nursery: trio.Nursery) -> None:
    target = await serve_http(nursery, b"sdk body")
    async with open_tunnel(
        f"127.0.0.1:{hub.client_port}",
        TLSFiles(pki.ca, pki.client.cert, pki.client.key),
        server_hostname="localhost",
    ) as tunnel:
        stream = await tunnel.connect("cluster2", target.host, target.port)
        await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        reply = b""
        while data := await stream.receive_some():
            reply += data
    assert reply.startswith(b"HTTP/1.1 200 OK")
    assert reply.endswith(b"\r\n\r\nsdk body")


ERROR_CASES = {
    # name: (cluster, authority factory, expected status, reason fragment)
    "unknown-cluster": ("nosuch", lambda t: "127.0.0.1:80", 404, "unknown cluster 'nosuch'"),
    "no-agent": ("cluster3", lambda t: "127.0.0.1:80", 503, "no agent of cluster 'cluster3'"),
    "target-refuses": ("cluster1", lambda t: f"127.0.0.1:{t['closed']}", 502, "refused"),
    "blackholed": ("cluster1", lambda t: t["blackhole"], 504, "timed out"),
    "egress-policy": ("cluster1", lambda t: "169.254.169.254:80", 403, "169.254.169.254"),
}


@pytest.fixture
def error_targets() -> dict[str, object]:
    hole = Blackhole()
    yield {"closed": closed_port(), "blackhole": hole.address}
    hole.close()


@pytest.mark.parametrize("case", list(ERROR_CASES))
async def test_errors_on_http1_frontend(hub: Hub, pki: PkiFiles, error_targets: dict, case: str) -> None:
    cluster, authority, status, fragment = ERROR_CASES[case]
    start = trio.current_time()
    reply = await h1_connect(
        hub.client_port,
        client_context(pki, alpn=["http/1.1"]),
        authority(error_targets),
        {"cluster-proxy-cluster": cluster},
    )
    assert reply.status == status, reply.head
    assert fragment in reply.body.decode(), reply.body
    assert f"cluster-proxy-reason: {reply.body.decode().strip()}" in reply.head
    if case == "blackholed":  # the agent's --dial-timeout is 2s
        assert trio.current_time() - start < 8


@pytest.mark.parametrize("case", list(ERROR_CASES))
async def test_errors_on_http2_frontend(hub: Hub, pki: PkiFiles, error_targets: dict, case: str) -> None:
    cluster, authority, status, fragment = ERROR_CASES[case]
    host, port = authority(error_targets).rsplit(":", 1)
    start = trio.current_time()
    async with open_tunnel(
        f"127.0.0.1:{hub.client_port}",
        TLSFiles(pki.ca, pki.client.cert, pki.client.key),
        server_hostname="localhost",
    ) as tunnel:
        with pytest.raises(ConnectRefused) as info:
            await tunnel.connect(cluster, host, int(port))
    assert info.value.status == status
    assert fragment in info.value.reason
    if case == "blackholed":
        assert trio.current_time() - start < 8


async def test_server_and_agent_log_a_stream_with_the_same_byte_keys(
    hub: Hub, pki: PkiFiles, nursery: trio.Nursery
) -> None:
    """``bytes_to_target`` / ``bytes_to_client`` mean the same direction in both processes' logs."""
    target = await serve_digest(nursery)
    token, wanted, upload = "log-keys", 300_000, b"u" * 123_456
    async with open_tunnel(
        f"127.0.0.1:{hub.client_port}",
        TLSFiles(pki.ca, pki.client.cert, pki.client.key),
        server_hostname="localhost",
    ) as tunnel:
        stream = await tunnel.connect("cluster1", target.host, target.port)
        request = f"{token} {wanted}\n".encode() + upload
        await stream.send_all(request)
        await stream.send_eof()
        received = 0
        while data := await stream.receive_some():
            received += len(data)
    assert received == wanted
    authority = f"{target.host}:{target.port}"
    server_line = await hub.server.wait_event("stream_closed", target=authority)
    agent_line = await hub.agents["agent-cluster1-agent-a"].wait_event("stream_closed", target=authority)
    for line in (server_line, agent_line):
        assert (line["bytes_to_target"], line["bytes_to_client"]) == (len(request), wanted), line
