"""What ``cluster-proxy local up`` prints once everything is up: what runs where (haproxy and each
replica, tinyproxy and who goes through it), a self-test through the proxy per cluster (and through
each replica), and ready-to-paste commands."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TextIO

import trio

from clusterproxy_protocol import http1client
from clusterproxy_sdk import TLSFiles, open_tunnel

from .local_plan import (
    BALANCER_NAME,
    FORWARD_PROXY_NAME,
    LOOPBACK,
    Ports,
    SignerPlan,
    agent_id,
    echo_target,
    loopback,
)
from .local_proxies import stats_url
from .state import LOCAL_JSON, ProxySettings, Target, curl_commands, curl_kube_apiserver

SELF_TEST_TIMEOUT = 10.0


async def self_test(proxy: ProxySettings, cluster: str, target: Target) -> str:
    """GET / on ``target`` through the proxy with the SDK; returns the echo's message."""
    tls = TLSFiles(proxy.ca, proxy.cert, proxy.key)
    async with open_tunnel((proxy.host, proxy.port), tls, server_hostname="localhost") as tunnel:
        stream = await tunnel.connect(cluster, target.host, target.port)
        async with stream:
            response = await http1client.request(stream, "GET", "/self-test", target.address)
            with trio.move_on_after(2):  # let the echo's close come through: a clean end both ways
                while await stream.receive_some():
                    pass
    if response.status != 200:
        raise RuntimeError(f"echo answered {response.status}")
    return json.loads(response.body).get("message", "")


async def _self_test_line(proxy: ProxySettings, cluster: str, target: Target) -> tuple[bool, str]:
    try:
        with trio.fail_after(SELF_TEST_TIMEOUT):
            message = await self_test(proxy, cluster, target)
    except Exception as exc:
        return False, f"FAILED: {type(exc).__name__}: {exc}"
    return True, f"OK: {message!r}"


async def _replica_checks(proxy: ProxySettings, ports: Ports, cluster: str, target: Target) -> str:
    """The self-test through each replica's own client port: whether every replica has the agent."""
    failed = []
    for server in ports.servers:
        ok, text = await _self_test_line(replace(proxy, port=server.client), cluster, target)
        if not ok:
            failed.append(f"{server.name} {text}")
    if failed:
        return f"; through each proxy-server: {'; '.join(failed)}"
    return f"; through each of the {len(ports.servers)} proxy-servers OK"


async def print_ready(
    proxy: ProxySettings,
    clusters: Sequence[str],
    ports: Ports,
    state_dir: Path,
    out: TextIO,
    signer: SignerPlan | None = None,
    proxied: dict[str, str] | None = None,
) -> None:
    proxied = proxied or {}
    logs = state_dir / "logs"
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("")
    p(f"cluster-proxy local is up ({state_dir / LOCAL_JSON})")
    if signer is not None:
        p(
            f"  cert-signer   {signer.url}  (CA store {signer.store}; leaves live {signer.cert_ttl}, renewed at 80%)"
        )
    if ports.balanced:
        n = len(ports.servers)
        p(
            f"  {BALANCER_NAME:<12}  client port {proxy.client_url}  (TCP mode, mTLS end to end; "
            f"round robin over {n} proxy-servers)"
        )
        p(
            f"                agent port  {loopback(ports.agent)}  (least connections; every agent "
            f"holds a tunnel to each of the {n})"
        )
        p(
            f"                stats       {stats_url(ports.admin)}  (health checks: GET /readyz on "
            f"each admin port; log {logs / f'{BALANCER_NAME}.log'})"
        )
        for server in ports.servers:
            p(
                f"  {server.name:<14}  admin {server.api_url}/api/v1/agents  (own ports: client "
                f"{loopback(server.client)}, agent {loopback(server.agent)})"
            )
    else:
        p(f"  proxy-server  client port {proxy.client_url}  (mTLS; HTTP/2 and HTTP/1.1 CONNECT)")
        p(f"                admin       {proxy.api_url}/api/v1/agents  (mutual TLS: the client certificate)")
    p(
        f"  agents (mTLS)   curl -s --cacert {proxy.ca} --cert {proxy.cert} --key {proxy.key} "
        f"{ports.servers[0].api_url}/api/v1/agents  (plain HTTP on that port: /healthz /readyz /metrics)"
    )
    if ports.forward_proxy is not None and proxied:
        who = ", ".join(f"{cluster}'s agent" for cluster in proxied)
        p(
            f"  {FORWARD_PROXY_NAME:<12}  {loopback(ports.forward_proxy)}  (forward proxy: {who} "
            f"reaches the hub only through it, by CONNECT; log {logs / f'{FORWARD_PROXY_NAME}.log'})"
        )
    for cluster in clusters:
        echo = echo_target(cluster, ports)
        via = f"through {FORWARD_PROXY_NAME} {proxied[cluster]}" if cluster in proxied else "directly"
        ok, text = await _self_test_line(proxy, cluster, echo)
        check = f"self-test through the proxy {text}"
        if ok and ports.balanced:
            check += await _replica_checks(proxy, ports, cluster, echo)
        p(
            f"  {cluster:<12}  agent {agent_id(cluster)} dials {loopback(ports.agent)} {via}, "
            f"echo service {echo.address}; {check}"
        )
    if ports.balanced:
        p("")
        p(
            "A proxy-server that dies is restarted after 1 s; haproxy sends new connections to the "
            f"others meanwhile (try: kill -9 the pid of {ports.servers[-1].name} in local.json)."
        )
    p("")
    p("Reach a cluster's echo service with curl (the proxy URL's user name names the cluster):")
    for cluster in clusters:
        p(f"  {curl_commands(proxy, cluster, echo_target(cluster, ports))['proxy-user']}")
    p("or name the cluster in a header:")
    first = clusters[0]
    p(f"  {curl_commands(proxy, first, echo_target(first, ports))['header']}")
    p(
        "The bare cluster name reaches the cluster's kube-apiserver (locally: its echo service, no real apiserver):"
    )
    p(f"  {curl_kube_apiserver(proxy, first)}")
    p("Forward a local port into a cluster:")
    p(
        f"  cluster-proxy port-forward {first} {LOOPBACK}:{ports.echo[first]} --listen 127.0.0.1:0 --state-dir {state_dir}"
    )
    if signer is not None:
        p("Certificates (every party, its CA, what it trusts; CA rotation with overlap):")
        p(f"  cluster-proxy certs status --store {signer.store}")
        p(f"  cluster-proxy certs rotate-ca --store {signer.store}   # start, then activate, then retire")
    p("")
    p("Press Ctrl-C to stop.")
    out.flush()
