"""Open Cluster Management's own programs and CRDs for tests, built from ``open-cluster-management.io/ocm``
into the tool cache on first use (like the kube binaries, :mod:`tests.support.kubebuild`).

The registry serves the module's zips at v1.0.0 and v1.2.0 only (v1.0.1, v1.0.2, v1.1.x: 403). v1.0.0 is
built: its Kubernetes libraries (0.32) match our kube-apiserver (1.32). One ``go build`` makes:

- ``registration``: the hub's cluster manager (``controller``) and the klusterlet's registration agent
  (``agent``);
- ``work``: the klusterlet's work agent (``agent``) and the hub's ManifestWorkReplicaSet manager;
- ``addon``: the hub's addon manager (``manager``);
- ``placement``: the hub's placement controller (``controller``).

The CRDs come from the same module's ``manifests/`` (the hub's under ``cluster-manager/hub``, a managed
cluster's under ``klusterlet/managed``), so they always match the programs. :func:`crds_for_test_hubs` is
the part of them the tests on bare API servers (tests/kube) install on their hub, copied into the tool
cache once.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support.gopeers import _go
from tests.support.kubeapi import _digest
from tests.support.kubebuild import _cached_folder, _module_dir, go_build_all

OCM_MODULE_PATH = "open-cluster-management.io/ocm"
OCM_VERSION = "v1.0.0"
OCM_COMMANDS = ("registration", "work", "addon", "placement")

OCM_MODULE = f"""module clusterproxy.test/ocm

go 1.23.6

require {OCM_MODULE_PATH} {OCM_VERSION}
"""


def _ldflags() -> str:
    major, minor = OCM_VERSION.removeprefix("v").split(".")[:2]
    stamps = {"versionFromGit": OCM_VERSION, "majorFromGit": major, "minorFromGit": minor}
    return "-s -w " + " ".join(f"-X {OCM_MODULE_PATH}/pkg/version.{k}={v}" for k, v in stamps.items())


@dataclass(frozen=True)
class OcmBinaries:
    registration: Path
    work: Path
    addon: Path
    placement: Path


def ocm_binaries() -> OcmBinaries:
    """OCM's registration, work, addon and placement programs at ``OCM_VERSION`` (about 10 min of
    2-core time cold: its Kubernetes libraries differ from kube-apiserver's, nothing is shared)."""
    go, go_version = _go("Open Cluster Management")
    digest = _digest(go_version, OCM_MODULE, " ".join(OCM_COMMANDS), _ldflags())

    def fill(out: Path) -> None:
        module = _module_dir(f"ocm-{digest}", OCM_MODULE)
        # OCM's own go.sum: the checksum database does not know every pseudo-version OCM requires
        # (sigs.k8s.io/about-api's answers 404), and these are the sums OCM was built and tested with
        shutil.copyfile(ocm_source() / "go.sum", module / "go.sum")
        packages = [f"{OCM_MODULE_PATH}/cmd/{c}" for c in OCM_COMMANDS]
        go_build_all(go, module, packages, out, ldflags=_ldflags())

    folder = _cached_folder("ocm", digest, fill)
    return OcmBinaries(*(folder / c for c in OCM_COMMANDS))


def ocm_source() -> Path:
    """The module's source folder in Go's module cache (downloaded when missing)."""
    go, _ = _go("Open Cluster Management's manifests")
    listed = subprocess.run(
        [go, "mod", "download", "-json", f"{OCM_MODULE_PATH}@{OCM_VERSION}"],
        capture_output=True,
        text=True,
        cwd=_module_dir("ocm-source", OCM_MODULE),
    )
    assert listed.returncode == 0, f"go mod download {OCM_MODULE_PATH}@{OCM_VERSION}:\n{listed.stderr}"
    return Path(json.loads(listed.stdout)["Dir"])


def hub_crds() -> list[Path]:
    """OCM's CRDs of a hub (ManagedCluster, ManifestWork, ClusterManagementAddOn, ...), in their
    install order."""
    return sorted((ocm_source() / "manifests" / "cluster-manager" / "hub").glob("*.crd.yaml"))


#: What the addon-manager reads and writes on a hub (tests/kube installs these on theirs): not every hub
#: CRD, since OCM's ClusterProfile CRD would stand in the way of the one tests/kube/test_cluster_profile.py
#: installs from deploy/kustomize/base/crds, and the rest has no reader in this project.
CRDS_FOR_TEST_HUBS = (
    "0000_00_addon.open-cluster-management.io_clustermanagementaddons.crd.yaml",
    "0000_00_clusters.open-cluster-management.io_managedclusters.crd.yaml",
    "0000_00_work.open-cluster-management.io_manifestworks.crd.yaml",
    "0000_01_addon.open-cluster-management.io_managedclusteraddons.crd.yaml",
    "0000_02_addon.open-cluster-management.io_addondeploymentconfigs.crd.yaml",
)


def crds_for_test_hubs() -> Path:
    """A folder of the tool cache holding :data:`CRDS_FOR_TEST_HUBS` from the module's hub manifests at
    ``OCM_VERSION`` (the real platform's OCM). Cold, the module is downloaded first (``go mod download``:
    without Go the caller skips, and fails under CI=true; a failed download fails); warm, nothing runs."""

    def fill(out: Path) -> None:
        hub = ocm_source() / "manifests" / "cluster-manager" / "hub"
        for name in CRDS_FOR_TEST_HUBS:
            shutil.copyfile(hub / name, out / name)  # the module cache's files are read-only
            (out / name).chmod(0o644)

    return _cached_folder("ocm-crds", _digest(OCM_MODULE_PATH, OCM_VERSION, *CRDS_FOR_TEST_HUBS), fill)


def managed_crds() -> list[Path]:
    """OCM's CRDs of a managed cluster (AppliedManifestWork, ClusterClaim, ...)."""
    return sorted((ocm_source() / "manifests" / "klusterlet" / "managed").glob("*crd.yaml"))
