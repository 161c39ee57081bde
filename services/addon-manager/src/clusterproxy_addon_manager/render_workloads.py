"""What every workload the manager renders shares, hub and managed cluster alike: Deployments,
Services, NetworkPolicies, the restricted pod and container security, placement, the bootstrap token
in the environment and the credentials volume. Pure, no I/O.

Parties that get certificates from the signer write them (and later renewals, and the trust bundle)
into a writable ``emptyDir``; an init container seeds it with the CA bundle from the Secret, since
the programs need a CA bundle to verify the signer before their first certificate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .render import BOOTSTRAP_DIR, CA_KEY, CREDENTIALS_DIR, TOKEN_KEY, labels, pod_selector

__all__ = [
    "IN_CLUSTER",
    "Sources",
    "credential_volumes",
    "deployment",
    "network_policy",
    "placement",
    "pod_disruption_budget",
    "health_probes",
    "pod_security",
    "restricted_container",
    "seed_ca_container",
    "service",
    "spread_over_nodes",
    "token_env",
]


def restricted_container() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


# A program that has not answered its health check yet is given this long (period x threshold) before
# the kubelet restarts it. The liveness probe is what restarts a wedged program; on a busy node a
# Python program's start (imports, its first certificate from the signer) can take longer than a
# liveness probe's initial delay, and killing it then only starts it again, slower (seen on the real
# nodes at load 35: the cert-signer restarted three times before it listened).
STARTUP_PERIOD_S = 2
STARTUP_FAILURES = 90
# The kubelet's default (1 s) counts a busy process's late answer as a failure: a loaded node (a
# second's CPU wait is common at a load average of 30 on 2 cores) restarted a healthy proxy-server.
PROBE_TIMEOUT_S = 5


def health_probes(ready_path: str, live_path: str, port: str, scheme: str = "HTTP") -> dict[str, Any]:
    """Readiness, liveness and startup probes over HTTP(S) GETs on a named port: liveness only begins
    once the startup probe has passed once."""

    def get(path: str) -> dict[str, Any]:
        action: dict[str, Any] = {"path": path, "port": port}
        if scheme != "HTTP":
            action["scheme"] = scheme
        return {"httpGet": action}

    return {
        "readinessProbe": {**get(ready_path), "periodSeconds": 5, "timeoutSeconds": PROBE_TIMEOUT_S},
        "livenessProbe": {
            **get(live_path),
            "periodSeconds": 10,
            "failureThreshold": 3,
            "timeoutSeconds": PROBE_TIMEOUT_S,
        },
        "startupProbe": {
            **get(live_path),
            "periodSeconds": STARTUP_PERIOD_S,
            "failureThreshold": STARTUP_FAILURES,
            "timeoutSeconds": PROBE_TIMEOUT_S,
        },
    }


def pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "fsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def seed_ca_container(image: str, resources: Mapping[str, Any]) -> dict[str, Any]:
    """Copies the CA bundle into the writable credentials volume on a pod's first start only: after a
    CA rotation the program's own copy is newer than the Secret's. ``resources``: the main
    container's, so a namespace quota or LimitRange finds them, and the pod's effective request (the
    larger of its init and main containers') is the main container's."""
    return {
        "name": "seed-ca-bundle",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "/bin/sh",
            "-c",
            f"test -s {CREDENTIALS_DIR}/{CA_KEY} || cp {BOOTSTRAP_DIR}/{CA_KEY} {CREDENTIALS_DIR}/{CA_KEY}",
        ],
        "resources": dict(resources),
        "securityContext": restricted_container(),
        "volumeMounts": [
            {"name": "bootstrap", "mountPath": BOOTSTRAP_DIR, "readOnly": True},
            {"name": "credentials", "mountPath": CREDENTIALS_DIR},
        ],
    }


def token_env(env_name: str, secret: str) -> dict[str, Any]:
    # The environment twin of --bootstrap-token, read from the Secret when the container starts: a
    # token the manager re-minted reaches the next start, and it stays off the command line.
    return {"name": env_name, "valueFrom": {"secretKeyRef": {"name": secret, "key": TOKEN_KEY}}}


def credential_volumes(secret: str) -> list[dict[str, Any]]:
    return [
        {"name": "bootstrap", "secret": {"secretName": secret, "defaultMode": 0o440}},
        # Certificate, key and CA bundle the program keeps current; memory-backed: a private key.
        {"name": "credentials", "emptyDir": {"medium": "Memory"}},
    ]


def placement(node_selector: Sequence[tuple[str, str]], tolerations: Sequence[Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        spec["tolerations"] = [dict(t) for t in tolerations]
    return spec


def spread_over_nodes(component: str) -> list[dict[str, Any]]:
    """Replicas on different nodes where the scheduler can: a node lost or drained takes one, not
    all. ``ScheduleAnyway``: a single-node cluster (or one full node) still runs every replica."""
    return [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": pod_selector(component)},
        }
    ]


def pod_disruption_budget(metadata: dict[str, Any], component: str) -> dict[str, Any]:
    """A drain (or any eviction) takes one replica at a time: the next waits until the replaced one
    is ready. ``maxUnavailable: 1`` rather than ``minAvailable``: it follows the replica count, and
    a single replica can still be evicted (a drain never blocks on it)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata,
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": pod_selector(component)}},
    }


def deployment(
    metadata: dict[str, Any],
    component: str,
    replicas: int,
    pod_spec: dict[str, Any],
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": pod_selector(component)},
            "template": {
                "metadata": {"labels": {**pod_selector(component), **labels(component)}},
                "spec": pod_spec,
            },
        },
    }


def service(
    metadata: dict[str, Any],
    service_type: str,
    component: str,
    ports: Sequence[tuple[str, int, str]],
    *,
    headless: bool = False,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "type": service_type,
        "selector": pod_selector(component),
        "ports": [
            {"name": name, "port": port, "targetPort": target, "protocol": "TCP"}
            for name, port, target in ports
        ],
    }
    if headless:
        spec["clusterIP"] = "None"
        spec["publishNotReadyAddresses"] = True  # a server not ready yet still answers who is connected
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": spec}


# --- NetworkPolicies --------------------------------------------------------------------------------------

#: Who may open a connection to a port, as a NetworkPolicy rule's ``from``: None is anyone (no ``from``:
#: other clusters, the internet, nodes); IN_CLUSTER every pod of every namespace. Whatever a policy
#: says, a node reaches its own pods (the kubelet's probes pass).
Sources = Sequence[Mapping[str, Any]] | None
IN_CLUSTER: Sources = ({"namespaceSelector": {}},)


def network_policy(
    metadata: dict[str, Any], component: str, ports: Sequence[tuple[str, Sources]]
) -> dict[str, Any]:
    """``component``'s pods accept connections on the named container ``ports`` only, each from its
    sources, and nothing else; egress is left alone (docs/kubernetes.md, "Network policies"). Named
    ports follow the Deployment's declarations, so a port number changed there needs nothing here."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {
            "podSelector": {"matchLabels": pod_selector(component)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    **({"from": [dict(s) for s in sources]} if sources is not None else {}),
                    "ports": [{"protocol": "TCP", "port": port}],
                }
                for port, sources in ports
            ],
        },
    }
