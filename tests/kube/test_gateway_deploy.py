"""The cluster-gateway as deploy/kustomize/overlays/hub-gateway installs it, on the session's hub.

The overlay is applied through an overlay of one's own that changes only what this machine needs: the
ports (the stack's free ports instead of the configuration's defaults, and a free port to listen on:
pods share the machine's loopback here), the namespace of the stack's proxy-server and cert-signer
Services, and the Service as an ``ExternalName`` to localhost (the only route the aggregator takes
without kube-proxy). The pod runs from the stored Deployment (tests.support.localpods.Kubelet) as its
ServiceAccount with only the overlay's RBAC: it reads the requestheader ConfigMap, patches the
APIService's caBundle, bootstraps its hub client certificate with the token of the Secret
``cluster-gateway-bootstrap`` (kept by the addon-manager: ``--hub-client``, as the hub overlay runs it;
nobody makes it by hand), lists the clusters and reads a cluster's token Secret. Then ``kubectl get
clustergateway`` and ``.../proxy/healthz`` work on the hub, and the token the gateway used is replaced in
the Secret for its next pod.
"""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.support.addonstack import AddonStack
from tests.support.kubeapi import KubeClusters, free_port
from tests.support.kustomize import KUSTOMIZE, own_overlay, render
from tests.support.localpods import Pod
from tests.support.procs import BIN
from tests.support.waiting import poll_until

pytestmark = pytest.mark.slow

NAMESPACE = "open-cluster-management-addon"
DEPLOYMENT = "cluster-proxy-cluster-gateway"
APISERVICE = "v1alpha1.cluster.core.oam.dev"
BOOTSTRAP_SECRET = "cluster-gateway-bootstrap"
OVERLAY = KUSTOMIZE / "overlays" / "hub-gateway"


def _overlay_for_this_machine(directory: Path, stack: AddonStack, port: int) -> Path:
    shipped = next(o for o in render(OVERLAY) if o["kind"] == "Deployment")
    args = []
    for arg in shipped["spec"]["template"]["spec"]["containers"][0]["args"]:
        if arg.startswith("--listen="):
            arg = f"--listen=127.0.0.1:{port}"
        elif arg.startswith("--proxy-server="):
            arg = f"--proxy-server=proxy-entrypoint.{stack.namespace}.svc:{stack.ports.client}"
        elif arg.startswith("--signer="):
            arg = f"--signer=https://cluster-proxy-cert-signer.{stack.namespace}.svc:{stack.ports.signer}"
        args.append(arg)
    patches = [
        {
            "target": {"kind": "Deployment", "name": DEPLOYMENT},
            "patch": yaml.safe_dump(
                [
                    {"op": "replace", "path": "/spec/template/spec/containers/0/args", "value": args},
                    {
                        "op": "replace",
                        "path": "/spec/template/spec/containers/0/ports/0/containerPort",
                        "value": port,
                    },
                ]
            ),
        },
        {
            "target": {"kind": "Service", "name": "cluster-gateway"},
            "patch": yaml.safe_dump(
                [
                    {
                        "op": "replace",
                        "path": "/spec",
                        "value": {
                            "type": "ExternalName",
                            "externalName": "localhost",
                            "ports": [{"name": "https", "port": port}],
                        },
                    }
                ]
            ),
        },
        {
            "target": {"kind": "APIService", "name": APISERVICE},
            "patch": yaml.safe_dump([{"op": "replace", "path": "/spec/service/port", "value": port}]),
        },
    ]
    return own_overlay(directory, "hub-gateway", {"patches": patches}, {})


