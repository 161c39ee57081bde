"""What the project's NetworkPolicies let in, read from rendered objects (the kustomize overlays', the
addon-manager's hub objects and ManifestWork) and checked against the pods they are meant for.

:func:`ingress_by_pod` matches every NetworkPolicy to the Deployments whose pod template it selects
(``podSelector.matchLabels`` against the template's labels, in the same namespace, as the API server
would) and fails when a policy selects no Deployment or several, a Deployment is selected by none, a
policy names a port its pods do not declare, or a pod declares a port no policy opens (a Service in
front of it would lead nowhere). What is left to a test is who may reach each port:
:data:`ANYWHERE`, :data:`IN_CLUSTER` (every pod of every namespace), :data:`IN_NAMESPACE` (the
policy's own namespace).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ANYWHERE", "IN_CLUSTER", "IN_NAMESPACE", "ingress_by_pod"]

ANYWHERE = "anywhere"
IN_CLUSTER = "every pod of the cluster"
IN_NAMESPACE = "the policy's namespace"


def _sources(rule: Mapping[str, Any]) -> str:
    peers = rule.get("from")
    if peers is None:
        return ANYWHERE
    if peers == [{"namespaceSelector": {}}]:
        return IN_CLUSTER
    if peers == [{"podSelector": {}}]:
        return IN_NAMESPACE
    raise AssertionError(f"sources the tests do not know: {peers}")


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are used: {selector}"
    wanted = selector.get("matchLabels") or {}
    assert wanted, "an empty podSelector selects every pod of the namespace: name the pods"
    return all(labels.get(k) == v for k, v in wanted.items())


def _declared_ports(deployment: Mapping[str, Any]) -> set[str]:
    pod = deployment["spec"]["template"]["spec"]
    ports = {p.get("name") for c in pod.get("containers") or [] for p in c.get("ports") or []}
    assert None not in ports, f"{deployment['metadata']['name']}: every container port is named"
    return {str(p) for p in ports}


def ingress_by_pod(objects: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """Deployment name -> {named port -> who may connect}, for the NetworkPolicies among ``objects``."""
    objects = list(objects)
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    found: dict[str, dict[str, str]] = {}
    for policy in policies:
        name, namespace = policy["metadata"]["name"], policy["metadata"].get("namespace")
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"], f"{name}: ingress only (egress is not restricted)"
        selected = [
            d
            for d in deployments
            if d["metadata"].get("namespace") == namespace
            and _selects(spec["podSelector"], d["spec"]["template"]["metadata"]["labels"])
        ]
        assert len(selected) == 1, f"NetworkPolicy {name} selects {[d['metadata']['name'] for d in selected]}"
        deployment = selected[0]
        pod = deployment["metadata"]["name"]
        assert pod not in found, f"two NetworkPolicies select {pod}: one per pod says it all"
        opened: dict[str, str] = {}
        for rule in spec.get("ingress") or []:
            for port in rule["ports"]:
                assert port.get("protocol", "TCP") == "TCP" and isinstance(port["port"], str), (
                    f"{name}: TCP ports by name (they follow the Deployment's declarations): {port}"
                )
                assert port["port"] not in opened, f"{name}: port {port['port']} in two rules"
                opened[port["port"]] = _sources(rule)
        declared = _declared_ports(deployment)
        assert set(opened) <= declared, f"{name} opens {set(opened) - declared}, which {pod} does not declare"
        assert declared <= set(opened), f"{name} leaves {pod}'s {declared - set(opened)} closed"
        found[pod] = opened
    unguarded = {d["metadata"]["name"] for d in deployments} - set(found)
    assert not unguarded, f"no NetworkPolicy selects {sorted(unguarded)}"
    return found
