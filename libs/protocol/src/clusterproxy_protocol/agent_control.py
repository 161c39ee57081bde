"""The agent's control endpoint: the vocabulary shared by the proxy-server, the agent and the hub client
that calls it (the cluster-gateway's managed service accounts, docs/managed-serviceaccount.md).

A hub client reaches it as an ordinary tunnel stream: ``CONNECT`` to the reserved target
:data:`CONTROL_AUTHORITY` with the cluster named in ``cluster-proxy-cluster``. The name is under
``.invalid`` (RFC 2606), so it can never be a real host an agent would dial. The proxy-server lets only
the hub clients of its control allow-list through (``--control-client``) and then marks the stream to
the agent with :data:`CONTROL_CLIENT_HEADER` naming that client; the agent answers the reserved target
itself, and only on a stream so marked (a proxy-server that does not authorize the target never sets
the header, and nothing a client sends reaches the agent as a header). Inside the stream, HTTP/1.1:

- ``POST /v1/serviceaccounts/NAME/token`` with ``{"expirationSeconds": N}``: the ServiceAccount NAME
  exists in the agent's service-account namespace (made when missing) and a TokenRequest token of it
  comes back as ``{"namespace", "serviceAccount", "token", "expirationTimestamp", "caBundle"}`` (the
  CA bundle of the managed cluster's kube-apiserver, as the agent trusts it);
- ``DELETE /v1/serviceaccounts/NAME``: the ServiceAccount is gone (``{"deleted": true|false}``).

Errors are JSON ``{"message": ...}`` with the status of the failure (the managed cluster's own status
when its API server refused).
"""

from __future__ import annotations

import re

__all__ = [
    "CONTROL_AUTHORITY",
    "CONTROL_CLIENT_HEADER",
    "CONTROL_HOST",
    "CONTROL_PORT",
    "SERVICEACCOUNT_PATH",
    "serviceaccount_path",
]

CONTROL_HOST = "agent-control.cluster-proxy.invalid"
CONTROL_PORT = 80
CONTROL_AUTHORITY = f"{CONTROL_HOST}:{CONTROL_PORT}"
# Set by the proxy-server on a CONNECT to CONTROL_AUTHORITY it authorized: the client's name.
CONTROL_CLIENT_HEADER = "cluster-proxy-control-client"

# /v1/serviceaccounts/NAME and /v1/serviceaccounts/NAME/token; NAME a DNS-1123 subdomain
SERVICEACCOUNT_PATH = re.compile(
    r"^/v1/serviceaccounts/(?P<name>[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?)(?P<token>/token)?$"
)


def serviceaccount_path(name: str, *, token: bool = False) -> str:
    return f"/v1/serviceaccounts/{name}" + ("/token" if token else "")
