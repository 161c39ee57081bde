"""Go clients with an ``https://`` proxy URL, as a new user writes them: the real kubectl with a
kubeconfig ``proxy-url``, and a Go ``net/http`` program. Go offers ALPN h2 to the proxy and speaks
HTTP/1.1 CONNECT on the connection; the client port must serve it (it tells the protocol by the
client's first bytes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import trio

from tests.support import require
from tests.support.gopeers import go_peer
from tests.support.kube_target import KubeTarget, serve_kube_target
from tests.support.pki import PkiFiles
from tests.support.procs import Hub
from tests.support.targets import pattern_digest

pytestmark = pytest.mark.slow

TOKEN = "cluster1-reader-token"


def trust_bundle(directory: Path, pki: PkiFiles, kube: KubeTarget) -> Path:
    """Go verifies the proxy and the target with the same roots: the hub's CA and the cluster's."""
    bundle = directory / "hub-and-cluster1-ca.pem"
    bundle.write_bytes(pki.ca.read_bytes() + kube.ca.read_bytes())
    return bundle


def kubeconfig(directory: Path, hub: Hub, pki: PkiFiles, kube: KubeTarget) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "cluster1",
                "cluster": {
                    "server": kube.url,
                    "certificate-authority": str(trust_bundle(directory, pki, kube)),
                    "proxy-url": f"https://cluster1@127.0.0.1:{hub.client_port}",
                },
            }
        ],
        "users": [
            {
                "name": "hub-admin",
                "user": {
                    # presented to the proxy (which checks it) and to the target (which ignores it)
                    "client-certificate": str(pki.client.cert),
                    "client-key": str(pki.client.key),
                    "token": TOKEN,  # what cluster1's API server authenticates
                },
            }
        ],
        "contexts": [{"name": "cluster1", "context": {"cluster": "cluster1", "user": "hub-admin"}}],
        "current-context": "cluster1",
    }
    path = directory / "cluster1.kubeconfig"
    path.write_text(json.dumps(config))
    return path


async def run(argv: list[str]) -> str:
    result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 0, f"{argv[0]} failed ({result.returncode}):\n{result.stderr.decode()}"
    return result.stdout.decode()


async def test_kubectl_with_proxy_url_reaches_cluster1(
    hub: Hub, pki: PkiFiles, nursery: trio.Nursery, tmp_path: Path
) -> None:
    kubectl = shutil.which("kubectl")
    require(kubectl is not None, "the kubectl binary (scripts/bootstrap.sh installs it)")
    assert kubectl is not None
    kube = await serve_kube_target(nursery, tmp_path, "cluster1", TOKEN)
    config = kubeconfig(tmp_path, hub, pki, kube)

    names = await run([kubectl, "--kubeconfig", str(config), "get", "namespaces", "-o", "name"])
    assert names.split() == ["namespace/inside-cluster1"]
    version = json.loads(await run([kubectl, "--kubeconfig", str(config), "version", "-o", "json"]))
    assert version["serverVersion"]["gitVersion"] == "v1.32.0-fake-cluster1"
    listed = [r for r in kube.requests if r[1] == "/api/v1/namespaces"]
    assert listed and all(auth == f"Bearer {TOKEN}" for _, _, auth in listed)


async def test_go_net_http_downloads_16_mib_through_https_proxy(
    hub: Hub, pki: PkiFiles, nursery: trio.Nursery, tmp_path: Path
) -> None:
    proxyget = await trio.to_thread.run_sync(go_peer, "proxyget")
    kube = await serve_kube_target(nursery, tmp_path, "cluster1", TOKEN)
    size = 16 << 20
    out = await run(
        [
            str(proxyget),
            "-proxy",
            f"https://cluster1@127.0.0.1:{hub.client_port}",
            "-url",
            f"{kube.url}/blob/go-download/{size}",
            "-ca",
            str(trust_bundle(tmp_path, pki, kube)),
            "-cert",
            str(pki.client.cert),
            "-key",
            str(pki.client.key),
        ]
    )
    result = json.loads(out)
    assert result["status"] == 200
    assert result["bytes"] == size
    assert result["sha256"] == pattern_digest("go-download", size)


async def test_go_client_with_a_foreign_certificate_gets_nothing(
    hub: Hub, pki: PkiFiles, nursery: trio.Nursery, tmp_path: Path
) -> None:
    proxyget = await trio.to_thread.run_sync(go_peer, "proxyget")
    kube = await serve_kube_target(nursery, tmp_path, "cluster1", TOKEN)
    argv = [
        str(proxyget),
        "-proxy",
        f"https://cluster1@127.0.0.1:{hub.client_port}",
        "-url",
        f"{kube.url}/blob/refused/1024",
        "-ca",
        str(trust_bundle(tmp_path, pki, kube)),
        "-cert",
        str(pki.foreign_client.cert),
        "-key",
        str(pki.foreign_client.key),
    ]
    result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode != 0 and not result.stdout
    assert not [r for r in kube.requests if r[1].startswith("/blob/refused")]
