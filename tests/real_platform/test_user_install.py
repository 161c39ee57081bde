"""The addon installed as a user installs it, on the real clusters with real OCM: the project's images
(the compose layer's) imported into each node's containerd, ``kubectl apply -k`` of the hub overlays,
the addon enabled for cluster1 as ``clusteradm addon enable`` does, OCM's own work agent applying
our ManifestWork, our agent on cluster1's node holding its tunnel to the proxy-server on the hub's
node, the addon Available (written by our addon-manager, ``healthCheck.mode: Customized``), the
health-collector's probe of cluster1's real kube-apiserver through the tunnel; then disabled and
uninstalled, leaving nothing of ours. The steps are :mod:`tests.support.realinstall`'s.

Needs the project's images: ``bash scripts/compose.sh images``. Runs after ``test_real_ocm`` in a
session (the clusters are joined once: :func:`realocm.join_all`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support import realocm
from tests.support.realclusters import DIRECT, HUB, PROXIED, RealClusters
from tests.support.realinstall import (
    agent_running,
    disable,
    enable,
    enroll,
    import_images,
    install_hub,
    kube_apiserver_version,
    probed_healthy,
    uninstall,
    wait_available,
    wait_for,
)

pytestmark = [pytest.mark.platform, pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_addon_installed_enabled_and_removed_as_a_user_does(
    real_clusters: RealClusters, tmp_path: Path
) -> None:
    hub, managed = real_clusters[HUB], real_clusters[DIRECT]
    times: dict[str, float] = {}
    started = time.monotonic()
    realocm.join_all(real_clusters, tmp_path)
    times["joined"] = time.monotonic() - started

    import_images(real_clusters)  # docker save, cached by image ID
    times["images"] = time.monotonic() - started
    install_hub(hub)  # docs/kubernetes.md, "Installing the hub"
    times["hub installed"] = time.monotonic() - started

    # enable for cluster1, as `clusteradm addon enable --names cluster-proxy --clusters cluster1`
    enable(hub, DIRECT)
    agent_running(managed)
    addon = wait_available(hub, DIRECT)
    assert addon["status"]["healthCheck"]["mode"] == "Customized", addon["status"]
    # Available is our manager's (its reason), not OCM's lease check ("ManagedClusterAddOnLeaseUpdated")
    available = next(c for c in addon["status"]["conditions"] if c["type"] == "Available")
    assert available["reason"] == "ProxyAgentConnected", available
    writers = sorted(
        m["manager"]
        for m in addon["metadata"]["managedFields"]
        if "f:conditions" in json.dumps(m.get("fieldsV1"))
    )
    print(f"the addon's conditions written by {writers}")
    times["cluster1 available"] = time.monotonic() - started
    # cluster1's real kube-apiserver probed through the tunnel by its bare name (the health-collector)
    wait_for("cluster1 probed healthy through its tunnel", lambda: probed_healthy(hub, DIRECT), 90, hub)
    times["cluster1 probed"] = time.monotonic() - started
    client = enroll(hub, tmp_path)
    status, body = kube_apiserver_version(hub, managed, client)
    assert status == 200 and '"gitVersion"' in body, (status, body)
    times["cluster1 /version through the tunnel"] = time.monotonic() - started

    # cluster2: its agent reaches the hub only through the forward proxy (AddOnDeploymentConfig)
    enable(hub, PROXIED, https_proxy=real_clusters.proxy_url)
    agent_running(real_clusters[PROXIED])
    wait_available(hub, PROXIED)
    wait_for("cluster2 probed healthy through its tunnel", lambda: probed_healthy(hub, PROXIED), 90, hub)
    assert real_clusters.proxy is not None
    assert f"CONNECT {hub.network.node_ip}:8091" in real_clusters.proxy.log_path.read_text()
    times["cluster2 probed"] = time.monotonic() - started

    # disable: nothing of ours left on cluster1
    disable(hub, managed)
    times["disabled"] = time.monotonic() - started

    # uninstall: docs/kubernetes.md's order (configuration, then the hub overlay)
    uninstall(hub)
    times["uninstalled"] = time.monotonic() - started
    print("times (s from the test's start): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
