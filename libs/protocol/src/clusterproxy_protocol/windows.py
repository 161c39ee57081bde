"""Receive windows as a budget: how many bytes a scope (one connection, one client identity, one
process) may let peers send it before anybody reads them.

Every byte a peer sends on a stream lands in that stream's receive buffer until the application reads
it, and the stream's receive window is the most the peer may send ahead of those reads. So the sum of
the windows granted is what a process may be made to hold, and granting windows from a
:class:`Budget` bounds memory where it is spent. A stream is charged its first window when it is
created (that much is promised by SETTINGS and cannot be refused later), and each growth of its
window only when every budget of its chain has room (:meth:`Budget.try_take`); the charge comes back
when the stream is forgotten.

Sans-IO like the core: plain integers, no clock, no I/O.
"""

from __future__ import annotations

__all__ = ["Budget", "format_size", "next_window"]


class Budget:
    """Bytes of receive window a scope may grant, charged to its ``parent`` too (a connection's budget
    to its client identity's, that one to the process's). ``limit`` 0 means unbounded."""

    __slots__ = ("limit", "name", "parent", "used")

    def __init__(self, limit: int, parent: Budget | None = None, name: str = "") -> None:
        if limit < 0:
            raise ValueError(f"budget limit {limit} is negative")
        self.limit = limit
        self.parent = parent
        self.name = name
        self.used = 0

    def room(self) -> int:
        """What may still be granted here and in every scope above (a large number when unbounded)."""
        room = self.limit - self.used if self.limit else 1 << 62
        return room if self.parent is None else min(room, self.parent.room())

    def exhausted(self, need: int) -> Budget | None:
        """The first scope of the chain, from here up, that cannot grant ``need`` more; None when all can."""
        scope: Budget | None = self
        while scope is not None:
            if scope.limit and scope.used + need > scope.limit:
                return scope
            scope = scope.parent
        return None

    def try_take(self, count: int) -> bool:
        """Charge ``count`` if every scope has room for it; say whether it was charged."""
        if self.exhausted(count) is not None:
            return False
        self.take(count)
        return True

    def take(self, count: int) -> None:
        """Charge ``count`` whatever the limits (a window the protocol already promised)."""
        scope: Budget | None = self
        while scope is not None:
            scope.used += count
            scope = scope.parent

    def full_reason(self) -> str:
        """Why this scope grants no more, for a refusal."""
        held, limit = format_size(self.used), format_size(self.limit)
        return f"{self.name or 'budget'}: {held} of stream windows held for data not read yet, of {limit}"

    def give(self, count: int) -> None:
        scope: Budget | None = self
        while scope is not None:
            scope.used -= count
            scope = scope.parent


def format_size(count: int) -> str:
    """A byte count as ``config.parse_size`` reads it back, in the largest binary unit that keeps it
    whole to a tenth (``64MiB``, ``1.5GiB``, ``900B``)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f}".removesuffix(".0") + unit
    return f"{count}B"


def next_window(window: int, largest: int) -> int:
    """The window a stream that keeps up grows to: twice what it had, at most ``largest``. Doubling
    reaches a 1 MiB window from 64 KiB in four round trips, the way TCP's slow start does."""
    return min(window * 2, largest)
