"""One real Kubernetes cluster for tests: kube-apiserver on the machine (over a shared etcd, under its
own ``--etcd-prefix``), and a node in its own network namespace (:mod:`tests.support.nodenet`) running
kube-controller-manager, kube-scheduler, its own containerd instance (own root, state, socket; CRI on),
kubelet, kube-proxy (iptables) and a CNI bridge; CoreDNS runs as a pod. Every program comes from the
tool cache (:mod:`tests.support.kubebuild`), every image from :mod:`tests.support.nodeimages`.

Traps of this machine handled here (``shared/infra-notes.md``, "A real Kubernetes node"):

- The VM drops CAP_SYS_RESOURCE, so runc cannot set a negative ``oom_score_adj`` (kubelet asks -998
  for every sandbox): containerd runs runc through a wrapper that sets negative values to 0 in the
  bundle's config.json first (memory limits are still enforced).
- kubelet writes outside its root dir and sets kernel sysctls: :mod:`tests.support.realclusters`
  snapshots the machine first and puts back what changed.
- Unix sockets need paths under 104 bytes: the node's runtime state (containerd's root and socket,
  kubelet's root dir) lives under ``state`` (``/var/lib/cpn-<tag>/<cluster>``), its logs and
  configuration under ``directory``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.support import kubebuild, nodeconfig, nodeimages
from tests.support.kubeapi import (
    CertPair,
    ServerProcess,
    ThrowawayCA,
    _http_probe,
    _kubeconfig,
    _service_account_keys,
    _write_key,
)
from tests.support.nodenet import API_PORT, NodeNetwork, in_netns

POLL = 0.1
READY_TIMEOUT = 90.0
TEARDOWN_TIMEOUT = 45.0
# Every kubelet binds /var/lib/kubelet/device-plugins/kubelet.sock (not under its --root-dir): each
# removes the file and listens, so two starting at the same instant can find the other's socket
# there and exit ("bind: address already in use"). Seen once in ~20 starts of three.
DEVICE_PLUGIN_RACE = "device-plugins/kubelet.sock: bind: address already in use"
NODE_PROGRAMS = ("kube-apiserver", "containerd", "kubelet", "kube-proxy")  # stopped last at teardown


@dataclass
class Identities:
    """Client certificates of the cluster's parties, signed by its CA."""

    admin: CertPair
    kubelet: CertPair
    kube_proxy: CertPair
    controller_manager: CertPair
    scheduler: CertPair
    apiserver_kubelet_client: CertPair


