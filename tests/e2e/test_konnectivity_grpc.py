"""Go programs written for upstream cluster-proxy, unchanged: the real ``konnectivity-client`` module
(``CreateSingleUseGrpcTunnel`` + ``tunnel.DialContext`` as an ``http.Client``'s dialer, gRPC with mTLS)
against our proxy-server's client port, a real agent and HTTP targets inside the cluster.

The Go side is ``tests/go-konnectivity/konnget``, run by tests/support/konnget.py; the HTTP target
there answers ``GET /bytes/N`` with N pattern bytes, ``POST /sha256`` with the sha256 of the body,
``GET /endless`` with a body that never ends (for a reader that stops reading).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from tests.support.gopeers import KONNECTIVITY_SOURCES, go_peer
from tests.support.konnget import answer_http, run_konnget
from tests.support.pki import PkiFiles
from tests.support.procs import Hub, running_hub
from tests.support.targets import Blackhole, Target, pattern_digest, serve

pytestmark = pytest.mark.slow

CLUSTER = "cluster1"


@pytest.fixture(scope="module")
def konnget() -> Path:
    return go_peer("konnget", KONNECTIVITY_SOURCES)


@pytest.fixture(scope="module")
def hub(pki: PkiFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    with running_hub(pki, tmp_path_factory.mktemp("logs")) as hub:
        yield hub


@pytest.fixture
async def cluster_target(hub: Hub, nursery: trio.Nursery) -> Target:
    """An HTTP target, also the agent's --kube-apiserver (the bare cluster name leads to it)."""
    target = await serve(nursery, answer_http)
    name = f"agent-{CLUSTER}"
    if name in hub.agents:
        hub.agents.pop(name).stop()
        await hub.wait_agent(CLUSTER, "agent-a", present=False)
    hub.agents[name] = hub.start_agent(
        CLUSTER, "agent-a", "--allow", "127.0.0.0/8", "--kube-apiserver", target.address, name=name
    )
    await hub.wait_agent(CLUSTER, "agent-a")
    return target


async def test_a_go_konnectivity_client_fetches_by_bare_cluster_name_and_by_host_port(
    hub: Hub, konnget: Path, cluster_target: Target
) -> None:
    size = 100 << 20
    by_name = await run_konnget(konnget, hub, "-mode", "get", "-url", f"http://{CLUSTER}/bytes/{size}")
    assert by_name["ok"] == 1 and by_name["bytes"] == size
    assert by_name["sha256"] == pattern_digest(f"/bytes/{size}", size)
    print(f"\n100 MiB download through konnectivity gRPC: {by_name['seconds']:.2f} s")

    direct = await run_konnget(
        konnget,
        hub,
        "-mode",
        "get",
        "-url",
        f"http://{cluster_target.address}/bytes/1000",
        "-cluster",
        CLUSTER,
    )
    assert direct["ok"] == 1 and direct["sha256"] == pattern_digest("/bytes/1000", 1000)

    upload = await run_konnget(
        konnget, hub, "-mode", "upload", "-url", f"http://{CLUSTER}/sha256", "-size", str(size)
    )
    assert upload["body"] == upload["sha256"], upload  # what the target received is what Go sent
    print(f"100 MiB upload through konnectivity gRPC: {upload['seconds']:.2f} s")


async def test_200_concurrent_single_use_tunnels(hub: Hub, konnget: Path, cluster_target: Target) -> None:
    result = await run_konnget(
        konnget, hub, "-mode", "get", "-url", f"http://{CLUSTER}/bytes/65536", "-n", "200", "-c", "200"
    )
    assert result == result | {"ok": 200, "failed": 0, "bytes": 200 * 65536}, result
    print(f"\n200 concurrent single-use tunnels: {result['seconds']:.2f} s")


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["-address", "no-such-cluster:443"], "no-such-cluster"),  # a cluster the hub does not know
        (
            ["-address", "192.0.2.1:80", "-cluster", CLUSTER],
            "is not allowed by any allow rule",
        ),  # egress policy
        (["-address", "127.0.0.1:1", "-cluster", CLUSTER], "refused"),  # the target refuses
        (["-address", "10.0.0.1:80"], "no cluster named"),  # nothing names a cluster
    ],
)
async def test_refusals_arrive_in_go_with_our_reason(
    hub: Hub, konnget: Path, cluster_target: Target, args: list[str], reason: str
) -> None:
    result = await run_konnget(konnget, hub, "-mode", "dial", *args)
    assert result["failed"] == 1, result
    assert reason in result["dial_error"], result