@pytest.fixture(scope="module")
def installed(
    kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("gateway-deploy")
    hub = kube_clusters["hub"]
    with hub.api_client() as admin, contextlib.suppress(client.exceptions.ApiException):
        client.CoreV1Api(admin).create_namespace({"metadata": {"name": NAMESPACE}})
    # the manager keeps the gateway's bootstrap Secret, as the hub overlay's manager does (there in the
    # proxy-server namespace, the overlay's own; here the stack's namespace is another one)
    stack = AddonStack(
        hub, directory, manager_args=[f"--hub-client=cluster-gateway={NAMESPACE}/{BOOTSTRAP_SECRET}"]
    )
    overlay = None
    pod: Pod | None = None
    try:
        stack.start()
        name = f"gw-{stack.tag}"
        stack.join(name, kube_clusters["cluster1"])
        with hub.api_client() as admin:
            core = client.CoreV1Api(admin)
            # the cluster's token (what point 2 will write): a ServiceAccount of cluster1
            with kube_clusters["cluster1"].api_client() as managed:
                managed_core = client.CoreV1Api(managed)
                managed_core.create_namespaced_service_account("default", {"metadata": {"name": name}})
                token = managed_core.create_namespaced_service_account_token(
                    name, "default", {"spec": {"expirationSeconds": 3600}}
                ).status.token
            core.create_namespaced_secret(
                name,
                {
                    "metadata": {"name": "cluster-gateway"},
                    "stringData": {"token": token, "ca.crt": kube_clusters["cluster1"].ca_path.read_text()},
                },
            )
        # no step of the admin's: the Secret is there once the manager reconciled the hub
        secret = poll_until(
            lambda: bootstrap_secret(hub), timeout=60, what=f"the Secret {NAMESPACE}/{BOOTSTRAP_SECRET}"
        )
        assert secret["labels"]["app.kubernetes.io/managed-by"] == "cluster-proxy-addon-manager", secret
        assert "BEGIN CERTIFICATE" in secret["ca.crt"]

        port = free_port()
        overlay = _overlay_for_this_machine(directory / "overlay", stack, port)
        applied = hub.kubectl("apply", "-k", str(overlay))
        assert applied.returncode == 0, applied.stderr
        pod = stack.hub_kubelet.run(NAMESPACE, DEPLOYMENT)
        waited = hub.kubectl("wait", "--for=condition=Available", "--timeout=60s", f"apiservice/{APISERVICE}")
        assert waited.returncode == 0, f"{waited.stderr}\n--- gateway pod\n{pod.container().tail()}"
        # Available is not yet discoverable: the hub adds the group to its aggregated discovery (/apis)
        # after it fetched the gateway's discovery document (a run's `get clustergateway` right after
        # the wait said "doesn't have a resource type"). kubectl reads that, so wait for it there.
        poll_until(
            lambda: (
                "clustergateways.cluster.core.oam.dev"
                in hub.kubectl(
                    "api-resources", "--api-group=cluster.core.oam.dev", "-o", "name"
                ).stdout.split()
            ),
            timeout=30,
            what=f"clustergateways in the hub's discovery:\n{pod.container().tail()}",
        )
        yield {
            "hub": hub,
            "cluster": name,
            "pod": pod,
            "stack": stack,
            "first_token": secret["bootstrap-token"],
        }
    finally:
        if overlay is not None:
            hub.kubectl("delete", "-k", str(overlay), "--wait=false")
        stack.close()  # the manager first: it would write the Secret again
        hub.kubectl("-n", NAMESPACE, "delete", "secret", BOOTSTRAP_SECRET, "--ignore-not-found")


def bootstrap_secret(hub: Any) -> dict[str, Any] | None:
    """The gateway's bootstrap Secret: its keys decoded and its labels; None while it does not exist."""
    done = hub.kubectl("-n", NAMESPACE, "get", "secret", BOOTSTRAP_SECRET, "-o", "json")
    if done.returncode != 0:
        return None
    secret = json.loads(done.stdout)
    decoded = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return {**decoded, "labels": secret["metadata"].get("labels") or {}}


def test_the_gateway_runs_as_the_overlay_installs_it(installed: dict[str, Any]) -> None:
    hub, name, pod = installed["hub"], installed["cluster"], installed["pod"]
    listed = hub.kubectl("get", "clustergateway", name, "--no-headers")
    assert listed.returncode == 0, f"{listed.stderr}\n--- gateway pod\n{pod.container().tail()}"
    assert listed.stdout.split() == [name, "cluster-proxy", "ServiceAccountToken", "ClusterProxy"]
    health = hub.kubectl(
        "get", "--raw", f"/apis/cluster.core.oam.dev/v1alpha1/clustergateways/{name}/proxy/healthz"
    )
    assert health.returncode == 0, f"{health.stderr}\n--- gateway pod\n{pod.container().tail()}"
    assert health.stdout.strip() == "ok"
    events = {r.get("event") for r in pod.container().events()}
    assert {"apiservice_ca_registered", "client_certificate_ready", "gateway_started"} <= events


def test_the_token_the_gateway_used_is_replaced_for_its_next_pod(installed: dict[str, Any]) -> None:
    """The gateway traded the manager's token; the manager, seeing it used in the signer's store, puts
    an unused one in the Secret (a new pod reads it at start), within seconds, not at its resync."""
    hub, stack, first = installed["hub"], installed["stack"], installed["first_token"]
    replaced = poll_until(
        lambda: (t := (bootstrap_secret(hub) or {}).get("bootstrap-token")) != first and t,
        timeout=30,
        what=f"the used token replaced in {BOOTSTRAP_SECRET}:\n{stack.manager.tail()}",
    )
    listed = subprocess.run(
        [str(BIN / "cluster-proxy-cert-signer"), "token", "list", f"--store={stack.store}",
         f"--kubeconfig={hub.kubeconfig}"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    states = {line.split()[0]: line.split()[-1] for line in listed.stdout.splitlines()[1:] if line.split()}
    assert states[first.split(".", 1)[0]] == "used" and states[replaced.split(".", 1)[0]] == "unused", (
        listed.stdout
    )
    minted = [r for r in stack.manager.events() if r.get("event") == "token_minted"
              and r.get("group") == "hub-client cluster-gateway"]  # fmt: skip
    assert len(minted) >= 2 and "was used" in minted[-1]["reason"], minted


def test_the_gateways_service_account_may_not_read_other_secrets(installed: dict[str, Any]) -> None:
    hub, name = installed["hub"], installed["cluster"]
    user = f"system:serviceaccount:{NAMESPACE}:{DEPLOYMENT}"
    allowed = hub.kubectl("auth", "can-i", "get", "secret/cluster-gateway", "-n", name, f"--as={user}")
    assert allowed.stdout.strip() == "yes"
    for question in (
        ("get", "secret/other", "-n", name),
        ("list", "secrets", "-n", name),
        ("create", "managedclusters"),
        ("patch", "apiservice/v1.apps"),
    ):
        refused = hub.kubectl("auth", "can-i", *question, f"--as={user}")
        assert refused.stdout.strip() == "no", question


def test_a_hub_read_refused_is_a_500_in_words_and_the_gateway_stays_up(installed: dict[str, Any]) -> None:
    hub, name, pod = installed["hub"], installed["cluster"], installed["pod"]
    binding = hub.kubectl("get", "clusterrolebinding", DEPLOYMENT, "-o", "json")
    assert binding.returncode == 0, binding.stderr
    saved = json.loads(binding.stdout)
    for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
        saved["metadata"].pop(key, None)
    deleted = hub.kubectl("delete", "clusterrolebinding", DEPLOYMENT)
    assert deleted.returncode == 0, deleted.stderr
    try:
        failed = poll_until(
            lambda: "InternalError" in (done := hub.kubectl("get", "clustergateway")).stderr and done,
            timeout=30,
            what="a 500 once the gateway may not read the clusters",
        )
        assert "the cluster-gateway failed: reading the hub failed (403 Forbidden)" in failed.stderr, (
            failed.stderr
        )
        assert 'cannot list resource "managedclusters"' in failed.stderr and "rbac.yaml" in failed.stderr
        print(f"\nRBAC removed: {failed.stderr.strip()}")
    finally:
        restored = hub.kubectl("apply", "-f", "-", input=json.dumps(saved))
        assert restored.returncode == 0, restored.stderr
    listed = poll_until(
        lambda: (done := hub.kubectl("get", "clustergateway", name, "--no-headers")).returncode == 0 and done,
        timeout=30,
        what="the gateway answering again",
    )
    assert listed.stdout.split()[0] == name
    assert pod.container().running
