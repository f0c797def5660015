"""Growth in place (issue 10): a worker that was lost is replaced by a new one, at a step boundary,
with no process restarted and no checkpoint read.

PP=2 x DP=3 on gloo. Worker 4 (stage 1) is SIGKILLed mid-step at FAIL_STEP; the survivors recover
in place (plan 1, micro-batches resized, ElasWave §4.1). At the boundary before JOIN_STEP a new
process, worker 6, joins: plan 2 takes the job back to the fault-free layout with rank 6 in rank
4's place (`Plan.joiners`). The joiner builds its groups at the plan's epoch with everyone else
(`Communicator.for_joiner`), learns the last committed step, and receives its blocks' parameters
and its ZeRO shard from their live owners (`executor.fabric.rebuild`, joining).

Checked against the job itself and a fault-free run of the same seed:
- right after the join, the gathered parameters and Adam moments equal the job's state right
  before it bitwise (nothing but the joiner's state moved), and the fault-free state at that step
  within fp32 round-off (the steps on DP = 2 summed gradients in another order);
- every sample of every step is processed once per stage, before and after the join;
- the losses follow the fault-free run to fp32 round-off, and from the join on the job is
  the fault-free layout again;
- every backup equals its owner's live shard at the end (the joiner's included).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pytest

from executor.comm import Communicator, PeerFailure, groups_for_stages
from executor.fabric.trainer_state import FabricParticipant, shard_state_of
from executor.step_protocol import PlanInterrupted, StepParticipant, StepProtocol, plan_key
from executor.store_server import connect_store
from executor.trainer import Trainer, TrainSpec
from planners.applicability import judge
from planners.dataflow import resize_after_loss
from planners.layout import Layout, Plan, RngMode, StageLayout
from planners.zero import joiner_bytes
from tests.executor.ft_procs import collect, spawn
from tests.executor.stores import start_store
from tests.executor.test_failstop import (
    BATCH,
    CFG,
    FAIL_STEP,
    STEPS,
    TIMEOUT_S,
    VICTIM,
    WORKERS,
    KillingCommunicator,
    _precision_spec,
    _state_numpy,
    assert_snapshots_equal_live,
    assert_states_bitwise,
    base_layout,
)
from tests.executor.test_whole_stage import stage_one_lost, three_stages

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

RNG: RngMode = "placement_invariant"
JOIN_STEP = 6  # the joiner trains from this step on
JOINER = 6
READY = "test/committed-before-join"  # worker 0 sets it once step JOIN_STEP - 1 committed
FP32_REL = 1e-5  # a relative difference fp32 round-off explains (different summation order)
FP16_OVERFLOWS = (2, JOIN_STEP)  # fp16 case: one overflow before the join, one in the joiner's first step


def renamed(layout: Layout, old: int, new: int) -> Layout:
    """`layout` with rank `new` in rank `old`'s place (same stage and DP index: same samples)."""
    stages = tuple(
        StageLayout(s.stage, s.layer_start, s.layer_stop, tuple(new if r == old else r for r in s.ranks))
        for s in layout.stages
    )
    return layout.replace(stages=stages)


@dataclass(frozen=True)
class Case:
    """A job, the rank it loses, the layout it recovers to and the one the join brings back."""

    name: str
    base: Layout
    victim: int
    after_loss: Layout
    kill_at_op: int

    @property
    def joined(self) -> Layout:
        return renamed(self.base, self.victim, JOINER)


# PP=2 x DP=3, rank 4 of stage 1 lost: its stage's survivors take its samples, the joiner takes
# its place back.
LOSE_A_RANK = Case(
    "a rank", base_layout(RNG), VICTIM, resize_after_loss(base_layout(RNG), {VICTIM}).layout, kill_at_op=5
)
# PP=3 x DP=(3, 1, 2), stage 1 (rank 3 alone) lost: its blocks go to its neighbours (two stages,
# rebuilt from the backup in stage 2), and the joiner re-creates stage 1: the stage count returns.
LOSE_A_STAGE = Case("a whole stage", three_stages(), 3, stage_one_lost(), kill_at_op=3)


