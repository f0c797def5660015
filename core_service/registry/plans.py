"""Epoch-fenced plan store: every plan of a job gets the next epoch, allocated atomically.

Plans are target layouts (docs/architecture.md ("The central idea")) and are fenced by epoch: an executor never applies a plan
older than the one it has, and a Core that lost leadership must not publish over its successor.
``publish`` allocates epochs by compare-and-swap on ``<prefix>/jobs/<job>/epoch`` (retried under
contention) and stores the plan under ``<prefix>/jobs/<job>/plans/<epoch:020d>`` in the same
transaction: an epoch exists exactly when its plan does, so a publisher that dies mid-way leaves
neither, and readers see plans in epoch order. With ``expected_epoch`` the swap only succeeds from
that epoch, so a publisher that has not seen the latest plan gets ``StaleEpoch`` instead of
overwriting it. With ``fence`` (the Core passes its leader-key fence) the same transaction also
requires the publisher to still lead, else ``FenceLost``: a deposed leader that has seen the
latest epoch cannot publish the next one over its successor either.
"""

from __future__ import annotations

from collections.abc import Callable

from core_service.registry.base import (
    Fence,
    KVEvent,
    Registry,
    RegistryError,
    WatchHandle,
    check_key,
    check_value,
)

EPOCH_DIGITS = 20
MAX_PUBLISH_ATTEMPTS = 1000  # contention bound: each failed swap means another publisher succeeded


class StaleEpoch(RegistryError):
    """The caller expected an epoch that is no longer the job's current one."""

    def __init__(self, job: str, expected: int, current: int) -> None:
        super().__init__(
            f"plan for job {job!r} is fenced: expected epoch {expected}, current epoch is {current}"
        )
        self.job = job
        self.expected = expected
        self.current = current


class PlanStore:
    """Plans of every job under ``prefix`` (e.g. ``/elaswave``), one epoch per plan."""

    def __init__(self, registry: Registry, prefix: str) -> None:
        check_key(prefix, "prefix")
        if not prefix.startswith("/") or prefix.endswith("/"):
            raise ValueError(f"prefix must start with '/' and not end with one, got {prefix!r}")
        self._registry = registry
        self._prefix = prefix

    def epoch_key(self, job: str) -> str:
        return f"{self._job_dir(job)}/epoch"

    def plan_key(self, job: str, epoch: int) -> str:
        return f"{self._plans_dir(job)}{_check_epoch(epoch, 'epoch'):0{EPOCH_DIGITS}d}"

    def current_epoch(self, job: str) -> int:
        """The last epoch allocated for ``job``; 0 before its first plan."""
        return _decode_epoch(self._registry.get(self.epoch_key(job)))

    def publish(
        self, job: str, plan_json: bytes, expected_epoch: int | None = None, fence: Fence | None = None
    ) -> int:
        """Store ``plan_json`` as the job's next plan; returns its epoch. With ``fence``, only
        while the fence holds (else ``FenceLost``, nothing stored)."""
        counter = self.epoch_key(job)
        plan_json = check_value(plan_json, "plan_json")
        if expected_epoch is not None:
            _check_epoch(expected_epoch, "expected_epoch")
        for _ in range(MAX_PUBLISH_ATTEMPTS):
            raw = self._registry.get(counter)
            current = _decode_epoch(raw)
            if expected_epoch is not None and current != expected_epoch:
                raise StaleEpoch(job, expected_epoch, current)
            epoch = current + 1
            if self._registry.compare_and_swap(
                counter, raw, str(epoch).encode(), also=[(self.plan_key(job, epoch), plan_json)], fence=fence
            ):
                return epoch
        raise RegistryError(f"could not allocate an epoch for job {job!r} in {MAX_PUBLISH_ATTEMPTS} attempts")

    def get(self, job: str, epoch: int) -> bytes | None:
        return self._registry.get(self.plan_key(job, epoch))

    def latest(self, job: str) -> tuple[int, bytes] | None:
        """The stored plan with the highest epoch, or None when the job has none."""
        epoch = self.current_epoch(job)
        plan = self.get(job, epoch) if epoch else None
        if plan is not None:
            return epoch, plan
        # The newest epoch is still being written (or its publisher died): take the newest stored.
        stored = self._registry.get_prefix(self._plans_dir(job))
        if not stored:
            return None
        key, plan = stored[-1]
        return self._epoch_of(key), plan

    def epochs(self, job: str) -> list[int]:
        """Epochs of every stored plan of ``job``, ascending."""
        return [self._epoch_of(key) for key, _ in self._registry.get_prefix(self._plans_dir(job))]

    def prune(self, job: str, keep: int) -> int:
        """Delete all but the newest ``keep`` plans of ``job``; returns how many were deleted."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        doomed = self.epochs(job)[:-keep]
        return sum(self._registry.delete(self.plan_key(job, epoch)) for epoch in doomed)

    def watch(self, job: str, callback: Callable[[int, bytes], None]) -> WatchHandle:
        """Call ``callback(epoch, plan_json)`` for every plan of ``job`` stored from now on."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")

        def on_change(event: KVEvent) -> None:
            if event.kind == "put" and event.value is not None:
                callback(self._epoch_of(event.key), event.value)

        return self._registry.watch_prefix(self._plans_dir(job), on_change)

    def _job_dir(self, job: str) -> str:
        check_key(job, "job")
        if "/" in job:
            raise ValueError(f"job name must not contain '/', got {job!r}")
        return f"{self._prefix}/jobs/{job}"

    def _plans_dir(self, job: str) -> str:
        return f"{self._job_dir(job)}/plans/"

    @staticmethod
    def _epoch_of(plan_key: str) -> int:
        return int(plan_key.rsplit("/", 1)[1])


def _check_epoch(epoch: object, what: str) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"{what} must be an int >= 0, got {epoch!r}")
    if epoch >= 10**EPOCH_DIGITS:
        raise ValueError(f"{what} {epoch} does not fit in {EPOCH_DIGITS} digits")
    return epoch


def _decode_epoch(raw: bytes | None) -> int:
    if raw is None:
        return 0
    try:
        return int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise RegistryError(f"epoch counter holds {raw!r}, not a decimal epoch") from None
