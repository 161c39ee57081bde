"""The health-collector's pure parts (probe URLs, the state's answers, the page's policy, metrics
series) and `cluster-proxy health`'s table and exit status."""

from __future__ import annotations

import base64
import hashlib
import io
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from clusterproxy_cli.health import format_latency, format_table, report
from clusterproxy_health.main import parse_settings
from clusterproxy_health.metrics import CollectorMetrics
from clusterproxy_health.page import PAGE_HEADERS, page_html
from clusterproxy_health.probe import CLUSTER_PLACEHOLDER, parse_probe_url
from clusterproxy_health.state import (
    AddonStatus,
    AddonsView,
    AgentTunnel,
    ProbeResult,
    ServerView,
    State,
    parse_agents,
    parse_clusters,
)
from clusterproxy_protocol.config import InvalidValue


@pytest.mark.parametrize(
    ("text", "scheme", "host", "port", "path"),
    [
        ("https://{cluster}:443/healthz", "https", CLUSTER_PLACEHOLDER, 443, "/healthz"),
        ("https://{cluster}/livez", "https", CLUSTER_PLACEHOLDER, 443, "/livez"),
        ("http://10.0.0.5:8080/ready", "http", "10.0.0.5", 8080, "/ready"),
        ("http://svc.ns.svc", "http", "svc.ns.svc", 80, "/"),
        ("tcp://{cluster}:443", "tcp", CLUSTER_PLACEHOLDER, 443, "/"),
        ("https://[fd00::1]:6443/healthz", "https", "fd00::1", 6443, "/healthz"),
    ],
)
def test_probe_urls(text: str, scheme: str, host: str, port: int, path: str) -> None:
    spec = parse_probe_url(text)
    assert (spec.scheme, spec.host, spec.port, spec.path) == (scheme, host, port, path)
    assert spec.target("c1") == ("c1" if host == CLUSTER_PLACEHOLDER else host, port)


@pytest.mark.parametrize(
    "text",
    ["ftp://{cluster}/", "https://{cluster}:0/", "tcp://{cluster}", "https://a b/", "https://u@h/x?q=1"],
)
def test_bad_probe_urls_are_refused_with_the_value(text: str) -> None:
    with pytest.raises(InvalidValue, match=re.escape(repr(text))):
        parse_probe_url(text)


def test_collector_flags_refuse_what_cannot_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = []
    for name in ("ca", "cert", "key"):
        (tmp_path / name).write_text("")
        files.append(f"--{name}={tmp_path / name}")
    with pytest.raises(SystemExit) as exited:
        parse_settings(files, environ={})
    assert exited.value.code == 2
    assert "--admin-url" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the admin API (agents, clusters) wants the client certificate
        parse_settings(["--admin-url", "https://h:1"], environ={})
    assert "give --ca, --cert, --key: the hub client certificate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings(["--admin-url", "http://h:1", *files], environ={})
    assert "served over mutual TLS only: https://h:1 (the same port)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings(["--admin-url", "https://h:1/x", *files], environ={})
    assert "invalid admin URL 'https://h:1/x'" in capsys.readouterr().err
    settings, once = parse_settings(
        ["--once", *files], environ={"CLUSTER_PROXY_HEALTH_ADMIN_URL": "https://a:1,https://b:2"}
    )
    assert once and settings.admin_urls == ["https://a:1", "https://b:2"] and settings.proxy is None


def test_signer_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With --signer the certificate files need not exist yet (the collector writes them); without it
    each must; a token needs a signer, a signer needs the probes' --proxy."""
    files = [f"--ca={tmp_path / 'ca.crt'}", f"--cert={tmp_path / 'tls.crt'}", f"--key={tmp_path / 'tls.key'}"]
    base = ["--admin-url=https://h:1", "--proxy=h:2", *files]
    with pytest.raises(SystemExit):
        parse_settings(base, environ={})
    assert "argument --ca: file not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings(base, environ={"CLUSTER_PROXY_HEALTH_BOOTSTRAP_TOKEN": "t"})
    assert "--bootstrap-token needs --signer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings(["--admin-url=https://h:1", "--signer=signer:8443", *files], environ={})
    assert "--signer needs --proxy" in capsys.readouterr().err
    settings, _ = parse_settings(
        [*base, "--signer=signer.ns.svc:8443"], environ={"CLUSTER_PROXY_HEALTH_BOOTSTRAP_TOKEN": " tok \n"}
    )
    assert (settings.signer, settings.bootstrap_token, settings.client_name) == (
        "https://signer.ns.svc:8443",
        "tok",
        "health-collector",
    )
    with pytest.raises(SystemExit):
        parse_settings([*base, "--signer=https://s:1", "--client-name=Not A Name"], environ={})
    assert "invalid client name" in capsys.readouterr().err


def _tunnel(cluster: str, agent: str, server: str) -> AgentTunnel:
    return AgentTunnel(cluster, agent, server, open_streams=1, bytes_in=10, bytes_out=20, last_rtt=0.002)


