"""Several failures in one recovery, and a failure during a recovery (issue: survive what clusters
do), on the engine itself: a PP=2 x DP=3 job on gloo, this process playing the Core through the
store (as in test_failstop).

- Two workers of different stages die in the same step: one plan covers both; the survivors
  rebuild both lost optimizer shards from their ring snapshots in one remap.
- A worker dies mid-step, the survivors start applying the plan for it, and a second worker dies
  during that recovery (it kills itself on entering the remap). Every wait of the first recovery
  gives up, either on the abort flag, on the second worker's absence, or because the Core's
  second plan is published (the communicator's interrupt); every survivor acknowledges the
  interrupted plan and applies the second one from the last committed state.

Both end like test_failstop: the gathered parameters and Adam moments right after the recovery
are bitwise the fault-free run's at the last committed step, each stage processes every sample
of every later step once, and the remaining losses follow the fault-free run.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, replace
from typing import Any

import pytest

from executor.comm import Communicator, PeerFailure, groups_for_stages
from executor.fabric.trainer_state import FabricParticipant
from executor.step_protocol import PlanInterrupted, StepProtocol, plan_key
from executor.store_server import connect_store
from executor.trainer import Trainer
from planners.dataflow import resize_after_loss
from planners.layout import Plan, RngMode
from tests.executor.ft_procs import collect, spawn
from tests.executor.stores import start_store
from tests.executor.test_failstop import (
    CFG,
    FAIL_STEP,
    STEPS,
    TIMEOUT_S,
    WORKERS,
    KillingCommunicator,
    _clean,
    _last_stage_losses,
    _mean_rel_dev,
    _state_numpy,
    assert_recovered_bitwise,
    assert_same_samples,
    base_layout,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]
RNG: RngMode = "placement_invariant"


@dataclass(frozen=True)
class Cascade:
    mid_step: tuple[int, ...]  # die together at op 2 of FAIL_STEP
    in_recovery: tuple[int, ...] = ()  # die on entering the remap of the first plan

    def plan(self, epoch: int, lost: set[int]) -> Plan:
        old = base_layout(RNG)
        return Plan(epoch, old, resize_after_loss(old, lost).layout, (f"lost workers {sorted(lost)}",), 0.0)


class DyingInRecovery(Communicator):
    """Dies on entering the remap of epoch 1 (after its groups were edited for that plan)."""

    def wait_keys(
        self, keys: Any, what: str, timeout_s: float | None = None, epoch: int | None = None
    ) -> None:
        if what == "remap integrity check" and self.epoch == 1:
            print(f"worker {self.worker}: SIGKILL during the recovery (remap of epoch 1)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        super().wait_keys(keys, what, timeout_s, epoch)


def _worker(worker: int, port: int, sc: Cascade) -> dict[str, Any]:
    layout = base_layout(RNG)
    store = connect_store("127.0.0.1", port)
    membership = groups_for_stages([s.ranks for s in layout.stages])
    comm: Communicator
    if worker in sc.mid_step:
        killer = KillingCommunicator(store, worker, membership, timeout_s=TIMEOUT_S)
        killer.kill_at_op = 2
        comm = killer
    elif worker in sc.in_recovery:
        comm = DyingInRecovery(store, worker, membership, timeout_s=TIMEOUT_S)
    else:
        comm = Communicator(store, worker, membership, timeout_s=TIMEOUT_S)
    trainer = Trainer(CFG, layout, worker, comm)
    participant = FabricParticipant(trainer, comm, verify_every=2)
    proto = StepProtocol(comm, participant, timeout_s=TIMEOUT_S)
    tried = [0]  # the newest plan epoch this worker has tried to apply
    comm.interrupt = lambda: (
        "a newer plan is published"
        if store.check([plan_key("ew", max(tried[0], proto.plan_epoch) + 1)])
        else None
    )
    out: dict[str, Any] = {"worker": worker, "stage": trainer.stage, "interrupted": [], "applied": []}
    losses: dict[int, float | None] = {}
    samples: dict[int, list[int]] = {}

    def recover(step: int) -> None:
        while True:
            plan = proto.await_plan(after_epoch=tried[0])
            tried[0] = plan.epoch
            try:
                proto.apply_plan(replace(plan, old=participant.committed_layout))
            except PlanInterrupted as exc:
                out["interrupted"].append((plan.epoch, str(exc)[:200]))
                continue
            out["applied"].append(plan.epoch)
            out["recovered_state"] = _state_numpy(trainer.gather_full_state())
            return

    step = 0
    while step < STEPS:
        proto.begin_step(step)
        if isinstance(comm, KillingCommunicator):
            comm.current_step, comm.ops_in_step = step, 0
        result = None
        try:
            result = trainer.train_step(step)
        except PeerFailure as exc:
            proto.report_failure(exc)
        if proto.should_commit():
            proto.commit()
            assert result is not None
            losses[step], samples[step] = result.loss, list(result.sample_ids)
            step += 1
        else:
            proto.rollback()
            recover(step)
    out.update(losses=losses, samples=samples, checksum_mismatches=participant.checksum_mismatches)
    out["dp_index_after"] = trainer.dp_index
    out["final_state"] = _state_numpy(trainer.gather_full_state())
    return out


def _run(sc: Cascade) -> dict[int, dict[str, Any]]:
    """This process plays the Core: a plan for the workers that died mid-step, then (if some die
    during that recovery) a second plan for all of them once they are gone."""
    server = start_store()
    try:
        store = connect_store("127.0.0.1", server.port)
        procs, results = spawn(_worker, WORKERS, server.port, sc)
        for victim in sc.mid_step:
            procs[victim].join(timeout=120)
            assert procs[victim].exitcode == -signal.SIGKILL, f"worker {victim} was not killed"
        store.set("ew/e0/abort", f"core: workers {list(sc.mid_step)} exited")
        store.set(plan_key("ew", 1), sc.plan(1, set(sc.mid_step)).to_json())
        if sc.in_recovery:
            for victim in sc.in_recovery:
                procs[victim].join(timeout=120)
                assert procs[victim].exitcode == -signal.SIGKILL, f"worker {victim} was not killed"
            store.set(plan_key("ew", 2), sc.plan(2, {*sc.mid_step, *sc.in_recovery}).to_json())
        survivors = [w for w in WORKERS if w not in sc.mid_step + sc.in_recovery]
        return collect(procs, results, survivors, timeout_s=180)
    finally:
        server.stop()


def _check(sc: Cascade, faulty: dict[int, dict[str, Any]]) -> None:
    clean = _clean(RNG)
    assert_recovered_bitwise(clean, faulty)
    assert_same_samples(clean, faulty, FAIL_STEP)
    dev = _mean_rel_dev(_last_stage_losses(faulty), _last_stage_losses(clean), range(FAIL_STEP, STEPS))
    assert dev <= 1e-6, dev
    assert all(r["checksum_mismatches"] == 0 for r in faulty.values())


def test_two_workers_of_different_stages_die_together_one_plan_recovers_both() -> None:
    sc = Cascade(mid_step=(1, 4))
    faulty = _run(sc)
    _check(sc, faulty)
    assert all(r["applied"] == [1] and not r["interrupted"] for r in faulty.values())


def test_a_failure_during_the_recovery_restarts_it_from_the_committed_state() -> None:
    sc = Cascade(mid_step=(4,), in_recovery=(1,))
    faulty = _run(sc)
    _check(sc, faulty)
    # Every survivor ends on plan 2; those that were waiting on worker 1 gave plan 1 up first.
    assert all(r["applied"][-1] == 2 for r in faulty.values()), {w: r["applied"] for w, r in faulty.items()}
    assert any(r["interrupted"] for r in faulty.values())
