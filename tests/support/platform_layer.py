"""The pytest side of the real clusters (:mod:`tests.support.realclusters`): the session-scoped
``real_clusters`` fixture, the build before the first test, and the ``platform`` marker's rule that
keeps these tests out of every run that does not ask for them (``-m platform``).

Use from a conftest: ``from tests.support.platform_layer import *  # noqa: F403``.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator

import pytest

from tests.support import require
from tests.support.nodenet import differences, machine_state
from tests.support.realclusters import RealClusters, build_everything

FIXTURE = "real_clusters"
MARKER = "platform"

__all__ = ["pytest_collection_finish", "pytest_collection_modifyitems", "real_clusters"]


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


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build what the clusters need before the first test, outside any test's timeout (a cold build
    takes about 10 minutes on 2 cores)."""
    if not any(item.get_closest_marker(MARKER) for item in session.items) or shutil.which("go") is None:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    started = time.monotonic()
    build_everything()
    if reporter is not None:
        reporter.write_line(f"platform: programs and images ready in {time.monotonic() - started:.1f}s")


def _prerequisites() -> None:
    require(os.geteuid() == 0, "root (real nodes: network namespaces, mounts, cgroups)")
    require(shutil.which("go") is not None, "the go toolchain (to build the kube node programs)")
    for program in ("ip", "iptables", "nsenter", "tinyproxy", "apt-get", "gcc"):
        require(shutil.which(program) is not None, f"{program} (scripts/bootstrap.sh installs it)")


@pytest.fixture(scope="session")
def real_clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealClusters]:
    """The hub, cluster1 and cluster2, each with a real node, for the whole session; its teardown
    fails the session if the machine is not left as it was found."""
    _prerequisites()
    clusters = RealClusters(tmp_path_factory.mktemp("real-clusters"))
    with clusters:
        yield clusters
    left = differences(clusters.before, machine_state())
    assert not left, f"the real clusters left this on the machine: {left}"
