"""Real Kubernetes API servers for the tests under tests/kube.

Usage (the fixture is session-scoped: one etcd and three API servers for the whole run)::

    import pytest
    from tests.support.kubeapi import KubeClusters

    pytestmark = pytest.mark.slow

    def test_something(kube_clusters: KubeClusters) -> None:
        hub = kube_clusters["hub"]  # also "cluster1", "cluster2"
        hub.name, hub.url, hub.port      # "hub", "https://127.0.0.1:<port>", <port>
        hub.ca_path, hub.kubeconfig      # the CA that signs its serving cert; admin kubeconfig file
        hub.admin_token                  # a static bearer token in system:masters
        with hub.api_client() as api:    # kubernetes.client.ApiClient as the admin
            kubernetes.client.CoreV1Api(api).list_namespace()
        done = hub.kubectl("get", "ns", "-o", "name")  # CompletedProcess (text); check returncode
        hub.restart()                    # same port and data; returns once /readyz answers
        hub.stop(); hub.start()          # the same, with the server down in between

OCM's own hub CRDs (those the addon-manager reads, from the OCM module the real platform runs:
``tests.support.ocmbuild.crds_for_test_hubs``) are installed and Established on the hub. Every test
shares the clusters: name what you create uniquely (a namespace per test) and delete it (a namespace stays
Terminating forever: no controller-manager runs). No pod ever runs (no kubelet/scheduler), and no
``default`` ServiceAccount appears by itself. ``tests.support.kubeapi.install_crds(cluster, dir)``
installs other CRDs. Binaries missing from the tool cache are built before the first test runs (about
8 min on 2 cores, once per machine: ``./scripts/task kube-peers`` does it ahead); without Go the tests
skip, and fail under CI=true. When a test using the fixture fails, the tail of every API server's and
etcd's log is attached to its report.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Generator, Iterator

import pytest

from tests.support import kubeapi, ocmbuild, require
from tests.support.kubeapi import KubeClusters, install_crds

FIXTURE = "kube_clusters"
RUNNING = pytest.StashKey[KubeClusters]()


def _uses_clusters(item: pytest.Item) -> bool:
    return FIXTURE in getattr(item, "fixturenames", ())


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kube_early: runs first in the session (it starts a long wait a kube_last test ends)"
    )
    config.addinivalue_line(
        "markers", "kube_last: runs last in the session (it ends a wait a kube_early test started)"
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on the real API servers carry the ``kube`` marker (``-m kube`` selects them). ``kube_early``
    tests move to the start of the session and ``kube_last`` tests to its end, each group in collection
    order: a wait that only real time ends (a 10-minute token's expiry) then runs beside every other
    test instead of after them (the API servers, session-scoped, are up from the first test then)."""
    for item in items:
        if _uses_clusters(item):
            item.add_marker(pytest.mark.kube)
    last = [item for item in items if item.get_closest_marker("kube_last")]
    early = [item for item in items if item.get_closest_marker("kube_early") and item not in last]
    if last or early:
        items[:] = [*early, *(item for item in items if item not in last and item not in early), *last]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build missing binaries and fetch OCM's CRDs before the first test, outside any test's timeout (a
    cold build takes minutes). Without Go nothing happens here: the fixture then skips, or fails under
    CI=true."""
    if not any(_uses_clusters(item) for item in session.items) or shutil.which("go") is None:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    started = time.monotonic()
    built = kubeapi.binaries()
    ocmbuild.crds_for_test_hubs()
    if reporter is not None and time.monotonic() - started > 5:
        reporter.write_line(
            f"kube: built etcd and kube-apiserver in {time.monotonic() - started:.0f}s ({built.etcd.parent})"
        )


@pytest.fixture(scope="session")
def kube_clusters(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KubeClusters]:
    """etcd and the hub, cluster1 and cluster2 API servers, ready, the OCM CRDs on the hub."""
    require(
        shutil.which("kubectl") is not None,
        "kubectl (apt-get install kubernetes-client, as scripts/bootstrap.sh does)",
    )
    clusters = KubeClusters(tmp_path_factory.mktemp("kube"), built=kubeapi.binaries())
    with clusters:
        request.config.stash[RUNNING] = clusters
        install_crds(clusters["hub"])
        yield clusters
    del request.config.stash[RUNNING]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    clusters = item.config.stash.get(RUNNING, None)
    if report.failed and clusters is not None and _uses_clusters(item):
        for name, tail in clusters.logs().items():
            report.sections.append((f"{name} log (last lines)", tail))
    return report
