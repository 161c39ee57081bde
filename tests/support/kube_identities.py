"""Namespaces and ServiceAccount identities on a test API server (``tests.support.kubeapi``): a fresh
namespace per test module, a ServiceAccount with a kubeconfig holding a TokenRequest token (what a pod
of it would present), optionally bound to a Role; and the raw Secrets of a cert-signer store, read as
the admin."""

from __future__ import annotations

import base64
import secrets
from pathlib import Path
from typing import Any

import yaml

from tests.support.kubeapi import KubeCluster


def _core(cluster: KubeCluster) -> Any:
    from kubernetes import client

    return client.CoreV1Api(cluster.api_client())


def create_namespace(cluster: KubeCluster, stem: str) -> str:
    """A new namespace ``<stem>-<random>`` (namespaces never finish terminating here: one per module)."""
    name = f"{stem}-{secrets.token_hex(3)}"
    _core(cluster).create_namespace({"metadata": {"name": name}})
    return name


def delete_namespace(cluster: KubeCluster, name: str) -> None:
    _core(cluster).delete_namespace(name)


def kubectl_apply(cluster: KubeCluster, manifest: str) -> None:
    done = cluster.kubectl("apply", "-f", "-", input=manifest)
    assert done.returncode == 0, done.stderr


def token_kubeconfig(
    cluster: KubeCluster, path: Path, user: str, token: str, *, server: str | None = None
) -> Path:
    """A kubeconfig presenting a bearer token (``server`` overrides the cluster's address)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": cluster.name,
                "cluster": {"server": server or cluster.url, "certificate-authority": str(cluster.ca_path)},
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": cluster.name, "user": user}}],
        "current-context": user,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


def service_account_kubeconfig(
    cluster: KubeCluster, namespace: str, name: str, path: Path, *, role: str | None = None
) -> Path:
    """Create the ServiceAccount ``name`` in ``namespace``, apply ``role`` (YAML: its Role and
    RoleBinding) if given, and write a kubeconfig with a one-hour token from TokenRequest."""
    core = _core(cluster)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    if role is not None:
        kubectl_apply(cluster, role)
    answer = core.create_namespaced_service_account_token(
        name, namespace, {"spec": {"expirationSeconds": 3600}}
    )
    return token_kubeconfig(cluster, path, f"system:serviceaccount:{namespace}:{name}", answer.status.token)


def store_secrets(cluster: KubeCluster, namespace: str, prefix: str) -> list[dict[str, Any]]:
    """Every Secret of the cert-signer store ``prefix`` (by its label), as JSON, read as the admin."""
    import json

    core = _core(cluster)
    response = core.list_namespaced_secret(
        namespace, label_selector=f"cluster-proxy.io/store={prefix}", _preload_content=False
    )
    return list(json.loads(response.data)["items"])


def store_bytes(cluster: KubeCluster, namespace: str, prefix: str) -> bytes:
    """Every byte the store's Secrets hold (their ``data``, decoded)."""
    return b"".join(
        base64.b64decode(value)
        for secret in store_secrets(cluster, namespace, prefix)
        for value in (secret.get("data") or {}).values()
    )
