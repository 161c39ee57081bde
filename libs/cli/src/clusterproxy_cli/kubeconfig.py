"""``cluster-proxy kubeconfig CLUSTER``: a kubeconfig for one managed cluster, through the hub's gateway.

It is the hub kubeconfig's current context (or ``--context``) with the server moved to the cluster's
``proxy`` subresource, seed 004's suffix trick::

    server: https://HUB/apis/cluster.core.oam.dev/v1alpha1/clustergateways/CLUSTER/proxy

The credentials stay the hub user's: the hub authenticates the caller and authorizes
``clustergateways/proxy`` with its own RBAC; the gateway talks to the managed cluster with that cluster's
token. Nothing of the managed cluster (endpoint, CA, credential) is needed or written. Relative file
paths of the hub kubeconfig (``certificate-authority``, ``client-certificate``, ...) are made absolute,
so the new file works from any directory.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from clusterproxy_protocol import ConfigError
from clusterproxy_sdk import check_cluster

__all__ = ["GATEWAY_PATH", "add_kubeconfig_command", "gateway_kubeconfig", "run_kubeconfig"]

GATEWAY_PATH = "/apis/cluster.core.oam.dev/v1alpha1/clustergateways/{cluster}/proxy"
PATH_KEYS = {
    "cluster": ("certificate-authority",),
    "user": ("client-certificate", "client-key", "tokenFile"),
}


def add_kubeconfig_command(commands: Any) -> argparse.ArgumentParser:
    command = commands.add_parser(
        "kubeconfig",
        help="write a kubeconfig for one managed cluster, through the hub's cluster-gateway",
        description="A kubeconfig whose server is the hub's clustergateways/CLUSTER/proxy subresource, with "
        "the hub user's credentials of the hub kubeconfig's current context (kubectl then reaches the "
        "managed cluster through the hub; see docs/cluster-gateway.md).",
    )
    command.add_argument("cluster", metavar="CLUSTER", help="the ManagedCluster's name")
    command.add_argument(
        "--kubeconfig",
        type=Path,
        help="the hub kubeconfig (default: the first file of $KUBECONFIG, else ~/.kube/config)",
    )
    command.add_argument("--context", help="the hub context to use (default: its current context)")
    command.add_argument("-o", "--output", type=Path, help="write here (mode 0600) instead of stdout")
    return command


def _hub_kubeconfig_path(given: Path | None) -> Path:
    if given is not None:
        path, source = given, "--kubeconfig"
    elif os.environ.get("KUBECONFIG"):
        path, source = Path(os.environ["KUBECONFIG"].split(os.pathsep)[0]), "$KUBECONFIG"
    else:
        path, source = Path.home() / ".kube" / "config", "the default kubeconfig"
    if not path.is_file():
        raise ConfigError(f"{source} {path}: no such file; pass --kubeconfig with the hub's kubeconfig")
    return path


def _named(
    items: list[dict[str, Any]] | None, name: str, kind: str, path: Path, *, what: str | None = None
) -> dict[str, Any]:
    for item in items or []:
        if item.get("name") == name:
            return copy.deepcopy(item)
    raise ConfigError(f"{what or f'the hub kubeconfig {path}'} has no {kind} named {name!r}")


def _absolute(entry: dict[str, Any], keys: tuple[str, ...], base: Path) -> None:
    for key in keys:
        value = entry.get(key)
        if isinstance(value, str) and value and not os.path.isabs(value):
            entry[key] = str((base / value).resolve())


def gateway_kubeconfig(
    hub: dict[str, Any], cluster: str, *, context: str | None, path: Path
) -> dict[str, Any]:
    """The kubeconfig document for ``cluster`` made from the hub's (``path`` resolves relative files)."""
    check_cluster(cluster)
    context_name = context or hub.get("current-context")
    if not context_name:
        raise ConfigError(f"the hub kubeconfig {path} has no current-context; pass --context")
    hub_context = _named(hub.get("contexts"), context_name, "context", path)["context"]
    hub_cluster = _named(hub.get("clusters"), hub_context.get("cluster", ""), "cluster", path)["cluster"]
    user_name = hub_context.get("user", "")
    user = _named(hub.get("users"), user_name, "user", path)["user"] if user_name else {}
    server = str(hub_cluster.get("server") or "")
    if not server.startswith("https://"):
        raise ConfigError(
            f"the hub cluster of context {context_name!r} in {path} has server {server!r}: the gateway is "
            "reached through the hub kube-apiserver's HTTPS address"
        )
    if "/clustergateways/" in server:
        raise ConfigError(
            f"context {context_name!r} of {path} already points at a cluster gateway ({server}); "
            "use the hub's own kubeconfig"
        )
    base = path.resolve().parent
    _absolute(hub_cluster, PATH_KEYS["cluster"], base)
    _absolute(user, PATH_KEYS["user"], base)
    hub_cluster["server"] = server.rstrip("/") + GATEWAY_PATH.format(cluster=cluster)
    user_entry = f"{user_name or 'hub-user'}@hub"
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster, "cluster": hub_cluster}],
        "users": [{"name": user_entry, "user": user}],
        "contexts": [
            {
                "name": cluster,
                "context": {
                    "cluster": cluster,
                    "user": user_entry,
                    **({"namespace": hub_context["namespace"]} if hub_context.get("namespace") else {}),
                },
            }
        ],
        "current-context": cluster,
    }


def run_kubeconfig(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        check_cluster(args.cluster)
        path = _hub_kubeconfig_path(args.kubeconfig)
        try:
            hub = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read the hub kubeconfig {path}: {exc}") from None
        if not isinstance(hub, dict):
            raise ConfigError(f"the hub kubeconfig {path} is not a kubeconfig (no mapping at its top)")
        document = gateway_kubeconfig(hub, args.cluster, context=args.context, path=path)
    except (ConfigError, ValueError) as exc:
        print(f"cluster-proxy kubeconfig: {exc}", file=sys.stderr)
        return 1
    text = yaml.safe_dump(document, sort_keys=False)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        descriptor = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as out:
            out.write(text)
    except OSError as exc:
        print(f"cluster-proxy kubeconfig: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.output}: KUBECONFIG={args.output} kubectl get ns reaches {args.cluster}",
        file=sys.stderr,
    )
    return 0
