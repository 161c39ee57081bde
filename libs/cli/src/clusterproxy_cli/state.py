"""``local.json``: what ``cluster-proxy local up`` started and how to reach it.

Shape (every path absolute)::

    {
      "proxy": {"client_url": "https://127.0.0.1:PORT", "admin_url": "http://127.0.0.1:PORT",
                "api_url": "https://127.0.0.1:PORT", "ca": "...", "cert": "...", "key": "..."},

``admin_url`` is a proxy-server's admin port as plain HTTP (``/healthz``, ``/readyz``, ``/metrics``);
``api_url`` the same port over mutual TLS, where its agents and clusters are served to the hub client
certificate ``cert``/``key`` (``/api/v1/agents``, ``/api/v1/clusters``).
      "clusters": {"cluster1": {"agent_id": "cluster1-agent-1", "kube_apiserver": "127.0.0.1:PORT",
                                "targets": [{"name": "echo", "address": "127.0.0.1:PORT"}]}, ...},
      "pids": {"cluster-proxy": PID, "proxy-server": PID, "cluster1-agent": PID, ...},
      "state_dir": "..."
    }

Other commands (``port-forward --state-dir``) read the proxy settings back from it.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from clusterproxy_protocol import CLUSTER_HEADER, ConfigError, format_authority, parse_hostport, write_atomic

LOCAL_JSON = "local.json"
DEFAULT_STATE_DIR = Path(".state") / "local"


@dataclass(frozen=True)
class Target:
    name: str
    host: str
    port: int

    @property
    def address(self) -> str:
        return format_authority(self.host, self.port)


@dataclass(frozen=True)
class ProxySettings:
    """How to reach a proxy-server's client port with a client certificate."""

    host: str
    port: int
    ca: Path
    cert: Path
    key: Path
    admin_url: str | None = None

    @property
    def client_url(self) -> str:
        return f"https://{format_authority(self.host, self.port)}"

    @property
    def api_url(self) -> str | None:
        """The admin port over mutual TLS (its agents and clusters): the same port as ``admin_url``."""
        return api_url(self.admin_url) if self.admin_url else None


def api_url(admin_url: str) -> str:
    """``https://`` for a proxy-server's ``http://`` admin URL: the port serves both (TLS told apart by
    its first byte), the inventory over TLS only."""
    return "https://" + admin_url.removeprefix("http://")


def build_local_json(
    proxy: ProxySettings,
    clusters: Mapping[str, Mapping[str, Any]],
    pids: Mapping[str, int],
    state_dir: Path,
) -> dict[str, Any]:
    """The ``local.json`` document. ``clusters`` maps a name to ``{"targets": [Target, ...]}`` plus
    optional ``agent_id`` and ``kube_apiserver`` (a Target)."""
    doc_clusters: dict[str, Any] = {}
    for name, info in clusters.items():
        entry: dict[str, Any] = {
            "targets": [{"name": t.name, "address": t.address} for t in info.get("targets", [])]
        }
        if info.get("agent_id"):
            entry["agent_id"] = info["agent_id"]
        if info.get("kube_apiserver") is not None:
            entry["kube_apiserver"] = info["kube_apiserver"].address
        doc_clusters[name] = entry
    return {
        "proxy": {
            "client_url": proxy.client_url,
            "admin_url": proxy.admin_url,
            "api_url": proxy.api_url,
            "ca": str(Path(proxy.ca).resolve()),
            "cert": str(Path(proxy.cert).resolve()),
            "key": str(Path(proxy.key).resolve()),
        },
        "clusters": doc_clusters,
        "pids": dict(pids),
        "state_dir": str(Path(state_dir).resolve()),
    }


def write_local_json(state_dir: Path, doc: Mapping[str, Any]) -> Path:
    """Write ``state_dir/local.json`` atomically; returns its path."""
    path = Path(state_dir) / LOCAL_JSON
    write_atomic(path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), 0o600)
    return path


def read_local_json(state_dir: Path) -> dict[str, Any]:
    """Read and check ``state_dir/local.json``; raises ConfigError naming the file and the problem."""
    path = Path(state_dir) / LOCAL_JSON
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{path} not found: start the local system first with `cluster-proxy local up --state-dir {state_dir}`"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    proxy = doc.get("proxy") if isinstance(doc, dict) else None
    if not isinstance(proxy, dict):
        raise ConfigError(f"{path}: missing object 'proxy'")
    for key in ("client_url", "ca", "cert", "key"):
        if not isinstance(proxy.get(key), str) or not proxy[key]:
            raise ConfigError(f"{path}: 'proxy.{key}' is missing or not a string")
    if not isinstance(doc.get("clusters", {}), dict):
        raise ConfigError(f"{path}: 'clusters' is not an object")
    return doc


def proxy_settings(doc: Mapping[str, Any], source: str = LOCAL_JSON) -> ProxySettings:
    """The proxy settings of a ``local.json`` document."""
    proxy = doc["proxy"]
    url = urlsplit(proxy["client_url"])
    if url.scheme != "https" or not url.netloc:
        raise ConfigError(f"{source}: proxy.client_url {proxy['client_url']!r} is not https://HOST:PORT")
    try:
        host, port = parse_hostport(url.netloc.rpartition("@")[2])
    except ConfigError as exc:
        raise ConfigError(f"{source}: proxy.client_url: {exc}") from None
    return ProxySettings(
        host, port, Path(proxy["ca"]), Path(proxy["cert"]), Path(proxy["key"]), proxy.get("admin_url")
    )


def curl_commands(proxy: ProxySettings, cluster: str, target: Target) -> dict[str, str]:
    """Ready-to-paste curl commands reaching ``target`` in ``cluster`` through the HTTP/1.1 frontend.

    ``proxy-user``: the cluster is the proxy URL's user name (sent as ``Proxy-Authorization``);
    ``header``: the cluster is the ``cluster-proxy-cluster`` header. ``--proxytunnel`` makes curl use
    CONNECT for a plain http:// target too.
    """
    hub = format_authority(proxy.host, proxy.port)
    tls = ["--proxy-cacert", str(proxy.ca), "--proxy-cert", str(proxy.cert), "--proxy-key", str(proxy.key)]
    url = f"http://{target.address}/"
    by_user = ["curl", "--proxytunnel", "--proxy", f"https://{cluster}@{hub}", *tls, url]
    by_header = [
        "curl",
        "--proxytunnel",
        "--proxy",
        f"https://{hub}",
        "--proxy-header",
        f"{CLUSTER_HEADER}: {cluster}",
        *tls,
        url,
    ]
    return {"proxy-user": shlex.join(by_user), "header": shlex.join(by_header)}


def curl_kube_apiserver(proxy: ProxySettings, cluster: str) -> str:
    """curl through the bare-cluster-name route (``CONNECT cluster:443``)."""
    hub = format_authority(proxy.host, proxy.port)
    tls = ["--proxy-cacert", str(proxy.ca), "--proxy-cert", str(proxy.cert), "--proxy-key", str(proxy.key)]
    return shlex.join(["curl", "--proxytunnel", "--proxy", f"https://{hub}", *tls, f"http://{cluster}:443/"])
