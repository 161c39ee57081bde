"""Three real clusters at once for tests: a hub and two managed clusters (:mod:`tests.support.realnode`),
each with its own node, over one etcd, with separate pod networks:

- ``cluster1``'s node (and its pods, masqueraded as it) reaches the hub's kube-apiserver and the
  hub node's NodePorts, as a user's load balancer would expose them; nothing else of the hub (no
  pod or Service address, not its kubelet);
- ``cluster2``'s reaches nothing of the hub directly, only a forward proxy (tinyproxy) that listens on
  its own veth address on the machine's side and CONNECTs to the hub's API server and NodePorts.

:class:`RealClusters` snapshots the machine before it starts anything (:func:`nodenet.machine_state`)
and its teardown puts it back: pods deleted first (CNI DEL), processes by pid, mounts, cgroups,
namespaces (their links, routes and iptables), our FORWARD chain, kubelet's sysctls, and the files
kubelet and containerd wrote outside the session's folder.

Try it by hand: ``python -m tests.support.realclusters up`` (runs until Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.support import kubeapi, kubebuild, nodeimages, nodenet
from tests.support.kubeapi import Etcd, ServerProcess
from tests.support.nodenet import API_PORT
from tests.support.realnode import RealCluster

CLUSTERS = ("hub", "cluster1", "cluster2")
HUB, DIRECT, PROXIED = CLUSTERS
PROXY_PORT = 3128
# The hub's load balancer (as k3s's ServiceLB or MetalLB in L2 mode makes one): a LoadBalancer
# Service's ingress address is the hub node's own, where kube-proxy forwards its port to the pods;
# the managed clusters reach these ports there. The addon's agent and cert-signer entrypoints.
HUB_LB_PORTS = (8091, 8443)


def _parallel(action: Callable[[RealCluster], None], clusters: Sequence[RealCluster]) -> None:
    """``action`` on every cluster at once (the waits overlap); the first error is raised."""
    with ThreadPoolExecutor(len(clusters)) as pool:
        for future in [pool.submit(action, c) for c in clusters]:
            future.result()


def route_services_through_node(cluster: RealCluster) -> None:
    """The machine routes the cluster's Service range through its node, as a control plane on a node
    with kube-proxy reaches Services: the API server runs outside the node's namespace, and its
    aggregator dials an APIService's Service IP (and an admission webhook's), which only the node's
    kube-proxy rules translate. The route goes with the node's veth at teardown."""
    node = cluster.network
    nodenet.run("ip", "route", "add", node.service_subnet, "via", node.node_ip, "dev", node.host_link)


def build_everything() -> None:
    """Every program and image of the clusters, built into the tool cache when missing."""
    kubeapi.binaries()
    kubebuild.kube_node_binaries()
    kubebuild.cni_plugins()
    kubebuild.container_runtime()
    nodeimages.all_images()


