"""The pending-dial bounds per client connection and per client identity (clusterproxy_server.pending_dials)."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from clusterproxy_protocol.errors import TooManyRequests
from clusterproxy_server.pending_dials import ConnectionDials, PendingDials


def test_each_bound_refuses_with_429_naming_its_flag_and_frees_on_exit() -> None:
    limits = PendingDials(per_connection=2, per_client=3)
    first, second = ConnectionDials(), ConnectionDials()
    with ExitStack() as held:
        held.enter_context(limits.hold(first, "alice"))
        held.enter_context(limits.hold(first, "alice"))
        with pytest.raises(TooManyRequests, match="max-pending-dials-per-connection 2") as refused:
            held.enter_context(limits.hold(first, "alice"))
        assert refused.value.status == 429 and refused.value.scope == "connection"  # type: ignore[attr-defined]
        held.enter_context(limits.hold(second, "alice"))
        with pytest.raises(TooManyRequests, match="max-pending-dials-per-client 3"):
            held.enter_context(limits.hold(second, "alice"))
        held.enter_context(limits.hold(second, "bob"))  # another client is not held back
        assert (limits.total, limits.pending_for("alice"), first.pending) == (4, 3, 2)
    assert (limits.total, limits.pending_for("alice"), first.pending, second.pending) == (0, 0, 0, 0)


def test_a_dial_that_fails_still_frees_its_place() -> None:
    limits = PendingDials(per_connection=1, per_client=1)
    connection = ConnectionDials()
    with pytest.raises(RuntimeError), limits.hold(connection, "alice"):
        raise RuntimeError("agent gone")
    with limits.hold(connection, "alice"):
        assert limits.total == 1
