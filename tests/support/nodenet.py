"""The networks of the real nodes: a network namespace per node, joined to the machine by a veth pair,
the rules that keep each node's pods to what the test lets them reach, and a snapshot of what a
node's programs change on the machine (to check that teardown put it all back).

Why a namespace per node: kube-proxy (iptables), kubelet and the CNI bridge each own machine-wide
state (iptables chains named ``KUBE-SERVICES``, ports 10250/10256, a bridge). Three of them in one
namespace would overwrite each other's rules; in its own namespace each node has its own, and
deleting the namespace removes them all. The node's programs enter it with ``nsenter --net`` only
(not ``ip netns exec``, which would also give each a mount namespace of its own: kubelet's volume
mounts must be seen by containerd).

Addresses: cluster ``i`` of a set gets ``10.250.<base+i>.0/24`` on its veth pair (``.1`` on the
machine's side, where its kube-apiserver listens; ``.2`` the node's InternalIP), its pods
``10.244.<base+i>.0/24`` on the node's bridge, its Services ``10.96.<base+i>.0/24``. Each node's
namespace routes only to its own veth subnet, and our chains first in the machine's INPUT and
FORWARD let it reach only its own API server, plus what :meth:`NodeNetworks.allow` adds (a managed
cluster reaches the hub's API server and the hub node's NodePorts) and :meth:`NodeNetworks.open_port`
(a node behind a forward proxy reaches the proxy, which listens on its own veth address). Pods leave
their node masqueraded as the node (the bridge plugin's ``ipMasq``), as pods leave a cloud VM.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "cpn"  # every name we give a machine-wide object starts with it (netns, links, chains)
API_PORT = 6443  # each API server listens on its own veth address: the same port for all
NODE_PORTS = "30000:32767"
SUBNETS = 60  # blocks of 4 /24s to choose a free one from, so two sessions never share addresses
SYSCTLS = (
    # kubelet sets the first three unless protectKernelDefaults (which would refuse to start instead)
    "vm/overcommit_memory",
    "kernel/panic",
    "kernel/panic_on_oops",
    "net/ipv4/ip_forward",
    "net/bridge/bridge-nf-call-iptables",
    "net/netfilter/nf_conntrack_max",
)
# Not /run/containerd: every containerd 1.6 shim (Docker's too, of other sessions) keeps its socket
# in /run/containerd/s and removes it when it exits; ours exit with their pods.
WATCHED_PATHS = (
    "/var/lib/cni",
    "/var/lib/kubelet",
    "/var/log/containers",
    "/var/log/pods",
    "/etc/cni",
    "/opt/cni",
)
BEFORE_FILE = "machine-before.json"  # in a set's state folder: the machine as it found it
FOREIGN_LINKS = re.compile(r"^(veth|br-|docker)")  # Docker's, of other sessions of this machine
FOREIGN_MOUNTS = re.compile(r"^(/var/lib/docker|/run/docker|/var/run/docker)")


def run(*argv: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess[str]:
    """A command on the machine (or in ``netns``); AssertionError with its output when it fails."""
    command = [*in_netns(netns), *argv] if netns else list(argv)
    done = subprocess.run(command, capture_output=True, text=True)
    if check:
        assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}{done.stderr}"
    return done


def in_netns(netns: str) -> list[str]:
    """The argv prefix that runs a program in the node's network namespace (and nothing else of it)."""
    return ["nsenter", f"--net=/run/netns/{netns}", "--"]


@dataclass
class NodeNetwork:
    """One node's namespace and addresses."""

    cluster: str
    netns: str
    host_link: str
    block: int

    @property
    def host_ip(self) -> str:
        return f"10.250.{self.block}.1"

    @property
    def node_ip(self) -> str:
        return f"10.250.{self.block}.2"

    @property
    def veth_subnet(self) -> str:
        return f"10.250.{self.block}.0/24"

    @property
    def pod_subnet(self) -> str:
        return f"10.244.{self.block}.0/24"

    @property
    def service_subnet(self) -> str:
        return f"10.96.{self.block}.0/24"

    @property
    def kubernetes_service_ip(self) -> str:
        return f"10.96.{self.block}.1"

    @property
    def dns_service_ip(self) -> str:
        return f"10.96.{self.block}.10"


