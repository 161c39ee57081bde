"""The RBAC the Kubernetes backend (:mod:`clusterproxy_castore.kubestore`) needs: the verbs it uses on
Secrets and the Role and RoleBinding that grant them to the cert-signer's ServiceAccount, in the store's
namespace only. Apart from the store because deployment code (the addon-manager's rendering, kustomize,
tests) needs the grant without talking to an API server; ``kubestore`` re-exports these names.
"""

from __future__ import annotations

__all__ = ["RBAC_VERBS", "RBAC_YAML", "rbac_yaml"]

#: Every verb the store uses on ``secrets``, in its namespace (nothing else, nothing cluster-scoped).
RBAC_VERBS: tuple[str, ...] = ("get", "list", "create", "update", "delete")

#: The Role and RoleBinding the cert-signer's ServiceAccount needs for ``--store kubernetes:NAMESPACE``.
#: Fill in with :func:`rbac_yaml` (or by hand / kustomize: ``{namespace}`` and ``{service_account}``).
RBAC_YAML = """\
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: cluster-proxy-cert-signer
  namespace: {namespace}
  labels:
    app.kubernetes.io/part-of: cluster-proxy
    app.kubernetes.io/component: cert-signer
rules:
  # the CA list, bootstrap tokens and issued-certificate records (kubestore.py has the layout)
  - apiGroups: [""]
    resources: ["secrets"]
    verbs: ["get", "list", "create", "update", "delete"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: cluster-proxy-cert-signer
  namespace: {namespace}
  labels:
    app.kubernetes.io/part-of: cluster-proxy
    app.kubernetes.io/component: cert-signer
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: cluster-proxy-cert-signer
subjects:
  - kind: ServiceAccount
    name: {service_account}
    namespace: {namespace}
"""


def rbac_yaml(namespace: str, service_account: str = "cluster-proxy-cert-signer") -> str:
    """:data:`RBAC_YAML` for a namespace and the signer's ServiceAccount."""
    return RBAC_YAML.format(namespace=namespace, service_account=service_account)
