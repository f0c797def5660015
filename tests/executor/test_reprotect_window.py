"""Resume first, re-protect after (issue 23 item 2): a failure inside the re-protection window is
the RESTORE it is, and the window is recorded exactly as the layouts imply.

PP=2 x DP=3 on gloo, a stage per node, so every shard's copy lives in the other stage
(`planners.backup` rule 2). This process plays the Core through the store (as in test_failstop),
deciding each plan's mode with the Core's own rule (`core_service.recovery.choose_mode` over the
windows the workers report, `core_service.backup_windows`).

1. Worker 0 SIGKILLs itself in the gradient reduce-scatter of step FIRST. The plan loses it in
   place; the survivors resume at once and re-seed the copies the new layout moved in the
   background (`FabricParticipant.reprotect_steps` = 2: done by the commit of step FIRST + 1).
2. Inside that window, worker 1 (whose copy moved from 4 to 3) and worker 4 (the old holder of
   1's copy) SIGKILL themselves in the reduce-scatter of step FIRST + 1. With the copies in
   place this would recover in place from 3 and 2; inside the window the Core's rule makes it a
   RESTORE, and an in-place plan for it is refused by every survivor before any group is edited.
3. The survivors restore the initial state in place (no checkpoint written) and train to the
   end: the losses and the final parameters and Adam moments match the fault-free run up to fp32
   round-off (the last layout reduces over other DP sizes).

Every survivor records the same windows: the first plan's (the pairs `reseed_pairs` gives, from
step FIRST until FIRST + 1, superseded by the RESTORE plan) and the RESTORE's (every copy of its
layout, from step 0 until 1, closed at 1); at the end every copy equals its live shard bitwise.

The job's first copies are seeded inside its first step (`FabricParticipant._first_seed`), so a
worker lost half-way through that seed (SEED_VICTIM: its sizes exchanged, its header never sent)
fails step 0 on every survivor, and no survivor dies with it. No copy protects anything before
step 0 commits: the in-place plan a Core would publish is refused by every survivor, and the
RESTORE of the initial state trains to the fault-free result.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import numpy as np
import pytest

from core_service.backup_windows import record_window
from core_service.config import FailSlowSettings
from core_service.failslow import FailSlowDetector
from core_service.jobs import Job
from core_service.recovery import choose_mode
from executor.comm import Communicator, PeerFailure, groups_for_stages
from executor.fabric.snapshot import SNAPSHOT_TAG
from executor.fabric.trainer_state import FabricParticipant, shard_state_of
from executor.step_protocol import StepProtocol, plan_key
from executor.store_server import connect_store
from executor.trainer import Trainer
from planners.applicability import judge
from planners.backup import backup_holder_sets, protected_by
from planners.dataflow import resize_after_loss
from planners.layout import Layout, Plan, PlanMode, RngMode
from planners.reprotect import ReprotectWindow, backup_pairs, reseed_pairs
from tests.executor.ft_procs import collect, spawn
from tests.executor.stores import start_store
from tests.executor.test_failstop import (
    CFG,
    STEPS,
    TIMEOUT_S,
    WORKERS,
    _clean,
    _last_stage_losses,
    base_layout,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

RNG: RngMode = "placement_invariant"
FIRST, SECOND = 3, 4
KILLS = {0: FIRST, 1: SECOND, 4: SECOND}  # worker -> the step whose reduce-scatter kills it
REDUCE_SCATTER_OP = 5  # test_failstop.KillingCommunicator's numbering: 4 pipeline ops, then it
STAGE_PER_NODE = ((0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1))
L0 = base_layout(RNG).replace(rank_nodes=STAGE_PER_NODE)
L1 = resize_after_loss(L0, {0}).layout
L2 = resize_after_loss(L1, {1, 4}).layout
SURVIVORS = [2, 3, 5]
SEED_VICTIM = 0
SEED_SURVIVORS = [1, 2, 3, 4, 5]


class KillAt(Communicator):
    """SIGKILLs this worker on entering the REDUCE_SCATTER_OP-th op of step `kill_step`."""

    kill_step, current_step, ops_in_step = -1, -1, 0

    def _tick(self) -> None:
        self.ops_in_step += 1
        if self.current_step == self.kill_step and self.ops_in_step == REDUCE_SCATTER_OP:
            os.kill(os.getpid(), signal.SIGKILL)

    def post_exchange(self, sends: Any, recvs: Any) -> Any:
        self._tick()
        return super().post_exchange(sends, recvs)

    def wait(self, name: str, work: object, has_future: bool = True, issued: int = 0) -> None:
        self._tick()
        super().wait(name, work, has_future, issued)


class KillInFirstSeed(Communicator):
    """SIGKILLs this worker half-way through seeding its backup pairs: the shard sizes went out,
    the headers (`ShardBackups._transfer_states`, tag SNAPSHOT_TAG + 1) never do."""

    def post_exchange(self, sends: Any, recvs: Any) -> Any:
        if any(op[3] == SNAPSHOT_TAG + 1 for op in (*sends, *recvs)):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().post_exchange(sends, recvs)


def _numpy(state: dict[str, Any]) -> dict[str, Any]:
    return {u: {f: t.cpu().numpy().copy() for f, t in d.items()} for u, d in state["units"].items()}


def _worker(worker: int, port: int, seed_victim: int | None = None) -> dict[str, Any]:
    """One worker of L0: KILLS apply, or with `seed_victim` only that worker dies (in its seed)."""
    store = connect_store("127.0.0.1", port)
    groups = groups_for_stages([s.ranks for s in L0.stages])
    if worker == seed_victim:
        comm: Communicator = KillInFirstSeed(store, worker, groups, timeout_s=TIMEOUT_S)
    else:
        comm = KillAt(store, worker, groups, timeout_s=TIMEOUT_S)
        comm.kill_step = KILLS.get(worker, -1) if seed_victim is None else -1
    trainer = Trainer(CFG, L0, worker, comm, CFG.local_device())
    participant = FabricParticipant(trainer, comm, verify_every=2, restore_source=lambda plan: None)
    proto = StepProtocol(comm, participant, timeout_s=TIMEOUT_S)
    losses: dict[int, float | None] = {}
    refused: list[int] = []
    step = 0
    while step < STEPS:
        proto.begin_step(step)
        if isinstance(comm, KillAt):
            comm.current_step, comm.ops_in_step = step, 0
        result = None
        try:
            result = trainer.train_step(step)
        except PeerFailure as exc:
            proto.report_failure(exc)
        if proto.should_commit():
            proto.commit()
            assert result is not None
            losses[step] = result.loss
            step += 1
            continue
        proto.rollback()
        tried = proto.plan_epoch
        while True:
            plan = proto.await_plan(after_epoch=tried)
            tried = plan.epoch
            try:
                proto.apply_plan(plan)
                break
            except ValueError as exc:  # refused before any group was edited (RelayoutError)
                refused.append(plan.epoch)
                store.set(f"test/refused/e{plan.epoch}/{worker}", str(exc)[:500])
        window = participant.window
        # what the APPLIED acknowledgement carries to the Core
        store.set(f"test/window/e{plan.epoch}/{worker}", json.dumps(window and window.as_dict()))
        step = proto.committed_step + 1
    snap = participant.snapshot
    assert snap is not None
    return {
        "losses": losses,
        "refused": refused,
        "windows": [w.as_dict() for w in participant.windows],
        "final_state": _numpy(trainer.gather_full_state()),
        "dp_index": trainer.dp_index,
        "live_shard": shard_state_of(trainer).to_numpy(),
        "snapshot": {p: st.to_numpy() for p, st in snap.states().items()},
        "restored_from": list(participant.restored_from),
        "checksum_mismatches": participant.checksum_mismatches,
    }


def _wait_exits(procs: dict[int, Any], workers: list[int]) -> None:
    for w in workers:
        procs[w].join(timeout=120)
        assert procs[w].exitcode == -signal.SIGKILL, f"worker {w} was not killed"


def _reported(store: Any, epoch: int, workers: list[int]) -> list[Any]:
    keys = [f"test/window/e{epoch}/{w}" for w in workers]
    store.wait(keys)
    return [json.loads(store.get(k)) for k in keys]


def _run_faulty() -> tuple[dict[int, dict[str, Any]], Plan]:
    """The job above; returns the survivors' results and the plan the Core's rule chose."""
    server = start_store()
    try:
        store = connect_store("127.0.0.1", server.port)
        procs, results = spawn(_worker, WORKERS, server.port)
        _wait_exits(procs, [0])
        store.set("ew/e0/abort", "core: worker 0 exited")
        verdict = judge(L0, L1)
        assert verdict.in_place, verdict.reason
        store.set(plan_key("ew", 1), Plan(1, L0, L1, ("lost worker 0",), 0.0).to_json())
        reports = _reported(store, 1, [1, 2, 3, 4, 5])
        assert all(r == reports[0] for r in reports), reports
        job = Job("j", "", 6, 0.0, FailSlowDetector(FailSlowSettings()))
        job.committed_layout_json, job.committed_epoch = L1.to_json(), 1
        record_window(job, 1, ReprotectWindow.from_dict(reports[0]), closed=False)

        _wait_exits(procs, [1, 4])
        store.set("ew/e1/abort", "core: workers 1 and 4 exited")
        # What the Core would publish with no window, refused by the executors' own rule ...
        assert judge(L1, L2).in_place
        store.set(plan_key("ew", 2), Plan(2, L1, L2, ("lost workers [1, 4]",), 0.0).to_json())
        store.wait([f"test/refused/e2/{w}" for w in SURVIVORS])
        # ... and what the Core's rule decides with the window the workers reported.
        mode, why = choose_mode(job, L1, L2, None)
        restore = Plan(3, L1, L2, ("lost workers [1, 4]", *why), 0.0, mode=mode)
        store.set(plan_key("ew", 3), restore.to_json())
        return collect(procs, results, SURVIVORS, timeout_s=180), restore
    finally:
        server.stop()


def _run_first_seed_fault() -> tuple[dict[int, dict[str, Any]], list[str]]:
    """SEED_VICTIM dies in its first seed; this process publishes the in-place plan a Core that
    never heard of the first seed would, then the RESTORE. Returns the survivors' results and the
    reasons they gave for refusing the first plan."""
    server = start_store()
    try:
        store = connect_store("127.0.0.1", server.port)
        procs, results = spawn(_worker, WORKERS, server.port, SEED_VICTIM)
        _wait_exits(procs, [SEED_VICTIM])
        store.set("ew/e0/abort", f"core: worker {SEED_VICTIM} exited")
        assert judge(L0, L1).in_place
        store.set(plan_key("ew", 1), Plan(1, L0, L1, ("lost worker 0",), 0.0).to_json())
        refusals = [f"test/refused/e1/{w}" for w in SEED_SURVIVORS]
        store.wait(refusals)
        reasons = [store.get(k).decode() for k in refusals]
        restore = Plan(2, L0, L1, ("lost worker 0", "no copy seeded yet"), 0.0, mode=PlanMode.RESTORE)
        store.set(plan_key("ew", 2), restore.to_json())
        return collect(procs, results, SEED_SURVIVORS, timeout_s=180), reasons
    finally:
        server.stop()


def _merged_final(results: dict[int, dict[str, Any]]) -> dict[str, Any]:
    units: dict[str, Any] = {}
    for r in results.values():
        if r["dp_index"] == 0:
            units.update(r["final_state"])
    return units


def _assert_ends_fault_free(
    clean: dict[int, dict[str, Any]], faulty: dict[int, dict[str, Any]], final: Layout
) -> None:
    """Every step's loss and the final parameters and Adam moments are the fault-free run's (fp32
    round-off: other DP sizes reduce), and every copy of `final` equals its owner's live shard."""
    ref_losses, got_losses = _last_stage_losses(clean), _last_stage_losses(faulty)
    assert sorted(got_losses) == list(range(STEPS))
    dev = [abs(got_losses[s] - ref_losses[s]) / abs(ref_losses[s]) for s in range(STEPS)]
    assert float(np.mean(dev)) <= 1e-5, dev
    ref = {u: d for r in clean.values() if r["dp_index"] == 0 for u, d in r["final_state"]["units"].items()}
    got = _merged_final(faulty)
    assert sorted(got) == sorted(ref)
    worst = 0.0
    for unit, fields in ref.items():
        for name, want in fields.items():
            scale = max(float(np.abs(want).max()), 1e-12)
            worst = max(worst, float(np.abs(got[unit][name] - want).max()) / scale)
    print(f"after the RESTORE: mean rel. loss dev. {np.mean(dev):.1e}, max rel. state diff {worst:.1e}")
    assert worst <= 1e-4
    sets = backup_holder_sets(final)
    for w, r in faulty.items():
        assert sorted(r["snapshot"]) == list(protected_by(sets, w))
        for owner, copy in r["snapshot"].items():
            for unit, (lo, hi, rows) in faulty[owner]["live_shard"].items():
                assert (lo, hi) == copy[unit][:2] and rows.tobytes() == copy[unit][2].tobytes()
        assert r["checksum_mismatches"] == 0


