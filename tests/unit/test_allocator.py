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


AFTER_A_BURST = """
import trio
from clusterproxy_protocol import allocator
assert allocator.tune()

def rss_kib() -> int:
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])

# First the heap's holes are filled: a hole left by the imports (their layout varies from run to run
# with the hash seed) would take the small objects below, the buffers would end up together at the
# top and glibc would trim them at once, with nothing left for return_free_memory to do. Filled until
# a small object is served by growing the heap, i.e. none of the free space left fits one.
fillers = []
previous = allocator.free_heap()
for _ in range(100_000):
    fillers.append(bytearray(2048))
    if allocator.free_heap() > previous:
        break
    previous = allocator.free_heap()
# a burst: 256 KiB buffers, each followed by a small object that outlives it, then the buffers freed
burst = []
for _ in range(200):
    burst.append(bytearray(256 << 10))
    burst.append(bytearray(2048))
survivors = burst[1::2]
del burst
held = rss_kib()
free = allocator.free_heap()

async def until_returned() -> int:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(allocator.return_free_memory, 0.01)
        with trio.fail_after(10):
            while rss_kib() > held - (20 << 10):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    return rss_kib()

print(free, held, trio.run(until_returned), len(survivors))
"""


def test_memory_freed_after_a_burst_goes_back_to_the_kernel() -> None:
    out = subprocess.run([sys.executable, "-c", AFTER_A_BURST], check=True, capture_output=True, text=True)
    free, held, after, _ = (int(n) for n in out.stdout.split())
    assert free > 40 << 20  # 50 MiB freed, kept in the heap below the survivors: RSS did not fall
    assert after < held - (20 << 10)
