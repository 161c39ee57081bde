"""The proxy-server's admin port serves what lists clusters and agents only to a hub client over mutual
TLS (on the same port), and stays plain HTTP for the probes and Prometheus.

A real server and a real agent in process; every request is a real TLS or TCP connection to the admin
port. Refused: plain HTTP (403 naming the https:// URL), TLS without a certificate and a client of
another CA (the handshake fails), an agent's certificate (403 naming the role). Answered: the hub
client certificate (the health-collector's kind). Plain ``/metrics`` sums the cluster and agent labels
away; the hub client's ``/metrics`` carries them.
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import pytest
import trio

from clusterproxy_agent.app import Service
from clusterproxy_protocol.pki import PemPair
from clusterproxy_protocol.tls import client_context
from clusterproxy_protocol.wire import ALPN_HTTP1
from tests.support.inprocess import agent_settings, start_server
from tests.support.pki import PkiFiles
from tests.support.procs import client_tls, http_get
from tests.support.waiting import wait_until

INVENTORY = ("/api/v1/agents", "/api/v1/clusters")


async def get(url: str, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    return await trio.to_thread.run_sync(http_get, url, 5.0, context)


def presenting(pair: PemPair | None, ca: Path) -> ssl.SSLContext:
    return client_context(pair.cert if pair else None, pair.key if pair else None, ca, alpn=[ALPN_HTTP1])


@pytest.fixture
async def admin(pki: PkiFiles, nursery: trio.Nursery) -> str:
    """``127.0.0.1:PORT`` of a server's admin port holding one tunnel of cluster1."""
    server, bound = await start_server(nursery, pki, server_id="hub-0", server_count=1)
    service = Service(agent_settings(pki, [bound.agent]))
    await nursery.start(service.run)
    await wait_until(lambda: bool(server.registry.tunnels("cluster1")), timeout=10, what="agent tunnel")
    return f"127.0.0.1:{bound.admin[1]}"


@pytest.mark.parametrize("path", INVENTORY)
async def test_plain_http_is_refused_with_where_to_go(admin: str, path: str) -> None:
    status, body = await get(f"http://{admin}{path}")
    assert status == 403, body
    assert f"https://{admin}{path}".encode() in body and b"mutual TLS" in body, body
    assert b"cluster1" not in body


@pytest.mark.parametrize("who", ["no certificate", "another CA's client"])
async def test_tls_without_a_hub_certificate_fails_the_handshake(pki: PkiFiles, admin: str, who: str) -> None:
    pair = None if who == "no certificate" else pki.foreign_client
    with pytest.raises(OSError):  # the server's alert: certificate required / unknown CA
        await get(f"https://{admin}/api/v1/agents", presenting(pair, pki.ca))


@pytest.mark.parametrize("path", INVENTORY)
async def test_an_agent_certificate_is_refused(pki: PkiFiles, admin: str, path: str) -> None:
    status, body = await get(f"https://{admin}{path}", presenting(pki.agent("cluster1", "agent-a"), pki.ca))
    assert status == 403, body
    assert b"role agent is refused on the admin port, which accepts client certificates only" in body, body
    assert b"agent-a" not in body


async def test_the_hub_client_is_answered(pki: PkiFiles, admin: str) -> None:
    hub = client_tls(pki.client, pki.ca)
    status, body = await get(f"https://{admin}/api/v1/agents", hub)
    assert status == 200, body
    assert [(a["cluster"], a["agent_id"], a["server_id"]) for a in json.loads(body)] == [
        ("cluster1", "agent-a", "hub-0")
    ]
    status, body = await get(f"https://{admin}/api/v1/clusters", hub)
    assert status == 200 and json.loads(body) == {"cluster1": {"agents": 1}}, body
    status, body = await get(f"https://{admin}/metrics", hub)
    assert status == 200 and b'cluster_proxy_server_agent_tunnels{cluster="cluster1"} 1.0' in body, body


async def test_probes_and_prometheus_stay_plain(admin: str) -> None:
    assert await get(f"http://{admin}/healthz") == (200, b"ok\n")
    assert await get(f"http://{admin}/readyz") == (200, b"ready\n")
    status, body = await get(f"http://{admin}/metrics")
    assert status == 200
    # the inventory's labels summed away: the totals stay, the names do not
    assert b"\ncluster_proxy_server_agent_tunnels 1.0\n" in body, body
    assert b'cluster="' not in body and b"agent_id=" not in body and b"cluster1" not in body, body
