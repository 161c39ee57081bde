"""The programs of a real Kubernetes node, built or unpacked into the tool cache
(``${XDG_CACHE_HOME:-~/.cache}/cluster-proxy/kube``) on first use, like kube-apiserver
(:mod:`tests.support.kubeapi`): kubelet, kube-controller-manager, kube-scheduler, kube-proxy and kubectl
at kube-apiserver's version (one ``go build`` sharing their packages), the CNI plugins, CoreDNS, a
static pause program, and Debian's containerd, runc and busybox (the machine's own when installed, else
unpacked from apt's own sources).

Each result is a digest-named folder (the digest covers the Go version and what is built), written under
``<name>.partial`` and renamed once complete, so a killed build leaves nothing that looks finished; a
lock file per folder lets several test sessions ask at once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import require
from tests.support.gopeers import _go, tool_cache
from tests.support.kubeapi import KUBE_VERSION, _build_lock, _digest, _kube_ldflags, _kube_module

KUBE_NODE_COMMANDS = ("kubelet", "kube-controller-manager", "kube-scheduler", "kube-proxy", "kubectl")
CNI_VERSION = "v1.6.2"
CNI_PLUGINS = {
    "bridge": "plugins/main/bridge",
    "host-local": "plugins/ipam/host-local",
    "loopback": "plugins/main/loopback",
    "portmap": "plugins/meta/portmap",
    "firewall": "plugins/meta/firewall",
}
COREDNS_VERSION = "v1.11.3"  # the CoreDNS that Kubernetes 1.32 ships with

# The registry refuses k8s.io/endpointslice at v0.32.13 (403); v0.32.12 differs from it only in go.mod.
ENDPOINTSLICE_PIN = ("k8s.io/endpointslice v0.32.13", "k8s.io/endpointslice v0.32.12")

CNI_MODULE = f"""module clusterproxy.test/cni

go 1.23.0

require github.com/containernetworking/plugins {CNI_VERSION}
"""

COREDNS_MODULE = f"""module clusterproxy.test/coredns

go 1.23.0

require github.com/coredns/coredns {COREDNS_VERSION}
"""

# pause: PID 1 of every pod sandbox; it only has to hold the namespaces and reap (a real init would
# too), and leave on SIGTERM/SIGINT.
PAUSE_C = r"""
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void leave(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }

