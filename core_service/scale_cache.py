"""FlexTrain's scale table of each job (FlexTrain §4.4), as `GET /api/v1/jobs/{job}` shows it
beside the job's spares: what the job could grow into.

Pricing every configuration of a large model takes a fraction of a second to seconds of CPU, so
the table is computed in the Core's planning process (`core_service.offload`: off the event
loop, stopped at its deadline), once per registered model, and cached; a computation that ran
out of time is not cached and is tried again by the next request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from core_service.offload import PlanningFailed, PlanningTimeout
from core_service.policies import scale_table
from core_service.scheduler_service import planning_copy

if TYPE_CHECKING:
    from core_service.jobs import Job
    from core_service.offload import PlanningWorker

# How long a read waits for a table it has to compute (the planning process may be busy).
SCALE_TABLE_S = 10.0


class Planning(Protocol):
    """Where scale tables are computed: the Core's planning process."""

    planning: PlanningWorker


class ScaleTables:
    def __init__(self, core: Planning) -> None:
        self.core = core
        self._cache: dict[str, tuple[str | None, dict[str, Any]]] = {}

    async def get(self, job: Job) -> dict[str, Any]:
        """{"rows": [...], "why_empty": ""} or no rows and why (no model, not priceable, busy)."""
        model = job.model_json
        cached = self._cache.get(job.name)
        if cached is not None and cached[0] is model:
            return cached[1]
        if model is None:
            result: dict[str, Any] = {"rows": [], "why_empty": "the job was created without a model"}
        else:
            try:
                rows = await self.core.planning.call(scale_table, planning_copy(job), timeout_s=SCALE_TABLE_S)
            except PlanningTimeout as exc:
                return {"rows": [], "why_empty": f"not computed yet: {exc}"}  # not cached: try again
            except PlanningFailed as exc:
                rows, result = (
                    [],
                    {"rows": [], "why_empty": f"the scale table cannot be computed: {exc.message}"},
                )
            else:
                result = {"rows": rows, "why_empty": ""}
        if len(self._cache) > 1024:  # bounded: jobs come and go
            self._cache.clear()
        self._cache[job.name] = (model, result)
        return result
