"""Real Kubernetes API servers for tests: etcd and kube-apiserver built from the Go module registry into
the tool cache (``${XDG_CACHE_HOME:-~/.cache}/cluster-proxy/kube``), and a runner that starts one etcd
and one kube-apiserver per simulated cluster on loopback.

Build (minutes cold, seconds warm): ``./scripts/task kube-peers`` or ``python -m tests.support.kubeapi
build``. Try one by hand: ``python -m tests.support.kubeapi up`` prints each cluster's admin kubeconfig
and runs until Ctrl-C.

There is no kubelet, scheduler or controller-manager: objects are stored and served, RBAC and
admission apply, TokenRequest works, but no pod ever runs, a namespace never finishes terminating, and
no ``default`` ServiceAccount appears by itself.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from clusterproxy_cli.local_plan import free_ports
from tests.support.gopeers import _build, _go, tool_cache
from tests.support.waiting import poll_until

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

ETCD_VERSION = "v3.5.35"
KUBE_VERSION = "v1.32.13"
CLUSTER_NAMES = ("hub", "cluster1", "cluster2")

START_TIMEOUT = 60.0
PORT_ATTEMPTS = 3
STOP_TIMEOUT = 15.0
POLL = 0.05
LOG_TAIL_LINES = 40

# etcd's server/v3 go.mod replaces its sibling modules with ../api etc., so `go install` refuses it; a
# throw-away main module that requires it (the replaces of a dependency do not apply) builds its main
# package. etcdctl is required too so that its pinned versions join the resolution, as upstream's own
# release build does.
ETCD_MODULE = f"""module clusterproxy.test/etcd

go 1.23.0

require (
\tgo.etcd.io/etcd/server/v3 {ETCD_VERSION}
\tgo.etcd.io/etcd/etcdctl/v3 {ETCD_VERSION}
)
"""

# k8s.io/kubernetes replaces its staging modules (k8s.io/api, ...) with ./staging/src/..., which its
# module zip does not hold: the throw-away main module restates each replace as the published module
# of the matching v0.x version (generated from k8s.io/kubernetes's own go.mod).
KUBE_MODULE_HEAD = f"""module clusterproxy.test/kube-apiserver

go 1.23.0

godebug default=go1.23

