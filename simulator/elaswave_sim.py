"""This project's ElasWave (the Core's planner and the executor's applicability rule) as a
simulated policy: `elaswave` and its ablations `elaswave-migrate`, `elaswave-resize`.

The plan is `planners.elaswave_policy.plan_elaswave` on the layout the job runs. It is applied in
place only when the executor's rule accepts it (`simulator.copies`: a copy of every lost shard
survives among its k copies, `planners.applicability.structural_problem`), otherwise as a
RESTORE (reload the latest durable checkpoint, redo the steps since). Waiting nodes join (in
place: the joiners read their state from the live owners, the growth issue) when the Core's
scale-up rule says the join pays before the next likely change (FlexTrain eq. 15-16), re-planned
from the healthy layout.

What the k copies cost is charged as the executor pays it: the gradient exchange of every copy
beyond the first on every step (`simulator.layouts.extra_copy_traffic_s`), and after every plan
the re-seed of the copies it moved before the first step (`simulator.layouts.reseed_bytes`).
A rank whose node was swapped for a spare keeps its id here but holds nothing: it receives its
whole state (`migration_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from planners.chameleon.state import Candidate
from planners.elaswave_policy import ElasWaveInput, ElasWavePlan, ElasWaveSettings, plan_elaswave, with_copies
from planners.flextrain import poisson_benefit
from planners.layout import Layout
from planners.redundancy import NodeLoss, RedundancyInput
from simulator.cluster import ClusterChange
from simulator.copies import in_place as applies_in_place
from simulator.jobs import JobSpec
from simulator.layouts import (
    busiest_state_bytes,
    extra_copy_traffic_s,
    layout_candidate,
    layout_model,
    reseed_bytes,
)
from simulator.sim_policy import SimPolicy, Transition, healthy_layout, itemised


@dataclass
class ElasWavePolicy(SimPolicy):
    """This project's Core and executor: the pure planner, in place only where `judge` allows."""

    settings: ElasWaveSettings = ElasWaveSettings()
    event_rate_per_s: float = 1.0 / 3600  # expected cluster changes per second (eq. 15's lambda)
    layout: Layout | None = None
    current: Candidate | None = None
    losses: list[NodeLoss] = field(default_factory=list)  # the node losses seen (for k)
    now_s: float = 0.0
    lost_now: frozenset[int] = frozenset()  # ranks of the running layout that died at this change

    def step(self, change: ClusterChange, step_before_s: float) -> Transition:
        healthy = healthy_layout(self.spec)
        unchanged = "no change"
        if self.layout is None:
            # The job's first layout keeps the k copies the Core's placement chooses before any
            # loss is seen (`planners.redundancy.initial_copies`: the prior, as memory allows).
            first, unchanged = self._plan(healthy, ())
            self.layout = first or healthy
        old = self.layout
        dead, lost, arrived = self.ranks(change)
        slots = change.lost_slots + change.swapped_slots
        if slots:
            self.losses.append(NodeLoss(change.time_s, frozenset(f"slot{n}" for n in slots)))
        self.now_s = change.time_s
        going = tuple(sorted((dead | lost) & set(old.ranks())))
        self.lost_now = frozenset(going)
        waiting = set(healthy.ranks()) - dead - (set(old.ranks()) - set(going))  # nodes free to join
        if not going and not waiting:
            return Transition(self._candidate(old, unchanged), layout=old)
        c = self.costs
        shrink = self._shrink(old, going) if going else (old, "nothing lost")
        if waiting and self._join_pays(old, shrink, healthy, dead):
            # Re-planned from the healthy layout: the waiting nodes' ranks join (with a loss in
            # the same plan, the lost ranks leave), in place where `judge` allows.
            new, why = self._plan(healthy, tuple(sorted(dead)))
            assert new is not None
            items = [("detection", c.detection_s)] if going else []
            items += [("planning", c.elaswave_planning_s), ("communicator", c.elaswave_communicator_s)]
            in_place = applies_in_place(old, new, self.lost_now)
            items += self._state_items(old, new, in_place, step_before_s if going else 0.0)
            return self._move(old, new, why, "in place" if in_place else "restore", items)
        new, why = shrink
        if new is None:
            cand = Candidate(self.name, False, why)
            self.current = cand
            return Transition(cand, previous_layout=old)
        if new == old:
            return Transition(self._candidate(old, why), layout=old)
        in_place = applies_in_place(old, new, self.lost_now)
        items = [("detection", c.detection_s), ("planning", c.elaswave_planning_s)]
        items.append(("communicator", c.elaswave_communicator_s))
        items += self._state_items(old, new, in_place, step_before_s)
        return self._move(old, new, why, "in place" if in_place else "restore", items)

    def _state_items(
        self, old: Layout, new: Layout, in_place: bool, step_before_s: float
    ) -> list[tuple[str, float]]:
        """In place: the state transfer into the busiest rank, the re-seed of the backup copies the
        plan moved and the replayed step (none for a join at a step boundary: `step_before_s` 0);
        else the RESTORE's reload and redone steps, then the re-seed of every copy.

        The re-seed is charged before the first step, as the executor does with
        `reprotect_steps` = 0 (`executor.fabric.trainer_state`): its default re-seeds in the
        background over 2 steps instead, a window in which a loss whose surviving copy is still
        being re-seeded is a RESTORE (`planners.reprotect`), which this model does not replay."""
        link = self.costs.link_bytes_per_s
        if not in_place:
            reseed = reseed_bytes(None, new) / link
            return [
                ("restore", self.costs.restore_s(busiest_state_bytes(self.spec, new))),
                ("backup re-seed", reseed),
            ]
        moved = migration_bytes(self.spec, old, new, self.lost_now)
        items = [("state transfer", self.costs.transfer_s(moved))]
        items.append(("backup re-seed", reseed_bytes(old, new, self.lost_now) / link))
        if step_before_s > 0:
            items.append(("replay", self.replay_s(step_before_s)))
        return items

    def _shrink(self, old: Layout, going: tuple[int, ...]) -> tuple[Layout | None, str]:
        return self._plan(old, going)

    def _join_pays(
        self, old: Layout, shrink: tuple[Layout | None, str], healthy: Layout, dead: frozenset[int]
    ) -> bool:
        """Take waiting nodes when the Core's scale-up rule says it pays before the next change
        is likely (FlexTrain eq. 15-16, `planners.flextrain.poisson_benefit`, the rule
        `core_service.policies.judge_offer` applies to offers): the cost is the in-place state
        transfer where `judge` allows it, else a RESTORE."""
        grown, why = self._plan(healthy, tuple(sorted(dead)))
        if grown is None:
            return False
        now = self._candidate(shrink[0], shrink[1]).throughput if shrink[0] is not None else 0.0
        after = self._candidate(grown, why).throughput
        if after <= now:
            return False
        if now <= 0:
            return True
        cost = sum(
            s for _, s in self._state_items(old, grown, applies_in_place(old, grown, self.lost_now), 0.0)
        )
        cost += self.costs.elaswave_planning_s + self.costs.elaswave_communicator_s
        return poisson_benefit(after / now, cost, self.event_rate_per_s).scale_up

    def _move(
        self, old: Layout, new: Layout, why: str, mode: str, items: list[tuple[str, float]]
    ) -> Transition:
        cand = self._candidate(new, why)
        self.layout, self.current = new, cand
        return replace(itemised(cand, mode, items), layout=new, previous_layout=old)

    def _plan(self, base: Layout, going: tuple[int, ...]) -> tuple[Layout | None, str]:
        # k copies (planners.redundancy): from the losses seen so far and the device memory cap,
        # for every layout the policy runs (a join back to the healthy layout included).
        redundancy = RedundancyInput(tuple(self.losses), self.now_s, self.spec.profile().mem_cap_bytes)
        model = layout_model(self.spec, base)
        layout, why = base, "healthy layout"
        if going:
            plan = plan_elaswave(ElasWaveInput(base, going, model, redundancy=redundancy), self.settings)
            if plan.action == "refuse":
                return None, plan.summary
            layout, why = plan.layout or base, plan.summary
        chosen = with_copies(ElasWavePlan("publish", layout, (), why), redundancy, model)
        return chosen.layout, chosen.summary

    def _candidate(self, layout: Layout, why: str) -> Candidate:
        key = (layout, why)
        if key not in self.cache:
            cand = layout_candidate(self.spec, layout, self.name, why)
            extra = extra_copy_traffic_s(self.spec, layout)  # k > 1: the copies' per-step traffic
            if cand.feasible and extra > 0:
                cand = replace(cand, step_time_s=cand.step_time_s + extra)
            self.cache[key] = cand
        return self.cache[key]


