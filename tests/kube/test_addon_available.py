"""``kubectl get managedclusteraddon -A`` shows AVAILABLE as the seeds do: True while the cluster's
agent holds a tunnel, False within 30 s of its agent being SIGKILLed, True again once it is back.

Everything runs from what the addon-manager wrote (tests.support.addonstack.AddonStack): the manager
with its default ``--availability-poll`` (10 s) asking the proxy-server's admin API over mutual TLS,
with a hub client certificate the cert-signer issued it for a token it minted (the admin port lists
clusters to hub clients only), the proxy-server and cert-signer from their Deployments, the agent from
its ManifestWork. The table is the real
kubectl's, printed from the ManagedClusterAddOn CRD's printer columns, parsed by the header's column
positions (a column may be empty: DEGRADED and PROGRESSING are not set by this addon). The addon's
``status.healthCheck.mode`` is ``Customized``: the manager, not OCM's lease check, writes AVAILABLE.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import pytest

from tests.support.addonstack import ADDON_NAME, AddonStack, Member
from tests.support.kubeapi import KubeCluster, KubeClusters
from tests.support.waiting import poll_until

pytestmark = pytest.mark.slow

UNAVAILABLE_WITHIN = 30.0  # seconds after the agent is killed (the bound)


def parse_table(text: str) -> list[dict[str, str]]:
    """kubectl's table (columns left-aligned under their header) as one dict per row."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    header = lines[0]
    starts = [i for i, char in enumerate(header) if char != " " and (i == 0 or header[i - 1] == " ")]
    names = [header[start:end].strip() for start, end in zip(starts, [*starts[1:], None], strict=True)]
    return [
        {
            name: line[start:end].strip()
            for name, start, end in zip(names, starts, [*starts[1:], None], strict=True)
        }
        for line in lines[1:]
    ]


def addon_row(hub: KubeCluster, cluster: str) -> dict[str, str] | None:
    done = hub.kubectl("get", "managedclusteraddon", "-A")
    assert done.returncode == 0, done.stderr
    rows = [
        r for r in parse_table(done.stdout) if r.get("NAMESPACE") == cluster and r.get("NAME") == ADDON_NAME
    ]
    return rows[0] if rows else None


def wait_available(hub: KubeCluster, cluster: str, want: str, timeout: float) -> float:
    """Seconds until kubectl's AVAILABLE column for ``cluster``'s addon reads ``want``."""
    started = time.monotonic()
    seen: list[dict[str, str] | None] = [None]

    def shows() -> bool:
        seen[0] = addon_row(hub, cluster)
        return seen[0] is not None and seen[0].get("AVAILABLE") == want

    try:
        poll_until(shows, timeout=timeout, what=f"AVAILABLE {want} for {cluster}", interval=0.25)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last row: {seen[0]}") from None
    return time.monotonic() - started


@pytest.fixture(scope="module")
def stack(kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AddonStack]:
    stack = AddonStack(kube_clusters["hub"], tmp_path_factory.mktemp("addon-available"))
    try:
        stack.start()
        stack.join(f"{stack.tag}-cluster1", kube_clusters["cluster1"])
        yield stack
    finally:
        stack.close()


def test_table_has_the_seed_columns(stack: AddonStack) -> None:
    done = stack.hub.kubectl("get", "managedclusteraddon", "-A")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n", 1)[0].split() == [
        "NAMESPACE",
        "NAME",
        "AVAILABLE",
        "DEGRADED",
        "PROGRESSING",
    ]


def test_mpc_shows_the_server_deployed_and_signed(stack: AddonStack) -> None:
    """The hub side's own status: the kubelet stand-in reported the Deployment ready, the server
    bootstrapped its certificate from the signer."""

    def row() -> dict[str, str] | None:
        done = stack.hub.kubectl("get", "managedproxyconfiguration", stack.mpc_name)
        assert done.returncode == 0, done.stderr
        rows = parse_table(done.stdout)
        return (
            rows[0]
            if rows and rows[0].get("DEPLOYED") == "True" and rows[0].get("SIGNED") == "True"
            else None
        )

    shown = poll_until(row, timeout=30, what="the MPC's DEPLOYED and SIGNED True", interval=0.25)
    assert shown["ENTRYPOINT"] == "Hostname"


def test_available_follows_the_agent(stack: AddonStack) -> None:
    member: Member = next(iter(stack.members.values()))
    assert member.agent is not None
    hub = stack.hub
    connected = wait_available(hub, member.name, "True", timeout=60)
    # the manager told OCM it judges the addon's health itself: OCM's registration agent, which
    # otherwise writes Available from a lease the agent does not renew, leaves the condition alone
    addon = json.loads(
        hub.kubectl("get", "managedclusteraddon", ADDON_NAME, "-n", member.name, "-o", "json").stdout
    )
    assert addon["status"]["healthCheck"] == {"mode": "Customized"}, addon["status"]
    assert addon["status"]["namespace"] == member.install_namespace
    # what it asked with: its own certificate, from the signer the manager deployed
    own = stack.wait_manager_event("cert_bootstrapped", name="addon-manager")
    assert stack.signer is not None
    issued = stack.signer.container().events("cert_issued")
    assert [e["via"] for e in issued if e.get("identity") == "client:addon-manager"] == ["bootstrap"], issued
    assert own["serial"].lstrip("0") in {e["serial"].lstrip("0") for e in issued}

    agent = member.agent.container()
    killed_at = time.monotonic()
    member.agent.kill(signal.SIGKILL)
    assert agent.wait_exit(10) == -signal.SIGKILL
    tunnel_gone = stack.wait_tunnel(member.name, present=False, timeout=UNAVAILABLE_WITHIN)
    wait_available(hub, member.name, "False", timeout=UNAVAILABLE_WITHIN - (time.monotonic() - killed_at))
    unavailable = time.monotonic() - killed_at

    restarted_at = time.monotonic()
    member.agent.restart()
    agent.wait_event("tunnel_connected", timeout=60)
    reconnected = time.monotonic() - restarted_at
    wait_available(hub, member.name, "True", timeout=60)
    available_again = time.monotonic() - restarted_at
    assert not agent.events("cert_bootstrapped"), "the restarted agent kept its certificate (same emptyDir)"
    row = addon_row(hub, member.name)
    print(
        f"\nAVAILABLE True {connected:.1f}s after the check began; agent SIGKILL -> tunnel gone "
        f"{tunnel_gone:.2f}s -> AVAILABLE False {unavailable:.1f}s; restart -> tunnel {reconnected:.2f}s "
        f"-> AVAILABLE True {available_again:.1f}s; row now {row}"
    )