require k8s.io/kubernetes {KUBE_VERSION}
"""


def _kube_ldflags(version: str) -> str:
    """The version stamps: without them the binary reports v0.0.0."""
    major, minor = version.removeprefix("v").split(".")[:2]
    values = {"gitVersion": version, "gitMajor": major, "gitMinor": minor, "gitTreeState": "clean"}
    stamps = " ".join(f"-X k8s.io/component-base/version.{k}={v}" for k, v in values.items())
    return f"-s -w {stamps}"  # no symbol table or DWARF: 95 MB instead of 135 MB


@contextlib.contextmanager
def _build_lock(binary: Path) -> Iterator[None]:
    """One build of a binary at a time on this machine: several test sessions may ask together."""
    binary.parent.mkdir(parents=True, exist_ok=True)
    with binary.with_name(binary.name + ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def etcd_binary() -> Path:
    """The etcd server binary at ``ETCD_VERSION`` (about 1.5 min cold on 2 cores)."""
    go, go_version = _go("etcd")
    digest = _digest(go_version, ETCD_MODULE)
    binary = tool_cache() / "kube" / f"etcd-{digest}"
    with _build_lock(binary):
        if not binary.exists():
            module = binary.with_name(binary.name + "-module")
            module.mkdir(parents=True, exist_ok=True)
            (module / "go.mod").write_text(ETCD_MODULE)
            _build(go, binary, "go.etcd.io/etcd/server/v3", module, mod="mod")
    return binary


def _kube_module(go: str, module: Path) -> str:
    """The throw-away module's go.mod: k8s.io/kubernetes's staging replaces, restated."""
    download = subprocess.run(
        [go, "mod", "download", "-json", f"k8s.io/kubernetes@{KUBE_VERSION}"],
        cwd=module,
        capture_output=True,
        text=True,
    )
    assert download.returncode == 0, (
        f"go mod download k8s.io/kubernetes failed:\n{download.stdout}{download.stderr}"
    )
    upstream = Path(json.loads(download.stdout)["GoMod"]).read_text()
    staging = re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", upstream, re.M)
    assert staging, f"no staging replaces found in k8s.io/kubernetes@{KUBE_VERSION}'s go.mod"
    staging_version = "v0." + KUBE_VERSION.removeprefix("v").split(".", 1)[1]
    replaces = "".join(f"\t{name} => {name} {staging_version}\n" for name in staging)
    return f"{KUBE_MODULE_HEAD}\nreplace (\n{replaces})\n"


def kube_apiserver_binary() -> Path:
    """The kube-apiserver binary at ``KUBE_VERSION`` (6-7 min cold on 2 cores, 1.7 GB peak RSS)."""
    go, go_version = _go("kube-apiserver")
    digest = _digest(go_version, KUBE_MODULE_HEAD, _kube_ldflags(KUBE_VERSION))
    binary = tool_cache() / "kube" / f"kube-apiserver-{digest}"
    with _build_lock(binary):
        if not binary.exists():
            module = binary.with_name(binary.name + "-module")
            module.mkdir(parents=True, exist_ok=True)
            (module / "go.mod").write_text(KUBE_MODULE_HEAD)
            (module / "go.mod").write_text(_kube_module(go, module))
            get = subprocess.run(
                [go, "get", f"k8s.io/kubernetes/cmd/kube-apiserver@{KUBE_VERSION}"],
                cwd=module,
                capture_output=True,
                text=True,
            )
            assert get.returncode == 0, f"go get kube-apiserver failed:\n{get.stderr}"
            _build(
                go,
                binary,
                "k8s.io/kubernetes/cmd/kube-apiserver",
                module,
                mod="mod",
                ldflags=_kube_ldflags(KUBE_VERSION),
            )
    return binary


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path


def binaries() -> Binaries:
    """Both binaries, built first if missing (skips on a laptop without Go, fails under CI=true)."""
    return Binaries(etcd=etcd_binary(), kube_apiserver=kube_apiserver_binary())


# --- certificates -------------------------------------------------------------------------------------


def _write_key(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


class ThrowawayCA:
    """A CA for one test session: it signs the API servers' serving certificates and client
    certificates (Kubernetes reads the user from CN and the groups from O)."""

    def __init__(self, directory: Path, name: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        self.path = _write_cert(self.cert, directory / f"{name}.crt")

    def issue(
        self,
        stem: str,
        common_name: str,
        *,
        organizations: Sequence[str] = (),
        dns_names: Sequence[str] = (),
        ip_addresses: Sequence[str] = (),
        server: bool = False,
    ) -> CertPair:
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        name = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        name.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(name))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
            )
        )
        alt_names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        if alt_names:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return CertPair(
            cert=_write_cert(cert, self.directory / f"{stem}.crt"),
            key=_write_key(key, self.directory / f"{stem}.key"),
        )


# --- processes ----------------------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range: a port the kernel hands out for
    port 0 is one any outgoing connection may take before our process binds it (five kube sessions at
    once: a proxy-server of the addon stack failed with EADDRINUSE that way)."""
    return free_ports(1)[0]


def die_with_parent() -> None:
    """Children of the main thread get SIGKILL if the test session dies without tearing down (a
    killed pytest must not leave API servers holding memory on a shared machine)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


_Probe = Callable[[], tuple[bool, str]]


class PortTaken(RuntimeError):
    """The server could not listen: another process took the port since :func:`free_port` chose it."""


class ServerProcess:
    """A long-running binary writing its output to ``<log_dir>/<name>.log`` (appended across
    restarts, each start marked)."""

    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.popen is None or self.popen.poll() is not None, f"{self.name} is already running"
        with self.log_path.open("ab") as log:
            log.write(f"=== start {dt.datetime.now(dt.UTC).isoformat()}: {' '.join(self.argv)}\n".encode())
            log.flush()
            # PR_SET_PDEATHSIG follows the thread that forked: only safe from the main thread (a
            # restart from a worker thread whose thread later exits must not kill the server).
            in_main_thread = threading.current_thread() is threading.main_thread()
            self.popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent if in_main_thread else None,
            )

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError(f"no VmRSS for {self.name}")

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _last_run(self) -> str:
        return self.log_path.read_text(errors="replace").rsplit("=== start ", 1)[-1]

    def terminate(self) -> None:
        """SIGTERM, not waiting (:meth:`stop` waits)."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM, SIGKILL after ``timeout``; always reaped."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        with self.log_path.open("ab") as log:
            log.write(f"=== exited {self.popen.returncode}\n".encode())

    def wait_ready(self, probe: _Probe, what: str, timeout: float = START_TIMEOUT) -> None:
        """Poll ``probe`` until it answers True; fail with the log tail if the process exits first or
        the deadline passes."""
        last = "no answer yet"

        def ready() -> bool:
            nonlocal last
            if not self.running:
                code = self.popen.returncode if self.popen else None
                failure = PortTaken if "address already in use" in self._last_run() else RuntimeError
                raise failure(f"{self.name} exited ({code}) before {what}:\n{self.tail()}")
            answered, last = probe()
            return answered

        poll_until(
            ready,
            timeout=timeout,
            interval=POLL,
            message=lambda: f"{self.name}: not {what} within {timeout:g}s (last: {last}):\n{self.tail()}",
            error=RuntimeError,
        )


