"""The kustomize overlays of deploy/kustomize rendered as ``kubectl apply -k`` would send them
(:func:`render`), and overlays of one's own over them as docs/kubernetes.md tells an admin to write
(:func:`own_overlay`, :data:`MY_CLUSTER_KUSTOMIZATION`, :data:`MY_HUB_KUSTOMIZATION`): for the
render tests (tests/unit/test_kustomize_render.py) and the ones that apply them (tests/kube)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from tests.support import require

REPO = Path(__file__).resolve().parents[2]


KUSTOMIZE = REPO / "deploy" / "kustomize"


def kubectl_path() -> str:
    found = shutil.which("kubectl")
    require(found is not None, "kubectl (Debian: apt-get install kubectl; it renders kustomize overlays)")
    assert found is not None
    return found


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k DIRECTORY`` would send, as ``kubectl kustomize`` renders them."""
    done = subprocess.run(
        [kubectl_path(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def key_of(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


def deployments(objects: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [o for o in objects if o["kind"] == "Deployment"]


def own_overlay(
    directory: Path, base: str, kustomization: Mapping[str, Any], files: Mapping[str, str]
) -> Path:
    """An overlay of one's own in ``directory`` that points at ``overlays/<base>`` of this repository."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    body = {"resources": [os.path.relpath(KUSTOMIZE / "overlays" / base, directory)], **kustomization}
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(body, sort_keys=False))
    return directory


NAMESPACE = "open-cluster-management-cluster-proxy"


# What docs/kubernetes.md tells an admin to write for a managed cluster.
MY_CLUSTER_KUSTOMIZATION = {
    "configMapGenerator": [
        {"name": "cluster-proxy-agent", "namespace": NAMESPACE, "behavior": "replace", "envs": ["agent.env"]}
    ],
    "secretGenerator": [
        {
            "name": "cluster-proxy-agent-bootstrap",
            "namespace": NAMESPACE,
            "behavior": "replace",
            "files": ["ca.crt", "bootstrap-token"],
        }
    ],
}


# What docs/kubernetes.md shows for a hub of one's own: the entrypoint, the replicas, a registry.
MY_HUB_KUSTOMIZATION = {
    "patches": [
        {
            "target": {"kind": "ManagedProxyConfiguration", "name": "cluster-proxy"},
            "patch": yaml.safe_dump(
                {
                    "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
                    "kind": "ManagedProxyConfiguration",
                    "metadata": {"name": "cluster-proxy"},
                    "spec": {
                        "proxyServer": {
                            "replicas": 2,
                            "entrypoint": {
                                "type": "Hostname",
                                "hostname": {"value": "proxy.hub.example.com"},
                            },
                        }
                    },
                }
            ),
        }
    ],
}
