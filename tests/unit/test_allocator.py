"""allocator.tune: buffers of a relay's sizes stop costing page faults, in the services too."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHURN = """
import resource
blob = bytes(300 << 10)
def churn():
    for _ in range(200):
        joined = blob + b"x"  # a read joined from records, a frame's payload cut from it, both freed
        payload = joined[1:]
        del joined, payload
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 200)
"""


def faults_per_buffer(setup: str) -> float:
    out = subprocess.run([sys.executable, "-c", setup + CHURN], check=True, capture_output=True, text=True)
    return float(out.stdout.split()[-1])


def test_a_tuned_process_reuses_its_buffers_where_glibcs_defaults_fault_them_in_again() -> None:
    assert faults_per_buffer("") > 50  # ~75 pages of 4 KiB each time
    assert faults_per_buffer("from clusterproxy_protocol import allocator\nassert allocator.tune()\n") < 1


@pytest.mark.parametrize(
    "entry_point", ["clusterproxy_server.main", "clusterproxy_agent.main", "clusterproxy_gateway.main"]
)
def test_the_data_moving_services_tune_it_first_thing(entry_point: str) -> None:
    setup = (
        f"import {entry_point} as service\ntry:\n    service.main(['--help'])\nexcept SystemExit:\n    pass\n"
    )
    assert faults_per_buffer(setup) < 1