def after_loss() -> Layout:
    return LOSE_A_RANK.after_loss


def with_joiner() -> Layout:
    return LOSE_A_RANK.joined


def join_plan(case: Case = LOSE_A_RANK) -> Plan:
    return Plan(2, case.after_loss, case.joined, ("spare taken in",), 0.0, joiners=((JOINER, "spare-0"),))


def replan(dying: int) -> Plan:
    """Plan 3, from the cumulative state after `dying` died during the join: without the joiner
    (it died), or with it and without the dead survivor (a kill racing the join)."""
    if dying == JOINER:
        return Plan(3, after_loss(), after_loss(), ("the joiner died",), 0.0)
    new = resize_after_loss(with_joiner(), {dying}).layout
    return Plan(3, after_loss(), new, (f"lost worker {dying}",), 0.0, joiners=((JOINER, "spare-0"),))


class DiesInJoin(Communicator):
    """SIGKILLs its own process on its first state transfer once `armed` (inside the join)."""

    armed = False

    def post_exchange(self, sends: Any, recvs: Any) -> Any:
        if self.armed:
            print(f"worker {self.worker}: SIGKILL during the join's state transfer", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().post_exchange(sends, recvs)


def _loop(
    worker: int,
    trainer: Trainer,
    proto: StepProtocol,
    comm: Communicator,
    step: int,
    out: dict[str, Any],
    kill: bool,
    dying: int | None = None,
) -> None:
    """Train to STEPS; adopt a plan after a rollback (the loss) and before JOIN_STEP (the join)."""
    while step < STEPS:
        if step == JOIN_STEP and worker != JOINER and "before_join" not in out:
            out["before_join"] = _state_numpy(trainer.gather_full_state())
            if kill:
                if isinstance(comm, DiesInJoin) and worker == dying:
                    comm.armed = True
                try:
                    proto.apply_plan(proto.await_plan(timeout_s=120))
                except PlanInterrupted:  # a worker died during the join: the Core re-plans
                    proto.apply_plan(proto.await_plan(timeout_s=120, after_epoch=2))
                out["edits"].append({"at_step": step})
                out["after_join"] = _state_numpy(trainer.gather_full_state())
        proto.begin_step(step)
        if isinstance(comm, KillingCommunicator):
            comm.current_step, comm.ops_in_step = step, 0
        result = None
        with contextlib.suppress(PeerFailure):
            result = trainer.train_step(step)
        if proto.should_commit():
            proto.commit()
            assert result is not None
            out["losses"][step], out["samples"][step] = result.loss, list(result.sample_ids)
            if result.skipped:
                out["skipped"].append(step)
            out["stage_of"][step] = trainer.stage
            if step == JOIN_STEP - 1 and worker == 0:
                comm.store.set(READY, "1")
            step += 1
        else:
            proto.rollback()
            proto.apply_plan(proto.await_plan())
            out["edits"].append({"at_step": step})


def _spec(precision: str) -> TrainSpec:
    """CFG, or CFG in fp16 with block_1 (stage 0) overflowing at FP16_OVERFLOWS."""
    return CFG if precision == "fp32" else _precision_spec(False, precision, FP16_OVERFLOWS)


def _worker(
    worker: int, port: int, kill: bool, dying: int | None, case: Case, precision: str = "fp32"
) -> dict[str, Any]:
    layout = case.base
    spec = _spec(precision)
    world = spec.needs_world_group
    store = connect_store("127.0.0.1", port)
    out: dict[str, Any] = {"worker": worker, "losses": {}, "samples": {}, "stage_of": {}, "edits": []}
    out["skipped"] = []
    if worker == JOINER:
        joiner = DiesInJoin.for_joiner(store, worker, timeout_s=TIMEOUT_S)
        comm: Communicator = joiner
        # Plans come from the Core in a real job; here from the store (plan 1 is not for it).
        # _NoState serves await_plan alone, which never calls the participant.
        plan = StepProtocol(comm, cast(StepParticipant, _NoState()), timeout_s=120).await_plan(after_epoch=1)
        assert plan.rank_of_joiner("spare-0") == worker
        trainer = Trainer(spec, plan.new, worker, comm)
        participant = FabricParticipant(trainer, comm, verify_every=2, joining=True)
        proto = StepProtocol(comm, participant, timeout_s=TIMEOUT_S, joining=True, world=world)
        started = time.perf_counter()
        joiner.armed = dying == JOINER
        try:
            proto.apply_plan(plan)
        except PlanInterrupted:  # a survivor died during the join: taken in by the next plan
            plan = proto.await_plan(timeout_s=120, after_epoch=2)
            assert plan.rank_of_joiner("spare-0") == worker
            proto.apply_plan(plan)
        out["join_s"] = time.perf_counter() - started
        out["received_bytes"] = participant.rebuilt_bytes
        out["edits"].append({"at_step": proto.committed_step + 1})
        out["after_join"] = _state_numpy(trainer.gather_full_state())
        out["start_step"] = proto.committed_step + 1
    else:
        cls = KillingCommunicator if kill and worker == case.victim else DiesInJoin
        groups = groups_for_stages([s.ranks for s in layout.stages], world=world)
        comm = cls(store, worker, groups, timeout_s=TIMEOUT_S)
        if isinstance(comm, KillingCommunicator):
            comm.kill_at_op = case.kill_at_op
        trainer = Trainer(spec, layout, worker, comm)
        participant = FabricParticipant(trainer, comm, verify_every=2)
        proto = StepProtocol(comm, participant, timeout_s=TIMEOUT_S)
    _loop(worker, trainer, proto, comm, out.get("start_step", 0), out, kill, dying)
    snap = participant.snapshot
    out.update(
        stage_after=trainer.stage,
        dp_index_after=trainer.dp_index,
        checksum_mismatches=participant.checksum_mismatches,
        verified=list(participant.verified_steps),
        live_shard=shard_state_of(trainer).to_numpy(),
        snapshot=None if snap is None else {p: st.to_numpy() for p, st in snap.states().items()},
        loss_scale=None if trainer.scaler is None else trainer.scaler.state_dict(),
    )
    return out


class _NoState:
    """A participant for `await_plan` alone (it reads the store and nothing else)."""


def _run(
    kill: bool, dying: int | None = None, case: Case = LOSE_A_RANK, precision: str = "fp32"
) -> dict[int, dict[str, Any]]:
    server = start_store()
    try:
        store = connect_store("127.0.0.1", server.port)
        workers = [*WORKERS, JOINER] if kill else WORKERS
        procs, results = spawn(_worker, workers, server.port, kill, dying, case, precision)
        if kill:
            procs[case.victim].join(timeout=120)
            assert procs[case.victim].exitcode == -signal.SIGKILL, "the victim was not killed"
            store.set("ew/e0/abort", f"core: worker {case.victim} exited")
            plan1 = Plan(1, case.base, case.after_loss, (f"lost worker {case.victim}",), 0.0)
            store.set(plan_key("ew", 1), plan1.to_json())
            store.wait([READY])  # plan 2 only once plan 1 is applied and the job moved on
            store.set(plan_key("ew", 2), join_plan(case).to_json())
            if dying is not None:
                procs[dying].join(timeout=120)
                assert procs[dying].exitcode == -signal.SIGKILL, f"worker {dying} was not killed"
                store.set(plan_key("ew", 3), replan(dying).to_json())
        expect = [w for w in workers if w not in (case.victim, dying)] if kill else workers
        return collect(procs, results, expect, timeout_s=240)
    finally:
        server.stop()


def _merged(results: dict[int, dict[str, Any]], key: str) -> dict[str, Any]:
    """Whole-model state from `key` of every worker that recorded it (the ranks of a stage
    gather the same full state, so any one of them gives the stage's units)."""
    units: dict[str, Any] = {}
    counts = set()
    for r in results.values():
        if key in r:
            for unit, fields in r[key]["units"].items():
                units.setdefault(unit, fields)
            counts.add(r[key]["step_count"])
    assert len(counts) == 1, counts
    return {"step_count": counts.pop(), "units": units}


def assert_once_per_stage(job: dict[int, dict[str, Any]], steps: range) -> None:
    """Each of `steps` fed its global batch exactly once per stage, whoever held the stage."""
    for step in steps:
        per_stage: dict[int, list[int]] = {}
        for r in job.values():
            if step in r["samples"]:
                per_stage.setdefault(r["stage_of"][step], []).extend(r["samples"][step])
        for stage, got in per_stage.items():
            assert sorted(got) == list(range(step * BATCH, (step + 1) * BATCH)), (step, stage)


def _max_rel(ref: dict[str, Any], got: dict[str, Any]) -> float:
    worst = 0.0
    for unit, fields in ref["units"].items():
        for f, a in fields.items():
            b = got["units"][unit][f]
            worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-12)))
    return worst


