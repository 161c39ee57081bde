"""The health-collector in Kubernetes mode against real API servers: ``cluster-proxy health`` as a hub
admin reads it.

Everything but the collector runs from what the addon-manager wrote (tests.support.addonstack.AddonStack):
the manager on the hub API server (availability polled every 2 s), the cert-signer and proxy-server
from their Deployments, and ``<tag>-cluster1`` and ``<tag>-cluster2`` joined with their agents run
from the ManifestWork applied to the cluster1 and cluster2 API servers. The collector is a process
with the hub's kubeconfig (``--kubernetes``): INSTALLED and AVAILABLE come from each cluster's
ManagedClusterAddOn; PROBED HEALTH is ``GET /healthz`` of the cluster's REAL kube-apiserver, reached
through the tunnel by the bare cluster name (``https://<cluster>:443/healthz``), its certificate
checked against the clusters' CA (``--probe-ca``) under ``kubernetes.default.svc``. Its hub client
certificate comes from the cert-signer the manager deployed, with the token of the Secret the manager
keeps for it (``--hub-client``, as the hub overlay runs it): the collector reads it through the API
(``--bootstrap-secret``) and trades it itself (``--signer``); nobody makes a token by hand.

- both clusters True/True/True with a latency; a wrong ``--probe-ca`` fails the probe on TLS (the
  check is real);
- an agent SIGKILLed: its row AVAILABLE False and PROBED HEALTH False within 15 s, exit status 1, the
  other row still True; the agent back: True again within 15 s;
- a cluster's ManagedClusterAddOn deleted: INSTALLED False within 15 s.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client

from tests.support.addonstack import ADDON_NAME, AddonStack, Member
from tests.support.health import CollectorProcess
from tests.support.kubeapi import KubeClusters
from tests.support.procs import BIN
from tests.support.waiting import poll_until

pytestmark = pytest.mark.slow

DEADLINE = 15.0  # the bound for a row to follow an agent's death and its return
CLIENT_NAME = "health-collector"
BOOTSTRAP_SECRET = "cluster-proxy-health-collector-bootstrap"
ADDON_GROUP, ADDON_VERSION = "addon.open-cluster-management.io", "v1alpha1"


@dataclass
class Health:
    stack: AddonStack
    collector: CollectorProcess
    clusters: list[str]  # the ManagedClusters of this stack: <tag>-cluster1, <tag>-cluster2
    kube_ca: Path  # signs every test API server's serving certificate
    directory: Path


def signer_cli(stack: AddonStack, *args: str) -> str:
    """``cluster-proxy-cert-signer`` as the hub admin runs it (the store is the signer's Secrets)."""
    done = subprocess.run(
        [
            str(stack.hub_kubelet.bin_dir / "cluster-proxy-cert-signer"),
            *args,
            f"--store={stack.store}",
            f"--kubeconfig={stack.hub.kubeconfig}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"cluster-proxy-cert-signer {' '.join(args)}:\n{done.stderr}"
    return done.stdout


def collector_flags(stack: AddonStack, directory: Path, probe_ca: Path) -> list[str]:
    """The collector's flags: its client certificate from the signer with the token of the Secret the
    manager keeps (``--bootstrap-secret``; its ``ca.crt`` seeds ``--ca``)."""
    directory.mkdir(parents=True, exist_ok=True)
    return [
        "--kubernetes",
        f"--kubeconfig={stack.hub.kubeconfig}",
        f"--admin-url={stack.admin_url}",
        f"--proxy=127.0.0.1:{stack.ports.client}",
        f"--signer=https://127.0.0.1:{stack.ports.signer}",
        f"--bootstrap-secret={stack.namespace}/{BOOTSTRAP_SECRET}",
        f"--ca={directory / 'ca.crt'}",
        f"--cert={directory / 'tls.crt'}",
        f"--key={directory / 'tls.key'}",
        f"--probe-ca={probe_ca}",
        "--interval=1s",
    ]


@pytest.fixture(scope="module")
def health(kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Health]:
    directory = tmp_path_factory.mktemp("health-kube")
    stack = AddonStack(
        kube_clusters["hub"],
        directory,
        manager_args=["--availability-poll=2s", f"--hub-client={CLIENT_NAME}={BOOTSTRAP_SECRET}"],
    )
    collector = None
    try:
        stack.start()
        names = []
        for api_name in ("cluster1", "cluster2"):
            name = f"{stack.tag}-{api_name}"
            stack.join(name, kube_clusters[api_name])
            names.append(name)
        kube_ca = kube_clusters["cluster1"].ca_path
        assert kube_clusters["cluster2"].ca_path == kube_ca
        collector = CollectorProcess.launch(
            directory, *collector_flags(stack, directory / "collector", kube_ca)
        )
        yield Health(stack, collector, names, kube_ca, directory)
    finally:
        if collector is not None:
            collector.stop()
        stack.close()


def cli(collector: CollectorProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "cluster-proxy"), "health", "--collector", collector.url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def rows(stdout: str) -> dict[str, list[str]]:
    """Table rows by cluster: INSTALLED, AVAILABLE, PROBED HEALTH, LATENCY."""
    lines = stdout.splitlines()
    assert lines[0].split() == ["CLUSTER", "NAME", "INSTALLED", "AVAILABLE", "PROBED", "HEALTH", "LATENCY"], (
        stdout
    )
    return {line.split()[0]: line.split()[1:] for line in lines[1:]}


def all_true(row: list[str]) -> bool:
    return row[:3] == ["True", "True", "True"] and row[3].endswith("ms") and float(row[3][:-2]) > 0


def wait_row(
    health: Health, cluster: str, want: list[str], *, timeout: float = DEADLINE
) -> subprocess.CompletedProcess[str]:
    """``cluster-proxy health`` until ``cluster``'s first three columns read ``want``; that output."""
    last: list[subprocess.CompletedProcess[str]] = []

    def shows() -> bool:
        done = cli(health.collector, *health.clusters)
        last[:] = [done]
        return rows(done.stdout).get(cluster, [])[:3] == want

    try:
        poll_until(shows, timeout=timeout, what=f"{cluster}'s row {want}", interval=0.2)
    except AssertionError as exc:
        shown = last[0].stdout + last[0].stderr if last else ""
        raise AssertionError(f"{exc}; last output:\n{shown}\n{health.collector.process.tail()}") from None
    return last[0]


def test_both_clusters_are_true_probed_at_their_real_kube_apiserver(health: Health) -> None:
    cluster1, cluster2 = health.clusters
    done = poll_until(
        lambda: (d := cli(health.collector, *health.clusters)).returncode == 0 and d,
        timeout=60,
        what="both clusters healthy",
        interval=0.2,
    )
    table = rows(done.stdout)
    assert set(table) == {cluster1, cluster2} and all(all_true(r) for r in table.values()), done.stdout
    document = health.collector.document()
    assert document["mode"] == "kubernetes" and document["problems"] == [], document["problems"]
    assert document["probe"]["url"] == "https://{cluster}:443/healthz" and document["probe"]["verify"] is True
    for name in (cluster1, cluster2):
        row = health.collector.cluster(name)
        assert row is not None and row["addon"]["available"] is True, row
        assert [a["agent_id"] for a in row["agents"]], row  # the agent the work agent's Deployment runs
    # the collector bootstrapped its own client certificate with the manager's token
    assert [r for r in health.collector.process.events() if r.get("event") == "cert_bootstrapped"]
    # ... and the manager put an unused one in its place (for the collector's next pod)
    states = poll_until(
        lambda: (
            (rows := [line.split()[-1] for line in signer_cli(health.stack, "token", "list").splitlines()
                      if f"client '{CLIENT_NAME}'" in line])
            and "unused" in rows and rows
        ),
        timeout=10,
        what=f"an unused {CLIENT_NAME} token beside the used one",
    )  # fmt: skip
    assert "used" in states, states
    # the proxy-server routed the probes as "<cluster>:443" (the bare cluster name)
    server = health.stack.server
    assert server is not None
    for name in (cluster1, cluster2):
        poll_until(
            lambda n=name: [
                r
                for r in server.container().events("stream_closed")
                if r.get("target") == f"{n}:443" and r.get("cluster") == n and r.get("client") == CLIENT_NAME
            ],
            timeout=10,
            what=f"the proxy-server's stream_closed for {name}:443 from {CLIENT_NAME}",
        )
    print(f"\n{done.stdout}")


def test_a_probe_with_the_wrong_ca_fails_on_tls(health: Health) -> None:
    """The probe checks the kube-apiserver's certificate: with the hub's cluster-proxy CA in
    ``--probe-ca`` (which did not sign it) one round of the collector's own command reports PROBED
    HEALTH False for a TLS failure."""
    flags = [f for f in health.collector.extra if not f.startswith(("--probe-ca=", "--bootstrap-secret="))]
    wrong_ca = next(f for f in flags if f.startswith("--ca=")).split("=", 1)[1]
    done = subprocess.run(
        [str(BIN / "cluster-proxy-health-collector"), *flags, f"--probe-ca={wrong_ca}", "--once"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    by_name = {c["name"]: c for c in json.loads(done.stdout)["clusters"]}
    for name in health.clusters:
        row = by_name[name]
        assert (row["installed"], row["available"], row["probed"]) == (True, True, False), row
        assert row["last_error"]["reason"] == "tls", row["last_error"]


def test_an_agents_death_turns_its_row_false_and_its_return_true(health: Health) -> None:
    cluster1, cluster2 = health.clusters
    wait_row(health, cluster1, ["True", "True", "True"], timeout=60)
    member: Member = health.stack.members[cluster1]
    assert member.agent is not None
    agent = member.agent.container()
    killed = time.monotonic()
    member.agent.kill(signal.SIGKILL)
    assert agent.wait_exit(10) == -signal.SIGKILL
    done = wait_row(health, cluster1, ["True", "False", "False"])
    unavailable = time.monotonic() - killed
    assert done.returncode == 1, done.stdout + done.stderr
    assert all_true(rows(done.stdout)[cluster2]), done.stdout
    row = health.collector.cluster(cluster1)
    assert row is not None and row["agents"] == [], row
    assert row["last_error"]["reason"] == "refused_503", row["last_error"]

    restarted = time.monotonic()
    member.agent.restart()
    done = wait_row(health, cluster1, ["True", "True", "True"])
    back = time.monotonic() - restarted
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"\nagent SIGKILL -> row False after {unavailable:.1f}s; restart -> True after {back:.1f}s")


def test_a_missing_managed_cluster_addon_is_not_installed(health: Health) -> None:
    """Last in this module: cluster2's addon is deleted (the stack's cleanup tolerates that)."""
    cluster1, cluster2 = health.clusters
    wait_row(health, cluster2, ["True", "True", "True"], timeout=60)
    with health.stack.hub.api_client() as api:
        client.CustomObjectsApi(api).delete_namespaced_custom_object(
            ADDON_GROUP, ADDON_VERSION, cluster2, "managedclusteraddons", ADDON_NAME
        )
    deleted = time.monotonic()
    done = poll_until(
        lambda: (
            (d := cli(health.collector, *health.clusters)) and rows(d.stdout)[cluster2][0] == "False" and d
        ),
        timeout=DEADLINE,
        what=f"{cluster2} INSTALLED False",
        interval=0.2,
    )
    took = time.monotonic() - deleted
    assert rows(done.stdout)[cluster2][1] == "False", done.stdout  # no addon: not available either
    assert done.returncode == 1
    assert all_true(rows(done.stdout)[cluster1]), done.stdout
    row = health.collector.cluster(cluster2)
    assert row is not None and row["installed"] is False and row["addon"] is None, row
    print(f"\n{cluster2}'s ManagedClusterAddOn deleted -> INSTALLED False after {took:.1f}s")
