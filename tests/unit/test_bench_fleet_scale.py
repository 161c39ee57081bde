"""The 10,000-cluster tool's arithmetic and parsing (bench/fleet_scale.py) and the fleet's status
(bench/fleet.py); the run itself is a benchmark, run by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import fleet_scale as fs
from bench.fleet import admin_address, server_base

SNMP = """Ip: Forwarding DefaultTTL InReceives
Ip: 1 64 1000
Tcp: RtoAlgorithm RtoMin ActiveOpens PassiveOpens AttemptFails
Tcp: 1 200 5000 4321 7
Udp: InDatagrams NoPorts
Udp: 10 2
"""

NETSTAT = """TcpExt: SyncookiesSent ListenOverflows ListenDrops
TcpExt: 0 12 15
IpExt: InNoRoutes InTruncatedPkts
IpExt: 0 0
"""

METRICS = """# HELP cluster_proxy_server_agent_tunnels Agent tunnels
# TYPE cluster_proxy_server_agent_tunnels gauge
cluster_proxy_server_agent_tunnels 19998.0
cluster_proxy_server_agent_connects_total{cluster="fleet-1"} 2.0
cluster_proxy_server_agent_connects_total{cluster="fleet-2"} 1.0
cluster_proxy_server_rejected_connections_total{port="agent",reason="SSLEOFError"} 3.0
cluster_proxy_server_rejected_connections_total{port="client",reason="SSLEOFError"} 1.0
cluster_proxy_server_rejected_connections_total{port="agent",reason="handshake timeout"} 5.0
"""


def test_workers_are_parsed_once_each_in_order() -> None:
    assert fs.parse_workers("1,2") == [1, 2]
    assert fs.parse_workers(" 2, 1 ,2,") == [2, 1]
    for bad in ("", "0", "1,x", "-1", ","):
        with pytest.raises(ValueError, match="--workers"):
            fs.parse_workers(bad)


def test_agent_processes_default_to_one_per_thousand_agents() -> None:
    assert fs.agent_processes(10000, 0) == 10
    assert fs.agent_processes(10001, 0) == 11
    assert fs.agent_processes(200, 0) == 1
    assert fs.agent_processes(200, 4) == 4
    assert fs.agent_processes(3, 8) == 3  # never a process without an agent


def test_admin_addresses_are_distinct_loopback_addresses() -> None:
    assert fs.loopback_ip(0) == "127.3.0.1"
    assert fs.loopback_ip(249) == "127.3.0.250"
    assert fs.loopback_ip(250) == "127.3.1.1"
    addresses = {fs.loopback_ip(i) for i in range(10000)}
    assert len(addresses) == 10000
    assert all(a.startswith("127.") and not a.endswith(".0") for a in addresses)


def test_descriptors_and_ports_needed() -> None:
    need = fs.descriptors_needed(10000, 10, 2, probe_parallel=32)
    assert need["server_process"] == 10000 + 64 + fs.FD_MARGIN
    assert need["fleet_process"] == 1000 * 4 + fs.FD_MARGIN
    assert fs.descriptors_needed(10, 3, 1, 1)["fleet_process"] == 4 * 3 + fs.FD_MARGIN  # rounded up
    assert fs.ports_needed(10000, 2) == 20000
    assert fs.parse_port_range("32768\t60999\n") == (32768, 60999)


def test_proc_net_sections() -> None:
    tcp = fs.parse_proc_net(SNMP, "Tcp")
    assert tcp["PassiveOpens"] == 4321 and tcp["AttemptFails"] == 7
    assert fs.parse_proc_net(NETSTAT, "TcpExt") == {
        "SyncookiesSent": 0,
        "ListenOverflows": 12,
        "ListenDrops": 15,
    }
    assert fs.parse_proc_net(SNMP, "Icmp") == {}


def test_metrics_sums_and_labels() -> None:
    sums = fs.metric_sums(METRICS)
    assert sums["cluster_proxy_server_agent_tunnels"] == 19998
    assert sums["cluster_proxy_server_agent_connects_total"] == 3
    by_reason = fs.metric_by_label(METRICS, "cluster_proxy_server_rejected_connections_total", "reason")
    assert by_reason == {"SSLEOFError": 4, "handshake timeout": 5}
    assert fs.metric_by_label(METRICS, "absent", "reason") == {}
    agent_port = fs.metric_by_label(
        METRICS, "cluster_proxy_server_rejected_connections_total", "reason", port="agent"
    )
    assert agent_port == {"SSLEOFError": 3, "handshake timeout": 5}


def test_accepted_connections_are_the_registered_and_the_refused() -> None:
    metrics = {"registrations": 190.0, "rejected": {"handshake timeout": 10.0}}
    assert fs.accepted_per_s(metrics, 4.0) == 50.0
    assert fs.accepted_per_s({"registrations": 10.0}, 2.0) == 5.0
    assert fs.accepted_per_s({"error": "connection refused"}, 2.0) is None


def test_fleet_statuses_sum_what_holds_the_named_server() -> None:
    statuses = [
        {
            "agents": 5,
            "routable": {"fleet-w2-restart": 3, "fleet-w2-start": 2},
            "registered": {"fleet-w2-restart": 7, "fleet-w2-start": 4},
            "tunnels": 8,
            "rss_kib": 1000,
            "base_rss_kib": 400,
        },
        None,  # a process that has not written yet
        {
            "agents": 5,
            "routable": {"fleet-w2-restart": 5},
            "registered": {"fleet-w2-restart": 10},
            "tunnels": 10,
            "rss_kib": 900,
            "base_rss_kib": 400,
        },
    ]
    total = fs.fleet_total(statuses, "fleet-w2-restart")
    assert total == {
        "agents": 10,
        "routable": 8,
        "registered": 17,
        "tunnels": 18,
        "rss_kib": 1900,
        "base_rss_kib": 800,
        "silent": 1,
    }
    assert fs.fleet_total(statuses, "other")["routable"] == 0


def test_a_worker_replica_id_belongs_to_its_server() -> None:
    assert server_base("fleet-w2-start.w0") == "fleet-w2-start"
    assert server_base("fleet-w2-start.w1.r3") == "fleet-w2-start"
    assert server_base("fleet-w1-start") == "fleet-w1-start"


def test_rates_mean_and_peak_over_windows() -> None:
    samples = [{"t": t / 2, "n": n} for t, n in enumerate([0, 0, 10, 40, 50, 50, 60])]
    r = fs.rates(samples, "n")
    assert r["mean_per_s"] == 20.0  # 60 over 3 s
    assert r["peak_per_s"] == 40.0  # windows 0-1 s: 10, 1-2 s: 40, 2-3 s: 10
    assert fs.rates(samples[:1], "n") == {"mean_per_s": 0.0, "peak_per_s": 0.0}
    short = [{"t": 0.0, "n": 0}, {"t": 0.5, "n": 5}]
    assert fs.rates(short, "n") == {"mean_per_s": 10.0, "peak_per_s": 10.0}  # one window, shorter than asked
    tail = [{"t": 0.0, "n": 0}, {"t": 1.0, "n": 1}, {"t": 1.5, "n": 5}]  # the 0.5 s tail joins 0-1 s
    assert fs.rates(tail, "n") == {"mean_per_s": 3.3, "peak_per_s": 3.3}
    unread = [{"t": 0.0, "n": None}, {"t": 1.0, "n": 4}, {"t": 2.0, "n": None}, {"t": 3.0, "n": 10}]
    assert fs.rates(unread, "n") == {"mean_per_s": 3.0, "peak_per_s": 3.0}  # ss not there: left out
    assert fs.rates([{"t": 0.0, "n": None}, {"t": 1.0, "n": None}], "n")["mean_per_s"] == 0.0
    cpu = [{"t": 0.0, "server_cpu_s": 1.0}, {"t": 1.0, "server_cpu_s": 1.5}, {"t": 2.0, "server_cpu_s": 1.6}]
    assert fs.peak_cpu_pct(cpu) == 50.0


def test_cpu_percent_and_extrapolation() -> None:
    assert fs.pct_of_core(3.0, 10.0) == 30.0
    assert fs.pct_of_core(1.0, 0.0) == 0.0
    assert fs.extrapolate(50 * 1024, 100.0, 10000) == round((50 * 1024 + 1_000_000) / 1024, 1)


def test_goal_check() -> None:
    assert fs.goal_check(10000, 1800.0, 25.0, 59.0) == {
        "at_goal_scale": True,
        "rss": True,
        "idle_cpu": True,
        "restart": True,
    }
    missed = fs.goal_check(200, 2100.0, 31.0, None)
    assert missed == {"at_goal_scale": False, "rss": False, "idle_cpu": False, "restart": None}


def test_markdown_names_every_figure_and_the_commands() -> None:
    run = {
        "workers": 2,
        "commands": {"server": "cluster-proxy-server --workers 2"},
        "connect": {"all_routable_s": 4.2, "registered_per_s": {"mean_per_s": 10.0, "peak_per_s": 20.0}},
        "memory": {"tunnels_per_agent": 2, "server_rss_mib": 300.0, "server_kib_per_tunnel": 50.0},
        "probe": {"ok": 200, "targets": 200, "wall_s": 1.5},
        "idle": {"server_cpu_pct": 3.0},
        "restart": {
            "all_routable_after_kill_s": 8.0,
            "accepted_per_s": 50.0,
            "rejected": {"SSLEOFError": 2.0},
        },
        "goals": fs.goal_check(200, 300.0, 3.0, 8.0),
    }
    results = {
        "agents": 200,
        "command": "python -m bench.fleet_scale --agents 200",
        "started": "now",
        "machine": {"cpus": 2, "kernel": "6"},
        "loadavg_before": "1 1 1",
        "agent_processes": 1,
        "agents_per_process": 200,
        "flag_notes": ["a note"],
        "runs": [run, {"workers": 1, "error": "boom"}],
    }
    md = fs.markdown(results)
    assert "| server RSS per tunnel, KiB | 50.0 | - |" in md
    assert "| probe: clusters answering | 200/200 in 1.5 s | - |" in md
    assert "| storm: agent connections refused, by reason | SSLEOFError 2 | - |" in md
    assert "| storm: agent connections accepted per s (server's counters), mean | 50.0 | - |" in md
    assert "| while connecting: tunnels registered per s, mean / peak | 10.0 / 20.0 | - |" in md
    assert "`cluster-proxy-server --workers 2`" in md
    assert "--workers 1 failed: boom" in md
    assert "not the goal's scale" in md and "- a note" in md


def test_arguments() -> None:
    opts = fs.parse_args(
        ["--agents", "200", "--workers", "1,2", "--out", "/tmp/x", "--server-flag=--keepalive-interval=30s"]
    )
    assert opts.agents == 200 and opts.workers == [1, 2] and opts.processes == 0
    assert opts.server_flags == ["--keepalive-interval=30s"]
    with pytest.raises(SystemExit):
        fs.parse_args(["--agents", "0", "--out", "/tmp/x"])
    with pytest.raises(SystemExit):
        fs.parse_args(["--workers", "0", "--out", "/tmp/x"])


def test_a_descendant_is_killed_only_while_it_runs_the_same_arguments() -> None:
    argv = [
        "/venv/bin/cluster-proxy-server",
        "--agent-listen",
        "127.0.0.1:30559",
        "--server-id",
        "fleet-w2-start",
    ]
    worker = (
        b"/venv/bin/python\0-m\0clusterproxy_server.main\0" + b"\0".join(a.encode() for a in argv[1:]) + b"\0"
    )
    assert fs.runs_with(worker, argv)
    assert not fs.runs_with(b"/usr/bin/python3\0-m\0something.else\0", argv)  # the pid was reused
    other_server = worker.replace(b"fleet-w2-start", b"proxy-server-1")
    assert not fs.runs_with(other_server, argv)
    assert not fs.runs_with(worker, ["/bin/only-a-program"])  # no arguments: nothing to recognise it by


def test_an_agent_listens_where_its_spec_says_or_on_any_free_port() -> None:
    assert admin_address({"cluster": "c"}) == ("127.0.0.1", 0)  # the fan-in workload's specs
    assert admin_address({"admin": "127.3.0.1:24001"}) == ("127.3.0.1", 24001)


def test_the_results_folder_is_written_by_the_helper_soak_shares(tmp_path: Path) -> None:
    from bench.report import results_folder, write_results

    out = tmp_path / "run"
    write_results(out, {"started": Path("/x"), "runs": []}, "# title")
    assert json.loads((out / "results.json").read_text()) == {"started": "/x", "runs": []}
    assert (out / "results.md").read_text() == "# title\n"
    assert results_folder(out) is None  # a tool that rewrites its own results as it goes
    assert "not empty" in (results_folder(out, fresh=True) or "")  # soak: a new folder per run
    assert results_folder(tmp_path / "new", fresh=True) is None
