"""What the REST API and the dashboard show of a job and of its spares (one view for both)."""

from __future__ import annotations

from typing import Any

from core_service.backup_windows import windows_view
from core_service.jobs import Job
from core_service.model import MemberRecord


def spare_view(member: MemberRecord) -> dict[str, Any]:
    return {
        "worker_id": member.worker_id,
        "host": member.host,
        "devices": len(member.devices),
        "registered_unix": member.registered_unix,
        "last_heartbeat_unix": member.last_heartbeat_unix,
    }


def job_summary(job: Job) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for member in job.members.values():
        counts[member.state.value] = counts.get(member.state.value, 0) + 1
    return {
        "name": job.name,
        "phase": job.phase.value,
        "plan_epoch": job.plan_epoch,
        # The newest epoch a step committed on, and how the newest plan is applied (in_place or
        # restore): a plan's apply restarts from the committed layout (docs/architecture.md).
        "committed_epoch": job.committed_epoch,
        "plan_mode": None if job.last_plan is None else job.last_plan.mode.value,
        "expected_workers": job.expected_workers,
        "min_workers": job.min_workers,
        "max_workers": job.max_workers,
        "offered_workers": job.offered_workers,  # admitted by accepted offers (OfferResources)
        "members_by_state": counts,
        # COMPLETED: every worker finished; where the final checkpoint is, as they reported it.
        "completed_unix": job.completed_unix,
        "final_checkpoint": job.final_checkpoint or None,
        # FAILED or STOPPED: when and why it ended; the newest checkpoint the workers reported.
        "ended_unix": job.ended_unix,
        "end_reason": job.end_reason or None,
        "latest_checkpoint": job.latest_checkpoint or None,
        "has_layout": job.layout_json is not None,
        **backup_copies_view(job),
        # Copies a plan's layout moved and re-seeds in the background (issue 23): the committed
        # layout's open window and the recent ones (core_service.backup_windows).
        **windows_view(job),
        # The rendezvous stores its launchers run (`elaswave run --core`), in the workers' order.
        "stores": list(job.stores),
        "last_event_seq": job.next_seq - 1,
    }


def backup_copies_view(job: Job) -> dict[str, Any]:
    """How many copies of every shard the job's layout keeps, and why (the plan's redundancy
    reason, `planners.redundancy`; None before a plan chose it)."""
    try:
        parsed = job.parsed_layout()
    except (ValueError, KeyError, TypeError):
        parsed = None  # the layout's own error is reported where it is applied
    copies = 1 if parsed is None else parsed.layout.backup_copies
    reasons = () if job.last_plan is None else job.last_plan.reasons
    why = next((r for r in reasons if r.startswith("backup copies k=")), None)
    return {"backup_copies": copies, "backup_copies_reason": why}
