"""What a policy sees of a job and what it returns: the schedule engine's decision interface
(docs/architecture.md, "The Core's decisions").

Policies (`core_service.policies`, `core_service.elaswave_policy`) import only this module: they
read a `JobSnapshot` (plain values, no handles) and return a `Decision`; the engine
(`core_service.engine`) acts on it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal, Protocol

from core_service.jobs import Job
from core_service.model import MemberRecord, WorkerState
from planners.layout import Layout


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    host: str
    stage: int
    dp_rank: int
    rank: int
    state: str
    # Last reported step time (own compute): the ElasWave policy sizes a fail-slow straggler's
    # slowdown from it.
    step_time_s: float | None = None
    # Last reported wall step time: the uniform cost model charges what compute leaves of it per
    # mini-step (planners.elaswave_model.uniform_model).
    wall_step_s: float | None = None


@dataclass(frozen=True)
class JobSnapshot:
    """What a policy may look at: plain data, no handles."""

    job: str
    plan_epoch: int
    layout: Layout | None  # the job's current target layout (the newest published), if any
    live: tuple[WorkerView, ...]
    gone: tuple[WorkerView, ...]
    changes: tuple[str, ...]  # "kind:worker" of every change since the last plan
    model_json: str | None = None  # the job's registered model (`elaswave plan` state.json), if any
    original: Layout | None = None  # the layout the job was created with (its fault-free shape)
    next_rank: int = 0  # the first rank id the job never used: where new ranks start
    min_ranks: int = 1  # no plan may have fewer ranks (min_workers) ...
    max_ranks: int = 0  # ... or more (max_workers, or the creation layout's plus accepted offers)
    step: int = -1  # the newest step any live worker reported
    unit_moved_at: tuple[tuple[int, int], ...] = ()  # (unit, step it last moved at)
    plan_pause_s: float | None = None  # how long the last applied plan took (None: none yet)

    @property
    def spares(self) -> tuple[WorkerView, ...]:
        return tuple(w for w in self.live if w.state == WorkerState.SPARE.value)


@dataclass(frozen=True)
class Decision:
    action: Literal["publish", "none", "refuse"]
    reason: str
    policy: str
    layout: Layout | None = None  # the target layout of a "publish" decision
    predicted_step_time_s: float = 0.0
    reasons: tuple[str, ...] = ()
    alternatives: tuple[dict, ...] = field(default_factory=tuple)
    joiners: tuple[tuple[int, str], ...] = ()  # (new rank, spare's worker id) the layout takes in
    # A plan nobody needs (only slow or recovered ranks): the units it moves start their
    # cool-down (planners.elaswave_payback). Moves forced by a loss or a join start none.
    optional: bool = False


class Policy(Protocol):
    @property
    def name(self) -> str: ...

    def decide(self, snapshot: JobSnapshot) -> Decision: ...


def _current_layout(job: Job) -> Layout | None:
    parsed = job.parsed_layout()
    return None if parsed is None else parsed.layout


@functools.lru_cache(maxsize=1 << 17)
def _worker_view(
    worker_id: str,
    host: str,
    stage: int,
    dp_rank: int,
    rank: int,
    state: str,
    step_time: float | None,
    wall: float | None,
) -> WorkerView:
    """Views are values: one per distinct content, reused across snapshots. A snapshot is taken
    on every planning tick, and building 10,000 frozen dataclasses each time dominated the
    Core's CPU while a large job registered."""
    return WorkerView(worker_id, host, stage, dp_rank, rank, state, step_time, wall)


def snapshot_of(job: Job) -> JobSnapshot:
    def view(m: MemberRecord) -> WorkerView:
        step = m.last_step
        own, wall = (None, None) if step is None else (step.own_time_s, step.step_time_s)
        return _worker_view(m.worker_id, m.host, m.stage, m.dp_rank, m.rank, m.state.value, own, wall)

    live: list[WorkerView] = []
    gone: list[WorkerView] = []
    lost, left = WorkerState.LOST, WorkerState.LEFT
    used = step = -1
    # One pass over the members (10,000 of them in a large job), in worker-id order.
    for m in sorted(job.members.values(), key=lambda m: m.worker_id):
        (gone if m.state is lost or m.state is left else live).append(view(m))
        used = max(used, m.rank)
        if m.last_step is not None:
            step = max(step, m.last_step.step)
    layout, original = _current_layout(job), job.original_layout()
    for known in (layout, original, job.last_plan.old if job.last_plan is not None else None):
        if known is not None:
            used = max(used, *known.ranks())
    fewest, most = job.rank_limit()
    return JobSnapshot(
        job=job.name,
        plan_epoch=job.plan_epoch,
        layout=layout,
        live=tuple(live),
        gone=tuple(gone),
        changes=tuple(f"{e.kind}:{e.worker_id}" for e in job.pending_changes),
        model_json=job.model_json,
        original=original,
        next_rank=used + 1,
        min_ranks=fewest,
        max_ranks=most,
        step=step,
        unit_moved_at=tuple(sorted(job.unit_moved_at.items())),
        plan_pause_s=job.plan_pause_s,
    )
