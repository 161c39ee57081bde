"""bench.scaling: the paper model of one pod and of a fleet (issue 17, point 4)."""

from __future__ import annotations

import math

import pytest

from bench import scaling

# round numbers: a core moves 1/4 GiB/s down and 1/8 up, opens 250 streams/s, answers 4,000 requests/s
COSTS = scaling.Costs(
    cpu_s_per_gib_down=4.0,
    cpu_s_per_gib_up=8.0,
    cpu_s_per_1k_connects=4.0,
    cpu_s_per_1k_requests=0.25,
    kib_per_tunnel=100.0,
    kib_per_stream=32.0,
    base_kib_per_worker=48 * 1024,
    pct_per_1k_idle_tunnels=2.0,
)


def test_a_pod_scales_with_its_usable_core_seconds() -> None:
    p = scaling.pod(COSTS, cores=8, usable=0.5)  # 4 core-seconds per second
    assert p.gbit_s_down == pytest.approx(1.0 * 8.589934592)  # 1 GiB/s is 8.59 Gbit/s, not 8
    assert p.gbit_s_up == pytest.approx(0.5 * 8.589934592)
    assert p.connects_per_s == pytest.approx(1000)
    assert p.requests_per_s == pytest.approx(16000)
    assert p.streams_per_gib == pytest.approx(32768)


def test_every_worker_carries_every_cluster_s_tunnel_whatever_the_number_of_pods() -> None:
    # 10,000 clusters: each worker holds 10,000 tunnels: 20 % of its core in keepalives (2 % per 1k)
    profile = scaling.Profile(connects_per_s=0.0, requests_per_s=0.0, mbit_s=0.0, streams=0.0)
    f = scaling.fleet_pods(COSTS, cores=4, usable=0.7, clusters=10_000, profile=profile)
    assert f["idle_share"] == pytest.approx(0.2)
    assert f["pods"] == 2  # no traffic: the availability minimum
    assert f["tunnels_per_agent"] == 8
    # per pod: 4 workers x (48 MiB + 10,000 x 100 KiB)
    assert f["tunnel_gib_per_pod"] == pytest.approx(4 * (48 * 1024 + 1_000_000) / 2**20)


def test_pods_for_the_traffic_use_what_the_idle_tunnels_leave() -> None:
    # per cluster: 0.1 connects/s (0.4 ms of CPU), 4 requests/s (1 ms), 0.859 Mbit/s up (0.8 ms):
    # 2.2 ms of CPU per second per cluster, 22 cores for 10,000 clusters
    profile = scaling.Profile(connects_per_s=0.1, requests_per_s=4.0, mbit_s=0.8589934592, streams=10)
    f = scaling.fleet_pods(COSTS, cores=4, usable=0.7, clusters=10_000, profile=profile)
    assert f["traffic_cores"] == pytest.approx(22.0)
    # each core gives 0.7 - 0.2 = 0.5: 22 / (4 x 0.5) = 11 pods (0.7 per core would say 8)
    assert f["pods"] == 11
    assert f["stream_gib_per_pod"] == pytest.approx(100_000 / 11 * 32 / 2**20)


def test_tunnels_alone_can_fill_a_worker() -> None:
    profile = scaling.Profile(connects_per_s=0.0, requests_per_s=0.0, mbit_s=0.0, streams=0.0)
    f = scaling.fleet_pods(COSTS, cores=4, usable=0.7, clusters=40_000, profile=profile)
    assert math.isinf(f["pods"])


def test_two_workers_on_two_shared_cores_are_limited_by_the_whole_machine() -> None:
    # CPU-s per GiB: server 4, agent 3, loadgen 0.75, target 0.25: 8 in all
    per_unit = {"server": 4.0, "agent": 3.0, "loadgen": 0.75, "target": 0.25}
    one = scaling.two_core_prediction(per_unit, streams=8, workers=1)
    two = scaling.two_core_prediction(per_unit, streams=8, workers=2)
    assert one["pod model"] == pytest.approx(0.25) and two["pod model"] == pytest.approx(0.5)
    assert two["machine"] == pytest.approx(0.25)  # 2 cores / 8 CPU-s per GiB
    assert two["agent"] == pytest.approx(1 / 3)
    assert one["predicted"] == pytest.approx(0.25)  # the one worker's core and the machine coincide
    assert two["predicted"] == pytest.approx(0.25)  # a second worker buys nothing here


def test_one_stream_is_one_worker_however_many_there_are() -> None:
    # a cheap rest of the run: the machine would allow more, the single stream's worker does not
    per_unit = {"server": 4.0, "agent": 1.0, "loadgen": 0.5, "target": 0.5}
    two = scaling.two_core_prediction(per_unit, streams=1, workers=2)
    assert two["machine"] == pytest.approx(2 / 6)
    assert two["streams"] == pytest.approx(0.25)
    assert two["predicted"] == pytest.approx(0.25)
