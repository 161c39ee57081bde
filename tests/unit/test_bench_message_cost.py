"""bench.message_cost: both ways move real messages, and the scheduler passes it reports are counted."""

from __future__ import annotations

from pathlib import Path

from bench.message_cost import _measure, _pair
from bench.pki import BenchPKI
from clusterproxy_protocol import transport


async def test_trios_way_passes_through_the_scheduler_and_the_direct_way_does_not(tmp_path: Path) -> None:
    server, client = await _pair(BenchPKI(tmp_path))
    micros, steps = await _measure(server.send_all, lambda: client.receive_some(1 << 16), 200, 1024)
    assert micros > 0 and steps >= 2  # two locks and a socket call each way, at least two of them yield
    micros, steps = await _measure(
        lambda data: transport.send_all(server, data),
        lambda: transport.receive_batch(client, 1 << 16),
        200,
        1024,
    )
    assert micros > 0 and steps <= 2 / transport.FAIR_EVERY + 0.05
    await server.aclose()
    await client.aclose()
