"""What ``cluster-proxy local up`` prints once everything is up: what runs where, a self-test through
the proxy per cluster, and ready-to-paste commands."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import trio

from clusterproxy_sdk import TLSFiles, open_tunnel

from . import _http
from .local_plan import LOOPBACK, Ports, SignerPlan, agent_id, echo_target
from .state import LOCAL_JSON, ProxySettings, Target, curl_commands, curl_kube_apiserver


async def self_test(proxy: ProxySettings, cluster: str, target: Target) -> str:
    """GET / on ``target`` through the proxy with the SDK; returns the echo's message."""
    tls = TLSFiles(proxy.ca, proxy.cert, proxy.key)
    async with open_tunnel((proxy.host, proxy.port), tls, server_hostname="localhost") as tunnel:
        stream = await tunnel.connect(cluster, target.host, target.port)
        async with stream:
            response = await _http.request(stream, "GET", "/self-test", target.address)
            with trio.move_on_after(2):  # let the echo's close come through: a clean end both ways
                while await stream.receive_some():
                    pass
    if response.status != 200:
        raise RuntimeError(f"echo answered {response.status}")
    return json.loads(response.body).get("message", "")


async def print_ready(
    proxy: ProxySettings,
    clusters: Sequence[str],
    ports: Ports,
    state_dir: Path,
    out: TextIO,
    signer: SignerPlan | None = None,
) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("")
    p(f"cluster-proxy local is up ({state_dir / LOCAL_JSON})")
    if signer is not None:
        p(
            f"  cert-signer   {signer.url}  (CA store {signer.store}; leaves live {signer.cert_ttl}, renewed at 80%)"
        )
    p(f"  proxy-server  client port {proxy.client_url}  (mTLS; HTTP/2 and HTTP/1.1 CONNECT)")
    p(f"                admin       {proxy.admin_url}/api/v1/agents")
    for cluster in clusters:
        echo = echo_target(cluster, ports)
        try:
            with trio.fail_after(10):
                message = await self_test(proxy, cluster, echo)
            check = f"self-test through the proxy OK: {message!r}"
        except Exception as exc:
            check = f"self-test through the proxy FAILED: {type(exc).__name__}: {exc}"
        p(f"  {cluster:<12}  agent {agent_id(cluster)}, echo service {echo.address}; {check}")
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