def test_the_join_plan_is_in_place() -> None:
    plan = join_plan()
    assert plan.old is not None
    assert judge(plan.old, plan.new).in_place
    assert Plan.from_json(plan.to_json()) == plan


_CLEAN: dict[str, dict[int, dict[str, Any]]] = {}


def _clean_run(case: Case = LOSE_A_RANK) -> dict[int, dict[str, Any]]:
    """The fault-free run of the same seed (once per case and pytest process)."""
    if case.name not in _CLEAN:
        _CLEAN[case.name] = _run(kill=False, case=case)
    return _CLEAN[case.name]


def test_a_new_worker_takes_a_lost_ranks_place_in_place_and_the_job_follows_the_fault_free_run() -> None:
    clean = _clean_run()
    job = _run(kill=True)
    joiner = job[JOINER]
    assert joiner["start_step"] == JOIN_STEP
    # It received its blocks' parameters and its shard's moments, as the planner predicts.
    assert joiner["received_bytes"] == joiner_bytes(after_loss(), with_joiner())[JOINER] > 0
    # Nothing but the joiner's state moved: the state after the join is the state before it.
    assert_states_bitwise(_merged(job, "before_join"), _merged(job, "after_join"))
    # ... and the fault-free state at that step, to fp32 round-off (DP = 2 steps in between).
    ref = {
        "step_count": JOIN_STEP,
        "units": {
            u: f
            for r in clean.values()
            if r["dp_index_after"] == 0
            for u, f in r["before_join"]["units"].items()
        },
    }
    assert _merged(job, "after_join")["step_count"] == ref["step_count"]
    assert _max_rel(ref, _merged(job, "after_join")) < FP32_REL
    # The layout is the fault-free one again: the joiner is stage 1, DP index 1 (rank 4's place).
    assert (joiner["stage_after"], joiner["dp_index_after"]) == (1, 1)
    # Every sample of every step from the loss on (the victim's results died with it), once per
    # stage; the joiner fed rank 4's share.
    assert_once_per_stage(job, range(FAIL_STEP, STEPS))
    for step in range(JOIN_STEP, STEPS):
        assert joiner["samples"][step] == clean[VICTIM]["samples"][step]
    losses = {s: v for r in job.values() for s, v in r["losses"].items() if v is not None}
    ref_losses = {s: v for r in clean.values() for s, v in r["losses"].items() if v is not None}
    assert sorted(losses) == list(range(STEPS))
    for step in range(STEPS):
        assert abs(losses[step] - ref_losses[step]) <= FP32_REL * abs(ref_losses[step]), step
    assert all(r["checksum_mismatches"] == 0 for r in job.values())
    assert_snapshots_equal_live(job)