def test_servers_mode_answers() -> None:
    state = State()
    server = ServerView(
        "http://a", 0, known={"c1": 2, "c2": 0}, tunnels=[_tunnel("c1", "x", "s1"), _tunnel("c1", "x", "s2")]
    )
    state.update_sources([server, ServerView("http://b", 0, error="refused")], None, now=100)
    c1, c2 = state.clusters["c1"], state.clusters["c2"]
    assert (c1.installed, c1.available, c1.probed, c1.state) == (True, True, None, "unknown")
    c1.record_probe(ProbeResult(100, 0.004))
    assert c1.healthy and c1.to_json()["latency_ms"] == 4.0
    assert c1.agents() == [
        {
            "agent_id": "x",
            "replicas": ["s1", "s2"],
            "tunnels": 2,
            "open_streams": 2,
            "bytes_in": 20,
            "bytes_out": 40,
            "last_rtt_ms": 2.0,
            "connected_since": None,
            "draining": False,
        }
    ]
    assert (c2.installed, c2.available) == (True, False)
    c2.record_probe(ProbeResult(100, None, "no agent", "refused_503"))
    assert c2.state == "unhealthy" and c2.to_json()["last_error"]["message"] == "no agent"
    document = state.document(interval=10, probe={}, now=101)
    assert document["summary"] == {"clusters": 2, "healthy": 1, "unhealthy": 1, "unknown": 0}
    assert document["problems"] == ["proxy-server http://b did not answer: refused"]

    # every server down: nothing can be said; a cluster not mentioned for long is forgotten
    state.update_sources([ServerView("http://a", 0, error="refused")], None, now=200)
    assert (c1.installed, c1.available) == (None, None)
    state.forget_after = 50
    assert sorted(state.update_sources([ServerView("http://a", 0, known={})], None, now=260)) == ["c1", "c2"]


def test_kubernetes_mode_answers_come_from_the_addons() -> None:
    state = State(kubernetes=True)
    addons = AddonsView(
        0, addons={"c1": AddonStatus(True), "c2": AddonStatus(False, "ProxyAgentNotConnected", "no agent")}
    )
    addons.clusters = {"c1", "c2", "c3"}
    state.update_sources([ServerView("http://a", 0, known={"c1": 1})], addons, now=1)
    answers = {n: (r.installed, r.available) for n, r in state.clusters.items()}
    assert answers == {"c1": (True, True), "c2": (True, False), "c3": (False, False)}
    state.update_sources([], AddonsView(2, error="HTTP 403"), now=2)
    assert state.clusters["c1"].installed is None
    assert (
        "cannot read the ManagedClusterAddOns: HTTP 403"
        in state.document(interval=1, probe={}, now=2)["problems"]
    )


def test_admin_answers_are_parsed_defensively() -> None:
    assert parse_clusters({"c1": {"agents": 2}, "c2": {"agents": "x"}, "c3": None}) == {
        "c1": 2,
        "c2": 0,
        "c3": 0,
    }
    tunnels = parse_agents(
        [{"cluster": "c1", "agent_id": "a", "last_rtt": float("nan")}, {"cluster": 5}, "junk"], "http://s"
    )
    assert tunnels == [AgentTunnel("c1", "a", "http://s")]
    with pytest.raises(ValueError):
        parse_agents({}, "http://s")


def test_the_pages_policy_allows_exactly_its_own_script_and_style() -> None:
    html = page_html().decode()
    script = html.split("<script>", 1)[1].split("</script>", 1)[0]
    style = html.split("<style>", 1)[1].split("</style>", 1)[0]
    policy = dict(PAGE_HEADERS)["content-security-policy"]

    def digest(text: str) -> str:
        return base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()

    assert f"script-src 'sha256-{digest(script)}'" in policy
    assert f"style-src 'sha256-{digest(style)}'" in policy
    assert "default-src 'none'" in policy
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "eval(" not in script


def test_forgotten_clusters_leave_the_metrics() -> None:
    metrics = CollectorMetrics()
    metrics.probe("c1", 0.01, "")
    metrics.probe("c1", None, "timeout")
    metrics.probe("c2", None, "refused_503")
    metrics.forget("c1")
    text = generate_latest(metrics.registry).decode()
    labels = {s.labels.get("cluster") for f in text_string_to_metric_families(text) for s in f.samples}
    assert "c1" not in labels and "c2" in labels


ROW = {
    "name": "cluster1",
    "state": "healthy",
    "installed": True,
    "available": True,
    "probed": True,
    "latency_ms": 67.595144,
    "agents": [{"agent_id": "cluster1-agent-1", "replicas": ["s1", "s2"]}],
}
BAD = {
    "name": "a-much-longer-cluster-name",
    "state": "unhealthy",
    "installed": True,
    "available": False,
    "probed": False,
    "latency_ms": None,
    "agents": [],
    "last_error": {"message": "no agent\nconnected", "at": "2026-01-01T00:00:00.000Z"},
}


def test_the_table_is_upstreams() -> None:
    assert format_table([ROW]).splitlines() == [
        "CLUSTER NAME    INSTALLED    AVAILABLE    PROBED HEALTH    LATENCY",
        "cluster1        True         True         True             67.595ms",
    ]
    wide = format_table([ROW, BAD], wide=True).splitlines()
    assert wide[0].split() == [
        *[
            "CLUSTER",
            "NAME",
            "INSTALLED",
            "AVAILABLE",
            "PROBED",
            "HEALTH",
            "LATENCY",
            "AGENTS",
            "LAST",
            "ERROR",
        ]
    ]
    assert wide[1].split()[5] == "cluster1-agent-1(2)"
    assert wide[2].endswith("no agent connected (2026-01-01T00:00:00.000Z)")
    assert format_latency(1500) == "1.500s" and format_latency(None) == "-"


def test_exit_status_and_warnings() -> None:
    out, err = io.StringIO(), io.StringIO()
    assert report({"clusters": [ROW]}, "table", [], out, err) == 0
    assert report({"clusters": [ROW, BAD]}, "table", [], out, err) == 1
    assert report({"clusters": [ROW, BAD]}, "table", ["cluster1"], out, err) == 0
    assert report({"clusters": [ROW]}, "table", ["nope"], out, err) == 1
    down = {"clusters": [ROW], "proxy_servers": [{"reachable": False}], "problems": ["proxy-server x down"]}
    err = io.StringIO()
    assert report(down, "table", [], out, err) == 1
    assert "warning: proxy-server x down" in err.getvalue()
