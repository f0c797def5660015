"""What the schedule engine checks and derives before it publishes a decision's plan: the job's
rank bounds, the ranks it takes in (`Plan.joiners`) or hands over (`Plan.standby`), the target a
retry republishes, and the units a plan moves (docs/architecture.md, "The Core's decisions").
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

from core_service.job_snapshot import Decision, JobSnapshot
from core_service.jobs import Job
from core_service.model import RetryRequest, WorkerState
from planners.layout import Layout


def note_unit_moves(job: Job, old: Layout | None, new: Layout, step: int) -> None:
    """Every unit `new` puts on another stage than `old` moved at `step` (the per-unit cool-down,
    planners.elaswave_payback)."""
    if old is None or old.num_layers != new.num_layers:
        return
    edges_old, edges_new = (0, *old.boundaries), (0, *new.boundaries)
    for unit in range(new.num_layers):
        if bisect_right(edges_old, unit) != bisect_right(edges_new, unit):
            job.unit_moved_at[unit] = max(step, 0)


def outside_bounds(snapshot: JobSnapshot, new: Layout) -> str:
    """Why `new` is outside the job's bounds on ranks ("" when inside): such a plan is refused
    and the job waits (below `min_workers`: for spares; the next change plans again)."""
    ranks = len(new.ranks())
    if ranks < snapshot.min_ranks:
        return (
            f"the plan would leave {ranks} rank(s), below the job's min_workers {snapshot.min_ranks}: "
            "nothing is published; the job waits for spares to register"
        )
    if snapshot.max_ranks and ranks > snapshot.max_ranks:
        return f"the plan would have {ranks} ranks, above the job's maximum {snapshot.max_ranks}: nothing is published"
    return ""


def standby_ranks(
    job: Job, committed: Layout | None, new: Layout, request: RetryRequest | None
) -> frozenset[int]:
    """`Plan.standby`: ranks `new` drops whose workers run on (a replica the policy dropped, not
    a loss or a departure): they hand their live state over with the plan instead of it being
    read from backups (`planners.applicability.judge`), then leave. A rank a failed collective
    named is never one: it may be dead before the Core has seen it go."""
    if committed is None:
        return frozenset()
    dropped = set(committed.ranks()).difference(new.ranks())
    dropped -= request.peers if request is not None else set()
    return frozenset(
        m.rank
        for m in job.members.values()
        if m.rank in dropped and m.state in (WorkerState.RUNNING, WorkerState.SLOW)
    )


def joiners_of(
    job: Job, committed: Layout | None, new: Layout, decision: Decision
) -> tuple[tuple[tuple[int, str], ...], str]:
    """`Plan.joiners`: every rank `new` adds to the committed layout, with its worker (a spare
    the decision takes in, or one an earlier plan of this apply took in), and why the plan is
    refused ("" when it is not): a new rank no worker takes, or a worker that is no spare."""
    if committed is None:
        return (), ""
    added = set(new.ranks()).difference(committed.ranks())
    chosen = dict(decision.joiners)
    for rank, worker in chosen.items():
        member = job.members.get(worker)
        if member is None or member.state is not WorkerState.SPARE:
            state = "not a member" if member is None else member.state.value
            return (), f"the plan takes in {worker!r} as rank {rank}, but it is {state}, not a spare"
        if rank not in added:
            return (), f"the plan takes in {worker!r} as rank {rank}, which is not a new rank of its layout"
    if not added:
        return (), ""
    holders = {m.rank: m.worker_id for m in job.members.values() if m.rank in added and not m.state.is_gone}
    out: list[tuple[int, str]] = []
    for rank in sorted(added):
        taker = chosen.get(rank, holders.get(rank))
        if taker is None:
            return (
                (),
                f"rank {rank} of the planned layout is new and no worker takes it: nothing is published",
            )
        if rank in chosen and rank in holders:
            return (), f"rank {rank} is already {holders[rank]!r}'s: a new rank gets a fresh id"
        out.append((rank, taker))
    return tuple(out), ""


def target_of(
    job: Job, decision: Decision, request: RetryRequest | None
) -> tuple[Layout, tuple[str, ...], str, float, int | None] | None:
    """What to publish for `decision`: (layout, reasons, event detail, predicted step time, the
    epoch it retries or None), or None when there is nothing to publish."""
    if decision.action == "publish" and decision.layout is not None:
        reasons = decision.reasons or (decision.reason,)
        return (
            decision.layout,
            reasons,
            decision.reason,
            decision.predicted_step_time_s,
            None,
        )
    if decision.action == "none" and request is not None and job.layout_json is not None:
        # The going ranks are planned out already, but the executors went back to their committed
        # state and wait: they get the same target again under a new epoch.
        detail = f"retry of epoch {job.plan_epoch} after {request.summary()}"
        predicted = job.last_plan.predicted_step_time_s if job.last_plan is not None else 0.0
        return Layout.from_json(job.layout_json), (detail,), detail, predicted, job.plan_epoch
    return None


def request_data(request: RetryRequest | None) -> dict[str, Any]:
    """What a decision answering `request` records about it (event data)."""
    if request is None:
        return {}
    return {
        "failed_workers": sorted(request.failed),
        "failures": {w: a.failure.value for w, a in sorted(request.failed.items()) if a.failure},
        "collective_peers": sorted(request.peers),
        "request": request.summary(),
    }