@pytest.mark.parametrize("dying", [JOINER, 3], ids=["joiner-killed-in-transfer", "kill-racing-the-join"])
def test_a_death_during_the_join_is_replanned_from_the_cumulative_state(dying: int) -> None:
    """The joiner killed during its state transfer: the job goes on without it (stage 1 keeps
    DP = 2). A survivor of stage 1 killed during the join: the next plan takes the joiner in
    and drops the dead rank (its shard from its backup). Either way the state right after the
    re-plan is the job's state before the join bitwise, every sample is fed once per stage, the
    losses follow the fault-free run and every backup equals its live shard."""
    clean = _clean_run()
    job = _run(kill=True, dying=dying)
    assert_states_bitwise(_merged(job, "before_join"), _merged(job, "after_join"))
    stage1 = sorted(w for w, r in job.items() if r["stage_after"] == 1)
    assert stage1 == ([3, 5] if dying == JOINER else [5, JOINER])
    # from the loss on; a dead survivor's own record of the steps before the join died with it
    assert_once_per_stage(job, range(FAIL_STEP if dying == JOINER else JOIN_STEP, STEPS))
    losses = {s: v for r in job.values() for s, v in r["losses"].items() if v is not None}
    ref = {s: v for r in clean.values() for s, v in r["losses"].items() if v is not None}
    assert sorted(losses) == list(range(STEPS))
    assert all(abs(losses[s] - ref[s]) <= FP32_REL * abs(ref[s]) for s in range(STEPS)), (losses, ref)
    assert_snapshots_equal_live(job)


