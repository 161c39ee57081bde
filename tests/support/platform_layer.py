"""The pytest side of the real clusters (:mod:`tests.support.realclusters`): the session-scoped
``real_clusters`` fixture, the build before the first test, the layer's prerequisites, and the
``platform`` marker's rule that keeps these tests out of every run that does not ask for them
(``-m platform``; ``./scripts/task test-platform``, a lane of ``./scripts/task test``).

Prerequisites: root, Go, the programs the nodes run, and the project's images (the compose layer's,
``scripts/compose.sh images``: the install tests import them into the nodes). A missing one skips
every test of the layer on a laptop and fails it under ``CI=true``, where the images are built
before the first test when missing (in ``./scripts/task test`` the compose layer of the slow lane,
which runs before, has built them already: they are the tree's).

Use from a conftest: ``from tests.support.platform_layer import *  # noqa: F403``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import kubebuild, nodeimages, require
from tests.support.nodenet import PREFIX, differences, machine_state
from tests.support.realclusters import RealClusters, build_everything

FIXTURE = "real_clusters"
MARKER = "platform"
IMAGES_LOG = "platform-images.log"  # in the tool cache: scripts/compose.sh images, when run from here
IMAGES = pytest.StashKey[str | None]()  # None: the project's images are there; else why not

__all__ = [
    "left_behind",
    "platform_prerequisites",
    "pytest_collection_finish",
    "pytest_collection_modifyitems",
    "real_clusters",
]


# A set's tag in the names of what it puts on the machine: netns cpn-<tag>-hub, links cpn<tag>0,
# chains CPN-<tag>, /var/lib/cpn-<tag>, cgroups cpn-<tag>-hub, CNI results cpn-<tag>-hub-<id>-eth0.
SET_TAG = re.compile(rf"(?i)\b{PREFIX}-?([0-9a-f]{{4}})")
POD_NETNS = re.compile(r"\bcni-[0-9a-f-]{36}\b")  # a pod's network namespace (containerd's CRI)
POD_ARTEFACTS = ("/var/log/containers/", "/var/log/pods/", "/var/lib/cni/results/")
# Where a set's own untagged items can be, per kind of item: elsewhere an untagged one is another
# session's (a mount of a benchmark's root, a namespace or link of another test). None: nowhere (all
# of a set's links, addresses and host routes carry its tag). Other kinds count whole.
UNTAGGED_OURS: dict[str, re.Pattern[str] | None] = {
    "mounts": re.compile(
        r"^(/run/netns($|/cni-)|/var/lib/(kubelet|containerd|cni)(/|$)|/run/containerd/|/sys/fs/)"
    ),
    "netns": POD_NETNS,
    "links": None,
    "addresses": None,
    "routes": None,
}
LOOPBACK_RESULT = re.compile(r"\bcni-loopback-([0-9a-f]{64})-lo$")


def _set_owners() -> dict[str, str]:
    """The set (its tag) of each pod network namespace (by the cgroups of its processes: every set's
    kubelet has a cgroup root of its own) and of each container log link (by where it points) now on
    the machine: their names carry no tag."""
    owners: dict[str, str] = {}
    for link in Path("/var/log/containers").glob("*.log"):
        try:
            if found := SET_TAG.search(os.readlink(link)):
                owners[str(link)] = found.group(1).lower()
        except OSError:
            continue
    folder = Path("/run/netns")
    for netns in folder.glob("cni-*") if folder.exists() else []:
        pids = subprocess.run(["ip", "netns", "pids", netns.name], capture_output=True, text=True).stdout
        for pid in pids.split():
            try:
                found = SET_TAG.search(Path(f"/proc/{pid}/cgroup").read_text())
            except OSError:
                continue
            if found:
                owners[netns.name] = found.group(1).lower()
                break
    return owners


def _owner(item: str, owners: dict[str, str], results: list[str]) -> str | None:
    """The tag of the set ``item`` (a line of :func:`nodenet.machine_state`) belongs to, if known."""
    if found := SET_TAG.search(item):
        return found.group(1).lower()
    if item in owners:
        return owners[item]
    if (netns := POD_NETNS.search(item)) and netns.group(0) in owners:
        return owners[netns.group(0)]
    if loopback := LOOPBACK_RESULT.search(item):  # the CNI result beside the pod's eth0 one
        for result in results:
            if loopback.group(1) in result and (found := SET_TAG.search(result.rsplit("/", 1)[-1])):
                return found.group(1).lower()
    return None


def left_behind(before: dict[str, object], after: dict[str, object], tag: str) -> dict[str, object]:
    """:func:`nodenet.differences` of two snapshots (``before`` taken before the set ``tag`` started),
    less what other sets of nodes own: other sessions of this machine run theirs at the same time,
    and start or stop them while this one runs. A pod's artefact (its network namespace, a container
    log link, a CNI result) that was there before is never this set's (its pods came later): gone, it
    was another set's, whose pod ended meanwhile. An untagged mount, namespace, link, address or
    route counts as this set's only where a set puts its own (:data:`UNTAGGED_OURS`); anything else
    no set is known to own counts as this set's."""
    owners = _set_owners()
    paths = [*before.get("paths", {}).values(), *after.get("paths", {}).values()]  # type: ignore[union-attr]
    results = [p for listing in paths for p in listing]

    def mine(item: str, gone: bool = False, kind: str = "") -> bool:
        if gone and (POD_NETNS.search(item) or item.startswith(POD_ARTEFACTS)):
            return False
        owner = _owner(item, owners, results)
        if owner is None and kind in UNTAGGED_OURS:
            where = UNTAGGED_OURS[kind]
            return where is not None and bool(where.search(item))
        return owner in (None, tag.lower())

    left: dict[str, object] = {}
    for key, change in differences(before, after).items():
        if isinstance(before[key], list):
            assert isinstance(change, dict)
            kept = {
                side: [i for i in items if mine(i, side == "removed", key)] for side, items in change.items()
            }
            if any(kept.values()):
                left[key] = kept
        elif key == "paths":
            old, new = before[key], after[key]
            assert isinstance(old, dict) and isinstance(new, dict)
            for root in old.keys() | new.keys():
                added = sorted(i for i in set(new.get(root, [])) - set(old.get(root, [])) if mine(i))
                removed = sorted(i for i in set(old.get(root, [])) - set(new.get(root, [])) if mine(i, True))
                if added or removed:
                    left.setdefault(key, {})[root] = {"added": added, "removed": removed}  # type: ignore[index]
        else:
            left[key] = change
    return left


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _selected(config: pytest.Config) -> bool:
    return MARKER in (config.getoption("markexpr", "") or "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests of this layer need root, minutes of building and about 2 GB: a run that does not name the
    marker (``-m platform``) deselects them, so the other lanes never start a node."""
    mine = [item for item in items if item.get_closest_marker(MARKER)]
    if not mine or _selected(config):
        return
    items[:] = [item for item in items if item not in mine]
    config.hook.pytest_deselected(items=mine)


def _missing_images() -> str | None:
    """Why the project's images are not usable (None when every one the overlays name is there)."""
    if shutil.which("docker") is None:
        return "docker (the project's images: ./scripts/task images)"
    refs = [nodeimages.project_image(n) for n in (*nodeimages.HUB_IMAGES, *nodeimages.AGENT_IMAGES)]
    done = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", *refs], capture_output=True, text=True
    )
    if done.returncode != 0:
        return f"the project's images (./scripts/task images): {done.stderr.strip()}"
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build what the clusters need before the first test, outside any test's timeout (a cold build
    takes about 12 minutes on 2 cores); under ``CI=true`` the project's images too, when missing."""
    if not any(item.get_closest_marker(MARKER) for item in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    started = time.monotonic()
    missing = _missing_images()
    if missing is not None and _under_ci():
        missing = nodeimages.build_project_images(kubebuild.kube_cache() / IMAGES_LOG) or _missing_images()
    session.config.stash[IMAGES] = missing
    if shutil.which("go") is not None:
        build_everything()
    if reporter is not None:
        reporter.write_line(f"platform: programs and images ready in {time.monotonic() - started:.1f}s")


def _prerequisites(config: pytest.Config) -> None:
    require(os.geteuid() == 0, "root (real nodes: network namespaces, mounts, cgroups)")
    require(shutil.which("go") is not None, "the go toolchain (to build the kube node programs)")
    for program in ("ip", "iptables", "nsenter", "tinyproxy", "apt-get", "gcc"):
        require(shutil.which(program) is not None, f"{program} (scripts/bootstrap.sh installs it)")
    missing = config.stash.get(IMAGES, "the project's images were not looked for (no test of the layer?)")
    if missing is not None and missing.startswith("scripts/compose.sh"):
        pytest.fail(missing)  # a build that failed is a failure wherever it runs
    require(missing is None, missing or "")


@pytest.fixture(scope="session", autouse=True)
def platform_prerequisites(request: pytest.FixtureRequest) -> None:
    """Every test of the layer (those that start their own clusters too): skipped on a laptop, failed
    under ``CI=true``, when a prerequisite is missing."""
    _prerequisites(request.config)


@pytest.fixture(scope="session")
def real_clusters(
    platform_prerequisites: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealClusters]:
    """The hub, cluster1 and cluster2, each with a real node, for the whole session; its teardown
    fails the session if the machine is not left as it was found."""
    clusters = RealClusters(tmp_path_factory.mktemp("real-clusters"))
    with clusters:
        yield clusters
    assert clusters.network is not None
    left = left_behind(clusters.before, machine_state(), clusters.network.tag)
    assert not left, f"the real clusters left this on the machine: {left}"
