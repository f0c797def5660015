"""The executor's step-boundary protocol (docs/architecture.md ("The executor") "Step atomicity"; ElasWave Fig. 2b-c).

In the style of torchft's Manager, a training loop drives it like this::

    proto.begin_step(step)
    try:
        trainer.train_step(step)
    except PeerFailure as exc:          # any collective/p2p error inside the step
        proto.report_failure(exc)
    if proto.should_commit():           # one decision per step, the same on every survivor
        proto.commit()
        step += 1
    else:
        proto.rollback()                # back to the last committed step, nothing half-applied
        proto.apply_plan(proto.await_plan())   # new layout; then replay `step` with the same samples

A step commits only when every worker of the layout has finished its optimizer update and no
worker saw a communication error. The decision is made once, atomically, in the store that no
training rank hosts (`compare_set` on one key per (plan epoch, step)): the first worker to know the
outcome writes it and every other worker reads the same value, so a late error cannot split the
survivors into committers and rollers-back (the failure mode docs/architecture.md ("Promises and rules") describes for torchft 0.2).

What a step's state is, and how it is rolled back and remapped, belongs to a `StepParticipant`
(for the engine: `executor.fabric.trainer_state.FabricParticipant`).
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Protocol, runtime_checkable

from torch.distributed import DistNetworkError

from executor.comm.communicator import Communicator, EditReport
from executor.comm.errors import PeerFailure, StoreLost
from executor.comm.groups import WORLD_GROUP, all_workers, groups_for_stages, transfer_groups
from executor.commit_vote import COMMIT as COMMIT  # re-exported: the decision's value
from executor.commit_vote import CommitVote, decision_base
from planners.applicability import far_pairs, handover_pairs
from planners.layout import Plan, PlanMode


class StepProtocolError(RuntimeError):
    """The protocol was driven out of order, or a plan cannot be applied."""


class DecisionUnknown(RuntimeError):
    """The store was lost while this worker waited for the commit decision of `step`, after it
    voted ok. Do not roll back: the next `apply_plan` settles the step with the other workers on
    the new store (committed if any of them read COMMIT, else rolled back)."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"the commit decision of step {step} was lost with the store: {reason}")
        self.step = step


class PlanInterrupted(RuntimeError):
    """Applying a plan was cut short (a peer failed, a wait timed out, a newer plan arrived).

    The groups may be half-edited and the participant's state half-moved; nothing is committed.
    The participant starts the next plan from its last committed point, so the caller only has
    to wait for a newer plan (docs/architecture.md ("Recovery"): recoveries are restartable)."""

    def __init__(self, epoch: int, cause: BaseException) -> None:
        super().__init__(f"applying plan {epoch} was interrupted: {type(cause).__name__}: {cause}")
        self.epoch, self.cause = epoch, cause


class StepParticipant(Protocol):
    """The state a step changes (parameters, optimizer shards, snapshots)."""

    def before_vote(self) -> None:
        """Finish the step's work still in flight (e.g. a posted snapshot exchange) before this
        worker votes; bounded by the communicator timeout; raises PeerFailure on a dead peer."""

    def on_commit(self, step: int) -> None:
        """Step `step` is committed everywhere: make its state the rollback point."""

    def on_rollback(self) -> None:
        """Restore the state of the last committed step (local, no communication)."""

    def check_plan(self, plan: Plan, lost: frozenset[int]) -> object:
        """Raise (a ValueError) if this participant cannot adopt `plan`; local, called before the
        groups are edited, so a refused plan changes nothing."""

    def on_plan(self, plan: Plan, lost: frozenset[int], committed_step: int) -> int:
        """Adopt `plan.new` (collective over the new layout's workers; groups already edited):
        for the engine, remap the committed state to the new ranks and migrate moved layers.
        Returns the last committed step afterwards (`committed_step`, or an earlier one when the
        plan restored a durable checkpoint). An exception leaves nothing committed: the next
        call starts again from the last committed point."""


@runtime_checkable
class HandsOver(Protocol):
    """A participant whose worker can be put on standby by a plan (`Plan.standby`)."""

    def check_plan(self, plan: Plan, lost: frozenset[int]) -> object: ...

    def hand_over(self, plan: Plan, lost: frozenset[int]) -> None:
        """Send this worker's committed state to the new layout's workers that need it
        (collective with their `on_plan`; groups already edited), then hold nothing: a spare."""


