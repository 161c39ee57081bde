"""The managed service accounts' objects the manager renders, pure functions (no I/O): in a managed
cluster (inside the agent's ManifestWork) the namespace of the managed service accounts with the
agent's Role there and the cluster-gateway service proxy's ClusterRole; on the hub, the
cluster-gateway's ManagedServiceAccounts in each cluster's namespace (docs/managed-serviceaccount.md).
"""

from __future__ import annotations

from typing import Any

from .render import (
    ADDON_NAME,
    AGENT_SERVICE_ACCOUNT,
    GATEWAY_SERVICEACCOUNT,
    MANAGED_BY,
    PART_OF,
    SERVICE_PROXY_ROLE,
    SERVICE_PROXY_SERVICEACCOUNT,
    SERVICEACCOUNT_NAMESPACE,
    SERVICEACCOUNT_ROLE,
    labels,
)

__all__ = ["gateway_managed_serviceaccount", "service_proxy_rbac", "serviceaccount_manifests"]


def serviceaccount_manifests(agent_namespace: str) -> list[dict[str, Any]]:
    """The namespace of the managed service accounts and the agent's rights there: exactly what its control
    endpoint does (read, make and delete a ServiceAccount, ask TokenRequest for its token), nothing else."""
    meta = {
        "name": SERVICEACCOUNT_ROLE,
        "namespace": SERVICEACCOUNT_NAMESPACE,
        "labels": labels("proxy-agent"),
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": SERVICEACCOUNT_NAMESPACE, "labels": labels("proxy-agent")},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [
                {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["get", "create", "delete"]},
                {"apiGroups": [""], "resources": ["serviceaccounts/token"], "verbs": ["create"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": SERVICEACCOUNT_ROLE},
            "subjects": [
                {"kind": "ServiceAccount", "name": AGENT_SERVICE_ACCOUNT, "namespace": agent_namespace}
            ],
        },
    ]


def service_proxy_rbac() -> list[dict[str, Any]]:
    """What the service proxy's ServiceAccount may do in the managed cluster: ``create`` TokenReviews (is
    a caller's token this cluster's?) and SubjectAccessReviews (may a hub caller impersonate whom it asks
    for?), and ``impersonate`` users, groups and ServiceAccounts (a hub caller's identity, or the one it
    was allowed to ask for). No ``uids`` or ``userextras``: the service proxy carries neither. It can
    read or change nothing by itself: every request it makes for a caller is authorized as that caller."""
    meta = {"name": SERVICE_PROXY_ROLE, "labels": labels("proxy-agent")}
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": meta,
            "rules": [
                {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
                {
                    "apiGroups": ["authorization.k8s.io"],
                    "resources": ["subjectaccessreviews"],
                    "verbs": ["create"],
                },
                {
                    "apiGroups": [""],
                    "resources": ["users", "groups", "serviceaccounts"],
                    "verbs": ["impersonate"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": meta,
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": SERVICE_PROXY_ROLE,
            },
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": SERVICE_PROXY_SERVICEACCOUNT,
                    "namespace": SERVICEACCOUNT_NAMESPACE,
                }
            ],
        },
    ]


def gateway_managed_serviceaccount(
    cluster: str, addon_uid: str, name: str = GATEWAY_SERVICEACCOUNT
) -> dict[str, Any]:
    """Created once with the addon (never overwritten: an admin may change its rotation), owned by the
    ManagedClusterAddOn so that a hub's garbage collector removes it with the addon."""
    return {
        "apiVersion": "authentication.open-cluster-management.io/v1beta1",
        "kind": "ManagedServiceAccount",
        "metadata": {
            "name": name,
            "namespace": cluster,
            "labels": {"app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/managed-by": MANAGED_BY},
            "ownerReferences": [
                {
                    "apiVersion": "addon.open-cluster-management.io/v1alpha1",
                    "kind": "ManagedClusterAddOn",
                    "name": ADDON_NAME,
                    "uid": addon_uid,
                }
            ],
        },
        "spec": {"rotation": {"enabled": True}},
    }