def _free_tag() -> str:
    """Four hex digits no namespace, link or chain of the machine is named with yet: teardown deletes
    by name, so a set must never share names with another session's."""
    links = run("ip", "-o", "link").stdout
    chains = run("iptables-save", "-t", "filter").stdout
    netns = [p.name for p in Path("/run/netns").iterdir()] if Path("/run/netns").exists() else []
    for _ in range(100):
        tag = os.urandom(2).hex()
        taken = (
            any(n.startswith(f"{PREFIX}-{tag}-") for n in netns)
            or f": {PREFIX}{tag}" in links
            or f":{PREFIX.upper()}-{tag}" in chains
            or Path(f"/var/lib/{PREFIX}-{tag}").exists()
        )
        if not taken:
            return tag
    raise AssertionError("no free name for a set of nodes")


def _used_blocks() -> set[int]:
    shown = run("ip", "-o", "-4", "addr", "show").stdout
    return {int(m) for m in re.findall(r"inet 10\.250\.(\d+)\.", shown)}


@dataclass
class NodeNetworks:
    """The namespaces of a set of nodes (``clusters`` in order), their veths, and the machine's
    forwarding rules between them; :meth:`remove` deletes all of it."""

    tag: str
    clusters: tuple[str, ...]
    nodes: dict[str, NodeNetwork] = field(default_factory=dict)
    chain: str = ""  # in FORWARD
    input_chain: str = ""  # in INPUT
    _rules: list[list[str]] = field(default_factory=list)

    @classmethod
    def create(cls, clusters: Iterable[str]) -> NodeNetworks:
        names = tuple(clusters)
        used = _used_blocks()
        base = next(
            (4 * b for b in range(SUBNETS) if not used & set(range(4 * b, 4 * b + 4))),
            None,
        )
        assert base is not None, "no free 10.250.x.0/24 block for the nodes"
        tag = _free_tag()
        networks = cls(
            tag=tag, clusters=names, chain=f"{PREFIX.upper()}-{tag}", input_chain=f"{PREFIX.upper()}-{tag}-IN"
        )
        try:
            for index, name in enumerate(names):
                networks._add_node(name, base + index, index)
            networks._host_rules()
        except BaseException:
            networks.remove()
            raise
        return networks

    def _add_node(self, cluster: str, block: int, index: int) -> None:
        netns = f"{PREFIX}-{self.tag}-{cluster}"
        host_link = f"{PREFIX}{self.tag}{index}"  # at most 15 characters
        node = NodeNetwork(cluster=cluster, netns=netns, host_link=host_link, block=block)
        self.nodes[cluster] = node
        run("ip", "netns", "add", netns)
        run("ip", "link", "add", host_link, "type", "veth", "peer", "name", host_link + "n")
        run("ip", "link", "set", host_link + "n", "netns", netns)
        run("ip", "addr", "add", f"{node.host_ip}/24", "dev", host_link)
        run("ip", "link", "set", host_link, "up")
        run("ip", "link", "set", host_link + "n", "name", "eth0", netns=netns)
        run("ip", "addr", "add", f"{node.node_ip}/24", "dev", "eth0", netns=netns)
        run("ip", "link", "set", "eth0", "up", netns=netns)
        run("ip", "link", "set", "lo", "up", netns=netns)
        # the node forwards its pods' traffic (its own copy of the sysctl: the machine's is untouched)
        run("sysctl", "-qw", "net.ipv4.ip_forward=1", netns=netns)
        run("sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1", netns=netns, check=False)

    def _host_rules(self) -> None:
        """Our two chains, first in the machine's FORWARD and INPUT: a node reaches its own API
        server, and what :meth:`allow` and :meth:`open_port` add; nothing else from our links (no
        other node, none of the machine's own services, never its uplink)."""
        ours = f"{PREFIX}{self.tag}+"
        for chain, hook in ((self.chain, "FORWARD"), (self.input_chain, "INPUT")):
            run("iptables", "-w", "-N", chain)
            run("iptables", "-w", "-I", hook, "1", "-j", chain)
        run("iptables", "-w", "-A", self.chain, "-i", ours, "-j", "DROP")
        run("iptables", "-w", "-A", self.chain, "-o", ours, "-j", "DROP")
        replies = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
        run("iptables", "-w", "-A", self.input_chain, "-i", ours, *replies)
        for node in self.nodes.values():
            self._accept_input(node, node.host_ip, API_PORT)
        run("iptables", "-w", "-A", self.input_chain, "-i", ours, "-j", "DROP")

    def _accept_input(self, source: NodeNetwork, address: str, port: int) -> None:
        rule = ["-i", source.host_link, "-d", address, "-p", "tcp", "--dport", str(port), "-j", "ACCEPT"]
        run("iptables", "-w", "-I", self.input_chain, "1", *rule)

    def open_port(self, cluster: str, port: int) -> None:
        """Let ``cluster``'s node reach TCP ``port`` on its own veth address on the machine's side
        (where a forward proxy for it listens)."""
        node = self.nodes[cluster]
        self._accept_input(node, node.host_ip, port)

    def allow(self, source: str, destination: str, ports: Iterable[int] = ()) -> None:
        """Let ``source``'s node (and its pods, masqueraded as it) reach ``destination``'s API server
        and its node's NodePorts (and ``ports`` on it: a load balancer's addresses on the node), as a
        user's network exposes a hub to its managed clusters."""
        src, dst = self.nodes[source], self.nodes[destination]
        run("ip", "route", "add", dst.veth_subnet, "via", src.host_ip, netns=src.netns)
        run("ip", "route", "add", src.veth_subnet, "via", dst.host_ip, netns=dst.netns)
        self._accept_input(src, dst.host_ip, API_PORT)
        replies = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED"]
        to_node = ["-i", src.host_link, "-o", dst.host_link, "-d", dst.node_ip, "-p", "tcp", "--dport"]
        for rule in (
            *([*to_node, str(port), "-j", "ACCEPT"] for port in ports),
            [*to_node, NODE_PORTS, "-j", "ACCEPT"],
            ["-i", dst.host_link, "-o", src.host_link, *replies, "-j", "ACCEPT"],
        ):
            run("iptables", "-w", "-I", self.chain, "1", *rule)

    def remove(self) -> None:
        """Delete the namespaces (their links, routes and iptables go with them) and our chain."""
        for node in self.nodes.values():
            run("ip", "netns", "del", node.netns, check=False)
            run("ip", "link", "del", node.host_link, check=False)  # gone with its peer already
        for chain, hook in ((self.chain, "FORWARD"), (self.input_chain, "INPUT")):
            if chain:
                run("iptables", "-w", "-D", hook, "-j", chain, check=False)
                run("iptables", "-w", "-F", chain, check=False)
                run("iptables", "-w", "-X", chain, check=False)


