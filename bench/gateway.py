"""The gateway workload: ``GET /healthz`` of cluster1's kube-apiserver through the hub and the
cluster-gateway (seed 004's ``kubectl get --raw .../clustergateways/cluster1/proxy/healthz``) against the
same request straight to cluster1's API server.

Real API servers (etcd, hub, cluster1; tests.support.kubeapi, built into the tool cache on first use),
the addon's stack and the gateway behind the hub's aggregator (tests/support/gateway_rig.py, what the kube
tests run). Two systems of the report: ``direct`` is straight to cluster1's kube-apiserver, ``ours`` is
hub kube-apiserver -> aggregator -> gateway -> proxy-server -> tunnel -> agent -> cluster1. Both as the
clusters' admin (a client certificate), so that both servers authorize the same way. Variants:

- ``new-connection``: each request on a new TLS connection, as a ``kubectl get --raw`` pays it;
- ``keep-alive``: every request on one kept-alive connection, as a controller's client pays it (the hub
  connection is reused; the gateway's hop to the cluster is a new tunnel stream and TLS session per
  request either way).

Sequential requests, every answer checked (200, ``ok``); ``count`` per variant, system and repeat,
interleaved (direct, ours, direct, ...). Bounded: each request times out after 30 s and the workload
stops after ``time_limit`` seconds with what it measured.
"""

from __future__ import annotations

import http.client
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REQUEST_TIMEOUT = 30.0
VARIANTS = ("new-connection", "keep-alive")


@dataclass(frozen=True)
class Target:
    system: str  # the report's column: direct or ours
    host: str
    port: int
    path: str
    context: ssl.SSLContext


def _one(connection: http.client.HTTPSConnection, path: str) -> float:
    started = time.perf_counter()
    connection.request("GET", path)
    answer = connection.getresponse()
    body = answer.read()
    elapsed = (time.perf_counter() - started) * 1000
    if answer.status != 200 or body.strip() != b"ok":
        raise RuntimeError(f"GET {path}: {answer.status} {body[:300]!r}")
    return elapsed


def measure(target: Target, variant: str, count: int) -> list[float]:
    """Milliseconds of ``count`` sequential GETs (request sent to body read; a new connection's TLS
    handshake included in its request)."""
    measured = []
    if variant == "keep-alive":
        connection = http.client.HTTPSConnection(
            target.host, target.port, context=target.context, timeout=REQUEST_TIMEOUT
        )
        try:
            _one(connection, target.path)  # the connection's handshake, not measured
            measured = [_one(connection, target.path) for _ in range(count)]
        finally:
            connection.close()
        return measured
    for _ in range(count):
        connection = http.client.HTTPSConnection(
            target.host, target.port, context=target.context, timeout=REQUEST_TIMEOUT
        )
        try:
            measured.append(_one(connection, target.path))
        finally:
            connection.close()
    return measured


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def figures(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(percentile(values, 50), 2),
        "p99_ms": round(percentile(values, 99), 2),
        "mean_ms": round(sum(values) / len(values), 2),
        "requests": len(values),
    }


def run_gateway_workload(
    directory: Path,
    *,
    count: int,
    repeats: int,
    time_limit: float,
    record: Callable[[str, str, int, dict[str, Any]], None],
    failed: Callable[[str, str, int, str], None],
    log: Callable[[str], None],
) -> dict[str, list[str]]:
    """Start the clusters and the gateway under ``directory``, measure, stop everything; ``record(variant,
    system, rep, metrics)`` per measurement. Returns the gateway's command line for the report."""
    from tests.support.gateway_rig import running_gateway
    from tests.support.kubeapi import KubeClusters, binaries

    started = time.monotonic()
    log("gateway: starting etcd and the hub, cluster1 and cluster2 kube-apiservers")
    with KubeClusters(directory / "kube", built=binaries()) as clusters:
        from tests.support.kubeapi import install_crds

        install_crds(clusters["hub"])
        log(
            f"gateway: API servers ready after {time.monotonic() - started:.0f} s; the addon's stack and the gateway"
        )
        with running_gateway(clusters, directory / "gateway", ("cluster1",), log_level="info") as gw:
            from tests.support.gateway_rig import _set_reader

            _set_reader(gw.clusters["cluster1"].api, True)
            hub, cluster1 = gw.hub, gw.clusters["cluster1"].api
            targets = [
                Target("direct", "127.0.0.1", cluster1.port, "/healthz", cluster1.admin_ssl_context()),
                Target(
                    "ours",
                    "127.0.0.1",
                    hub.port,
                    gw.proxy_path(gw.clusters["cluster1"].name, "/healthz"),
                    hub.admin_ssl_context(),
                ),
            ]
            # warm-up: discovery caches, the aggregator's connection to the gateway, the agent's dial
            for target in targets:
                measure(target, "new-connection", 5)
            log(f"gateway: ready after {time.monotonic() - started:.0f} s; measuring")
            for rep in range(repeats):
                for variant in VARIANTS:
                    for target in targets:
                        if time.monotonic() - started > time_limit:
                            failed(variant, target.system, rep, f"time limit {time_limit:.0f} s reached")
                            continue
                        try:
                            record(variant, target.system, rep, figures(measure(target, variant, count)))
                        except Exception as exc:
                            failed(variant, target.system, rep, f"{type(exc).__name__}: {exc}")
            return {"cluster-gateway": gw.process.argv}
