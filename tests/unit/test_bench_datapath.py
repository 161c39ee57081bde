"""bench.datapath: it moves the bytes it says it moves and times both sides."""

from __future__ import annotations

import pytest

from bench import datapath


@pytest.mark.parametrize("arrival", [100, 16384, 1 << 20])
def test_each_arrival_size_moves_the_bytes_and_times_both_sides(arrival: int) -> None:
    send, receive = datapath.seconds_per_gib(arrival, 2 << 20)
    assert send > 0 and receive > 0


def test_a_core_delivering_other_bytes_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    read = datapath.TunnelCore.read
    monkeypatch.setattr(datapath.TunnelCore, "read", lambda self, sid, n: read(self, sid, n)[:-1] + b"?")
    with pytest.raises(AssertionError, match="other bytes"):
        datapath.seconds_per_gib(16384, 1 << 20)