def release_netns_folder(mounts_before: list[str], existed_before: bool) -> None:
    """``ip netns add`` makes ``/run/netns`` a mount point (and the folder): undone once empty, if it
    was not so before."""
    folder = Path("/run/netns")
    if not folder.exists() or any(folder.iterdir()):
        return
    if str(folder) not in mounts_before:
        run("umount", str(folder), check=False)
    if not existed_before:
        folder.rmdir()


# --- what the machine looks like ---------------------------------------------------------------------


def read_sysctls() -> dict[str, str]:
    values = {}
    for name in SYSCTLS:
        path = Path("/proc/sys") / name
        values[name] = path.read_text().strip() if path.exists() else "(absent)"
    return values


def restore_sysctls(values: dict[str, str]) -> None:
    for name, value in values.items():
        path = Path("/proc/sys") / name
        if value != "(absent)" and path.exists() and path.read_text().strip() != value:
            path.write_text(value + "\n")


def restore_paths(before: dict[str, list[str]]) -> None:
    """Remove what appeared under the watched paths since ``before`` (a :func:`machine_state`'s
    ``paths``): what kubelet, containerd and the CNI plugins write outside the session's folders."""
    for root, listing in before.items():
        now = set(_listing(root))
        new = now - set(listing)
        for path in sorted(new, key=len):
            if any(path.startswith(parent + "/") for parent in new):
                continue  # goes with its new parent
            target = Path(path)
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink(missing_ok=True)