int main(void) {
    signal(SIGTERM, leave);
    signal(SIGINT, leave);
    signal(SIGCHLD, reap);
    for (;;) pause();
}
"""


def kube_cache() -> Path:
    return tool_cache() / "kube"


def _cached_folder(stem: str, digest: str, fill: Callable[[Path], None]) -> Path:
    """``<cache>/<stem>-<digest>``, filled by ``fill(partial_folder)`` the first time."""
    folder = kube_cache() / f"{stem}-{digest}"
    with _build_lock(folder):
        if not folder.exists():
            partial = folder.with_name(folder.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            fill(partial)
            partial.rename(folder)
    return folder


def _run(
    argv: list[str], cwd: Path, what: str, *, nice: bool = False, env: dict[str, str] | None = None
) -> str:
    done = subprocess.run(
        argv,
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        preexec_fn=(lambda: os.nice(10)) if nice else None,
    )
    assert done.returncode == 0, (
        f"{what} failed ({' '.join(argv)}):\n{done.stdout[-4000:]}{done.stderr[-8000:]}"
    )
    return done.stdout


def go_build_all(go: str, module: Path, packages: list[str], out: Path, *, ldflags: str = "") -> None:
    """One ``go build`` of several main packages into ``out/`` (shared packages compile once), at a
    lower CPU priority, without cgo (static binaries)."""
    _run(
        [go, "build", "-mod=mod", "-trimpath", f"-ldflags={ldflags}", "-o", f"{out}/", *packages],
        module,
        f"go build {' '.join(packages)}",
        nice=True,
        env={"CGO_ENABLED": "0"},
    )


def _module_dir(folder_name: str, go_mod: str) -> Path:
    module = kube_cache() / f"{folder_name}-module"
    module.mkdir(parents=True, exist_ok=True)
    (module / "go.mod").write_text(go_mod)
    return module


# --- Kubernetes node binaries ------------------------------------------------------------------------


@dataclass(frozen=True)
class KubeNodeBinaries:
    kubelet: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kube_proxy: Path
    kubectl: Path


def kube_node_binaries() -> KubeNodeBinaries:
    """kubelet, kube-controller-manager, kube-scheduler, kube-proxy and kubectl at ``KUBE_VERSION``
    (about 6.5 min of 2-core time cold, seconds when Go's build cache is warm)."""
    go, go_version = _go("the Kubernetes node binaries")
    ldflags = _kube_ldflags(KUBE_VERSION)
    digest = _digest(go_version, KUBE_VERSION, " ".join(KUBE_NODE_COMMANDS), ldflags, *ENDPOINTSLICE_PIN)

    def fill(out: Path) -> None:
        module = _module_dir(f"kube-node-{digest}", "module clusterproxy.test/kube-node\n\ngo 1.23.0\n")
        go_mod = _kube_module(go, module).replace(*ENDPOINTSLICE_PIN)
        (module / "go.mod").write_text(
            go_mod.replace("clusterproxy.test/kube-apiserver", "clusterproxy.test/kube-node")
        )
        packages = [f"k8s.io/kubernetes/cmd/{c}" for c in KUBE_NODE_COMMANDS]
        _run([go, "get", *(f"{p}@{KUBE_VERSION}" for p in packages)], module, "go get the kube node commands")
        go_build_all(go, module, packages, out, ldflags=ldflags)

    folder = _cached_folder("kube-node", digest, fill)
    return KubeNodeBinaries(*(folder / c for c in KUBE_NODE_COMMANDS))


def cni_plugins() -> Path:
    """The folder of the CNI plugins (bridge, host-local, loopback, portmap, firewall) at
    ``CNI_VERSION``: kubelet's ``--cni-bin-dir`` (containerd's ``bin_dir``)."""
    go, go_version = _go("the CNI plugins")
    digest = _digest(go_version, CNI_MODULE, " ".join(CNI_PLUGINS))

    def fill(out: Path) -> None:
        module = _module_dir(f"cni-{digest}", CNI_MODULE)
        packages = [f"github.com/containernetworking/plugins/{p}" for p in CNI_PLUGINS.values()]
        go_build_all(go, module, packages, out)

    return _cached_folder("cni", digest, fill)


def coredns_binary() -> Path:
    """CoreDNS at ``COREDNS_VERSION`` (3-4 min cold)."""
    go, go_version = _go("CoreDNS")
    digest = _digest(go_version, COREDNS_MODULE)

    def fill(out: Path) -> None:
        module = _module_dir(f"coredns-{digest}", COREDNS_MODULE)
        go_build_all(go, module, ["github.com/coredns/coredns"], out)

    return _cached_folder("coredns", digest, fill) / "coredns"


def pause_binary() -> Path:
    """A static pause program (gcc -static), the process each pod sandbox holds its namespaces with."""
    gcc = shutil.which("gcc")
    require(gcc is not None, "gcc (to build the pod sandbox's pause program)")
    assert gcc is not None
    digest = _digest(PAUSE_C, subprocess.run([gcc, "--version"], capture_output=True, text=True).stdout)

    def fill(out: Path) -> None:
        (out / "pause.c").write_text(PAUSE_C)
        _run([gcc, "-static", "-O2", "-s", "-o", str(out / "pause"), str(out / "pause.c")], out, "gcc pause")

    return _cached_folder("pause", digest, fill) / "pause"


# --- Debian packages ------------------------------------------------------------------------------------


def _apt_version(package: str) -> str:
    shown = subprocess.run(
        ["apt-cache", "show", "--no-all-versions", package], capture_output=True, text=True
    ).stdout
    for line in shown.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    require(False, f"Debian package {package} (apt-get update first?)")
    raise AssertionError  # unreachable: require skipped or failed


def debian_package(package: str) -> Path:
    """The root of Debian's ``package`` unpacked into the tool cache (``apt-get download`` from apt's
    own sources, ``dpkg-deb -x``): works beside an apt that holds the install lock, and installs
    nothing into the machine."""
    unpacked = sorted(kube_cache().glob(f"deb-{package}-*/root"), key=lambda p: p.stat().st_mtime)
    if unpacked:  # any version will do: asking apt which is current takes seconds on a busy machine
        return unpacked[-1]
    require(shutil.which("apt-get") is not None, f"apt-get (to fetch Debian's {package})")
    version = _apt_version(package)
    digest = _digest(package, version)

    def fill(out: Path) -> None:
        _run(["apt-get", "download", f"{package}={version}"], out, f"apt-get download {package}")
        (deb,) = out.glob("*.deb")
        _run(["dpkg-deb", "-x", str(deb), str(out / "root")], out, f"dpkg-deb -x {deb.name}")
        deb.unlink()

    return _cached_folder(f"deb-{package}", digest, fill) / "root"


@dataclass(frozen=True)
class ContainerRuntime:
    containerd: Path
    ctr: Path
    shim: Path  # containerd-shim-runc-v2: containerd finds it on its PATH
    runc: Path


def container_runtime() -> ContainerRuntime:
    """Debian's containerd and runc: the installed ones, else unpacked into the tool cache."""
    names = ("containerd", "ctr", "containerd-shim-runc-v2")
    found = [shutil.which(n) for n in names]
    if all(found):
        containerd, ctr, shim = (Path(p) for p in found if p)
    else:
        root = debian_package("containerd") / "usr" / "bin"
        containerd, ctr, shim = (root / n for n in names)
    runc_path = shutil.which("runc")
    runc = Path(runc_path) if runc_path else debian_package("runc") / "usr" / "sbin" / "runc"
    return ContainerRuntime(containerd=containerd, ctr=ctr, shim=shim, runc=runc)


def busybox() -> Path:
    """A static busybox (Debian's busybox-static): the shell, HTTP server and DNS client of the test
    pods' image."""
    return debian_package("busybox-static") / "bin" / "busybox"


# --- command line ---------------------------------------------------------------------------------------


def _everything() -> list[tuple[str, Callable[[], object]]]:
    from tests.support import kubeapi, nodeimages, ocmbuild

    return [
        (f"etcd {kubeapi.ETCD_VERSION}", kubeapi.etcd_binary),
        (f"kube-apiserver {KUBE_VERSION}", kubeapi.kube_apiserver_binary),
        (f"{', '.join(KUBE_NODE_COMMANDS)} {KUBE_VERSION}", kube_node_binaries),
        (f"CNI plugins {CNI_VERSION}", cni_plugins),
        (f"CoreDNS {COREDNS_VERSION}", coredns_binary),
        ("pause", pause_binary),
        ("containerd, runc", container_runtime),
        ("busybox", busybox),
        ("node images (pause, busybox, CoreDNS)", lambda: nodeimages.all_images()[0].parent),
        (f"OCM {ocmbuild.OCM_VERSION}", ocmbuild.ocm_binaries),
        (f"OCM {ocmbuild.OCM_VERSION} CRDs", lambda: ocmbuild.hub_crds()[0].parent),
    ]


def _describe(built: object) -> str:
    """A path, or the paths of a dataclass of paths (one folder when they share it)."""
    if isinstance(built, Path):
        return str(built)
    paths = [Path(p) for p in vars(built).values()]
    folders = {p.parent for p in paths}
    if len(folders) == 1:
        return f"{folders.pop()}/{{{','.join(p.name for p in paths)}}}"
    return " ".join(str(p) for p in paths)


def main(argv: list[str] | None = None) -> None:
    """``build``: build (or find) every program of the real-cluster tests; print paths and times."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["build"]:
        sys.exit("usage: python -m tests.support.kubebuild build")
    total = time.monotonic()
    try:
        for what, build in _everything():
            print(f"{what}: building or finding it in {kube_cache()} ...", flush=True)
            started = time.monotonic()
            built = build()
            print(f"{what}: {_describe(built)} ({time.monotonic() - started:.1f}s)", flush=True)
    except (pytest.skip.Exception, pytest.fail.Exception, AssertionError) as exc:
        sys.exit(f"error: {exc}")
    print(f"all built or found in {time.monotonic() - total:.1f}s", flush=True)


if __name__ == "__main__":
    main()