def _http_probe(url: str, context: ssl.SSLContext | None = None) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            body = response.read().decode(errors="replace")
            return response.status == 200, f"{response.status} {body[:200]}"
    except urllib.error.HTTPError as exc:
        return False, f"{exc.code} {exc.read().decode(errors='replace')[:500]}"
    except (OSError, ssl.SSLError) as exc:
        return False, repr(exc)


class Etcd:
    """One etcd for every simulated cluster (each API server stores under its own prefix)."""

    def __init__(self, binary: Path, directory: Path) -> None:
        self.binary = binary
        self.directory = directory
        self.process = ServerProcess("etcd", [], directory)
        self.url = ""

    def _argv(self) -> list[str]:
        self.url = f"http://127.0.0.1:{free_port()}"
        peer = f"http://127.0.0.1:{free_port()}"
        return [
            str(self.binary),
            "--name=default",
            f"--data-dir={self.directory / 'etcd-data'}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]

    def start(self) -> None:
        """Start on free ports (others if one was taken meanwhile); return once healthy."""
        for attempt in range(PORT_ATTEMPTS):
            self.process.argv = self._argv()
            self.process.start()
            try:
                self.process.wait_ready(lambda: _http_probe(f"{self.url}/health"), "healthy")
                return
            except PortTaken:
                if attempt == PORT_ATTEMPTS - 1:
                    raise


@dataclass
class KubeCluster:
    """One simulated cluster: a kube-apiserver on loopback over the shared etcd, under
    ``--etcd-prefix=/<name>``. ``restart()`` keeps its port, certificates and data."""

    name: str
    port: int
    directory: Path
    ca_path: Path
    admin: CertPair
    admin_token: str
    kubeconfig: Path
    process: ServerProcess
    kubectl_binary: str | None = None
    _ssl: ssl.SSLContext | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def admin_ssl_context(self) -> ssl.SSLContext:
        """Trusts the cluster's CA and presents the admin client certificate."""
        if self._ssl is None:
            context = ssl.create_default_context(cafile=str(self.ca_path))
            context.load_cert_chain(str(self.admin.cert), str(self.admin.key))
            self._ssl = context
        return self._ssl

    def api_client(self) -> ApiClient:
        """A ``kubernetes.client.ApiClient`` from the admin kubeconfig (close it when done)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def kubectl(
        self, *args: str, input: str | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """The machine's kubectl as the cluster admin; check ``returncode`` yourself."""
        assert self.kubectl_binary, (
            "kubectl is not installed: run scripts/bootstrap.sh (apt kubernetes-client)"
        )
        return subprocess.run(
            [
                self.kubectl_binary,
                f"--kubeconfig={self.kubeconfig}",
                f"--cache-dir={self.directory / 'kubectl-cache'}",
                *args,
            ],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def readyz(self) -> tuple[bool, str]:
        return _http_probe(f"{self.url}/readyz", self.admin_ssl_context())

    def start(self, timeout: float = START_TIMEOUT) -> None:
        self.process.start()
        self.process.wait_ready(self.readyz, "ready (/readyz)", timeout)

    def move_to(self, port: int) -> None:
        """Listen on ``port`` from the next start on (the kubeconfig follows)."""
        self.port = port
        self.process.argv = [
            f"--secure-port={port}" if arg.startswith("--secure-port=") else arg for arg in self.process.argv
        ]
        self.kubeconfig.write_text(_kubeconfig(self.name, self.url, self.ca_path, self.admin))

    def stop(self) -> None:
        self.process.stop()

    def restart(self) -> None:
        """Stop the API server (SIGTERM) and start it again on the same port over the same data."""
        self.stop()
        self.start()

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return self.process.tail(lines)


def _kubeconfig(cluster: str, url: str, ca: Path, admin: CertPair) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": cluster, "cluster": {"server": url, "certificate-authority": str(ca)}}],
            "users": [
                {
                    "name": f"{cluster}-admin",
                    "user": {"client-certificate": str(admin.cert), "client-key": str(admin.key)},
                }
            ],
            "contexts": [{"name": cluster, "context": {"cluster": cluster, "user": f"{cluster}-admin"}}],
            "current-context": cluster,
        },
        sort_keys=False,
    )