def _listing(root: str) -> list[str]:
    top = Path(root)
    if not top.exists():
        return []
    return sorted([root, *(str(p) for p in top.rglob("*"))])


def machine_state() -> dict[str, object]:
    """What a node may change on the machine, without what other sessions' Docker changes meanwhile:
    iptables rules, links, addresses, routes, network namespaces, mounts, top-level cgroups,
    kubelet's sysctls and the paths kubelet, containerd and CNI write outside their folders."""
    iptables = [
        line
        for table in ("filter", "nat", "mangle", "raw")
        for line in run("iptables-save", "-t", table).stdout.splitlines()
        if re.search(r"KUBE-|CNI-|cpn|CPN-|10\.250\.|10\.244\.|10\.96\.", line)
    ]
    links = sorted(
        name
        for name in re.findall(r"^\d+: ([^:@]+)", run("ip", "-o", "link").stdout, re.M)
        if not FOREIGN_LINKS.match(name)
    )
    addresses = sorted(
        f"{link} {address}"
        for link, address in re.findall(r"^\d+: (\S+)\s+inet6? (\S+)", run("ip", "-o", "addr").stdout, re.M)
        if not FOREIGN_LINKS.match(link)
    )
    routes = sorted(
        line
        for line in run("ip", "route").stdout.splitlines()
        if not re.search(r"\b(docker\d*|br-\w+)\b", line)
    )
    mounts = sorted(
        point
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if not FOREIGN_MOUNTS.match(point := line.split()[4])
    )
    cgroups = sorted(
        str(child)
        for hierarchy in Path("/sys/fs/cgroup").iterdir()
        if hierarchy.is_dir()
        for child in hierarchy.iterdir()
        if child.is_dir()
    )
    netns_folder = Path("/run/netns")
    netns = sorted(p.name for p in netns_folder.iterdir()) if netns_folder.exists() else ["(no folder)"]
    return {
        "iptables": iptables,
        "links": links,
        "addresses": addresses,
        "routes": routes,
        "mounts": mounts,
        "cgroups": cgroups,
        "netns": netns,
        "sysctls": read_sysctls(),
        "paths": {root: _listing(root) for root in WATCHED_PATHS},
        "node state": sorted(str(p) for p in Path("/var/lib").glob(f"{PREFIX}-*")),
    }


def differences(before: dict[str, object], after: dict[str, object]) -> dict[str, object]:
    """What changed between two :func:`machine_state` snapshots (empty when nothing did)."""
    changed: dict[str, object] = {}
    for key, old in before.items():
        new = after[key]
        if old == new:
            continue
        if isinstance(old, list) and isinstance(new, list):
            changed[key] = {"added": sorted(set(new) - set(old)), "removed": sorted(set(old) - set(new))}
        else:
            changed[key] = {"before": old, "after": new}
    return changed


# --- a forward proxy in front of a node --------------------------------------------------------------