async def test_a_target_that_never_answers_is_a_timeout_in_go_with_our_reason(
    hub: Hub, konnget: Path, cluster_target: Target
) -> None:
    blackhole = Blackhole()  # a loopback listener whose accept queue is full: the connect hangs
    try:
        result = await run_konnget(
            konnget, hub, "-mode", "dial", "-address", blackhole.address, "-cluster", CLUSTER
        )
        queued = blackhole.queued()
    finally:
        blackhole.close()
    # Seen once under load (not reproduced since): a failure says what the agent and the blackhole saw.
    agent = hub.agents[f"agent-{CLUSTER}"]
    seen = [r for r in agent.events() if blackhole.address in str(r.get("target", ""))]
    why = f"{result}; blackhole accept queue {queued} (1 = full); the agent's records: {seen}"
    assert result["failed"] == 1, why
    assert f"dial to {blackhole.address} timed out after 10s" in result["dial_error"], why


async def test_a_cluster_whose_agent_is_gone_is_refused_in_go_with_our_reason(
    hub: Hub, konnget: Path, cluster_target: Target
) -> None:
    hub.agents.pop(f"agent-{CLUSTER}").stop()
    await hub.wait_agent(CLUSTER, "agent-a", present=False)
    result = await run_konnget(konnget, hub, "-mode", "dial", "-address", f"{CLUSTER}:443")
    assert result["failed"] == 1, result
    assert f"no agent of cluster '{CLUSTER}' is connected" in result["dial_error"], result


async def test_a_go_reader_that_stops_reading_slows_only_its_own_tunnel(
    hub: Hub, konnget: Path, cluster_target: Target
) -> None:
    """One tunnel's body is never read (its HTTP/2 stream's window fills and stays full, the target
    blocked behind it); other tunnels of the same client, on the same proxy-server, go on. Throughput
    is printed (the ratio is the issue's number); what is asserted is that the others are not stuck
    behind it (head-of-line blocking would bring them to a halt, not to a fraction)."""
    size = 16 << 20
    result = await run_konnget(
        konnget,
        hub,
        "-mode",
        "stall",
        "-url",
        f"http://{CLUSTER}/bytes/{size}",
        "-slow",
        f"http://{CLUSTER}/endless",
        "-n",
        "4",
    )
    ratio = result["with_stall_bytes_per_second"] / result["alone_bytes_per_second"]
    print(
        f"\nother tunnels alone {result['alone_bytes_per_second'] / 1e6:.0f} MB/s, beside a stalled one "
        f"{result['with_stall_bytes_per_second'] / 1e6:.0f} MB/s: {ratio:.2f}"
    )
    assert ratio > 0.5, result


def test_go_module_builds_from_the_pinned_upstream_version() -> None:
    mod = (KONNECTIVITY_SOURCES / "go.mod").read_text()
    assert "sigs.k8s.io/apiserver-network-proxy/konnectivity-client v0.36.0" in mod
    listed = subprocess.run(
        ["go", "list", "-mod=readonly", "-m", "sigs.k8s.io/apiserver-network-proxy/konnectivity-client"],
        cwd=KONNECTIVITY_SOURCES,
        capture_output=True,
        text=True,
        check=True,
    )
    assert listed.stdout.split() == ["sigs.k8s.io/apiserver-network-proxy/konnectivity-client", "v0.36.0"]
