"""Keep one tunnel to every proxy-server replica.

Several proxy-server replicas run behind one address (a Kubernetes Service, a TCP load balancer), and a
hub client may use any of them, so every agent must hold a tunnel to each. Each tunnel learns which
replica it reached, and how many replicas there are, from the server's ``GET /v1/info`` headers
(``cluster-proxy-server-id``, ``cluster-proxy-server-count``). The agent runs *slots*
(:class:`~clusterproxy_agent.tunnel.TunnelRunner`: connect, serve, back off, again) and keeps as many
as it needs:

* **One address** (the load-balanced case): the agent looks for the largest count any held,
  non-draining replica tells (one until a replica has told it; the last count told while it holds
  none). While it holds fewer distinct replicas than that, it runs more slots, each dialing the same
  address. A dial the balancer sends to a replica already held is answered ``409`` on ``/v1/info`` and
  closed (counted in ``cluster_proxy_agent_duplicate_dials_total``); the hub did answer, so that slot
  dials again soon (50 ms, doubling with each such answer in a row, full jitter) but never waits longer
  than ``--replica-search-backoff-max`` (2 s), so that a balancer's misses cost little and a replica's
  successor is found within that once it is up, however long the search lasted (with
  ``--backoff-max``'s 30 s, a successor started late waited for its agents for many seconds: the
  benchmark's failover row). So the cost of looking for a missing replica is bounded: after a few quick
  dials, one TLS handshake and one ``/v1/info`` per slot per second on average (uniform in [0, 2 s]),
  and only while a replica is missing; with every replica held, nothing is dialed.
* **Several addresses** (``--server a:8091,b:8091``, each one replica): one slot per address, and the
  count is only reported (a warning when it is larger than the list).

A tunnel whose server announced a drain (SIGTERM, a rolling upgrade) stops counting at once: the
replica set starts a slot to find the replica's successor while the open streams finish on the old
tunnel. A slot that is only dialing or backing off is stopped when the slots that hold or are getting
a tunnel already cover the count (scale down, a drained replica's tunnel gone); a live tunnel is
never closed because of the count, so an agent always holds every replica it reached.

The decision is :func:`plan`, a pure function of the slots' states (``tests/unit/test_replica_set.py``).
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from clusterproxy_agent.agent import Agent, TunnelRecord
from clusterproxy_agent.tunnel import Opener, TunnelOptions, TunnelRunner

__all__ = ["MAX_REPLICAS", "Plan", "ReplicaSet", "SlotState", "plan", "slot_state", "wanted_replicas"]

MAX_REPLICAS = 64  # a server telling a larger count is believed only this far (a slot costs a dial)


class SlotState(enum.Enum):
    DIALING = "dialing"  # connecting, or backing off before the next dial
    HOLDING = "holding"  # a live tunnel (identified or about to be), counts toward the replicas
    DRAINING = "draining"  # a live tunnel whose server drains: the slot ends with it


@dataclass(frozen=True)
class Plan:
    start: int  # new slots to start
    stop: tuple[int, ...]  # indexes (into the states given) of dialing slots to stop


def slot_state(record: TunnelRecord | None, opening: bool = False) -> SlotState:
    """``opening``: the slot's transport is up and its tunnel being set up (no record yet); it counts
    as holding, or a stop meant for a dialing slot would land on a tunnel about to hold a replica."""
    if opening:
        return SlotState.HOLDING
    if record is None or record.mux.dead or record.duplicate:
        return SlotState.DIALING
    if record.mux.peer_draining:
        return SlotState.DRAINING
    return SlotState.HOLDING


def plan(states: Sequence[SlotState], wanted: int) -> Plan:
    """Slots to start or stop so that the slots holding a tunnel or dialing for one number ``wanted``.
    Draining slots do not count (each ends with its tunnel); only dialing slots are ever stopped, the
    last started first."""
    active = [i for i, state in enumerate(states) if state is not SlotState.DRAINING]
    if len(active) < wanted:
        return Plan(wanted - len(active), ())
    dialing = [i for i in active if states[i] is SlotState.DIALING]
    excess = len(active) - wanted
    return Plan(0, tuple(reversed(dialing))[:excess] if excess else ())


def wanted_replicas(records: Sequence[TunnelRecord], last_told: int) -> int:
    """The replica count to look for: the largest count told by a tunnel that holds a replica, else
    ``last_told`` (nothing held, or nobody told one); at least 1, at most :data:`MAX_REPLICAS`."""
    told = [
        r.identity.server_count
        for r in records
        if r.holds_replica and r.identity is not None and r.identity.server_count
    ]
    return max(1, min(MAX_REPLICAS, max(told, default=last_told)))


@dataclass
class _Slot:
    runner: TunnelRunner
    group: int  # which address


class ReplicaSet:
    """The agent's tunnels: one address (load-balanced) or one slot per address; see the module."""

    def __init__(
        self,
        agent: Agent,
        targets: Sequence[tuple[TunnelOptions, Opener]],
        *,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if not targets:
            raise ValueError("a replica set needs at least one server address")
        self.agent = agent
        self.targets = list(targets)
        self._rng = rng
        self.slots: list[_Slot] = []
        self.stopped = trio.Event()
        self._stopping = False
        self._last_told = 1
        self._warned_count: int | None = None
        self.log = agent.log

    @property
    def balanced(self) -> bool:
        """One address for every replica (behind a load balancer): dial it until each is held."""
        return len(self.targets) == 1

    def stop(self) -> None:
        """Dial no more; live tunnels stay up (the agent's drain closes them)."""
        self._stopping = True
        for slot in self.slots:
            slot.runner.stop()
        self.agent.notify_change()

    def wanted(self) -> int:
        """Distinct replicas to hold per address group (see :func:`wanted_replicas`)."""
        records = self.agent.replica_tunnels()
        told = wanted_replicas(records, self._last_told)
        if any(r.holds_replica and r.identity and r.identity.server_count for r in records):
            self._last_told = told
        if self.balanced:
            return told
        if told > len(self.targets) and self._warned_count != told:
            self._warned_count = told
            self.log.warning(
                "server_count_exceeds_addresses",
                server_count=told,
                addresses=[options.address for options, _ in self.targets],
                hint="list every replica's address in --server, or give one load-balanced address",
            )
        return 1

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                while not self._stopping:
                    self._reconcile(nursery)
                    await self.agent.wait_change()
        finally:
            self.stopped.set()

    def _reconcile(self, nursery: trio.Nursery) -> None:
        self.slots = [slot for slot in self.slots if not slot.runner.stopped.is_set()]
        wanted = self.wanted()
        self.agent.expected_replicas = wanted * len(self.targets)
        for group, (options, opener) in enumerate(self.targets):
            slots = [s for s in self.slots if s.group == group and not s.runner.stopping]
            decision = plan([slot_state(s.runner.record, s.runner.opening) for s in slots], wanted)
            for index in decision.stop:
                slots[index].runner.stop()
            if decision.start or decision.stop:
                self.log.info(
                    "replica_slots_changed",
                    server=options.address,
                    wanted=wanted,
                    held=len(self.agent.held_replicas()),
                    started=decision.start,
                    stopped=len(decision.stop),
                )
            for _ in range(decision.start):
                slot = _Slot(TunnelRunner(self.agent, options, opener, rng=self._rng), group)
                self.slots.append(slot)
                nursery.start_soon(slot.runner.run)
