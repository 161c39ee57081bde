"""The real kubectl through the local proxy to a real kube-apiserver, by the bare cluster name.

A proxy-server and an agent of cluster1 (processes) whose ``--kube-apiserver`` is the cluster1 API
server of the session's harness; on the hub side ``cluster-proxy proxy`` (a process) and
``cluster-proxy kubectl`` (its in-process proxy). kubectl's kubeconfig says ``server:
https://cluster1`` and ``proxy-url: socks5://cluster1@127.0.0.1:PORT``: Go hands the name to the
SOCKS5 proxy unresolved, the agent maps its own cluster name to its API server, and the TLS to the
API server is kubectl's own, verified against the cluster's CA under ``kubernetes.default.svc`` (the
name the API server's certificate carries; ``cluster1`` is not on it, which is checked too).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import yaml

from tests.support import require
from tests.support.kube_identities import create_namespace, delete_namespace
from tests.support.kubeapi import KubeCluster, KubeClusters
from tests.support.pki import PkiFiles, make_pki
from tests.support.procs import BIN, Hub, Process
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

API_SERVER_NAME = "kubernetes.default.svc"


@dataclass
class Rig:
    hub: Hub
    pki: PkiFiles
    api: KubeCluster
    namespace: str  # exists on cluster1's API server only
    token_file: Path  # a bearer token of cluster1 (its admin's static token)
    directory: Path

    def hub_flags(self) -> list[str]:
        return [
            f"--proxy=127.0.0.1:{self.hub.client_port}",
            f"--ca={self.pki.ca}",
            f"--cert={self.pki.client.cert}",
            f"--key={self.pki.client.key}",
        ]


@pytest.fixture(scope="module")
def rig(kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    require(shutil.which("kubectl") is not None, "kubectl")
    directory = tmp_path_factory.mktemp("local-proxy-kube")
    pki = make_pki(directory / "pki")
    api = kube_clusters["cluster1"]
    namespace = create_namespace(api, "local-proxy")
    hub = Hub(pki, directory)

    async def start() -> None:
        await hub.start_server()
        hub.start_agent(
            "cluster1", "agent-a", f"--kube-apiserver=127.0.0.1:{api.port}", "--allow=127.0.0.0/8"
        )
        await hub.wait_agent("cluster1", "agent-a")

    try:
        trio.run(start)
        token_file = directory / "cluster1.token"
        token_file.write_text(api.admin_token)
        yield Rig(hub, pki, api, namespace, token_file, directory)
    finally:
        hub.stop()
        delete_namespace(api, namespace)


def _names(output: str) -> set[str]:
    return {line.removeprefix("namespace/") for line in output.split()}


def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env={**os.environ, **env}
    )


def _cli_kubectl(rig: Rig, *flags: str, args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    cache = f"--cache-dir={rig.directory / 'kubectl-cache'}"
    return _run(
        [str(BIN / "cluster-proxy"), "kubectl", "cluster1", *flags, *rig.hub_flags(), "--", cache, *args],
        **env,
    )


@pytest.fixture
def proxy_process(rig: Rig) -> Iterator[int]:
    """``cluster-proxy proxy`` on a free loopback port; yields the port."""
    process = Process(
        f"proxy-{uuid.uuid4().hex[:6]}",
        [str(BIN / "cluster-proxy"), "proxy", "--listen=127.0.0.1:0", *rig.hub_flags()],
        rig.directory,
    )
    try:
        found: list[str] = []

        def line() -> bool:
            assert process.popen.poll() is None, process.tail()
            match = re.search(r"Proxying on 127\.0\.0\.1:(\d+)", process.log_path.read_text())
            found.extend([match.group(1)] if match else [])
            return match is not None

        trio.run(lambda: wait_until(line, timeout=20, what="the proxy's Proxying line"))
        yield int(found[0])
    finally:
        process.stop()


def test_kubectl_with_a_socks5_proxy_url_lists_namespaces_by_bare_cluster_name(
    rig: Rig, proxy_process: int
) -> None:
    config = rig.directory / "socks5.kubeconfig"
    config.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "cluster1",
                        "cluster": {
                            "server": "https://cluster1",
                            "proxy-url": f"socks5://cluster1@127.0.0.1:{proxy_process}",
                            "certificate-authority": str(rig.api.ca_path),
                            "tls-server-name": API_SERVER_NAME,
                        },
                    }
                ],
                "users": [{"name": "u", "user": {"tokenFile": str(rig.token_file)}}],
                "contexts": [{"name": "c", "context": {"cluster": "cluster1", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    done = _run(
        [
            "kubectl",
            f"--kubeconfig={config}",
            f"--cache-dir={rig.directory / 'kc'}",
            "get",
            "ns",
            "-o",
            "name",
        ]
    )
    assert done.returncode == 0, done.stderr
    names = _names(done.stdout)
    assert rig.namespace in names and "default" in names


def test_cluster_proxy_kubectl_lists_namespaces(rig: Rig) -> None:
    done = _cli_kubectl(
        rig,
        f"--cluster-ca={rig.api.ca_path}",
        f"--token-file={rig.token_file}",
        args=["get", "ns", "-o", "name"],
    )
    assert done.returncode == 0, done.stderr
    assert rig.namespace in _names(done.stdout)


def test_cluster_proxy_kubectl_takes_user_and_ca_from_a_kubeconfig_context(rig: Rig) -> None:
    """The harness's admin kubeconfig (client certificate, CA, server https://127.0.0.1:PORT): its user
    and CA are used, its server is replaced by the bare cluster name through the proxy."""
    done = _cli_kubectl(rig, f"--kubeconfig={rig.api.kubeconfig}", args=["auth", "whoami", "-o", "json"])
    assert done.returncode == 0, done.stderr
    who = json.loads(done.stdout)["status"]["userInfo"]
    assert "system:masters" in who.get("groups", []), who
    done = _cli_kubectl(
        rig, f"--kubeconfig={rig.api.kubeconfig}", args=["get", "ns", rig.namespace, "-o", "name"]
    )
    assert done.returncode == 0, done.stderr


def test_the_temporary_kubeconfig_points_at_the_proxy_and_is_removed(rig: Rig, tmp_path: Path) -> None:
    done = _cli_kubectl(
        rig,
        f"--cluster-ca={rig.api.ca_path}",
        f"--token-file={rig.token_file}",
        args=["config", "view", "--raw", "-o", "json"],
        TMPDIR=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    cluster = json.loads(done.stdout)["clusters"][0]["cluster"]
    assert cluster["server"] == "https://cluster1"
    assert re.fullmatch(r"socks5://cluster1@127\.0\.0\.1:\d+", cluster["proxy-url"]), cluster
    assert cluster["tls-server-name"] == API_SERVER_NAME
    assert list(tmp_path.iterdir()) == []  # the kubeconfig (mode 0600 while it lived) is gone


def test_a_failing_kubectl_command_exits_with_kubectls_status(rig: Rig) -> None:
    args = ["get", "no-such-kind-of-thing"]
    direct = rig.api.kubectl(*args)
    assert direct.returncode != 0
    done = _cli_kubectl(rig, f"--cluster-ca={rig.api.ca_path}", f"--token-file={rig.token_file}", args=args)
    assert done.returncode == direct.returncode, done.stderr
    assert "no-such-kind-of-thing" in done.stderr


def test_the_cluster_name_is_not_on_the_api_servers_certificate(rig: Rig) -> None:
    """Why the default tls-server-name: checked under the name in the URL, ``cluster1``, the API
    server's certificate (localhost, kubernetes, kubernetes.default, kubernetes.default.svc) fails."""
    done = _cli_kubectl(
        rig,
        f"--cluster-ca={rig.api.ca_path}",
        f"--token-file={rig.token_file}",
        "--tls-server-name=cluster1",
        args=["get", "ns", "-o", "name"],
    )
    assert done.returncode == 1
    assert "x509" in done.stderr and "cluster1" in done.stderr, done.stderr
