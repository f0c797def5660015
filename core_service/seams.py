"""The narrow interfaces the Core's servicers and routers depend on, instead of the whole `Core`.

`core_service.core.Core` assembles the servicers and satisfies every protocol here (mypy checks
it where `core.py` hands itself over). A servicer names the smallest protocol that covers what it
uses, and declares its own extension beside it when it needs more (`executor_service.ExecutorCore`,
`dashboard.DashboardCore`, ...). So no servicer imports `core.py`, and the module import graph of
the control plane stays acyclic (`tests/test_layers.py`).
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from core_service.config import CoreSettings
    from core_service.jobs import Job, JobTable
    from core_service.membership import Membership
    from core_service.metrics import CoreMetrics


class Leadership(Protocol):
    """Whether this Core leads, and the refusal a standby answers with."""

    @property
    def leads(self) -> bool: ...

    def not_leader_message(self, api: str = "grpc") -> str: ...

    def require_leader(self) -> None:
        """Raise UNAVAILABLE with the leader's address unless this Core leads now."""


class Guards(Leadership, Protocol):
    """The checks every request passes before it touches a job (tokens before lookups, so no answer
    reveals whether a job exists)."""

    def job_or_not_found(self, name: str) -> Job: ...

    def check_job_token(self, job_name: str, token: str | None) -> None: ...

    def check_read_access(self, token: str | None) -> None: ...

    def scheduler_token_ok(self, token: str | None) -> bool: ...

    def check_scheduler_token(self, token: str | None) -> None: ...


class CoreState(Protocol):
    """The job table and membership a servicer reads and changes, with the settings and metrics."""

    settings: CoreSettings
    metrics: CoreMetrics
    table: JobTable
    membership: Membership

    async def wait_durable(self) -> None:
        """Return once every change made so far is stored (UNAVAILABLE if it cannot be)."""


class ServicerCore(Guards, CoreState, Protocol):
    """What most servicers need: the guards and the state."""


class Background(Protocol):
    def run_in_background(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work` as a task of this Core, cancelled when the Core stops."""