def _service_account_keys(directory: Path) -> tuple[Path, Path]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = directory / "service-account.pub"
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return _write_key(key, directory / "service-account.key"), public


def _prepare_cluster(
    name: str, binary: Path, directory: Path, ca: ThrowawayCA, front_proxy: ThrowawayCA
) -> KubeCluster:
    """Certificates, keys, kubeconfig and command line of one cluster's API server (its
    ``--etcd-servers`` is added once etcd runs)."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    serving = ca.issue(
        f"{name}-serving",
        f"{name}-kube-apiserver",
        dns_names=["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"],
        ip_addresses=["127.0.0.1", "::1", "10.0.0.1"],
        server=True,
    )
    admin = ca.issue(f"{name}-admin", "cluster-admin", organizations=["system:masters"])
    proxy_client = front_proxy.issue(f"{name}-front-proxy-client", "front-proxy-client")
    sa_key, sa_public = _service_account_keys(directory)
    admin_token = hashlib.sha256(os.urandom(32)).hexdigest()
    tokens = directory / "tokens.csv"
    tokens.write_text(f'{admin_token},token-admin,token-admin,"system:masters"\n')
    tokens.chmod(0o600)
    argv = [
        str(binary),
        f"--etcd-prefix=/{name}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        "--advertise-address=127.0.0.1",
        "--endpoint-reconciler-type=none",
        f"--cert-dir={directory}",
        f"--tls-cert-file={serving.cert}",
        f"--tls-private-key-file={serving.key}",
        f"--client-ca-file={ca.path}",
        f"--token-auth-file={tokens}",
        # its own URL: an OIDC issuer whose discovery (/.well-known/openid-configuration) and keys
        # (/openid/v1/jwks) a relying party can fetch (tests/kube/test_service_proxy_oidc.py); fixed at
        # the first port (a cluster moved with move_to keeps it, and keeps its tokens valid)
        f"--service-account-issuer=https://127.0.0.1:{port}",
        f"--service-account-key-file={sa_public}",
        f"--service-account-signing-key-file={sa_key}",
        "--service-cluster-ip-range=10.0.0.0/24",
        "--authorization-mode=RBAC",
        # Aggregated APIs (APIService) work: the API server proxies to them with this identity.
        f"--requestheader-client-ca-file={front_proxy.path}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={proxy_client.cert}",
        f"--proxy-client-key-file={proxy_client.key}",
        "--profiling=false",
        "--v=1",
    ]
    kubeconfig = directory / "admin.kubeconfig"
    kubeconfig.write_text(_kubeconfig(name, f"https://127.0.0.1:{port}", ca.path, admin))
    return KubeCluster(
        name=name,
        port=port,
        directory=directory,
        ca_path=ca.path,
        admin=admin,
        admin_token=admin_token,
        kubeconfig=kubeconfig,
        process=ServerProcess(f"kube-apiserver-{name}", argv, directory),
        kubectl_binary=shutil.which("kubectl"),
    )


class KubeClusters:
    """etcd and one kube-apiserver per name, all on loopback under ``directory``; a context manager
    (``with KubeClusters(dir) as clusters: clusters["hub"]...``) that stops everything on exit."""

    def __init__(
        self, directory: Path, names: Sequence[str] = CLUSTER_NAMES, built: Binaries | None = None
    ) -> None:
        self.directory = directory
        self.binaries = built or binaries()
        self.ca = ThrowawayCA(directory / "pki", "kube-ca")
        self.front_proxy_ca = ThrowawayCA(directory / "pki", "front-proxy-ca")
        self.etcd = Etcd(self.binaries.etcd, directory)
        self.clusters = {
            name: _prepare_cluster(
                name, self.binaries.kube_apiserver, directory / name, self.ca, self.front_proxy_ca
            )
            for name in names
        }

    def __getitem__(self, name: str) -> KubeCluster:
        return self.clusters[name]

    def __iter__(self) -> Iterator[KubeCluster]:
        return iter(self.clusters.values())

    def start(self) -> None:
        """etcd, then every API server started together and each awaited until ready."""
        self.etcd.start()
        for cluster in self:
            cluster.process.argv.append(f"--etcd-servers={self.etcd.url}")
            cluster.process.start()
        for cluster in self:
            for attempt in range(PORT_ATTEMPTS):
                try:
                    cluster.process.wait_ready(cluster.readyz, "ready (/readyz)")
                    break
                except PortTaken:
                    if attempt == PORT_ATTEMPTS - 1:
                        raise
                    cluster.move_to(free_port())
                    cluster.process.start()

    def stop(self) -> None:
        """Every API server at once (each takes about a second to shut down), then etcd."""
        for cluster in self:
            cluster.process.terminate()
        for cluster in self:
            cluster.stop()
        self.etcd.process.stop()

    def __enter__(self) -> KubeClusters:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def logs(self, lines: int = LOG_TAIL_LINES) -> dict[str, str]:
        """The tail of every server's log, by process name."""
        processes = [self.etcd.process, *(c.process for c in self)]
        return {p.name: p.tail(lines) for p in processes}