class RealClusters:
    """The hub, cluster1 and cluster2 under ``directory``; a context manager. ``timings`` holds how
    long start and teardown took (seconds)."""

    def __init__(self, directory: Path, names: Sequence[str] = CLUSTERS) -> None:
        self.directory = directory
        self.names = tuple(names)
        self.before = nodenet.machine_state()
        self.timings: dict[str, float] = {}
        self.network: nodenet.NodeNetworks | None = None
        self.etcd: Etcd | None = None
        self.proxy: ServerProcess | None = None
        self.clusters: dict[str, RealCluster] = {}
        self.state: Path | None = None

    def __getitem__(self, name: str) -> RealCluster:
        return self.clusters[name]

    def __iter__(self) -> Iterator[RealCluster]:
        return iter(self.clusters.values())

    @property
    def proxy_url(self) -> str:
        """The forward proxy cluster2 reaches the hub through (from cluster2's node and pods)."""
        assert self.network is not None
        return f"http://{self.network.nodes[PROXIED].host_ip}:{PROXY_PORT}"

    def start(self) -> None:
        started = time.monotonic()
        build_everything()
        binaries = kubeapi.binaries()
        node_binaries = kubebuild.kube_node_binaries()
        runtime = kubebuild.container_runtime()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.network = nodenet.NodeNetworks.create(self.names)
        # unix sockets (containerd's, kubelet's) need paths under 104 bytes: a test's tmp folder is
        # longer, so the nodes keep their state here (logs and configs stay in ``directory``)
        self.state = Path("/var/lib") / f"{nodenet.PREFIX}-{self.network.tag}"
        self.state.mkdir(parents=True)
        # for `clean` after a killed session: what to put back
        (self.state / nodenet.BEFORE_FILE).write_text(json.dumps(self.before))
        if HUB in self.names:
            for managed in (DIRECT,):
                if managed in self.names:
                    self.network.allow(managed, HUB, HUB_LB_PORTS)
        self.etcd = Etcd(binaries.etcd, self.directory)
        self.etcd.start()
        for name in self.names:
            self.clusters[name] = RealCluster(
                name=name,
                network=self.network.nodes[name],
                directory=self.directory / name,
                etcd_url=self.etcd.url,
                etcd_prefix=f"/{self.network.tag}/{name}",
                state=self.state / name,
            )
        clusters = list(self)
        for cluster in clusters:
            cluster.start_apiserver(binaries.kube_apiserver)
            cluster.start_containerd(runtime)
        _parallel(lambda c: c.wait_apiserver(), clusters)
        self.timings["apiservers ready"] = time.monotonic() - started
        for cluster in clusters:
            cluster.start_controllers(node_binaries)
        _parallel(lambda c: c.wait_containerd_and_import(), clusters)
        for cluster in clusters:
            cluster.start_kubelet(node_binaries)
            cluster.start_kube_proxy(node_binaries)
        _parallel(lambda c: c.wait_node_ready(), clusters)
        self.timings["nodes ready"] = time.monotonic() - started
        for cluster in clusters:
            route_services_through_node(cluster)
        for cluster in clusters:
            cluster.install_coredns()
        if HUB in self.names and PROXIED in self.names:
            self._start_proxy()
        _parallel(lambda c: c.wait_coredns(), clusters)
        self.timings["up"] = time.monotonic() - started

    def _start_proxy(self) -> None:
        assert self.network is not None
        tinyproxy = shutil.which("tinyproxy") or "/usr/bin/tinyproxy"
        config = nodenet.tinyproxy_config(
            self.directory / "tinyproxy.conf",
            self.network.nodes[PROXIED].host_ip,
            PROXY_PORT,
            # the hub's API server, its load balancer's ports; NodePorts are CONNECTed to by their
            # number (30000-32767)
            connect_ports=(API_PORT, *HUB_LB_PORTS, *range(30000, 30010)),
        )
        self.network.open_port(PROXIED, PROXY_PORT)
        self.proxy = ServerProcess("tinyproxy", [tinyproxy, "-d", "-c", str(config)], self.directory)
        self.proxy.start()

    def stop(self) -> None:
        """Leave the machine as :attr:`before` found it (every step runs even if one fails)."""
        started = time.monotonic()
        clusters = list(self)
        errors: list[BaseException] = []

        def step(action: Callable[[], None]) -> None:
            try:
                action()
            except Exception as exc:  # teardown goes on; the first error is raised at its end
                errors.append(exc)

        step(lambda: _parallel(lambda c: c.delete_pods(), clusters))
        step(lambda: _parallel(lambda c: c.stop_node(), clusters))
        for cluster in clusters:
            step(cluster.stop_apiserver)
        if self.proxy is not None:
            step(self.proxy.stop)
        if self.etcd is not None:
            step(self.etcd.process.stop)
        if self.network is not None:
            step(self.network.remove)
        step(
            lambda: nodenet.release_netns_folder(
                self.before["mounts"],  # type: ignore[arg-type]
                "(no folder)" not in self.before["netns"],  # type: ignore[operator]
            )
        )
        step(lambda: nodenet.restore_sysctls(self.before["sysctls"]))  # type: ignore[arg-type]
        if self.state is not None:
            step(lambda: shutil.rmtree(self.state, ignore_errors=True))  # type: ignore[arg-type]
        step(lambda: nodenet.restore_paths(self.before["paths"]))  # type: ignore[arg-type]
        self.timings["down"] = time.monotonic() - started
        if errors:
            raise errors[0]

    def __enter__(self) -> RealClusters:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def logs(self, lines: int = 30) -> dict[str, str]:
        found: dict[str, str] = {}
        for cluster in self:
            found.update(cluster.logs(lines))
        return found


def _up_command(directory: Path | None) -> None:
    directory = directory or Path(tempfile.mkdtemp(prefix="cluster-proxy-nodes-"))
    with RealClusters(directory) as clusters:
        print(f"up in {clusters.timings['up']:.1f}s ({clusters.timings})")
        for cluster in clusters:
            print(
                f"  {cluster.name}: {cluster.url}  KUBECONFIG={cluster.kubeconfig}  node {cluster.network.node_ip}"
            )
        print(f"  cluster2's forward proxy: {clusters.proxy_url}")
        print("Ctrl-C (or SIGTERM) stops them.", flush=True)
        stopped = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stopped.set())
        while not stopped.is_set():
            signal.pause()
    print(f"down in {clusters.timings['down']:.1f}s")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.realclusters", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="run the hub, cluster1 and cluster2 with real nodes until Ctrl-C")
    up.add_argument("--dir", type=Path, help="state directory (default: a new temporary one)")
    commands.add_parser("clean", help="remove what an interrupted session's nodes left on the machine")
    args = parser.parse_args(argv)
    if args.command == "clean":
        for line in nodenet.clean_leftovers() or ["nothing left"]:
            print(line)
    else:
        _up_command(args.dir)


if __name__ == "__main__":
    main()
