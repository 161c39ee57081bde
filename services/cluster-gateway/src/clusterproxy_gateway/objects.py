"""The API's documents: discovery, ClusterGateway objects and lists, their table form for kubectl, and
``Status`` errors (what kubectl prints as ``Error from server (Reason): message``)."""

from __future__ import annotations

from typing import Any

from .inventory import ClusterEntry

__all__ = [
    "GROUP",
    "KIND",
    "RESOURCE",
    "VERSION",
    "api_group",
    "api_group_list",
    "api_resource_list",
    "cluster_gateway",
    "cluster_gateway_list",
    "not_found_message",
    "status",
    "table",
    "wants_table",
]

GROUP, VERSION = "cluster.core.oam.dev", "v1alpha1"
GROUP_VERSION = f"{GROUP}/{VERSION}"
KIND, RESOURCE = "ClusterGateway", "clustergateways"
PROVIDER = "cluster-proxy"
CREDENTIAL_TYPE = "ServiceAccountToken"
ENDPOINT_TYPE = "ClusterProxy"

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    413: "RequestEntityTooLarge",
    500: "InternalError",
    501: "NotImplemented",
    502: "BadGateway",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def status(code: int, message: str, *, name: str | None = None) -> dict[str, Any]:
    """A ``meta.k8s.io/v1`` Status (kubectl prints ``Error from server (<reason>): <message>``)."""
    reason = _REASONS.get(code, "InternalError")
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if name is not None:
        body["details"] = {"name": name, "group": GROUP, "kind": RESOURCE}
    return body


def _version_entry() -> dict[str, str]:
    return {"groupVersion": GROUP_VERSION, "version": VERSION}


def api_group() -> dict[str, Any]:
    return {
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": GROUP,
        "versions": [_version_entry()],
        "preferredVersion": _version_entry(),
    }


def api_group_list() -> dict[str, Any]:
    group = api_group()
    del group["kind"], group["apiVersion"]
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [group]}


def api_resource_list() -> dict[str, Any]:
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": GROUP_VERSION,
        "resources": [
            {
                "name": RESOURCE,
                "singularName": "clustergateway",
                "namespaced": False,
                "kind": KIND,
                "verbs": ["get", "list", "watch"],
                "shortNames": ["gateway"],
            },
            {
                "name": f"{RESOURCE}/proxy",
                "singularName": "",
                "namespaced": False,
                "kind": "ClusterGatewayProxyOptions",
                "verbs": ["create", "delete", "get", "patch", "update"],
            },
        ],
    }


def cluster_gateway(entry: ClusterEntry) -> dict[str, Any]:
    """The ClusterGateway of one cluster. No credential is ever shown: the token stays on the hub."""
    return {
        "kind": KIND,
        "apiVersion": GROUP_VERSION,
        "metadata": {
            "name": entry.name,
            "uid": entry.uid,
            "resourceVersion": str(entry.resource_version),
            "creationTimestamp": entry.created,
        },
        "spec": {
            "provider": PROVIDER,
            "access": {
                "endpoint": {"type": ENDPOINT_TYPE},
                "credential": {"type": CREDENTIAL_TYPE},
            },
        },
        "status": {
            "healthy": entry.addon_available,
            **({} if entry.addon_available else {"healthyReason": entry.addon_reason}),
        },
    }


def cluster_gateway_list(entries: list[ClusterEntry], resource_version: int) -> dict[str, Any]:
    return {
        "kind": f"{KIND}List",
        "apiVersion": GROUP_VERSION,
        "metadata": {"resourceVersion": str(resource_version)},
        "items": [cluster_gateway(e) for e in entries],
    }


def wants_table(accept: str) -> bool:
    """kubectl get asks for ``application/json;as=Table;v=v1;g=meta.k8s.io`` first."""
    for offer in accept.split(","):
        params = {p.strip().partition("=")[0]: p.strip().partition("=")[2] for p in offer.split(";")[1:]}
        if params.get("as") == "Table" and params.get("g") == "meta.k8s.io" and params.get("v") == "v1":
            return True
    return False


COLUMNS = [
    {"name": "Name", "type": "string", "format": "name", "description": "the managed cluster's name"},
    {"name": "Provider", "type": "string", "format": "", "description": "spec.provider"},
    {"name": "Credential-Type", "type": "string", "format": "", "description": "spec.access.credential.type"},
    {"name": "Endpoint-Type", "type": "string", "format": "", "description": "spec.access.endpoint.type"},
]


def table(entries: list[ClusterEntry], resource_version: int, *, with_columns: bool = True) -> dict[str, Any]:
    """The ``meta.k8s.io/v1`` Table kubectl prints: NAME, PROVIDER, CREDENTIAL-TYPE, ENDPOINT-TYPE."""
    rows = []
    for entry in entries:
        gateway = cluster_gateway(entry)
        rows.append(
            {
                "cells": [entry.name, PROVIDER, CREDENTIAL_TYPE, ENDPOINT_TYPE],
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": gateway["metadata"],
                },
            }
        )
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": str(resource_version)},
        "columnDefinitions": COLUMNS if with_columns else [],
        "rows": rows,
    }


def not_found_message(name: str) -> str:
    return (
        f'clustergateways.{GROUP} "{name}" not found: no ManagedCluster {name!r} with the '
        f"cluster-proxy addon on the hub (kubectl get managedclusters; kubectl get managedclusteraddon -n {name})"
    )
