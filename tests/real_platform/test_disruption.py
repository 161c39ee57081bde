"""Disruptions on the real clusters, under traffic (issue 33, "Must show"): the addon installed as a
user installs it (:mod:`tests.support.realinstall`), two proxy-server replicas (the
ManagedProxyConfiguration's ``spec.proxyServer.replicas``), continuous requests to cluster1's real
kube-apiserver through the tunnel from a client on the hub (:mod:`tests.support.tunnel_load`: the
SDK's shared tunnel through the client port's Service, inside the hub node's network namespace).

1. Quiet first: from the registration agent's view (the ManagedClusterAddOn on the hub, every write
   of it watched), Available stays True for 2 minutes, nobody flips it. cluster1's second node
   (:mod:`tests.support.secondnode`) starts meanwhile.
2. A proxy-server pod deleted (``kubectl delete pod``): every request that started after the delete
   succeeds (through the other replica, or the draining one before it says GOAWAY: the SDK re-dials
   as it does for any user), the Deployment's new pod becomes routable to cluster1 by itself.
3. The agent's node drained (``kubectl drain``, evictions respecting PodDisruptionBudgets): the agent
   comes back on the second node and cluster1 is routable again within seconds; meanwhile the
   proxy-server holds the requests for the drained agent's successor: none fails.

Available is True again after each disruption. Needs the project's images (``bash scripts/compose.sh
images``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import nodeimages, realocm
from tests.support.nodenet import run
from tests.support.realclusters import DIRECT, HUB, HUB_LB_PORTS, RealClusters
from tests.support.realinstall import (
    ADDON_NAMESPACE,
    AGENT_NAMESPACE,
    REPO,
    agent_running,
    disable,
    enable,
    enroll,
    import_images,
    install_hub,
    rollout,
    uninstall,
    wait_available,
    wait_for,
)
from tests.support.realnode import RealCluster
from tests.support.secondnode import SecondNode, add_second_node

pytestmark = [pytest.mark.platform, pytest.mark.slow, pytest.mark.timeout(1500)]

SERVER_DEPLOYMENT = "cluster-proxy"
SERVER_PODS = "proxy.open-cluster-management.io/component-name=proxy-server"
AGENT_PODS = "proxy.open-cluster-management.io/component-name=proxy-agent"
CLIENT_PORT = 8090
SERVER_NAME = f"proxy-entrypoint.{ADDON_NAMESPACE}.svc"
OUR_MANAGER = "cluster-proxy-addon-manager"
AVAILABLE_HELD = 120.0  # seconds of quiet Available (issue 33: "stays so for 2 minutes")
# "Routable again, in seconds": the proxy-server holds requests for a drained agent's successor this
# long (relaying.REPLACEMENT_GRACE); a later successor fails requests, which the test counts anyway.
# Measured 3.3 s after the old agent left on a quieter machine, 14 s under a load average of 30.
ROUTABLE_AFTER_DRAIN = 30.0
# Image archives (``docker save``) imported into the hub's node after the project's images, under the
# same names: a change of a hub image tried here without rebuilding them all (colon-separated paths).
HUB_ARCHIVES = (
    "CLUSTER_PROXY_PLATFORM_HUB_ARCHIVES"  # "routable again, in seconds": after the old agent is gone
)


class AddonWatch:
    """``kubectl get -w`` of cluster1's ManagedClusterAddOn (every write of it, managedFields shown):
    each version's Available condition and the managers that hold its conditions."""

    def __init__(self, hub: RealCluster, cluster: str) -> None:
        self.versions: list[dict[str, Any]] = []
        self._process = subprocess.Popen(
            [
                str(hub.kubectl_binary),
                f"--kubeconfig={hub.kubeconfig}",
                "-n",
                cluster,
                "get",
                "managedclusteraddon",
                "cluster-proxy",
                "-w",
                "-o",
                "json",
                "--show-managed-fields",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        decoder = json.JSONDecoder()
        buffer = ""
        for line in self._process.stdout:
            buffer += line
            try:
                addon, end = decoder.raw_decode(buffer.lstrip())
            except json.JSONDecodeError:
                continue
            buffer = buffer.lstrip()[end:]
            conditions = (addon.get("status") or {}).get("conditions") or []
            available = next((c for c in conditions if c["type"] == "Available"), {})
            self.versions.append(
                {
                    "at": time.monotonic(),
                    "resourceVersion": addon["metadata"]["resourceVersion"],
                    "available": (
                        available.get("status"),
                        available.get("reason"),
                        available.get("lastTransitionTime"),
                    ),
                    "writers": sorted(
                        {
                            m["manager"]
                            for m in addon["metadata"].get("managedFields", [])
                            if '"f:conditions"' in json.dumps(m.get("fieldsV1"))
                        }
                    ),
                }
            )

    def stop(self) -> str:
        self._process.terminate()
        self._process.wait(10)
        self._reader.join(10)
        assert self._process.stderr is not None
        return self._process.stderr.read()


class Load:
    """:mod:`tests.support.tunnel_load` in the hub node's network namespace."""

    def __init__(
        self, hub: RealCluster, managed: RealCluster, client: tuple[Path, Path, Path], folder: Path
    ) -> None:
        self.hub, self.managed, self.client = hub, managed, client
        self.out = folder / "load.jsonl"
        self.process: subprocess.Popen[str] | None = None
        self.route = False

    def _argv(self, mode: str, address: str) -> list[str]:
        ca, cert, key = self.client
        return [
            "nsenter",
            f"--net=/run/netns/{self.hub.network.netns}",
            "--",
            sys.executable,
            "-m",
            "tests.support.tunnel_load",
            mode,
            f"--address={address}",
            f"--server-hostname={SERVER_NAME}",
            f"--cluster={self.managed.name}",
            f"--ca={ca}",
            f"--cert={cert}",
            f"--key={key}",
            f"--kube-ca={self.managed.ca.path}",
            f"--kube-cert={self.managed.ids.admin.cert}",
            f"--kube-key={self.managed.ids.admin.key}",
        ]

    def start(self) -> None:
        # The hub's node has no default route (nodenet): the Service range routed to its link, as a
        # node's default route would take it (kube-proxy's DNAT then sends it to a pod).
        network = self.hub.network
        run("ip", "route", "add", network.service_subnet, "via", network.host_ip, netns=network.netns)
        self.route = True
        service = self.hub.kubectl_ok(
            "-n", ADDON_NAMESPACE, "get", "svc", "proxy-entrypoint", "-o", "jsonpath={.spec.clusterIP}"
        ).strip()
        argv = [*self._argv("load", f"{service}:{CLIENT_PORT}"), "--workers=4", f"--out={self.out}"]
        self.process = subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE, text=True)

    def routable_through(self, pod_ip: str) -> bool:
        """One request through this proxy-server pod's own client port."""
        done = subprocess.run(
            self._argv("once", f"{pod_ip}:{CLIENT_PORT}"),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.returncode == 0

    def records(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        return [json.loads(line) for line in self.out.read_text().splitlines() if line.endswith("}")]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self.route:
            network = self.hub.network
            run("ip", "route", "del", network.service_subnet, "via", network.host_ip, netns=network.netns)
            self.route = False
        assert self.process is None or self.process.returncode == 0, (
            self.process.stderr.read() if self.process.stderr else ""
        )


def pods(cluster: RealCluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    found = json.loads(cluster.kubectl_ok("-n", namespace, "get", "pods", "-l", selector, "-o", "json"))
    return found["items"]


def ready(pod: dict[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def server_pods(hub: RealCluster) -> list[dict[str, Any]]:
    return pods(hub, ADDON_NAMESPACE, SERVER_PODS)


def two_server_replicas(hub: RealCluster) -> None:
    """Two proxy-server replicas, set as a user sets them: the ManagedProxyConfiguration."""
    replicas = hub.kubectl_ok(
        "-n", ADDON_NAMESPACE, "get", "deployment", SERVER_DEPLOYMENT, "-o", "jsonpath={.spec.replicas}"
    )
    if int(replicas or 1) < 2:
        hub.kubectl_ok(
            "patch",
            "managedproxyconfiguration",
            "cluster-proxy",
            "--type=merge",
            "-p",
            json.dumps({"spec": {"proxyServer": {"replicas": 2}}}),
        )

    def rendered() -> bool:
        # the manager's new template (replicas and --server-count together), not the old one scaled
        found = json.loads(
            hub.kubectl_ok("-n", ADDON_NAMESPACE, "get", "deployment", SERVER_DEPLOYMENT, "-o", "json")
        )
        args = found["spec"]["template"]["spec"]["containers"][0].get("args", [])
        return found["spec"]["replicas"] == 2 and "--server-count=2" in args

    wait_for("the proxy-server Deployment rendered with 2 replicas", rendered, 60, hub)
    rollout(hub, ADDON_NAMESPACE, SERVER_DEPLOYMENT)
    wait_for(
        "exactly the 2 new proxy-server pods (the old ones gone)",
        lambda: [ready(p) for p in server_pods(hub)] == [True, True],
        120,
        hub,
    )


def failures(
    records: list[dict[str, Any]], since: float, until: float = float("inf")
) -> list[dict[str, Any]]:
    return [r for r in records if since <= r["start"] < until and r["error"]]


def test_a_server_pod_deleted_and_the_agents_node_drained_under_traffic(
    real_clusters: RealClusters, tmp_path: Path
) -> None:
    hub, managed = real_clusters[HUB], real_clusters[DIRECT]
    assert real_clusters.network is not None
    times: dict[str, float] = {}
    started = time.monotonic()
    realocm.join_all(real_clusters, tmp_path)
    import_images(real_clusters)
    for archive in filter(None, os.environ.get(HUB_ARCHIVES, "").split(":")):
        hub.import_images([Path(archive)])  # after the project's: the same names point at these
    install_hub(hub)
    two_server_replicas(hub)
    enable(hub, DIRECT)
    agent_running(managed)
    wait_available(hub, DIRECT)
    client = enroll(hub, tmp_path)
    times["installed"] = time.monotonic() - started

    # --- quiet: Available held 2 minutes (the second node and the traffic start meanwhile) ---------
    watch = AddonWatch(hub, DIRECT)
    quiet_from = time.monotonic()
    load = Load(hub, managed, client, tmp_path)
    second: SecondNode | None = None
    drained = False
    try:
        second = add_second_node(
            real_clusters.network, managed, hub, HUB_LB_PORTS, images=nodeimages.AGENT_IMAGES
        )
        times["second node ready"] = time.monotonic() - started
        load.start()
        for pod in server_pods(hub):
            wait_for(
                f"cluster1 routable through {pod['metadata']['name']}",
                lambda ip=pod["status"]["podIP"]: load.routable_through(ip),
                60,
                hub,
            )
        wait_for(
            "the quiet phase", lambda: time.monotonic() - quiet_from >= AVAILABLE_HELD, AVAILABLE_HELD + 5
        )
        quiet_until = time.monotonic()
        held = [v for v in watch.versions if v["at"] <= quiet_until]
        assert held, "the watch saw no version of the addon"
        states = {v["available"] for v in held}
        writers = sorted({w for v in held for w in v["writers"]})
        print(
            f"quiet {quiet_until - quiet_from:.0f}s: {len(held)} versions, Available {states}, writers {writers}"
        )
        assert len(states) == 1 and next(iter(states))[:2] == ("True", "ProxyAgentConnected"), held
        assert writers == [OUR_MANAGER], held
        quiet_failures = failures(load.records(), quiet_from)
        assert not quiet_failures, quiet_failures[:5]
        times["quiet held"] = quiet_until - quiet_from

        # --- a proxy-server pod deleted under traffic ---------------------------------------------
        before = {p["metadata"]["name"] for p in server_pods(hub)}
        victim = sorted(before)[0]
        deleted_at = time.monotonic()
        hub.kubectl_ok("-n", ADDON_NAMESPACE, "delete", "pod", victim, "--wait=false")
        replacement: dict[str, Any] = {}

        def replaced() -> bool:
            new = [p for p in server_pods(hub) if p["metadata"]["name"] not in before and ready(p)]
            if new:
                replacement.update(new[0])
            return bool(new)

        wait_for("the replacement proxy-server pod Ready", replaced, 120, hub)
        times["replacement Ready after the delete"] = time.monotonic() - deleted_at
        name = replacement["metadata"]["name"]
        print(f"replacement {name}: created {replacement['metadata']['creationTimestamp']}, conditions:")
        for condition in replacement["status"]["conditions"]:
            print(f"  {condition['type']} {condition['status']} {condition['lastTransitionTime']}")
        print(
            hub.kubectl(
                "-n", ADDON_NAMESPACE, "get", "events", f"--field-selector=involvedObject.name={name}"
            ).stdout
        )
        started_log = hub.kubectl("-n", ADDON_NAMESPACE, "logs", name, "--timestamps").stdout
        print("\n".join(started_log.splitlines()[:6]))
        wait_for(
            "cluster1 routable through the replacement pod",
            lambda: load.routable_through(replacement["status"]["podIP"]),
            60,
            hub,
        )
        times["replacement routable after the delete"] = time.monotonic() - deleted_at
        wait_for(
            "the deleted pod gone",
            lambda: victim not in {p["metadata"]["name"] for p in server_pods(hub)},
            90,
            hub,
        )
        times["deleted pod gone after the delete"] = time.monotonic() - deleted_at
        wait_available(hub, DIRECT)
        records = load.records()
        after_delete = [r for r in records if r["start"] >= deleted_at]
        broken = failures(records, deleted_at)
        print(f"pod delete: {len(after_delete)} requests started after it, {len(broken)} failed")
        assert after_delete and not broken, broken[:10]

        # --- the agent's node drained under traffic ----------------------------------------------
        (agent,) = [p for p in pods(managed, AGENT_NAMESPACE, AGENT_PODS) if ready(p)]
        assert agent["spec"]["nodeName"] == managed.node_name, agent["spec"]["nodeName"]
        drain_at = time.monotonic()
        drained = True
        drain = managed.kubectl(
            "drain",
            managed.node_name,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--timeout=120s",
            timeout=130,
        )
        drained_at = time.monotonic()
        assert drain.returncode == 0, drain.stdout + drain.stderr
        times["drain took"] = drained_at - drain_at
        (moved,) = [
            p
            for p in pods(managed, AGENT_NAMESPACE, AGENT_PODS)
            if p["metadata"]["name"] != agent["metadata"]["name"]
        ]
        assert moved["spec"]["nodeName"] == second.node_name, moved["spec"]["nodeName"]

        print(f"successor {moved['metadata']['name']}: created {moved['metadata']['creationTimestamp']}")
        for condition in (moved.get("status") or {}).get("conditions") or []:
            print(f"  {condition['type']} {condition['status']} {condition['lastTransitionTime']}")

        def routable_again() -> bool:
            return any(not r["error"] and r["start"] >= drained_at for r in load.records())

        wait_for("cluster1 routable after the drain", routable_again, 60, managed)
        first_ok = min(r["end"] for r in load.records() if not r["error"] and r["start"] >= drained_at)
        times["routable after the drain began"] = first_ok - drain_at
        times["routable after the old agent was gone"] = first_ok - drained_at
        records = load.records()
        during = failures(records, drain_at, first_ok)
        print(
            f"drain: {len([r for r in records if drain_at <= r['start'] < first_ok])} requests until routable, "
            f"{len(during)} failed: {sorted({r['error'][:60] for r in during})}"
        )
        assert first_ok - drained_at <= ROUTABLE_AFTER_DRAIN, times
        # The drain lets the old agent finish its streams while its successor starts on the other
        # node; the proxy-server holds the requests meanwhile: none started since the drain fails.
        assert not failures(load.records(), drain_at), failures(load.records(), drain_at)[:10]
        wait_available(hub, DIRECT)
        times["available after the drain began"] = time.monotonic() - drain_at
    finally:
        errors: list[str] = []
        try:
            load.stop()
        except AssertionError as exc:
            errors.append(f"load: {exc}")
        watch_errors = watch.stop()
        if drained:
            managed.kubectl("uncordon", managed.node_name)
        if second is not None:
            second.stop(real_clusters.network)
        print("times (s): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
        if watch_errors.strip():
            print(f"watch: {watch_errors}")
    assert not errors, errors

    # --- leave the hub as found: disable, uninstall ----------------------------------------------
    disable(hub, managed)
    uninstall(hub)