@dataclass
class RealCluster:
    """A cluster named ``name`` whose node is ``network``'s namespace; files under ``directory``."""

    name: str
    network: NodeNetwork
    directory: Path
    etcd_url: str
    etcd_prefix: str
    state: Path  # the node's runtime state: a short path (unix sockets live there), removed at teardown
    processes: dict[str, ServerProcess] = field(default_factory=dict)
    ca: ThrowawayCA = field(init=False)
    ids: Identities = field(init=False)

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.pki = self.directory / "pki"
        self.ca = ThrowawayCA(self.pki, "ca")
        self.ca_key = _write_key(self.ca.key, self.pki / "ca.key")
        self.front_proxy_ca = ThrowawayCA(self.pki, "front-proxy-ca")
        issue = self.ca.issue
        self.ids = Identities(
            admin=issue("admin", "cluster-admin", organizations=["system:masters"]),
            kubelet=issue("kubelet", f"system:node:{self.node_name}", organizations=["system:nodes"]),
            kube_proxy=issue("kube-proxy", "system:kube-proxy"),
            controller_manager=issue("controller-manager", "system:kube-controller-manager"),
            scheduler=issue("scheduler", "system:kube-scheduler"),
            apiserver_kubelet_client=issue(
                "apiserver-kubelet-client", "kube-apiserver-kubelet-client", organizations=["system:masters"]
            ),
        )
        self.kubeconfig = self._kubeconfig("admin", self.ids.admin)
        self.cgroup_root = f"/{self.network.netns}"
        self.containerd_socket = self.state / "containerd" / "containerd.sock"
        self.kubectl_binary = kubebuild.kube_node_binaries().kubectl

    # --- names and files --------------------------------------------------------------------------

    @property
    def node_name(self) -> str:
        return f"{self.name}-node"

    @property
    def url(self) -> str:
        return f"https://{self.network.host_ip}:{API_PORT}"

    def _kubeconfig(self, stem: str, pair: CertPair) -> Path:
        path = self.directory / f"{stem}.kubeconfig"
        path.write_text(_kubeconfig(self.name, self.url, self.ca.path, pair))
        return path

    def _process(self, name: str, argv: list[str], *, in_node: bool = True) -> ServerProcess:
        argv = [*in_netns(self.network.netns), *argv] if in_node else argv
        process = ServerProcess(f"{self.name}-{name}", argv, self.directory)
        self.processes[name] = process
        return process

    def start_program(self, name: str, argv: list[str]) -> ServerProcess:
        """Another program on the node (in its network namespace), logging to ``<name>.log``,
        stopped before the node at teardown."""
        process = self._process(name, argv)
        process.start()
        return process

    def kubectl(
        self, *args: str, input: str | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """kubectl (of the tool cache, at the cluster's version) as the cluster admin."""
        return subprocess.run(
            [str(self.kubectl_binary), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def kubectl_ok(self, *args: str, input: str | None = None, timeout: float = 60.0) -> str:
        done = self.kubectl(*args, input=input, timeout=timeout)
        assert done.returncode == 0, f"{self.name}: kubectl {' '.join(args)}:\n{done.stdout}{done.stderr}"
        return done.stdout

    def apply(self, documents: list[dict[str, object]]) -> None:
        self.kubectl_ok("apply", "-f", "-", input=yaml.safe_dump_all(documents))

    # --- control plane ----------------------------------------------------------------------------

    def start_apiserver(self, binary: Path) -> None:
        net = self.network
        serving = self.ca.issue(
            "apiserver-serving",
            "kube-apiserver",
            dns_names=[
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
            ip_addresses=[net.host_ip, net.kubernetes_service_ip, "127.0.0.1"],
            server=True,
        )
        proxy_client = self.front_proxy_ca.issue("front-proxy-client", "front-proxy-client")
        self.sa_key, sa_public = _service_account_keys(self.pki)
        argv = [
            str(binary),
            f"--etcd-servers={self.etcd_url}",
            f"--etcd-prefix={self.etcd_prefix}",
            f"--bind-address={net.host_ip}",
            f"--advertise-address={net.host_ip}",
            f"--secure-port={API_PORT}",
            f"--cert-dir={self.pki}",
            f"--tls-cert-file={serving.cert}",
            f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={self.ca.path}",
            f"--service-account-issuer={self.url}",
            f"--service-account-key-file={sa_public}",
            f"--service-account-signing-key-file={self.sa_key}",
            f"--service-cluster-ip-range={net.service_subnet}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            f"--kubelet-client-certificate={self.ids.apiserver_kubelet_client.cert}",
            f"--kubelet-client-key={self.ids.apiserver_kubelet_client.key}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--requestheader-client-ca-file={self.front_proxy_ca.path}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={proxy_client.cert}",
            f"--proxy-client-key-file={proxy_client.key}",
            "--profiling=false",
            "--v=1",
        ]
        self._process("kube-apiserver", argv, in_node=False).start()

    def wait_apiserver(self) -> None:
        context = self.admin_ssl_context()
        self.processes["kube-apiserver"].wait_ready(
            lambda: _http_probe(f"{self.url}/readyz", context), "ready (/readyz)", READY_TIMEOUT
        )

    def admin_ssl_context(self) -> ssl.SSLContext:
        """Trusts the cluster's CA and presents the admin client certificate."""
        context = ssl.create_default_context(cafile=str(self.ca.path))
        context.load_cert_chain(str(self.ids.admin.cert), str(self.ids.admin.key))
        return context

    def start_controllers(self, binaries: kubebuild.KubeNodeBinaries) -> None:
        """kube-controller-manager (it signs CSRs with the cluster's CA) and kube-scheduler, on the node."""
        cm = self._kubeconfig("controller-manager", self.ids.controller_manager)
        self._process(
            "kube-controller-manager",
            [
                str(binaries.kube_controller_manager),
                f"--kubeconfig={cm}",
                f"--authentication-kubeconfig={cm}",
                f"--authorization-kubeconfig={cm}",
                "--bind-address=127.0.0.1",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={self.sa_key}",
                f"--root-ca-file={self.ca.path}",
                f"--cluster-signing-cert-file={self.ca.path}",
                f"--cluster-signing-key-file={self.ca_key}",
                f"--service-cluster-ip-range={self.network.service_subnet}",
                "--allocate-node-cidrs=false",
                "--controllers=*,bootstrapsigner,tokencleaner",
                "--profiling=false",
                "--v=1",
            ],
        ).start()
        scheduler = self._kubeconfig("scheduler", self.ids.scheduler)
        self._process(
            "kube-scheduler",
            [
                str(binaries.kube_scheduler),
                f"--kubeconfig={scheduler}",
                f"--authentication-kubeconfig={scheduler}",
                f"--authorization-kubeconfig={scheduler}",
                "--bind-address=127.0.0.1",
                "--leader-elect=false",
                "--profiling=false",
                "--v=1",
            ],
        ).start()

    # --- node ---------------------------------------------------------------------------------------

    def _make_cgroup_root(self) -> None:
        """kubelet wants its ``cgroupRoot`` to exist in every hierarchy; cpuset needs its CPUs and
        memory nodes copied from the parent before a task may join."""
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            if not hierarchy.is_dir() or hierarchy.name == "unified":
                continue
            folder = hierarchy / self.cgroup_root.lstrip("/")
            folder.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (folder / name).exists():
                    (folder / name).write_text((hierarchy / name).read_text())

    def _cni_config(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        conflist = nodeconfig.cni_conflist(
            self.network.netns, self.network.pod_subnet, self.state / "cni-ipam"
        )
        (folder / "10-bridge.conflist").write_text(json.dumps(conflist, indent=2))
        return folder

    def start_containerd(self, runtime: kubebuild.ContainerRuntime) -> None:
        folder = self.state / "containerd"
        folder.mkdir(parents=True, exist_ok=True)
        wrapper = folder / "runc-wrapper"
        wrapper.write_text(nodeconfig.RUNC_WRAPPER.format(runc=runtime.runc))
        wrapper.chmod(0o755)
        config = folder / "config.toml"
        config.write_text(
            nodeconfig.containerd_config(
                folder, wrapper, self._cni_config(self.directory / "cni"), self.containerd_socket
            )
        )
        # containerd finds the shim on its PATH
        path = f"{runtime.shim.parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        argv = ["env", f"PATH={path}", str(runtime.containerd), f"--config={config}", "--log-level=warn"]
        self._process("containerd", argv).start()
        self.ctr_binary = runtime.ctr

    def wait_containerd_and_import(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while not self.containerd_socket.exists():
            assert self.processes["containerd"].running, (
                f"containerd exited:\n{self.processes['containerd'].tail()}"
            )
            assert time.monotonic() < deadline, "containerd did not create its socket"
            time.sleep(POLL)
        self.import_images(nodeimages.all_images())

    def import_images(self, archives: list[Path]) -> None:
        """OCI or Docker image archives into the node's containerd (where kubelet finds them)."""
        for archive in archives:
            done = subprocess.run(
                [
                    str(self.ctr_binary),
                    f"--address={self.containerd_socket}",
                    "-n",
                    "k8s.io",
                    "images",
                    "import",
                    "--all-platforms",
                    str(archive),
                ],
                capture_output=True,
                text=True,
            )
            assert done.returncode == 0, f"{self.name}: ctr import {archive.name}:\n{done.stderr}"

    def start_kubelet(self, binaries: kubebuild.KubeNodeBinaries) -> None:
        self._make_cgroup_root()
        root = self.state / "kubelet"
        root.mkdir(parents=True, exist_ok=True)
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.ca.path)},
            },
            "authorization": {"mode": "Webhook"},
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "failSwapOn": False,
            "resolvConf": "",
            "clusterDNS": [self.network.dns_service_ip],
            "clusterDomain": "cluster.local",
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "podLogsDir": str(self.state / "pod-logs"),
            "healthzBindAddress": "127.0.0.1",
            "readOnlyPort": 0,
            "maxPods": 40,
            # never collect our images (they cannot be pulled again) or evict for a busy disk
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "serializeImagePulls": False,
        }
        config_path = self.directory / "kubelet.yaml"
        config_path.write_text(yaml.safe_dump(config))
        self._process(
            "kubelet",
            [
                str(binaries.kubelet),
                f"--config={config_path}",
                f"--kubeconfig={self._kubeconfig('kubelet', self.ids.kubelet)}",
                f"--root-dir={root}",
                f"--cert-dir={self.state / 'kubelet-pki'}",
                f"--hostname-override={self.node_name}",
                f"--node-ip={self.network.node_ip}",
                "--v=1",
            ],
        ).start()

    def start_kube_proxy(self, binaries: kubebuild.KubeNodeBinaries) -> None:
        """kube-proxy in iptables mode, set so that it changes no sysctl of the machine."""
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self._kubeconfig("kube-proxy", self.ids.kube_proxy))},
            "hostnameOverride": self.node_name,
            "mode": "iptables",
            "clusterCIDR": self.network.pod_subnet,
            "healthzBindAddress": "127.0.0.1:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            "nodePortAddresses": [f"{self.network.node_ip}/32"],
            "conntrack": {
                "maxPerCore": 0,
                "min": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
            },
            "iptables": {"localhostNodePorts": False},
        }
        path = self.directory / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(config))
        self._process("kube-proxy", [str(binaries.kube_proxy), f"--config={path}", "--v=1"]).start()

    def wait_node_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """The node Ready and the ``default`` ServiceAccount there (bare Pods are refused until it is)."""
        deadline = time.monotonic() + timeout
        last = ""
        restarted = False
        while time.monotonic() < deadline:
            kubelet = self.processes["kubelet"]
            if not kubelet.running and not restarted and DEVICE_PLUGIN_RACE in kubelet.tail(5):
                kubelet.start()  # once: the other kubelets have their socket by now
                restarted = True
            for name, process in self.processes.items():
                assert process.running, f"{self.name}: {name} exited:\n{process.tail()}"
            done = self.kubectl(
                "get",
                "node",
                self.node_name,
                "-o",
                "jsonpath={.status.conditions[?(@.type=='Ready')].status}",
            )
            last = done.stdout + done.stderr
            if done.stdout == "True" and self.kubectl("get", "serviceaccount", "default").returncode == 0:
                return
            time.sleep(POLL)
        raise AssertionError(
            f"{self.name}: node not Ready in {timeout:g}s ({last}):\n{self.processes['kubelet'].tail()}"
        )

    def install_coredns(self) -> None:
        self.apply(nodeconfig.coredns_manifests(self.network.dns_service_ip))

    def wait_coredns(self, timeout: float = READY_TIMEOUT) -> None:
        self.kubectl_ok(
            "-n",
            "kube-system",
            "rollout",
            "status",
            "deployment/coredns",
            f"--timeout={timeout:g}s",
            timeout=timeout + 10,
        )

    # --- teardown ----------------------------------------------------------------------------------

    def delete_pods(self, timeout: float = TEARDOWN_TIMEOUT) -> None:
        """Every pod deleted through kubelet (so that CNI DEL runs and the sandboxes stop), with the
        controllers stopped first (no replacement pods)."""
        for name, process in self.processes.items():
            if name not in NODE_PROGRAMS:
                process.stop()  # controllers and added programs: nothing makes new pods
        kubelet = self.processes.get("kubelet")
        if kubelet is None or not kubelet.running or not self.processes["kube-apiserver"].running:
            return
        self.kubectl("delete", "pods", "--all", "--all-namespaces", "--grace-period=1", "--wait=false")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = self.kubectl("get", "pods", "-A", "-o", "name")
            if left.returncode == 0 and not left.stdout.strip():
                return
            time.sleep(POLL)

    def stop_node(self) -> None:
        """kube-proxy and kubelet, then containerd and the shims it leaves, then every mount under the
        cluster's folder and its cgroups."""
        for name, process in self.processes.items():
            if name not in ("kube-apiserver", "containerd"):
                process.stop()
        if "containerd" in self.processes:
            self.processes["containerd"].stop()
        self._kill_leftovers()
        self._unmount()
        self._remove_cgroups()
        shutil.rmtree(self.state, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        """Shims (and their containers) of this node's containerd outlive it: found by the socket path
        on their command line, or by membership in the node's cgroups."""
        mine = str(self.state)
        pids: set[int] = set()
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    if mine.encode() in (proc / "cmdline").read_bytes():
                        pids.add(int(proc.name))
                except OSError:
                    continue
        for tasks in Path("/sys/fs/cgroup/memory", self.cgroup_root.lstrip("/")).rglob("cgroup.procs"):
            pids.update(int(p) for p in tasks.read_text().split())
        pids.discard(os.getpid())
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _unmount(self) -> None:
        mine = str(self.state)
        points = [
            line.split()[4]
            for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4].startswith(mine)
        ]
        for point in sorted(points, key=len, reverse=True):
            if subprocess.run(["umount", point], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", point], capture_output=True)

    def _remove_cgroups(self) -> None:
        deadline = time.monotonic() + 10
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            top = hierarchy / self.cgroup_root.lstrip("/")
            if not top.is_dir():
                continue
            folders = sorted(
                (p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
            )
            for folder in [*folders, top]:
                while True:
                    try:
                        folder.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(POLL)  # its last task is still exiting

    def stop_apiserver(self) -> None:
        if "kube-apiserver" in self.processes:
            self.processes["kube-apiserver"].stop()

    def logs(self, lines: int = 30) -> dict[str, str]:
        return {p.name: p.tail(lines) for p in self.processes.values()}
