"""``cluster-proxy health``: is every cluster reachable through its tunnel, and how fast.

::

    CLUSTER NAME    INSTALLED    AVAILABLE    PROBED HEALTH    LATENCY
    cluster1        True         True         True             3.12ms

Where the answer comes from, first match wins:

1. ``--collector URL``: a running health-collector's ``/api/v1/clusters``;
2. ``--admin-url URL`` (repeat) with ``--proxy``/``--ca``/``--cert``/``--key``: straight from the
   proxy-servers, one round of ``cluster-proxy-health-collector --once`` (its console script: the
   library never imports a service);
3. no flags: ``--state-dir`` (default ``.state/local``) ``local.json`` of ``cluster-proxy local up``:
   its collector when it runs one, else its proxy-server as in 2.

Exit status: 0 every cluster healthy; 1 some cluster is not (or a proxy-server did not answer);
2 bad usage; 3 no answer at all (the collector or the proxy-servers cannot be reached).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from clusterproxy_protocol import ConfigError, InvalidValue, add_flag, existing_file, parse_duration

from .commands import executable
from .state import DEFAULT_STATE_DIR, LOCAL_JSON, proxy_settings, read_local_json

__all__ = ["COLLECTOR", "add_health_command", "format_table", "run_health"]

COLLECTOR = "cluster-proxy-health-collector"
EXIT_HEALTHY, EXIT_UNHEALTHY, EXIT_NO_ANSWER = 0, 1, 3
HEADERS = ("CLUSTER NAME", "INSTALLED", "AVAILABLE", "PROBED HEALTH", "LATENCY")
WIDE_HEADERS = (*HEADERS, "AGENTS", "LAST ERROR")
LOCAL_PROBE_URL = (
    "http://{cluster}:443/healthz"  # local mode: an echo service stands in for the kube-apiserver
)


class NoAnswer(Exception):
    """Neither the collector nor the proxy-servers answered; the message says what to do."""


def _url(scheme: str, text: str) -> str:
    value = text.strip().rstrip("/")
    if not value.startswith(f"{scheme}://") or len(value) <= len(f"{scheme}://"):
        raise InvalidValue(f"invalid URL {text!r}: expected {scheme}://HOST:PORT")
    return value


def _http_url(text: str) -> str:
    return _url("http", text)


def _https_url(text: str) -> str:
    """A proxy-server's admin port for its agents and clusters: mutual TLS (an ``http://`` one is the
    probes' face of the same port, which serves no inventory)."""
    return _url("https", text)


def add_health_command(commands: Any) -> argparse.ArgumentParser:
    health = commands.add_parser(
        "health",
        help="is every cluster reachable through its tunnel (installed, available, probed, latency)",
        description="One row per managed cluster: INSTALLED (the addon, or known to a proxy-server), "
        "AVAILABLE (an agent holds a tunnel), PROBED HEALTH (a request through the tunnel succeeded) "
        "and its LATENCY. From a health-collector (--collector), else straight from the proxy-servers "
        f"(--admin-url with the client flags, one round of {COLLECTOR} --once), else from "
        "`cluster-proxy local up`'s local.json.",
        epilog="exit status: 0 all healthy; 1 a cluster is not (or a proxy-server did not answer); "
        "2 bad usage; 3 no answer from the collector or the proxy-servers.",
    )
    add_flag(health, "--collector", env="CLUSTER_PROXY_HEALTH_COLLECTOR", type=_http_url, metavar="URL",
             help="a health-collector, http://HOST:PORT")  # fmt: skip
    add_flag(health, "--admin-url", env="CLUSTER_PROXY_ADMIN_URL", type=_https_url, multiple=True, metavar="URL",
             help="a proxy-server replica's admin port, https://HOST:PORT (repeat; mutual TLS with --cert); "
             "probes go through --proxy")  # fmt: skip
    add_flag(health, "--proxy", env="CLUSTER_PROXY_PROXY", metavar="HOST:PORT",
             help="the proxy-server's client port (with --admin-url)")  # fmt: skip
    add_flag(health, "--ca", env="CLUSTER_PROXY_CA", type=existing_file, help="CA bundle for the server")
    add_flag(health, "--cert", env="CLUSTER_PROXY_CERT", type=existing_file, help="client certificate (PEM)")
    add_flag(health, "--key", env="CLUSTER_PROXY_KEY", type=existing_file, help="client private key (PEM)")
    add_flag(health, "--server-name", env="CLUSTER_PROXY_SERVER_NAME",
             help="name checked against the server certificate (default: the proxy host)")  # fmt: skip
    add_flag(health, "--probe-url", env="CLUSTER_PROXY_PROBE_URL", metavar="URL",
             help="what a probe requests in each cluster, {cluster} for its name (default: the "
             "collector's, https://{cluster}:443/healthz; local mode: " + LOCAL_PROBE_URL + ")")  # fmt: skip
    add_flag(health, "--state-dir", env="CLUSTER_PROXY_STATE_DIR", type=Path,
             help=f"read DIR/{LOCAL_JSON} of `cluster-proxy local up` (default {DEFAULT_STATE_DIR} when "
             "no other source is given)")  # fmt: skip
    add_flag(health, "--timeout", env="CLUSTER_PROXY_HEALTH_TIMEOUT", type=parse_duration, default="30s",
             help="how long to wait for the answer")  # fmt: skip
    health.add_argument("-o", "--output", choices=("table", "wide", "json"), default="table",
                        help="table (the default), wide (adds agents and last error), json (the "
                        "collector's document)")  # fmt: skip
    health.add_argument("clusters", metavar="CLUSTER", nargs="*", help="only these clusters")
    return health


