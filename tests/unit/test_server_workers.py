"""The pieces of ``--workers`` that need no process: the pod's merged metrics, the shared ports, the
inherited spec, the workers' replica ids."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import structlog.testing
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from clusterproxy_server import workers as workers_module
from clusterproxy_server.config import ServerConfig
from clusterproxy_server.worker_metrics import MergedMetrics
from clusterproxy_server.worker_sockets import WorkerSpec, reuseport_sockets
from clusterproxy_server.workers import default_workers, worker_server_id
from tests.support.waiting import poll_until


def worker_metrics(streams: int, tunnels: int, dial: float) -> str:
    registry = CollectorRegistry()
    Counter("cluster_proxy_server_streams_total", "s", ["frontend", "status"], registry=registry).labels(
        "http1", "200"
    ).inc(streams)
    Gauge("cluster_proxy_server_agent_tunnels", "t", ["cluster"], registry=registry).labels("c1").set(tunnels)
    Histogram("cluster_proxy_server_dial_seconds", "d", registry=registry).observe(dial)
    return generate_latest(registry).decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_merged_metrics_sum_what_each_worker_counts_once() -> None:
    merged = MergedMetrics()
    merged.texts = [worker_metrics(3, 1, 0.02), worker_metrics(4, 1, 3.0)]
    registry = CollectorRegistry()
    registry.register(merged)
    got = samples(generate_latest(registry).decode())
    assert got[("cluster_proxy_server_streams_total", (("frontend", "http1"), ("status", "200")))] == 7
    assert got[("cluster_proxy_server_agent_tunnels", (("cluster", "c1"),))] == 2
    assert got[("cluster_proxy_server_dial_seconds_count", ())] == 2
    assert got[("cluster_proxy_server_dial_seconds_sum", ())] == 3.02
    assert got[("cluster_proxy_server_dial_seconds_bucket", (("le", "0.025"),))] == 1
    assert got[("cluster_proxy_server_dial_seconds_bucket", (("le", "+Inf"),))] == 2
    created = [v for (name, _), v in got.items() if name == "cluster_proxy_server_streams_created"]
    firsts = [
        v
        for (name, _), v in samples(merged.texts[0]).items()
        if name == "cluster_proxy_server_streams_created"
    ]
    assert created == firsts  # the earliest, not a sum of times


def test_reuseport_sockets_share_one_port_picked_by_the_first_bind() -> None:
    groups = reuseport_sockets("127.0.0.1", 0, 3)
    try:
        ports = {sock.getsockname() for group in groups for sock in group}
        assert len(groups) == 3 and all(len(group) == 1 for group in groups)
        assert len(ports) == 1 and next(iter(ports))[1] != 0
        # each is a listening socket of its own: a connection lands in exactly one queue
        with socket.create_connection(next(iter(ports)), timeout=5):

            def accepted() -> int:
                count = 0
                for group in groups:
                    group[0].setblocking(False)
                    try:
                        group[0].accept()[0].close()
                        count += 1
                    except BlockingIOError:
                        pass
                return count

            # the handshake completes in the kernel, at once on loopback
            assert poll_until(accepted, timeout=2, what="the connection accepted") == 1
    finally:
        for group in groups:
            for sock in group:
                sock.close()


def test_worker_spec_round_trips_and_ids_name_worker_and_restart() -> None:
    spec = WorkerSpec(1, 2, "hub-1.w1", 6, (7,), (8, 9), (), 10, 11)
    assert WorkerSpec.from_json(spec.to_json()) == spec
    assert spec.fds() == (7, 8, 9, 10, 11)
    assert worker_server_id("hub-1", 0) == "hub-1.w0"
    assert worker_server_id("hub-1", 1, 2) == "hub-1.w1.r2"


def test_default_workers_is_the_affinity_capped_by_the_cgroup_quota(tmp_path: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("max 100000\n")
    assert default_workers(cpu_max) == cores
    cpu_max.write_text("150000 100000\n")  # 1.5 CPUs: 2 workers (one would leave half a CPU unused)
    assert default_workers(cpu_max) == min(cores, 2)
    cpu_max.write_text("50000 100000\n")
    assert default_workers(cpu_max) == 1
    assert default_workers(tmp_path / "absent") == cores


def test_an_agent_port_the_kernel_will_not_steer_is_served_unsteered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(sock: socket.socket, workers: int) -> None:
        raise PermissionError(1, "Operation not permitted")  # a seccomp policy, say

    monkeypatch.setattr(workers_module, "attach_steering", refuse)
    config = ServerConfig(
        ca=tmp_path / "ca.crt",
        cert=tmp_path / "tls.crt",
        key=tmp_path / "tls.key",
        agent_listen=("127.0.0.1", 0),
        client_listen=("127.0.0.1", 0),
    )
    supervisor = workers_module.Supervisor(config, [], 2)
    with structlog.testing.capture_logs() as logs:
        supervisor._bind()
    try:
        assert [e["event"] for e in logs] == ["agent_port_not_steered"]
        assert "not permitted" in logs[0]["error"]
        assert len(supervisor._sockets["agent"]) == 2  # both workers' sockets, listening
        assert all(sock.getsockname()[1] for group in supervisor._sockets["agent"] for sock in group)
    finally:
        supervisor._close_sockets()
        for sock in supervisor._admin_sockets:
            sock.close()