def migration_bytes(spec: JobSpec, old: Layout, new: Layout, lost: frozenset[int] = frozenset()) -> float:
    """Bytes into the busiest rank of `new`: the blocks of its new stage it did not hold (weights
    and its optimizer share; all of them for a rank that changed stage or joined) plus, where its
    stage's DP size shrank, the larger optimizer share it takes over of the blocks it kept (from
    the ring snapshots, ElasWave §5.2, §6.3 interleaved ZeRO). A `lost` rank that `new` keeps
    (its node swapped for a spare: the rank id is a device position here) holds nothing: it
    receives everything, as a joining rank does."""
    prof = spec.profile()
    ratio = prof.optimizer_bytes_per_param_byte
    old_stage = {r: s for s in old.stages for r in s.ranks}
    busiest = 0.0
    for stage in new.stages:
        dp_new = stage.dp_size
        weights = sum(prof.layer_param_bytes[stage.layer_start : stage.layer_stop])
        for rank in stage.ranks:
            before = None if rank in lost else old_stage.get(rank)
            held = range(0) if before is None else before.layers
            stayed = sum(prof.layer_param_bytes[x] for x in stage.layers if x in held)
            incoming = weights - stayed
            dp_old = before.dp_size if before is not None else dp_new
            remap = stayed * ratio * (1 / dp_new - 1 / dp_old) if dp_new < dp_old else 0.0
            busiest = max(busiest, incoming * (1 + ratio / dp_new) + remap)
    return busiest