def test_failure_inside_the_window_restores_and_matches_the_fault_free_run() -> None:
    clean = _clean(RNG, layout=L0)
    faulty, restore = _run_faulty()
    assert restore.mode == PlanMode.RESTORE, restore.reasons
    assert any("re-protection window" in r for r in restore.reasons), restore.reasons
    for r in faulty.values():
        assert r["refused"] == [2]
        assert [epoch for epoch, _, _ in r["restored_from"]] == [3]
    # the windows, exactly as the layouts imply
    first = ReprotectWindow(1, tuple(sorted(reseed_pairs(L0, L1))), FIRST, FIRST + 1, superseded_by=3)
    after_restore = ReprotectWindow(3, tuple(sorted(backup_pairs(L2))), 0, 1, closed_step=1)
    assert first.pairs == ((1, 3), (2, 4), (3, 1), (4, 2), (5, 1))
    for r in faulty.values():
        assert [ReprotectWindow.from_dict(w) for w in r["windows"]] == [first, after_restore]
    _assert_ends_fault_free(clean, faulty, L2)


def test_a_worker_lost_during_the_first_seed_is_a_restore_no_survivor_dies() -> None:
    clean = _clean(RNG, layout=L0)
    faulty, reasons = _run_first_seed_fault()
    assert sorted(faulty) == SEED_SURVIVORS  # every survivor trained to the end
    # worker 0's shard had no copy yet: every survivor refused the in-place plan, for that reason
    assert all("lost ranks [0]" in r and "not seeded yet" in r for r in reasons), reasons
    for r in faulty.values():
        assert r["refused"] == [1]
        assert r["restored_from"] == [(2, None, 0)]  # the initial state, from step 0
        # no window for the first seed (it was never open on a committed step), then the RESTORE's
        assert [ReprotectWindow.from_dict(w) for w in r["windows"]] == [
            ReprotectWindow(2, tuple(sorted(backup_pairs(L1))), 0, 1, closed_step=1)
        ]
    _assert_ends_fault_free(clean, faulty, L1)


def test_layouts_of_the_scenario() -> None:
    """The layouts above say what the test relies on: 1's copy moves from 4 to 3, and losing 1
    and 4 is in place once the copies are re-seeded, a RESTORE inside the window."""
    assert backup_holder_sets(L0)[1] == (4,) and backup_holder_sets(L1)[1] == (3,)
    assert judge(L1, L2).in_place
    assert not judge(L1, L2, unprotected=reseed_pairs(L0, L1)).in_place
    assert isinstance(L2, Layout) and L2.dp_sizes == (1, 2)