# --- where the answer comes from -------------------------------------------------------------------------


def fetch_collector(url: str, timeout: float) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{url}/api/v1/clusters", timeout=timeout) as answer:
            document = json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        raise NoAnswer(f"the health-collector at {url} answered HTTP {exc.code}") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise NoAnswer(f"the health-collector at {url} does not answer: {reason}") from None
    if not isinstance(document, dict) or not isinstance(document.get("clusters"), list):
        raise NoAnswer(f"{url}/api/v1/clusters is not a health-collector's answer")
    return document


def collect_once(argv: Sequence[str], timeout: float) -> dict[str, Any]:
    """One round of the collector's own command; its JSON document."""
    command = [executable(COLLECTOR), "--once", "--listen=127.0.0.1:0", "--log-level=error", *argv]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise NoAnswer(f"{COLLECTOR} --once did not finish within {timeout:g}s") from None
    if done.returncode != 0:
        detail = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise NoAnswer(f"{COLLECTOR} --once failed: {detail[0]}")
    return json.loads(done.stdout)


def _direct_argv(
    admin_urls: Sequence[str],
    proxy: str | None,
    ca: Path | None,
    cert: Path | None,
    key: Path | None,
    server_name: str | None,
    probe_url: str | None,
) -> list[str]:
    argv = [*(f"--admin-url={url}" for url in admin_urls), f"--ca={ca}", f"--cert={cert}", f"--key={key}"]
    if proxy:
        argv.append(f"--proxy={proxy}")
    if server_name:
        argv.append(f"--server-name={server_name}")
    if probe_url:
        argv.append(f"--probe-url={probe_url}")
    return argv


def resolve_source(args: argparse.Namespace) -> tuple[str, Callable[[], dict[str, Any]]]:
    """What to ask (in words, for errors) and how. ConfigError for a usage problem."""
    timeout = args.timeout
    if args.collector:
        return f"the health-collector at {args.collector}", lambda: fetch_collector(args.collector, timeout)
    if args.admin_url:
        missing = [f for f, v in (("--ca", args.ca), ("--cert", args.cert), ("--key", args.key)) if not v]
        if missing:
            raise ConfigError(
                f"--admin-url needs {', '.join(missing)}: the hub client certificate the proxy-servers "
                "want for their agents and clusters (mutual TLS)"
            )
        argv = _direct_argv(
            args.admin_url, args.proxy, args.ca, args.cert, args.key, args.server_name, args.probe_url
        )
        return "the proxy-servers", lambda: collect_once(argv, timeout)
    state_dir = args.state_dir
    if state_dir is None:
        if not (DEFAULT_STATE_DIR / LOCAL_JSON).exists():
            raise ConfigError(
                "nothing to ask: give --collector http://HOST:PORT (a health-collector), or --admin-url "
                "https://HOST:PORT with --proxy/--ca/--cert/--key (the proxy-servers), or run "
                "`cluster-proxy local up` (its local.json is read by default)"
            )
        state_dir = DEFAULT_STATE_DIR
    doc = read_local_json(state_dir)
    health = doc.get("health") if isinstance(doc.get("health"), dict) else None
    if health and isinstance(health.get("url"), str):
        url = health["url"].rstrip("/")
        return f"local mode's health-collector at {url}", lambda: fetch_collector(url, timeout)
    proxy = proxy_settings(doc, str(Path(state_dir) / LOCAL_JSON))
    if not proxy.api_url:
        raise ConfigError(f"{Path(state_dir) / LOCAL_JSON} names no proxy-server admin URL")
    argv = _direct_argv(
        [proxy.api_url],
        f"{proxy.host}:{proxy.port}",
        proxy.ca,
        proxy.cert,
        proxy.key,
        args.server_name or "localhost",
        args.probe_url or LOCAL_PROBE_URL,
    )
    return "local mode's proxy-server", lambda: collect_once(argv, timeout)