def test_a_join_after_a_whole_stage_loss_brings_the_stage_count_back() -> None:
    """PP=3: stage 1 (one rank) is lost and its blocks go to its neighbours (two stages); the
    joiner re-creates stage 1 with its blocks: three stages again, state bitwise the job's before
    the join, losses to fp32 round-off of the fault-free run, samples once per stage."""
    case = LOSE_A_STAGE
    assert judge(case.after_loss, case.joined).in_place and case.joined.num_stages == 3
    clean = _clean_run(case)
    job = _run(kill=True, case=case)
    assert_states_bitwise(_merged(job, "before_join"), _merged(job, "after_join"))
    assert (
        job[JOINER]["stage_after"] == 1
        and job[JOINER]["received_bytes"] == (joiner_bytes(case.after_loss, case.joined)[JOINER])
    )
    assert_once_per_stage(job, range(JOIN_STEP, STEPS))
    losses = {s: v for r in job.values() for s, v in r["losses"].items() if v is not None}
    ref = {s: v for r in clean.values() for s, v in r["losses"].items() if v is not None}
    assert sorted(losses) == list(range(STEPS))
    assert all(abs(losses[s] - ref[s]) <= FP32_REL * abs(ref[s]) for s in range(STEPS)), (losses, ref)
    assert_snapshots_equal_live(job)


def test_a_joiner_takes_the_fp16_loss_scale_of_the_survivors() -> None:
    """fp16, one overflow skipped before the join (the scale halved once), one in the joiner's
    first step: the joiner starts with the survivors' scale, not a fresh one (executor.fabric
    .trainer_state.share_scaler), and skips that step with everyone; every worker ends with the
    same scaler state, and the backups still equal the live shards."""
    job = _run(kill=True, precision="fp16")
    assert job[JOINER]["start_step"] == JOIN_STEP
    for w, r in job.items():
        expected = [s for s in FP16_OVERFLOWS if s >= r.get("start_step", 0)]
        assert r["skipped"] == expected, (w, r["skipped"])
        assert r["loss_scale"] == {"scale": 2.0**14, "growth_tracker": STEPS - 1 - JOIN_STEP, "skipped": 2}, w
    assert all(r["checksum_mismatches"] == 0 for r in job.values())
    assert_snapshots_equal_live(job, verified_after_edit=False)  # 1 update after the join: none due