def plan_key(namespace: str, epoch: int) -> str:
    """Where the Core publishes the plan of `epoch` (a `planners.layout.Plan` as JSON)."""
    return f"{namespace}/plan/{epoch}"


class StepProtocol:
    """One worker's side of the protocol. Every method states how long it may block."""

    def __init__(
        self,
        comm: Communicator,
        participant: StepParticipant,
        plan_epoch: int = 0,
        timeout_s: float = 30.0,
        committed_step: int = -1,
        joining: bool = False,
        world: bool | None = None,
    ) -> None:
        """`committed_step`: the last step already committed (-1: none; a resumed job starts at
        its checkpoint's last step). `joining`: this worker joins a running job (growth): it
        holds no group and no state until a plan names it in `Plan.joiners`, and learns the job's
        last committed step from the other workers when it applies that plan. `world`: whether
        the job has a job-wide group (default: whether the communicator holds one; a joiner's
        holds none yet, so it must be told)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if committed_step < -1:
            raise ValueError(f"committed_step must be >= -1, got {committed_step}")
        self.comm, self.participant, self.timeout_s = comm, participant, timeout_s
        self.plan_epoch = plan_epoch
        self.committed_step = committed_step  # last committed step (-1: none yet)
        self.step: int | None = None
        self.failure: str | None = None
        # Every abort decision makes every survivor roll back once, so all agree on this count;
        # it keeps a replayed step's decision apart from the aborted attempt's.
        self.attempt = 0
        # A step whose decision was lost with the store (`DecisionUnknown`): its state is kept
        # until the next plan settles it with the other workers on the new store.
        self.undecided: int | None = None
        # Whether the job has a job-wide group (clipping by the global norm): a property of the
        # job, not of the groups an interrupted edit happened to build.
        self.world = WORLD_GROUP in comm.membership if world is None else world
        self._settled_generation = comm.store_generation
        # Until its first commit on a layout that holds it: a plan that adds it again (the plan
        # that took it in was interrupted, or superseded before a step committed) starts over.
        self.joining = joining
        self.standby: frozenset[int] = frozenset()  # ranks the applied plan put on standby
        self.vote = CommitVote()

    # ----- one step ------------------------------------------------------------------------
    def begin_step(self, step: int, timeout_s: float | None = None) -> None:
        """Start step `step` (must be the one after the last committed step). Never blocks;
        `timeout_s` is accepted for symmetry with the other calls and bounds nothing here."""
        if step != self.committed_step + 1:
            raise StepProtocolError(
                f"begin_step({step}) but the last committed step is {self.committed_step}"
            )
        self.step, self.failure = step, None

    def report_failure(self, exc: BaseException) -> None:
        """Record that this step failed here and tell every survivor (one store write)."""
        self._require_step()
        self.failure = f"{type(exc).__name__}: {exc}"
        self.comm.signal_abort(f"step {self.step}: {self.failure}")

    def should_commit(self, timeout_s: float | None = None) -> bool:
        """The commit decision of the current step, identical on every worker.

        First lets the participant finish its in-flight work (`before_vote`), then votes "ok" (this worker finished its optimizer update) or "fail", then blocks until the
        decision exists: commit once every worker of the layout voted ok; abort as soon as a
        worker voted fail or flagged an abort (ms after a peer's socket closed), or when
        `timeout_s` (default: the protocol timeout) passes without every vote (a hung peer)."""
        step = self._require_step()
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        try:
            # Also after a failure: ops that did complete are then accounted as complete, so the
            # edit can reuse their groups; the rest raise at once (the abort flag is set).
            self.participant.before_vote()
        except PeerFailure as exc:
            if self.failure is None:
                self.report_failure(exc)
        try:
            return self._decide(step, deadline)
        except (StoreLost, DistNetworkError) as exc:
            if self.failure is None:
                self.failure = f"StoreLost: {exc}"
                # This worker voted ok (or was about to): the decision may be COMMIT in the lost
                # store, read by others. Keep the step's state until the workers settle it.
                self.undecided = step
                raise DecisionUnknown(step, str(exc)) from exc
            return False  # this worker voted fail (or never voted): no one can have committed

    def _decide(self, step: int, deadline: float) -> bool:
        # Ranks on standby keep a pair group until the next edit, but take no part in steps.
        voters = all_workers(self.comm.membership) - self.standby
        return self.vote.decide(
            self.comm.store,
            decision_base(self.comm.namespace, self.plan_epoch, step, self.attempt),
            len(voters),
            # A worker that skipped its step for a waiting plan flagged the abort without failing.
            ok=self.failure is None and not self.comm.flagged_abort(),
            should_abort=lambda: self.failure is not None or self.comm.aborted(),
            deadline=deadline,
        )

    def commit(self) -> None:
        """Make the current step the rollback point. Local; blocks only for the participant's copy."""
        step = self._require_step()
        self.participant.on_commit(step)
        self.committed_step, self.step = step, None
        self.joining = False

    def rollback(self) -> None:
        """Return to the last committed step (local, no communication, never blocks)."""
        self._require_step()
        self.participant.on_rollback()
        self.step = None
        self.attempt += 1

    # ----- layout changes ------------------------------------------------------------------
    def await_plan(self, timeout_s: float | None = None, after_epoch: int | None = None) -> Plan:
        """Block (at most `timeout_s`, default the protocol timeout) until a plan newer than
        `after_epoch` (default: the applied epoch) is published in the store, and return the
        newest one; raises StepProtocolError if none arrives in time. (Under the Core, plans come
        through `executor.plan_client` instead; this is the store-only path of the tests.)"""
        after = self.plan_epoch if after_epoch is None else after_epoch
        key = plan_key(self.comm.namespace, after + 1)
        wait = self.timeout_s if timeout_s is None else timeout_s
        try:
            self.comm.store.wait([key], timedelta(seconds=wait))
        except Exception as exc:  # noqa: BLE001 - the store reports a timeout as a generic error
            raise StepProtocolError(f"no plan after epoch {after} within {wait}s") from exc
        newest = after + 1
        while self.comm.store.check([plan_key(self.comm.namespace, newest + 1)]):
            newest += 1
        return Plan.from_json(self.comm.store.get(plan_key(self.comm.namespace, newest)))

    def apply_plan(self, plan: Plan, timeout_s: float | None = None) -> EditReport:
        """Apply `plan` between steps: edit the communicator in place (only changed groups, under
        the plan's epoch), then let the participant move its state to `plan.new`. Collective over
        the new layout's workers; each wait is bounded by the communicator timeout and abandoned
        as soon as the communicator's `interrupt` says a newer plan exists. A worker the plan
        puts on standby (`Plan.standby`: its DP replica dropped) hands its state over instead
        (`hand_over`) and is a spare afterwards (`joining`).

        Refused, changing nothing (StepProtocolError, or the participant's ValueError from
        `check_plan`): an older or repeated epoch, a plan without its old layout, a plan this
        worker is not in. Any failure after the edit began raises PlanInterrupted after flagging
        the plan's epoch as aborted, so the other workers stop waiting for this one."""
        if self.step is not None and self.step != self.undecided:
            raise StepProtocolError(f"apply_plan inside step {self.step}: commit or roll back first")
        if plan.epoch <= self.plan_epoch:
            raise StepProtocolError(
                f"plan epoch {plan.epoch} is not newer than the applied epoch {self.plan_epoch}"
            )
        if plan.old is None:
            raise StepProtocolError("a plan applied to a running job must name its old layout")
        standby = frozenset(plan.standby)
        if self.comm.worker in standby and not self.joining:
            return self.hand_over(plan)
        if self.comm.worker not in plan.new.ranks():
            raise StepProtocolError(
                f"worker {self.comm.worker} is not in the new layout of plan {plan.epoch}"
            )
        lost = frozenset(plan.old.ranks()) - frozenset(plan.new.ranks()) - standby
        joined = frozenset(plan.new.ranks()) - frozenset(plan.old.ranks())
        if self.joining and self.comm.worker not in joined:
            raise StepProtocolError(
                f"joining worker {self.comm.worker} is already in the old layout of plan {plan.epoch}"
            )
        self.participant.check_plan(plan, lost)
        try:
            if self.comm.store_generation != self._settled_generation and not self.joining:
                self._settle(plan)
            if joined:
                self._agree_join_point(plan, joined)
            report = self.comm.apply_edit(self._membership(plan, lost), epoch=plan.epoch)
            committed = self.participant.on_plan(plan, lost, self.committed_step)
        except Exception as exc:  # noqa: BLE001 - whatever broke, the attempt is over and retried
            with contextlib.suppress(Exception):  # an unreachable store must not mask the cause
                self.comm.store.set(self.comm.abort_key(plan.epoch), f"{self.comm.worker}: {exc}"[:500])
            raise PlanInterrupted(plan.epoch, exc) from exc
        self.plan_epoch, self.committed_step, self.attempt = plan.epoch, committed, 0
        self.standby = standby
        return report

    def _membership(self, plan: Plan, lost: frozenset[int]) -> dict[str, tuple[int, ...]]:
        """The groups of `plan.new`, and a two-rank group per pair whose state must travel
        outside them: blocks moved past a neighbour, and ranks handing over before standby."""
        assert plan.old is not None
        membership = groups_for_stages([s.ranks for s in plan.new.stages], world=self.world)
        if plan.mode is PlanMode.IN_PLACE:
            pairs = far_pairs(plan.old, plan.new, lost) + handover_pairs(
                plan.old, plan.new, frozenset(plan.standby), lost
            )
            membership |= transfer_groups(pairs)
        return membership

    def hand_over(self, plan: Plan) -> EditReport:
        """This worker's rank is dropped while it is alive (`Plan.standby`, a DP replica dropped):
        join the plan's edit (its only groups are the pairs to the ranks taking its blocks), send
        its committed live shard where the new layout needs it (`HandsOver.hand_over`, collective
        with the new layout's workers), and become a spare: the next plan that applies to it must
        take it back in (`Plan.joiners`), like any joining worker. Bounded like `apply_plan`;
        PlanInterrupted when cut short (the next plan starts again from the committed point)."""
        assert plan.old is not None
        lost = frozenset(plan.old.ranks()) - frozenset(plan.new.ranks()) - frozenset(plan.standby)
        participant = self.participant
        if not isinstance(participant, HandsOver):
            raise StepProtocolError(
                f"plan {plan.epoch} puts this worker on standby; its state cannot hand over"
            )
        participant.check_plan(plan, lost)
        try:
            if self.comm.store_generation != self._settled_generation:
                self._settle(plan)
            report = self.comm.apply_edit(self._membership(plan, lost), epoch=plan.epoch)
            participant.hand_over(plan, lost)
        except Exception as exc:  # noqa: BLE001 - whatever broke, the attempt is over and retried
            with contextlib.suppress(Exception):
                self.comm.store.set(self.comm.abort_key(plan.epoch), f"{self.comm.worker}: {exc}"[:500])
            raise PlanInterrupted(plan.epoch, exc) from exc
        self.plan_epoch, self.attempt, self.joining = plan.epoch, 0, True
        return report

    def _agree_join_point(self, plan: Plan, joined: frozenset[int]) -> None:
        """Ranks join in this plan: every worker already in the job announces its last committed
        step, and a joiner adopts it (they all agree, or the plan is refused: no in-place way to
        pick one). Bounded and interruptible like every recovery wait."""
        key = f"{self.comm.namespace}/e{plan.epoch}/join-point/"
        if not self.joining:
            self.comm.store.set(key + str(self.comm.worker), str(self.committed_step))
        members = sorted(set(plan.new.ranks()) - joined)
        self.comm.wait_keys(
            [key + str(w) for w in members], "the job's last committed step for the joiners", epoch=plan.epoch
        )
        said = {w: int(self.comm.store.get(key + str(w))) for w in members}
        if len(set(said.values())) != 1:
            raise StepProtocolError(
                f"the workers of plan {plan.epoch} disagree on the last committed step: {said}"
            )
        if self.joining:
            self.committed_step = next(iter(said.values()))

    def _settle(self, plan: Plan) -> None:
        """After a move to a new store: agree with the workers of `plan.new` on the last committed
        step. A worker whose step decision was lost commits it if any worker has committed it
        (every worker then voted ok, so every one holds that step's update), else rolls it back.
        Bounded and interruptible like every recovery wait."""
        key = f"{self.comm.namespace}/e{plan.epoch}/settle/"
        self.comm.store.set(key + str(self.comm.worker), str(self.committed_step))
        members = sorted(plan.new.ranks())
        self.comm.wait_keys(
            [key + str(w) for w in members], "settling the last step on the new store", epoch=plan.epoch
        )
        newest = max(int(self.comm.store.get(key + str(w))) for w in members)
        if self.undecided is not None:
            if newest == self.undecided:
                self.commit()
            else:
                self.rollback()
            self.undecided = None
        if self.committed_step != newest:
            raise StepProtocolError(
                f"worker {self.comm.worker} committed step {self.committed_step}, another worker {newest}: "
                "no in-place way to agree"
            )
        self._settled_generation = self.comm.store_generation

    def _require_step(self) -> int:
        if self.step is None:
            raise StepProtocolError("no step in progress: call begin_step first")
        return self.step