# --- output ----------------------------------------------------------------------------------------------


def _word(value: Any) -> str:
    return {True: "True", False: "False"}.get(value, "Unknown")


def format_latency(ms: Any) -> str:
    if not isinstance(ms, int | float) or isinstance(ms, bool):
        return "-"
    return f"{ms / 1000:.3f}s" if ms >= 1000 else f"{ms:.3f}ms"


def _agents(cluster: Mapping[str, Any]) -> str:
    agents = cluster.get("agents") or []
    if not agents:
        return "-"
    return ",".join(f"{a.get('agent_id')}({len(a.get('replicas') or [])})" for a in agents)


def _last_error(cluster: Mapping[str, Any]) -> str:
    error = cluster.get("last_error")
    if cluster.get("state") == "healthy" or not isinstance(error, dict):
        addon = cluster.get("addon")
        if isinstance(addon, dict) and addon.get("available") is not True and addon.get("message"):
            return " ".join(str(addon["message"]).split())
        return "-"
    return f"{' '.join(str(error.get('message')).split())} ({error.get('at')})"


def format_table(clusters: Sequence[Mapping[str, Any]], *, wide: bool = False) -> str:
    """The upstream ``clusteradm proxy health`` table (columns padded, 4 spaces apart)."""
    headers = WIDE_HEADERS if wide else HEADERS
    rows = []
    for cluster in clusters:
        row = [
            str(cluster.get("name")),
            _word(cluster.get("installed")),
            _word(cluster.get("available")),
            _word(cluster.get("probed")),
            format_latency(cluster.get("latency_ms")) if cluster.get("probed") is True else "-",
        ]
        if wide:
            row += [_agents(cluster), _last_error(cluster)]
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = []
    for cells in (list(headers), *rows):
        padded = [cell.ljust(widths[i]) for i, cell in enumerate(cells[:-1])]
        lines.append("    ".join([*padded, cells[-1]]))
    return "\n".join(lines)


def report(document: Mapping[str, Any], output: str, only: Sequence[str], out: TextIO, err: TextIO) -> int:
    clusters = [c for c in document.get("clusters") or [] if not only or c.get("name") in only]
    missing = [name for name in only if name not in {c.get("name") for c in clusters}]
    if output == "json":
        out.write(json.dumps({**document, "clusters": clusters}, indent=2, sort_keys=True) + "\n")
    else:
        out.write(format_table(clusters, wide=output == "wide") + "\n")
    problems = list(document.get("problems") or [])
    for problem in problems:
        err.write(f"warning: {problem}\n")
    for name in missing:
        err.write(f"error: cluster {name!r} is not known to the collector or any proxy-server\n")
    if not clusters and not missing:
        err.write("no cluster known: no proxy-server answered with one\n")
    unhealthy = [c for c in clusters if c.get("state") != "healthy"]
    servers_down = any(s.get("reachable") is False for s in document.get("proxy_servers") or [])
    if missing or unhealthy or servers_down or (not clusters and problems):
        return EXIT_UNHEALTHY
    return EXIT_HEALTHY


def run_health(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        where, fetch = resolve_source(args)
    except ConfigError as exc:
        parser.error(str(exc))
    try:
        document = fetch()
    except (NoAnswer, ConfigError) as exc:
        print(f"cluster-proxy health: {exc}", file=sys.stderr)
        return EXIT_NO_ANSWER
    except ValueError as exc:
        print(f"cluster-proxy health: {where} answered something unreadable: {exc}", file=sys.stderr)
        return EXIT_NO_ANSWER
    return report(document, args.output, args.clusters, sys.stdout, sys.stderr)
