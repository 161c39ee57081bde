"""Where the hub-side services (addon-manager, cert-signer's Kubernetes store, health-collector,
cluster-gateway) find their API server: --kubeconfig, then $KUBECONFIG (a list, merged as kubectl
merges it), then the pod's ServiceAccount, then ~/.kube/config; each missing source named."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from clusterproxy_castore.kubestore import KubernetesSecretStore
from clusterproxy_castore.store import CertStore, StoreError, open_store
from clusterproxy_protocol.config import ConfigError
from clusterproxy_protocol.kubeconfig import load_configuration

ROOT = Path(__file__).resolve().parents[2]
FLAG_ENV = "CLUSTER_PROXY_X_KUBECONFIG"


def kubeconfig_file(path: Path, server: str, *, context: str = "c", current: bool = True) -> Path:
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": server}}],
        "users": [{"name": context, "user": {"token": "t"}}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": context}}],
    }
    if current:
        document["current-context"] = context
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.fixture
def in_a_pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The in-cluster environment a pod has: the Service address in the environment and the
    ServiceAccount's files (at a folder of the test's: the client's fixed path is patched to it)."""
    from kubernetes.config import incluster_config

    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("pod-token")
    (account / "ca.crt").write_text((ROOT / "deploy/kustomize/overlays/managed/example/ca.crt").read_text())
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(account / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(account / "ca.crt"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    return account


def host(kubeconfig: Path | None = None) -> str:
    return load_configuration(kubeconfig, flag_env=FLAG_ENV).configuration.host


def test_the_order_is_flag_then_env_then_pod_then_home(
    in_a_pod: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = kubeconfig_file(tmp_path / "home" / ".kube" / "config", "https://home:6443")
    loaded = load_configuration(None, flag_env=FLAG_ENV)
    assert (loaded.configuration.host, loaded.source) == ("https://10.96.0.1:443", "the pod's ServiceAccount")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    loaded = load_configuration(None, flag_env=FLAG_ENV)
    assert (loaded.configuration.host, loaded.source) == ("https://home:6443", str(home))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig_file(tmp_path / "env.kubeconfig", "https://env:6443")))
    assert host() == "https://env:6443"  # an explicit kubeconfig wins over the pod's own identity
    assert host(kubeconfig_file(tmp_path / "flag.kubeconfig", "https://flag:6443")) == "https://flag:6443"


def test_a_kubeconfig_list_is_merged_as_kubectl_merges_it(
    in_a_pod: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KUBECONFIG=a:b, the current context in b, a missing entry skipped: kubectl's reading (the
    services took the first entry only, and the cert-signer the whole value as one path)."""
    first = kubeconfig_file(tmp_path / "a.kubeconfig", "https://a:6443", context="a", current=False)
    second = kubeconfig_file(tmp_path / "b.kubeconfig", "https://b:6443", context="b")
    listed = os.pathsep.join([str(tmp_path / "missing"), str(first), str(second)])
    monkeypatch.setenv("KUBECONFIG", listed)
    loaded = load_configuration(None, flag_env=FLAG_ENV)
    assert (loaded.configuration.host, loaded.source) == ("https://b:6443", f"$KUBECONFIG {listed}")


def test_each_missing_source_is_named_with_what_to_do(
    in_a_pod: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    what_to_do = f"give --kubeconfig FILE (env {FLAG_ENV}), set KUBECONFIG, or run in a pod"
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError, match=re.escape(f"--kubeconfig {missing}: no such file; {what_to_do}")):
        host(missing)
    monkeypatch.setenv("KUBECONFIG", f"{missing}{os.pathsep}{missing}-too")
    with pytest.raises(ConfigError, match=rf"\$KUBECONFIG {missing}{os.pathsep}{missing}-too: no such file"):
        host()
    monkeypatch.delenv("KUBECONFIG")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(
        ConfigError, match=rf"no Kubernetes configuration \(and no {tmp_path}/home/.kube/config\)"
    ):
        host()
    broken = tmp_path / "broken.kubeconfig"
    broken.write_text("apiVersion: v1\nkind: Config\n")
    with pytest.raises(ConfigError, match=f"--kubeconfig {broken}: "):
        host(broken)


def test_the_signers_store_says_which_store_lacks_a_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It contacts nothing until used (a store object is cheap to make), then names itself."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    missing = tmp_path / "no-such-kubeconfig"
    store = open_store("kubernetes:hub/pki", kubeconfig=missing)
    assert isinstance(store, KubernetesSecretStore) and isinstance(store, CertStore)
    with pytest.raises(
        StoreError,
        match=f"the store kubernetes:hub/pki: --kubeconfig {missing}: no such file",
    ):
        store.read_authorities()
    with pytest.raises(
        StoreError, match=r"the store kubernetes:hub/cluster-proxy-ca: no Kubernetes configuration \(and no"
    ):
        open_store("kubernetes:hub").check()
