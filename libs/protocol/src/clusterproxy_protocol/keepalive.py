"""Keepalive of a tunnel connection: HTTP/2 PINGs that prove the peer alive, or end the connection.

:func:`clusterproxy_protocol.driver.open_mux` runs :func:`keep_alive` beside the :class:`Mux` when it
is given ``keepalive=(interval, timeout)``: a PING not answered within the timeout declares the
connection dead, which fails all its streams at once. A side that PINGs only when quiet (the agent's:
the hub PINGs anyway, and data proves the peer alive as well) waits for the peer's silence first.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import trio

from clusterproxy_protocol.core import CANCEL
from clusterproxy_protocol.errors import TunnelClosed

if TYPE_CHECKING:
    from clusterproxy_protocol.driver import Mux

__all__ = ["KEEPALIVE_GRID", "QUIET_FACTOR", "keep_alive", "keepalive_due"]

# A side that PINGs only when quiet waits this many of its intervals without a frame from the peer: a
# peer PINGing at the same interval (the hub) is heard first however their timers are offset.
QUIET_FACTOR = 1.5
# Keepalive timers fall due on a grid of this fraction of their interval (0.1 s at the default 10 s):
# the PINGs of a process's many tunnels that fall due within one step go out in one wake-up of the
# process instead of one each (docs/benchmarks.md, twelfth round), in bursts of a hundredth of them.
KEEPALIVE_GRID = 1 / 100


def keepalive_due(when: float, interval: float) -> float:
    """``when``, moved up to the next point of the keepalive grid of ``interval``."""
    step = interval * KEEPALIVE_GRID
    return math.ceil(when / step - 1e-6) * step  # a time on the grid but for float error stays there


async def keep_alive(mux: Mux, interval: float, timeout: float, ping_when_quiet: bool) -> None:
    """PING ``mux``'s peer every ``interval`` (with ``ping_when_quiet``, only after
    :data:`QUIET_FACTOR` intervals without a frame from it) and close the connection when a PING is
    not answered within ``timeout``; returns once the connection is dead."""
    while not mux.dead:
        if ping_when_quiet:
            quiet_until = mux.last_heard + QUIET_FACTOR * interval
            if trio.current_time() < quiet_until:
                await trio.sleep_until(keepalive_due(quiet_until, interval))
                continue
        rtt = math.inf
        with trio.move_on_after(timeout):
            try:
                rtt = await mux.ping()
            except TunnelClosed:
                return
        if math.isinf(rtt):
            mux.close(f"no PING answer within {timeout:g}s", error_code=CANCEL)
            return
        if not ping_when_quiet:
            await trio.sleep_until(keepalive_due(trio.current_time() + interval, interval))
