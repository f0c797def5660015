"""A `Layout` priced by the same step-time model as every policy's candidate plan, and the
healthy layout of a job state.

The ElasWave policy plans Layouts (`planners.elaswave_policy`), the baselines plan Candidates
(`planners.chameleon`); to compare them fairly (`elaswave plan`, the simulator) a Layout becomes
a one-pipeline Candidate: each stage's ranks take its slot's samples split evenly, at the stage's
slowest clock, timed by eq. (11) + the all-reduce rounds and checked against eq. (14).
"""

from __future__ import annotations

import math

from planners.chameleon.candidates import even_counts
from planners.chameleon.elastic import elaswave
from planners.chameleon.state import Candidate, ClusterState, PipelinePlan
from planners.chameleon.stepmodel import make_stage, over_cap, step_time
from planners.chameleon.to_layout import candidate_layout
from planners.layout import Layout


def healthy_layout(state: ClusterState) -> Layout:
    """The state's configured layout with no rank lost (its boundaries, or Algorithm 1's balanced
    ones), with the device memory as every stage's cap so a planner never plans past it."""
    whole = ClusterState(state.shape, state.profile, boundaries=state.boundaries, mttr=state.mttr)
    layout = candidate_layout(elaswave(whole, migrate=False, dvfs=False), whole)
    return layout.replace(stage_mem_cap_bytes=(state.profile.mem_cap_bytes,) * layout.num_stages)


def layout_candidate(state: ClusterState, layout: Layout, policy: str, reason: str) -> Candidate:
    """`layout` as a one-pipeline Candidate of `state`'s job (its slowdowns apply); infeasible,
    naming the stage, when it exceeds the device memory."""
    prof = state.profile
    slot = math.ceil(layout.global_batch / layout.num_micro_batches)
    stages = []
    for i, st in enumerate(layout.stages):
        clock = min(layout.frequency_of(r) or prof.freq_nominal_mhz for r in st.ranks)
        samples = even_counts(slot, len(st.ranks))
        stages.append(
            make_stage(
                state,
                st.layer_start,
                st.layer_stop,
                st.ranks,
                samples,
                i,
                layout.num_stages,
                len(st.ranks),
                clock,
            )
        )
    pipe = PipelinePlan(tuple(stages), layout.num_micro_batches)
    cap = over_cap((pipe,), prof)
    if cap:
        return Candidate(policy, False, f"out of memory: {cap}")
    devices = sum(len(s.ranks) for s in layout.stages) * state.shape.tp
    return Candidate(
        policy, True, reason, (pipe,), step_time((pipe,), prof), layout.global_batch, 0.0, 0.0, devices
    )
