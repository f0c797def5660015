"""The cluster a trace describes, and the job's node slots on it.

The trace's nodes are the cluster. The job has `spec.num_nodes` slots (ElasWave Table 2: 12
nodes of 8 devices); a node added while a slot is free fills it (a join), a node added while
every slot is full waits as a spare. When a node in a slot is preempted:

- `spares="swap"` (default): a waiting spare takes the slot at once. The job still loses the
  node's ranks and their in-flight step, and the spare must receive their state: a `swap`, which
  every policy prices as a loss plus a join (`simulator.costs`);
- `spares="idle"`: spares never take a running job's slot; a freed slot waits for a fresh node.

`dev<i>` events (the Poisson generator) kill or revive device i directly; there are no spares.
Simultaneous events form one change. The horizon is the trace's last event unless the caller
gives one (`elaswave simulate --hours`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from simulator.jobs import JobSpec
from simulator.traces import TraceEvent

SpareMode = Literal["swap", "idle"]


@dataclass(frozen=True)
class ClusterChange:
    """The job's devices after the trace events at `time_s`: which slots lost their node, which
    got one (a join), which lost one and got a spare in the same instant (a swap)."""

    time_s: float
    dead_devices: frozenset[int]
    lost_slots: tuple[int, ...] = ()
    joined_slots: tuple[int, ...] = ()
    swapped_slots: tuple[int, ...] = ()
    spares_waiting: int = 0
    devices_per_slot: int = 8
    # `dev<i>` events name single devices: then these, not whole slots, are what changed.
    lost_device_ids: tuple[int, ...] = ()
    joined_device_ids: tuple[int, ...] = ()

    def devices(self, which: str) -> frozenset[int]:
        """The devices `which` ("lost", "joined", "swapped") of this change."""
        single = {"lost": self.lost_device_ids, "joined": self.joined_device_ids}.get(which, ())
        slots = {"lost": self.lost_slots, "joined": self.joined_slots, "swapped": self.swapped_slots}[which]
        n = self.devices_per_slot
        return frozenset(single) | frozenset(d for s in slots for d in range(s * n, (s + 1) * n))

    @property
    def kind(self) -> str:
        parts = [
            name
            for name, slots in (
                ("loss", self.lost_slots + self.lost_device_ids),
                ("swap", self.swapped_slots),
                ("join", self.joined_slots + self.joined_device_ids),
            )
            if slots
        ]
        return "+".join(parts) or "start"


@dataclass(frozen=True)
class ClusterTimeline:
    changes: tuple[ClusterChange, ...]
    trace_end_s: float
    preemptions_of_running: int = 0  # nodes preempted while in a job slot
    absorbed_by_spares: int = 0  # of those, how many a waiting spare replaced at once
    spares_used: int = 0  # spare nodes that took a slot (swaps)
    notes: tuple[str, ...] = field(default_factory=tuple)


def cluster_timeline(
    events: Sequence[TraceEvent], spec: JobSpec, spares: SpareMode = "swap"
) -> ClusterTimeline:
    """Turn node (or device) events into the job's changes, one per distinct event time."""
    if spares not in ("swap", "idle"):
        raise ValueError(f"spares must be 'swap' or 'idle', got {spares!r}")
    per_node, n_slots = spec.devices_per_node, spec.num_nodes
    node_events = any(_device_index(e.target) is None for e in events)
    state = _SlotState(n_slots, per_node, node_events)
    changes = [ClusterChange(0.0, state.dead_devices())]
    by_time: dict[float, list[TraceEvent]] = {}
    for ev in sorted(events):
        by_time.setdefault(ev.time_s, []).append(ev)
    for t, group in sorted(by_time.items()):
        lost: list[int] = []
        joined: list[int] = []
        swapped: list[int] = []
        dev_lost: list[int] = []
        dev_joined: list[int] = []
        for ev in group:
            dev = _device_index(ev.target)
            if dev is not None:
                state.apply_device(dev, ev.kind)
                (dev_lost if ev.kind == "remove" else dev_joined).append(dev)
            else:
                state.apply(ev, spares, lost, joined, swapped)
        change = ClusterChange(
            t,
            state.dead_devices(),
            tuple(lost),
            tuple(joined),
            tuple(swapped),
            len(state.spares),
            per_node,
            tuple(dev_lost),
            tuple(dev_joined),
        )
        if t == 0.0:
            changes[0] = ClusterChange(0.0, change.dead_devices, spares_waiting=change.spares_waiting)
        elif lost or joined or swapped or dev_lost or dev_joined:
            changes.append(change)
    trace_end = max((e.time_s for e in events), default=0.0)
    return ClusterTimeline(tuple(changes), trace_end, state.preempted_running, state.absorbed, state.absorbed)


class _SlotState:
    """Which node holds each slot, the spares in arrival order, and the dead devices."""

    def __init__(self, n_slots: int, per_node: int, node_events: bool) -> None:
        self.per_node = per_node
        self.node_of: dict[int, str] = {}
        self.free = set(range(n_slots)) if node_events else set()
        self.spares: list[str] = []
        self.dead_devs: set[int] = set()
        self.preempted_running = 0
        self.absorbed = 0

    def dead_devices(self) -> frozenset[int]:
        nodes = {d for s in self.free for d in range(s * self.per_node, (s + 1) * self.per_node)}
        return frozenset(nodes | self.dead_devs)

    def apply_device(self, dev: int, kind: str) -> None:
        (self.dead_devs.add if kind == "remove" else self.dead_devs.discard)(dev)

    def apply(
        self, ev: TraceEvent, spares: SpareMode, lost: list[int], joined: list[int], swapped: list[int]
    ) -> None:
        slot_of = {n: s for s, n in self.node_of.items()}
        if ev.kind == "add":
            if self.free and ev.target not in slot_of:
                slot = min(self.free)
                self.free.discard(slot)
                self.node_of[slot] = ev.target
                (swapped if slot in lost else joined).append(slot)
                if slot in lost:
                    lost.remove(slot)
            elif ev.target not in slot_of and ev.target not in self.spares:
                self.spares.append(ev.target)
            return
        if ev.target in slot_of:
            slot = slot_of[ev.target]
            del self.node_of[slot]
            self.preempted_running += 1
            if spares == "swap" and self.spares:
                self.node_of[slot] = self.spares.pop(0)
                self.absorbed += 1
                swapped.append(slot)
            else:
                self.free.add(slot)
                lost.append(slot)
        elif ev.target in self.spares:
            self.spares.remove(ev.target)


def _device_index(target: str) -> int | None:
    return int(target[3:]) if target.startswith("dev") and target[3:].isdigit() else None