def tinyproxy_config(path: Path, listen: str, port: int, connect_ports: Iterable[int]) -> Path:
    """tinyproxy's configuration for a node behind a forward proxy: it listens on the node's veth
    address on the machine's side, and CONNECTs only to ``connect_ports``."""
    lines = [
        f"Port {port}",
        f"Listen {listen}",
        "Timeout 600",
        "LogLevel Info",
        "MaxClients 100",
        "DisableViaHeader Yes",
        *(f"ConnectPort {p}" for p in connect_ports),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


# --- after an interrupted run ---------------------------------------------------------------------


def clean_leftovers() -> list[str]:
    """Remove what a killed test session's nodes left (everything named with :data:`PREFIX`):
    their processes (found by our paths on their command line or by our cgroups), mounts, cgroups,
    namespaces (theirs and their pods'), links, FORWARD chains, state folders, CNI results and log
    links; kubelet's sysctls and the folders it made outside (``/var/lib/kubelet``, ...) are put back
    as the killed set's own record (:data:`BEFORE_FILE`) says the machine was. Returns what was
    removed."""
    removed: list[str] = []
    state = "/var/lib/" + PREFIX + "-"
    markers = (state.encode(), f"/run/netns/{PREFIX}-".encode())
    pids: set[int] = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and any(m in (proc / "cmdline").read_bytes() for m in markers):
                pids.add(int(proc.name))
        except OSError:
            continue
    for procs in Path("/sys/fs/cgroup/memory").glob(f"{PREFIX}-*/**/cgroup.procs"):
        pids.update(int(p) for p in procs.read_text().split())
    pids.discard(os.getpid())
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            removed.append(f"process {pid}")
        except ProcessLookupError:
            pass
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for point in sorted((p for p in points if p.startswith(state)), key=len, reverse=True):
        run("umount", "-l", point, check=False)
        removed.append(f"mount {point}")
    for top in Path("/sys/fs/cgroup").glob(f"*/{PREFIX}-*"):
        for folder in sorted(
            (p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
        ):
            folder.rmdir()
        top.rmdir()
        removed.append(f"cgroup {top}")
    netns_folder = Path("/run/netns")
    for netns in sorted(netns_folder.glob(f"{PREFIX}-*")) if netns_folder.exists() else []:
        run("ip", "netns", "del", netns.name, check=False)
        removed.append(f"netns {netns.name}")
    for link in re.findall(rf"^\d+: ({PREFIX}[^:@]+)", run("ip", "-o", "link").stdout, re.M):
        run("ip", "link", "del", link, check=False)
        removed.append(f"link {link}")
    for chain in re.findall(rf"^:({PREFIX.upper()}-\S+)", run("iptables-save", "-t", "filter").stdout, re.M):
        hook = "INPUT" if chain.endswith("-IN") else "FORWARD"
        while run("iptables", "-w", "-D", hook, "-j", chain, check=False).returncode == 0:
            pass
        run("iptables", "-w", "-F", chain, check=False)
        run("iptables", "-w", "-X", chain, check=False)
        removed.append(f"chain {chain}")
    for netns in sorted(netns_folder.glob("cni-*")) if netns_folder.exists() else []:
        # a pod's namespace (only a CRI containerd makes cni-*): left with no process by a killed node
        if not run("ip", "netns", "pids", netns.name, check=False).stdout.strip():
            run("ip", "netns", "del", netns.name, check=False)
            removed.append(f"netns {netns.name}")
    results = Path("/var/lib/cni/results")
    for result in sorted(results.glob(f"{PREFIX}-*")) if results.exists() else []:
        container = result.name.rsplit("-", 1)[0].rsplit("-", 1)[-1]
        for path in (result, *results.glob(f"cni-loopback-{container}-*")):
            path.unlink(missing_ok=True)
            removed.append(f"file {path}")
    for log in Path("/var/log/containers").glob("*.log"):
        if log.is_symlink() and os.readlink(log).startswith(state):
            log.unlink()
            removed.append(f"file {log}")
    for before_file in sorted(
        Path("/var/lib").glob(f"{PREFIX}-*/{BEFORE_FILE}"), key=lambda p: p.stat().st_mtime
    ):
        before = json.loads(before_file.read_text())
        restore_sysctls(before["sysctls"])
        restore_paths(before["paths"])
        removed.append(f"sysctls and paths as {before_file} found them")
        break  # the oldest set saw the machine before any of them
    for folder in Path("/var/lib").glob(f"{PREFIX}-*"):
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(f"folder {folder}")
    return removed