def install_crds(cluster: KubeCluster, directory: Path | None = None, timeout: float = 60.0) -> list[str]:
    """Apply every ``*.yaml`` CRD of ``directory`` (server-side: the big OCM CRDs exceed the
    last-applied annotation's size) and wait until each is Established; returns their names. Without
    ``directory``: OCM's own hub CRDs at the real platform's version (:func:`ocmbuild.crds_for_test_hubs`)."""
    if directory is None:
        from tests.support.ocmbuild import crds_for_test_hubs  # it imports this module

        directory = crds_for_test_hubs()
    files = sorted(directory.glob("*.yaml"))
    assert files, f"no CRD manifests in {directory}"
    names = [yaml.safe_load(f.read_text())["metadata"]["name"] for f in files]
    file_args = [arg for f in files for arg in ("-f", str(f))]
    applied = cluster.kubectl("apply", "--server-side", "--force-conflicts", *file_args, timeout=timeout)
    assert applied.returncode == 0, f"kubectl apply of the CRDs in {directory} failed:\n{applied.stderr}"
    waited = cluster.kubectl(
        "wait",
        "--for=condition=Established",
        f"--timeout={timeout:g}s",
        *(f"crd/{n}" for n in names),
        timeout=timeout + 10,
    )
    assert waited.returncode == 0, f"CRDs not Established on {cluster.name}:\n{waited.stdout}{waited.stderr}"
    return names


# --- command line ---------------------------------------------------------------------------------------


def _build_command() -> None:
    for name, build in (("etcd", etcd_binary), ("kube-apiserver", kube_apiserver_binary)):
        version = ETCD_VERSION if name == "etcd" else KUBE_VERSION
        print(f"{name} {version}: building or finding it in {tool_cache() / 'kube'} ...", flush=True)
        started = time.monotonic()
        path = build()
        print(f"{name} {version}: {path} ({time.monotonic() - started:.1f}s)", flush=True)


def _up_command(directory: Path | None) -> None:
    directory = directory or Path(tempfile.mkdtemp(prefix="cluster-proxy-kube-"))
    directory.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with KubeClusters(directory) as clusters:
        install_crds(clusters["hub"])
        print(f"etcd + {len(clusters.clusters)} API servers ready in {time.monotonic() - started:.1f}s")
        for cluster in clusters:
            print(f"  {cluster.name}: {cluster.url}  KUBECONFIG={cluster.kubeconfig}")
        print("Ctrl-C (or SIGTERM) stops them.", flush=True)
        stopped = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stopped.set())
        while not stopped.is_set():
            signal.pause()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.kubeapi", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="build (or find) etcd and kube-apiserver; print their paths and times")
    up = commands.add_parser("up", help="run etcd and the hub, cluster1, cluster2 API servers until Ctrl-C")
    up.add_argument("--dir", type=Path, help="state directory (default: a new temporary one)")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            _build_command()
        else:
            _up_command(args.dir)
    except (pytest.skip.Exception, pytest.fail.Exception, AssertionError, RuntimeError) as exc:
        # A missing Go toolchain surfaces as pytest's skip (tests.support.require): say it plainly.
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
