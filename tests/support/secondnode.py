"""A second node for a real cluster (:mod:`tests.support.realclusters`), only for the tests that ask
for it (a drain needs somewhere to reschedule): its own network namespace, containerd instance,
kubelet and kube-proxy, joined to the cluster's kube-apiserver as ``<cluster>-b-node`` with its own
kubelet identity (``system:node:...``: NodeRestriction holds each kubelet to its own node).

Its network follows :mod:`tests.support.nodenet`'s rules, in the set's fourth address block (a set
of three clusters leaves it free): the node reaches its cluster's API server, the hub node's load
balancer ports and NodePorts (as the first node does), and the first node and its pods (a pod
network spans both nodes: routes on each node, the machine forwarding between their links). Every
route and rule added here is removed by :meth:`SecondNode.stop`, which deletes its pods first (CNI
DEL), then its Node, programs, mounts, cgroups, namespace and state, leaving the set as it found it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from pathlib import Path

from tests.support import kubebuild, nodeimages
from tests.support.nodenet import API_PORT, NODE_PORTS, NodeNetwork, NodeNetworks, run
from tests.support.realnode import POLL, TEARDOWN_TIMEOUT, RealCluster

BLOCKS_PER_SET = 4  # nodenet's: each set owns four consecutive /24 blocks
# Every kubelet, containerd (its CNI config monitor) and kube-apiserver holds inotify instances, all
# as root: with several sets of nodes on the machine the default 128 runs out, and a node started
# then fails ("fsnotify watcher: too many open files", containerd without its CRI plugin). Raised
# while the second node lives, put back after.
INOTIFY_INSTANCES = Path("/proc/sys/fs/inotify/max_user_instances")
INOTIFY_WANTED = 1024


@dataclasses.dataclass
class SecondNodeNetwork(NodeNetwork):
    """A second node's addresses: its own veth and pod subnets, its cluster's Services (kubelet's
    cluster DNS, kube-proxy's Service range)."""

    first: NodeNetwork | None = None

    @property
    def service_subnet(self) -> str:
        assert self.first is not None
        return self.first.service_subnet

    @property
    def kubernetes_service_ip(self) -> str:
        assert self.first is not None
        return self.first.kubernetes_service_ip

    @property
    def dns_service_ip(self) -> str:
        assert self.first is not None
        return self.first.dns_service_ip


class SecondNode(RealCluster):
    """Another node of ``cluster``: :class:`RealCluster`'s node half (containerd, kubelet, kube-proxy)
    on its own namespace, talking to the first node's kube-apiserver."""

    api_url: str
    rules: list[tuple[str, list[str]]]  # (chain, rule) inserted into the set's chains
    routes: list[tuple[str | None, str, str]]  # (netns or None for the machine, destination, via)
    inotify_before: str | None  # the machine's inotify instance limit, when raised

    @property
    def url(self) -> str:
        return self.api_url

    @classmethod
    def beside(cls, cluster: RealCluster, network: NodeNetwork) -> SecondNode:
        node = cls.__new__(cls)
        node.__dict__.update(vars(cluster))  # its CA, identities, admin kubeconfig, etcd, ...
        node.api_url = cluster.url
        node.name = network.cluster
        node.network = network
        node.directory = cluster.directory.parent / network.cluster
        node.directory.mkdir(parents=True, exist_ok=True)
        node.state = cluster.state.parent / network.cluster
        node.processes = {}
        node.cgroup_root = f"/{network.netns}"
        node.containerd_socket = node.state / "containerd" / "containerd.sock"
        kubelet = cluster.ca.issue(
            f"kubelet-{network.cluster}", f"system:node:{node.node_name}", organizations=["system:nodes"]
        )
        node.ids = dataclasses.replace(cluster.ids, kubelet=kubelet)
        node.rules = []
        node.routes = []
        node.inotify_before = None
        return node

    # --- network ------------------------------------------------------------------------------------

    def _route(self, netns: str | None, destination: str, via: str) -> None:
        run("ip", "route", "add", destination, "via", via, netns=netns)
        self.routes.append((netns, destination, via))

    def _rule(self, chain: str, rule: list[str]) -> None:
        run("iptables", "-w", "-I", chain, "1", *rule)
        self.rules.append((chain, rule))

    def connect(
        self, networks: NodeNetworks, first: NodeNetwork, hub: NodeNetwork, lb_ports: Iterable[int]
    ) -> None:
        """Routes and rules: this node to its API server, to the hub's load balancer ports and
        NodePorts, and to the first node and its pods (both ways)."""
        mine = self.network
        self._route(mine.netns, first.veth_subnet, mine.host_ip)
        self._rule(
            networks.input_chain,
            [
                "-i",
                mine.host_link,
                "-d",
                first.host_ip,
                "-p",
                "tcp",
                "--dport",
                str(API_PORT),
                "-j",
                "ACCEPT",
            ],
        )
        # the hub's load balancer ports and NodePorts (the agent's tunnel, the signer)
        self._route(mine.netns, hub.veth_subnet, mine.host_ip)
        self._route(hub.netns, mine.veth_subnet, hub.host_ip)
        to_hub = ["-i", mine.host_link, "-o", hub.host_link, "-d", hub.node_ip, "-p", "tcp", "--dport"]
        for port in (*(str(p) for p in lb_ports), NODE_PORTS):
            self._rule(networks.chain, [*to_hub, port, "-j", "ACCEPT"])
        replies = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
        self._rule(networks.chain, ["-i", hub.host_link, "-o", mine.host_link, *replies])
        # one pod network over both nodes (pods leave their node masqueraded as it: the veth
        # subnets route back)
        self._route(first.netns, mine.pod_subnet, first.host_ip)
        self._route(first.netns, mine.veth_subnet, first.host_ip)
        self._route(mine.netns, first.pod_subnet, mine.host_ip)
        self._route(None, mine.pod_subnet, mine.node_ip)
        self._route(None, first.pod_subnet, first.node_ip)
        for a, b in ((mine, first), (first, mine)):
            self._rule(networks.chain, ["-i", a.host_link, "-o", b.host_link, "-j", "ACCEPT"])

    def disconnect(self, networks: NodeNetworks) -> None:
        for chain, rule in reversed(self.rules):
            run("iptables", "-w", "-D", chain, *rule, check=False)
        self.rules.clear()
        for netns, destination, via in reversed(self.routes):
            run("ip", "route", "del", destination, "via", via, netns=netns, check=False)
        self.routes.clear()
        run("ip", "netns", "del", self.network.netns, check=False)
        run("ip", "link", "del", self.network.host_link, check=False)
        networks.nodes.pop(self.network.cluster, None)

    # --- life ----------------------------------------------------------------------------------------

    def start(self, extra_images: Iterable[str] = ()) -> None:
        binaries = kubebuild.kube_node_binaries()
        limit = INOTIFY_INSTANCES.read_text().strip()
        if int(limit) < INOTIFY_WANTED:
            self.inotify_before = limit
            INOTIFY_INSTANCES.write_text(f"{INOTIFY_WANTED}\n")
        self.state.mkdir(parents=True, exist_ok=True)
        self.start_containerd(kubebuild.container_runtime())
        self.wait_containerd_and_import()
        extra = tuple(extra_images)
        self.import_images([nodeimages.project_images_archive(extra)] if extra else [])
        self.start_kubelet(binaries)
        self.start_kube_proxy(binaries)
        self.wait_node_ready()

    def delete_own_pods(self, timeout: float = TEARDOWN_TIMEOUT) -> None:
        """This node's pods deleted through its kubelet (CNI DEL), the node cordoned first so that
        nothing lands on it meanwhile."""
        kubelet = self.processes.get("kubelet")
        if kubelet is None or not kubelet.running:
            return
        self.kubectl("cordon", self.node_name)
        on_me = f"spec.nodeName={self.node_name}"
        self.kubectl("delete", "pods", "-A", f"--field-selector={on_me}", "--grace-period=1", "--wait=false")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = self.kubectl("get", "pods", "-A", f"--field-selector={on_me}", "-o", "name")
            if left.returncode == 0 and not left.stdout.strip():
                return
            time.sleep(POLL)

    def _restore_inotify(self) -> None:
        if self.inotify_before is not None and INOTIFY_INSTANCES.read_text().strip() == str(INOTIFY_WANTED):
            INOTIFY_INSTANCES.write_text(f"{self.inotify_before}\n")
        self.inotify_before = None

    def stop(self, networks: NodeNetworks) -> None:
        """Everything of this node gone (every step runs; the first error is raised at the end)."""
        errors: list[BaseException] = []
        for step in (
            self.delete_own_pods,
            self.stop_node,
            lambda: self.kubectl("delete", "node", self.node_name, "--wait=false"),
            lambda: self.disconnect(networks),
            self._restore_inotify,
        ):
            try:
                step()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


def add_second_node(
    networks: NodeNetworks,
    cluster: RealCluster,
    hub: RealCluster,
    lb_ports: Iterable[int],
    images: tuple[str, ...] = (),
) -> SecondNode:
    """``cluster``'s second node, started and Ready (the set's fourth address block)."""
    blocks = [n.block for n in networks.nodes.values()]
    first_block = min(blocks)
    block = first_block + len(blocks)
    assert block < first_block + BLOCKS_PER_SET, f"no free address block in the set ({blocks})"
    name = f"{cluster.name}-b"
    networks._add_node(name, block, block - first_block)
    added = networks.nodes[name]
    network = SecondNodeNetwork(
        added.cluster, added.netns, added.host_link, added.block, first=cluster.network
    )
    networks.nodes[name] = network
    node = SecondNode.beside(cluster, network)
    try:
        node.connect(networks, cluster.network, hub.network, lb_ports)
        node.start(images)
    except BaseException:
        node.stop(networks)
        raise
    return node
