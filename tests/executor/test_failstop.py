"""Fail-stop end to end (docs/architecture.md ("Promises and rules"), ElasWave §5): a PP=2 x DP=3 job on gloo, one worker is killed
with SIGKILL in the middle of a step. The survivors — the same processes, no restart — roll back
to the last committed step, edit their groups in place, rebuild the lost optimizer shard from its
ring snapshot, and replay the step under the new layout with the same samples. Compared with a
fault-free run of the same seed: gathered parameters and optimizer state right after recovery are
bitwise equal to the fault-free state at the last committed step; every step feeds the same
samples (the ids of the batches the trainers consumed); the remaining losses follow the
fault-free ones (placement-invariant RNG on and off); the edit rebuilds exactly the groups that
lost a member or were left half-matched and reuses every other one; the ring snapshots still
equal the live shards at the end.

The job driver (`Scenario`, `_run`) and the assertions are shared with
`test_failstop_migrate.py` (a loss whose plan also moves a block, and a pipeline-only plan)."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch

from executor.comm import Communicator, PeerFailure, groups_for_stages
from executor.comm.groups import WORLD_GROUP, physical_groups
from executor.fabric.trainer_state import FabricParticipant, shard_state_of
from executor.optim import OptimizerConfig, UnitSlice
from executor.step_protocol import StepProtocol, plan_key
from executor.store_server import connect_store
from executor.trainer import Trainer, TrainSpec
from planners.dataflow import resize_after_loss
from planners.layout import Layout, Plan, RngMode, make_uniform_layout
from tests.executor.engine_cases import NUM_UNITS, gpt_spec, with_first_unit_frozen, with_weights_frozen
from tests.executor.ft_procs import collect, spawn
from tests.executor.stores import start_store

SlicesUpdate = Callable[[Sequence[UnitSlice], int], None]  # Trainer.update_slices

STEPS, FAIL_STEP, VICTIM = 8, 4, 4
WORKERS = list(range(6))
BATCH = 12
CFG = gpt_spec(dropout=0.1)  # 4 blocks: units embed, block_0..block_3, head
# The same job with gradient clipping by the global norm (clips most steps of this run): every
# step adds one all-gather over the job-wide "world" group, which a loss must rebuild too.
CLIP_CFG = gpt_spec(
    dropout=0.1, optimizer=OptimizerConfig("adamw", lr=3e-3, weight_decay=0.01, max_grad_norm=1.0)
)
TIMEOUT_S = 20.0


FROZEN_CFG = with_first_unit_frozen(gpt_spec(dropout=0.1))
BITFIT_CFG = with_weights_frozen(gpt_spec(dropout=0.1))  # every unit trains in part, or not at all


@functools.cache
def _precision_spec(clip: bool, precision: str, overflow_steps: tuple[int, ...]) -> TrainSpec:
    """CFG (CLIP_CFG) in `precision`, block_1 overflowing fp16 at `overflow_steps`."""
    from tests.api.precision_cases import with_precision  # noqa: PLC0415

    base = CLIP_CFG if clip else CFG
    return with_precision(base, precision, "block_1" if overflow_steps else None, overflow_steps)


def base_layout(rng_mode: RngMode) -> Layout:
    """Stage 0: embed, block_0, block_1 on workers 0-2; stage 1: block_2, block_3, head on 3-5."""
    return make_uniform_layout(
        NUM_UNITS,
        2,
        3,
        global_batch=BATCH,
        num_micro_batches=2,
        layer_numel=CFG.unit_numels(),
        rng_mode=rng_mode,
    )


@dataclass(frozen=True)
class Scenario:
    """One job: fault-free, a kill, or a plan applied at a step boundary."""

    rng_mode: RngMode = "placement_invariant"
    kill_at_op: int = 0  # > 0: `victim` SIGKILLs itself on entering this op of FAIL_STEP
    victim: int = VICTIM
    also_killed: tuple[int, ...] = ()  # further victims, killed at the same op of the same step
    relayout_at: int = -1  # >= 0: no kill; the published plan is applied before this step
    new_layout: Layout | None = None  # the plan's layout (default after a kill: resize_after_loss)
    migration: str = "blocking"  # FabricParticipant's migration mode on the plan path
    clip: bool = False  # CLIP_CFG (and its world group) instead of CFG
    layout: Layout | None = None  # the job's layout over WORKERS (default: base_layout)
    precision: str = "fp32"  # "bf16"/"fp16": the job computes under autocast (executor.precision)
    overflow_steps: tuple[int, ...] = ()  # fp16: block_1 overflows at these steps (precision_cases)
    # "cuda": every worker on cuda:0 of this machine, collectives over gloo (make gpu-check (c))
    device_kind: str = "cpu"
    # Every backup replay drifts by one ulp per step, as a host replay of a GPU update does by
    # round-off; the remap then accepts drift (FabricParticipant.exact_backups off)
    drifting_backups: bool = False
    frozen: bool = False  # the embedding frozen (FROZEN_CFG): a unit in no ZeRO exchange
    bitfit: bool = False  # every matrix frozen (BITFIT_CFG): exchanges carry trainable runs only
    # (worker, op, seconds) each: a worker that stalls for `seconds` on entering its `op`-th op
    # of FAIL_STEP (a straggler still on its way to an exchange; a victim, before it dies there)
    stalls: tuple[tuple[int, int, float], ...] = ()
    # every unit its own ZeRO exchange, received in place into the parameters (the tiny units
    # of CFG share a copied bucket by default, as models under 2^18 elements a unit do)
    in_place: bool = False

    def spec(self) -> TrainSpec:
        if self.frozen:
            return FROZEN_CFG
        if self.bitfit:
            return BITFIT_CFG
        base = CLIP_CFG if self.clip else CFG
        if self.precision != "fp32" or self.overflow_steps:
            base = _precision_spec(self.clip, self.precision, self.overflow_steps)
        return base if self.device_kind == "cpu" else dataclasses.replace(base, device_kind=self.device_kind)

    def base(self) -> Layout:
        return self.layout or base_layout(self.rng_mode)

    @property
    def victims(self) -> tuple[int, ...]:
        return (self.victim, *self.also_killed)

    def plan(self) -> Plan | None:
        old = self.base()
        if self.kill_at_op:
            new = self.new_layout or resize_after_loss(old, set(self.victims)).layout
            return Plan(1, old, new, (f"lost workers {list(self.victims)}",), 0.0)
        if self.relayout_at >= 0:
            assert self.new_layout is not None
            return Plan(1, old, self.new_layout, ("pipeline-only change",), 0.0)
        return None


class KillingCommunicator(Communicator):
    """The victim: SIGKILLs itself on entering its `kill_at_op`-th communication op of step
    FAIL_STEP. Ops of a victim in step FAIL_STEP, in order: 1-4 pipeline receives and sends,
    5 gradient reduce-scatter, 6 snapshot checksum exchange (a verify step), 7 snapshot gradient
    exchange (posted; the survivors wait for it just before the commit vote), 8 parameter
    all-gather (after its own optimizer update), 9 loss all-gather (last stage only). With
    clipping, the global-norm all-gather on "world" comes right after the reduce-scatter (op 6)."""

    kill_at_op = 0
    stall_at_op, stall_s = 0, 0.0
    current_step = -1
    ops_in_step = 0

    def _tick(self, what: str) -> None:
        self.ops_in_step += 1
        if self.current_step == FAIL_STEP and self.ops_in_step == self.stall_at_op:
            print(
                f"worker {self.worker}: stalls {self.stall_s} s at op {self.ops_in_step} ({what})", flush=True
            )
            time.sleep(self.stall_s)
        if self.current_step == FAIL_STEP and self.ops_in_step == self.kill_at_op:
            self.die(f"op {self.ops_in_step} ({what})")

    def die(self, where: str) -> None:
        print(f"victim {self.worker}: SIGKILL at {where} of step {FAIL_STEP}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def post_exchange(self, sends: Any, recvs: Any) -> Any:
        self._tick(f"p2p {[s[0] for s in sends]} {[r[0] for r in recvs]}")
        return super().post_exchange(sends, recvs)

    def wait(self, name: str, work: object, has_future: bool = True, issued: int = 0) -> None:
        self._tick(f"collective on {name}")
        super().wait(name, work, has_future, issued)

    def all_gather(self, name: str, outputs: Any, tensor: torch.Tensor) -> None:
        self._tick(f"all_gather on {name}")
        super().all_gather(name, outputs, tensor)


def _state_numpy(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "step_count": state["step_count"],
        "units": {u: {f: t.cpu().numpy().copy() for f, t in d.items()} for u, d in state["units"].items()},
    }


def _drifting(update: SlicesUpdate) -> SlicesUpdate:
    """`update`, then each slice's parameters and moments one ulp up: the round-off by which a
    backup replayed on the host drifts from a shard updated on a GPU."""

    def drifted(slices: Sequence[UnitSlice], step: int) -> None:
        update(slices, step)
        for s in slices:
            for t in (s.param, s.exp_avg, s.exp_avg_sq):
                t.copy_(torch.nextafter(t, torch.full_like(t, math.inf)))

    return drifted


def _job_worker(worker: int, port: int, sc: Scenario) -> dict[str, Any]:
    """One worker of a job (see `Scenario`)."""
    inject = sc.kill_at_op > 0
    layout = sc.base()
    if sc.in_place:
        import executor.zero_exchange  # noqa: PLC0415

        executor.zero_exchange.BUCKET_MIN_ELEMENTS = 0
    store = connect_store("127.0.0.1", port)
    stall = next((s for s in sc.stalls if s[0] == worker), None)
    cls = KillingCommunicator if (inject and worker in sc.victims) or stall else Communicator
    spec = sc.spec()
    if spec.device_kind == "cuda":  # runs compared bit for bit: no atomics-ordered kernels
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    world = spec.needs_world_group
    comm = cls(
        store, worker, groups_for_stages([s.ranks for s in layout.stages], world=world), timeout_s=TIMEOUT_S
    )
    if isinstance(comm, KillingCommunicator) and worker in sc.victims:
        comm.kill_at_op = sc.kill_at_op
    if isinstance(comm, KillingCommunicator) and stall is not None:
        comm.stall_at_op, comm.stall_s = stall[1], stall[2]
    trainer = Trainer(spec, layout, worker, comm, spec.local_device())
    participant = FabricParticipant(trainer, comm, verify_every=2, migration=sc.migration)
    if sc.drifting_backups:
        participant.exact_backups = False
        trainer.update_slices = _drifting(trainer.update_slices)  # type: ignore[method-assign, assignment]  # the replay under test, wrapped
    proto = StepProtocol(comm, participant, timeout_s=TIMEOUT_S)
    losses: dict[int, float | None] = {}
    samples: dict[int, list[int]] = {}
    out: dict[str, Any] = {
        "skipped": [],  # fp16: committed steps whose update an overflow skipped
        "worker": worker,
        "stage": trainer.stage,
        "dp_index": trainer.dp_index,
        "failures": [],
        "edits": [],
    }

    def adopt(plan: Plan, step: int) -> None:
        report = proto.apply_plan(plan)
        out["edits"].append({"rebuilt": report.rebuilt, "reused": report.reused, "at_step": step})
        print(
            f"worker {worker}: plan {plan.epoch} at step {step}: rebuilt {report.rebuilt}, reused {report.reused}"
        )
        out["recovered_state"] = _state_numpy(trainer.gather_full_state())

    step = 0
    while step < STEPS:
        if step == sc.relayout_at:
            adopt(proto.await_plan(), step)
        proto.begin_step(step)
        if isinstance(comm, KillingCommunicator):
            comm.current_step, comm.ops_in_step = step, 0
        result = None
        try:
            result = trainer.train_step(step)
        except PeerFailure as exc:
            if isinstance(comm, KillingCommunicator) and worker in sc.victims and step == FAIL_STEP:
                # A victim whose co-victim died first can fail before reaching its own op (a
                # reduce-scatter the backward posts is refused by a dead peer): it dies now,
                # as it would have a moment later, so every scenario loses all its victims.
                comm.die(f"a failure before op {comm.kill_at_op}: {exc}")
            proto.report_failure(exc)
            out["failures"].append((step, exc.group))
        if proto.should_commit():
            proto.commit()
            assert result is not None
            losses[step] = result.loss
            if result.skipped:
                out["skipped"].append(step)
            samples[step] = list(result.sample_ids)  # what the trainer actually fed
            if step == 0:  # the first layout's copies are seeded inside its first step
                snap0 = participant.snapshot
                out["initial_backup_bytes"] = 0 if snap0 is None else snap0.held_bytes()
            assert len(samples[step]) == result.samples_processed
            if not inject and step == FAIL_STEP - 1:
                out["committed_state"] = _state_numpy(trainer.gather_full_state())
            step += 1
        else:
            proto.rollback()
            adopt(proto.await_plan(), step)
    snap = participant.snapshot
    out.update(
        losses=losses,
        samples=samples,
        stage_after=trainer.stage,
        dp_index_after=trainer.dp_index,
        checksum_mismatches=participant.checksum_mismatches,
        verified=list(participant.verified_steps),
        migrations=[m.as_dict() for m in participant.migrations],
        final_state=_state_numpy(trainer.gather_full_state()),
        live_shard=shard_state_of(trainer).to_numpy(),
        loss_scale=None if trainer.scaler is None else trainer.scaler.state_dict(),
        snapshot=None if snap is None else {p: st.to_numpy() for p, st in snap.states().items()},
        backup_bytes=0 if snap is None else snap.held_bytes(),
        restored_from=list(participant.restored_from),
        layout_after=trainer.layout.to_json(),
    )
    return out


def _run(sc: Scenario) -> dict[int, dict[str, Any]]:
    """One job. With a kill, this process plays the Core: it sees the victim exit, flags the
    abort and publishes the plan for the survivors; with `relayout_at` it publishes the plan up
    front. Each worker that edited its groups gets the op ledgers it published for the edit
    (`ledger`), read back from the store."""
    server = start_store()
    try:
        store = connect_store("127.0.0.1", server.port)
        plan = sc.plan()
        if plan is not None and not sc.kill_at_op:
            store.set(plan_key("ew", 1), plan.to_json())
        procs, results = spawn(_job_worker, WORKERS, server.port, sc)
        survivors = WORKERS
        if sc.kill_at_op:
            assert plan is not None
            for victim in sc.victims:
                procs[victim].join(timeout=120)
                assert procs[victim].exitcode == -signal.SIGKILL, f"victim {victim} was not killed"
            # the direct signal (process exit)
            store.set("ew/e0/abort", f"core: workers {list(sc.victims)} exited")
            store.set(plan_key("ew", 1), plan.to_json())
            survivors = [w for w in WORKERS if w not in sc.victims]
        out = collect(procs, results, survivors, timeout_s=120)
        if plan is not None:
            from executor.comm.ledger import decode

            for w in survivors:
                out[w]["ledger"] = decode(store.get(f"ew/e1/ledger/{w}"))
        return out
    finally:
        server.stop()


def _merged(results: dict[int, dict[str, Any]], key: str) -> dict[str, Any]:
    """Whole-model state from the DP-index-0 rank of each stage (after any re-layout)."""
    units: dict[str, Any] = {}
    counts = set()
    for r in results.values():
        if r["dp_index_after" if key != "committed_state" else "dp_index"] == 0 and key in r:
            units.update(r[key]["units"])
            counts.add(r[key]["step_count"])
    assert len(counts) == 1
    return {"step_count": counts.pop(), "units": units}


def _last_stage_losses(results: dict[int, dict[str, Any]]) -> dict[int, float]:
    losses: dict[int, float] = {}
    for r in results.values():
        for step, loss in r["losses"].items():
            if loss is not None:
                assert losses.setdefault(step, loss) == loss, "last-stage ranks disagree on a loss"
    return losses


def _stage_samples(results: dict[int, dict[str, Any]], steps: range) -> dict[tuple[int, int], list[int]]:
    """(stage, step) -> sorted global sample ids its ranks fed (duplicates kept)."""
    out: dict[tuple[int, int], list[int]] = {}
    for r in results.values():
        for step in steps:
            out.setdefault((r["stage"], step), []).extend(r["samples"][step])
    return {k: sorted(v) for k, v in out.items()}


def _mean_rel_dev(a: dict[int, float], b: dict[int, float], steps: range) -> float:
    return float(np.mean([abs(a[s] - b[s]) / abs(b[s]) for s in steps]))


_CLEAN: dict[Scenario, dict[int, dict[str, Any]]] = {}


def _clean(
    rng_mode: RngMode, clip: bool = False, layout: Layout | None = None, like: Scenario | None = None
) -> dict[int, dict[str, Any]]:
    """The fault-free run of the same seed (computed once per RNG mode, clipping on or off,
    layout, precision of `like`, and pytest process)."""
    key = Scenario(
        rng_mode,
        clip=clip,
        layout=layout,
        precision=like.precision if like else "fp32",
        overflow_steps=like.overflow_steps if like else (),
        device_kind=like.device_kind if like else "cpu",
        frozen=like.frozen if like else False,
        bitfit=like.bitfit if like else False,
    )
    if key not in _CLEAN:
        _CLEAN[key] = _run(key)
    return _CLEAN[key]


def assert_states_bitwise(ref: dict[str, Any], got: dict[str, Any]) -> None:
    assert ref["step_count"] == got["step_count"]
    assert sorted(ref["units"]) == sorted(got["units"])
    for unit, fields in ref["units"].items():
        for f, arr in fields.items():
            assert arr.tobytes() == got["units"][unit][f].tobytes(), (unit, f)


def assert_recovered_bitwise(clean: dict[int, dict[str, Any]], faulty: dict[int, dict[str, Any]]) -> None:
    """Recovered state == fault-free state at the last committed step, bitwise: no partial update
    of the failed step survives, and the lost shard came back exactly from its snapshot."""
    ref_state, rec_state = _merged(clean, "committed_state"), _merged(faulty, "recovered_state")
    assert ref_state["step_count"] == FAIL_STEP
    assert_states_bitwise(ref_state, rec_state)


def assert_same_samples(
    clean: dict[int, dict[str, Any]], faulty: dict[int, dict[str, Any]], changed_at: int
) -> None:
    """Before `changed_at` every worker fed exactly what it fed fault-free; from then on, each
    stage's workers fed the whole global batch of the step once, as fault-free."""
    for w in faulty:
        assert all(faulty[w]["samples"][s] == clean[w]["samples"][s] for s in range(changed_at)), w
    expected = {(stage, s): list(range(s * BATCH, (s + 1) * BATCH)) for stage in (0, 1) for s in range(STEPS)}
    assert _stage_samples(clean, range(STEPS)) == expected
    got = _stage_samples(faulty, range(changed_at, STEPS))
    assert got == {k: v for k, v in expected.items() if k[1] >= changed_at}


def _balanced(name: str, members: tuple[int, ...], ledgers: dict[int, Any]) -> bool:
    """A group is reusable iff, by every member's published ledger, nothing is pending or failed,
    all issued the same number of collectives and every send met its receive."""
    recs = {w: ledgers[w][name] for w in members}
    if (
        any(r["pending"] or r["failed"] for r in recs.values())
        or len({r["collectives"] for r in recs.values()}) != 1
    ):
        return False
    return all(
        int(recs[a]["sent"].get(str(b), 0)) == int(recs[b]["received"].get(str(a), 0))
        for a in members
        for b in members
        if a != b
    )


def assert_exact_edit(
    results: dict[int, dict[str, Any]], plan: Plan, world: bool = False
) -> dict[int, set[str]]:
    """Every worker rebuilt exactly the groups that lost a member or whose ops were left
    half-matched (by the ledgers every member published for the edit) and reused every other
    group; returns each worker's half-matched groups. `world`: the job has the world group."""
    assert plan.old is not None
    old = physical_groups(groups_for_stages([s.ranks for s in plan.old.stages], world=world), pp_links=True)
    new = physical_groups(groups_for_stages([s.ranks for s in plan.new.stages], world=world), pp_links=True)
    ledgers = {w: r["ledger"] for w, r in results.items()}
    dirty: dict[int, set[str]] = {}
    for w, r in results.items():
        mine = {n: ws for n, ws in new.items() if w in ws}
        changed = {n for n, ws in mine.items() if old.get(n) != ws}
        dirty[w] = {n for n in set(mine) - changed if not _balanced(n, mine[n], ledgers)}
        (edit,) = r["edits"]
        assert set(edit["rebuilt"]) == changed | dirty[w], (w, edit, changed, dirty[w])
        assert set(edit["reused"]) == set(mine) - changed - dirty[w], (w, edit)
        lost = set(plan.old.ranks()) - set(plan.new.ranks())
        lost_stages = {plan.old.stage_of_rank(v) for v in lost}
        expect = {f"dp/{r['stage']}"} if r["stage"] in lost_stages else set()
        assert changed == expect | ({WORLD_GROUP} if world and lost else set()), (w, changed)
    return dirty


def assert_snapshots_equal_live(results: dict[int, dict[str, Any]], verified_after_edit: bool = True) -> None:
    """At the end every shard backup equals its owner's live shard bitwise, and the periodic
    checksum verification found nothing (and, unless `verified_after_edit` is False, ran after
    the last re-layout: it runs every `verify_every` optimizer *updates*, which fp16's skipped
    steps leave behind the step count)."""
    protected = {}
    for w, r in results.items():
        assert r["snapshot"] is not None, w
        for owner, snap in r["snapshot"].items():
            assert owner not in protected, (owner, w)
            protected[owner] = w
            live = results[owner]["live_shard"]
            assert sorted(snap) == sorted(live), (w, owner)
            for unit, (lo, hi, rows) in live.items():
                assert (lo, hi) == snap[unit][:2] and rows.tobytes() == snap[unit][2].tobytes(), (
                    w,
                    owner,
                    unit,
                )
        assert r["checksum_mismatches"] == 0
        last_edit = max((e["at_step"] for e in r["edits"]), default=0)
        assert not verified_after_edit or any(s >= last_edit for s in r["verified"]), (w, r["verified"])
    assert sorted(protected) == sorted(results)  # every worker is backed up exactly once


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "victim, kill_at_op",
    [(4, 2), (4, 5), (4, 7), (4, 8), (4, 9), (1, 6)],
    ids=[
        "pipeline",
        "grad-reduce-scatter",
        "snapshot-exchange",
        "param-all-gather",
        "loss",
        "stage0-checksum-exchange",
    ],
)
def test_kill9_mid_step_recovers_in_place(victim: int, kill_at_op: int) -> None:
    _check_kill_recovery(Scenario(kill_at_op=kill_at_op, victim=victim))


def _check_kill_recovery(sc: Scenario, loss_rel: float = 1e-4) -> dict[int, dict[str, Any]]:
    """`loss_rel`: the bound on the mean relative loss deviation after the recovery, whose
    smaller DP group adds the gradient contributions in another order (fp32: round-off; bf16's
    per-rank rounding of autocast gradients is larger, tests/api/test_precision.py)."""
    clean, faulty = _clean(sc.rng_mode, sc.clip, like=sc), _run(sc)
    ref_losses, got_losses = _last_stage_losses(clean), _last_stage_losses(faulty)
    assert sorted(got_losses) == sorted(ref_losses) == list(range(STEPS))
    for s in range(FAIL_STEP):  # same layout before the failure: identical bits
        assert got_losses[s] == ref_losses[s]
    deviation = _mean_rel_dev(got_losses, ref_losses, range(FAIL_STEP, STEPS))
    print(
        f"\nvictim {sc.victim}, kill at op {sc.kill_at_op}{' (clipping)' if sc.clip else ''}: mean relative loss "
        f"deviation vs fault-free over steps {FAIL_STEP}..{STEPS - 1}: {deviation:.3e} (placement-invariant RNG)"
    )
    assert deviation <= loss_rel
    assert_recovered_bitwise(clean, faulty)
    assert_same_samples(clean, faulty, FAIL_STEP)
    for r in faulty.values():  # one recovery, in place, in the same processes
        assert [e["at_step"] for e in r["edits"]] == [FAIL_STEP]
    plan = sc.plan()
    assert plan is not None
    dirty = assert_exact_edit(faulty, plan, world=sc.spec().needs_world_group)
    print(
        f"half-matched groups rebuilt besides dp/{plan.old.stage_of_rank(sc.victim) if plan.old else '?'}: "
        f"{ {w: sorted(d) for w, d in dirty.items() if d} }"
    )
    assert_snapshots_equal_live(faulty)
    return faulty


def check_kill_recovery_with_drifting_backups(
    sc: Scenario, drift_rel: float = 1e-5
) -> dict[int, dict[str, Any]]:
    """A kill where every backup has drifted from its shard by round-off (a host replay of a
    GPU update; make gpu-check (c) runs this on a GPU, where the drift is real): the job still
    recovers in place, the parameters at the committed step are the fault-free ones bitwise
    (taken from the surviving replicas), the moments are within `drift_rel` (relative, 2-norm,
    per unit), and the losses after it follow the fault-free run."""
    clean, faulty = _clean(sc.rng_mode, sc.clip, like=sc), _run(sc)
    ref_losses, got_losses = _last_stage_losses(clean), _last_stage_losses(faulty)
    assert sorted(got_losses) == sorted(ref_losses) == list(range(STEPS))
    for s in range(FAIL_STEP):
        assert got_losses[s] == ref_losses[s]
    assert _mean_rel_dev(got_losses, ref_losses, range(FAIL_STEP, STEPS)) <= 1e-4
    for r in faulty.values():  # one recovery, in place, in the same processes
        assert [e["at_step"] for e in r["edits"]] == [FAIL_STEP]
    ref, got = _merged(clean, "committed_state"), _merged(faulty, "recovered_state")
    assert ref["step_count"] == got["step_count"] == FAIL_STEP
    for unit, fields in ref["units"].items():
        assert fields["param"].tobytes() == got["units"][unit]["param"].tobytes(), unit
        for f in ("exp_avg", "exp_avg_sq"):
            a, b = got["units"][unit][f].astype(np.float64), fields[f].astype(np.float64)
            assert np.linalg.norm(a - b) <= drift_rel * max(float(np.linalg.norm(b)), 1e-30), (unit, f)
    return faulty


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_kill9_with_backups_drifted_by_round_off_recovers_in_place() -> None:
    """The CPU stand-in for make gpu-check (c): backups one ulp per step off their shards still
    recover a kill in place; a bitwise-only remap refused them ("differ from the replicated
    copy"), which on a GPU failed every recovery. The periodic verify (every 2 steps here)
    checks them within round-off: no mismatch, nothing re-sent (a bitwise one failed each)."""
    faulty = check_kill_recovery_with_drifting_backups(
        Scenario(kill_at_op=5, victim=4, drifting_backups=True)
    )
    assert all(r["checksum_mismatches"] == 0 for r in faulty.values())
    assert all(r["verified"] for r in faulty.values())  # checked, and found within round-off


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_kill9_with_a_frozen_unit_recovers_in_place() -> None:
    """The embedding frozen, so stage 0's exchanges leave it out: a rank of stage 0 killed in
    the gradient reduce-scatter recovers bitwise, the embedding as it was built."""
    faulty = _check_kill_recovery(Scenario(kill_at_op=5, victim=1, frozen=True))
    built = FROZEN_CFG.model.build(0)
    initial = torch.cat([p.detach().reshape(-1) for p in built.parameters()]).numpy()
    state = _merged(faulty, "final_state")
    assert state["units"][FROZEN_CFG.model.names[0]]["param"].tobytes() == initial.tobytes()


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kill_at_op, victim", [(7, 4), (8, 1)], ids=["snapshot-exchange", "all-gather"])
def test_kill9_in_a_bitfit_fine_tune_recovers_in_place(kill_at_op: int, victim: int) -> None:
    """Every matrix frozen, so every exchange and every backup's gradient carries the trainable
    runs only: a rank killed in the snapshot's gradient exchange or in the parameter all-gather
    recovers bitwise (its shard rebuilt from a copy fed those runs), every frozen element as
    built."""
    faulty = _check_kill_recovery(Scenario(kill_at_op=kill_at_op, victim=victim, bitfit=True))
    state = _merged(faulty, "final_state")
    for i, name in enumerate(BITFIT_CFG.model.names):
        built = BITFIT_CFG.model.build(i)
        frozen = torch.cat([torch.full((p.numel(),), not p.requires_grad) for p in built.parameters()])
        initial = torch.cat([p.detach().reshape(-1) for p in built.parameters()])
        assert torch.equal(torch.from_numpy(state["units"][name]["param"])[frozen], initial[frozen]), name


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_kill9_in_the_all_gather_with_a_straggling_survivor_recovers_bitwise() -> None:
    """Every unit its own all-gather, received in place into the parameters (ops 9-11 of stage
    1). Survivor 3 posts the first unit's all-gather (receives from 4 and 5 into its parameter
    buffer); worker 4 dies entering it; 3's next post fails at issue on the dead peer, so the
    first unit's receives stay posted while 3 rolls back and waits for the plan. Straggler 5,
    2.5 s late, then sends that unit its slice of the failed step over the old group before it
    sees the failure. The late slice must not land in what 3 rolled back to (it did, 2.3e-3
    mean loss deviation, before the abandoned gather moved its receiving units to fresh
    buffers): the recovered state is the fault-free committed one bitwise, compared against
    the default bucketing's fault-free run."""
    _check_kill_recovery(
        Scenario(kill_at_op=9, victim=4, stalls=((4, 9, 0.3), (3, 10, 0.8), (5, 9, 2.5)), in_place=True)
    )


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_kill9_in_the_global_norm_all_gather_with_clipping_recovers_in_place() -> None:
    """Gradient clipping by the global norm: the victim dies entering the all-gather of every
    rank's sum of squares over the world group. The survivors rebuild the world group with the
    others and recover bitwise, as without clipping."""
    faulty = _check_kill_recovery(Scenario(kill_at_op=6, victim=4, clip=True))
    failures = {w: r["failures"] for w, r in faulty.items()}
    assert any(group == WORLD_GROUP for fs in failures.values() for _, group in fs), failures


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_loss_deviation_with_rng_switch_off() -> None:
    """Placement-invariant RNG is what keeps the losses on the fault-free trajectory: with
    per-rank RNG (the switch off) the same failure moves dropout masks and the losses drift."""
    deviations = {}
    for mode in ("placement_invariant", "per_rank"):
        faulty = _run(Scenario(mode, kill_at_op=2))
        deviations[mode] = _mean_rel_dev(
            _last_stage_losses(faulty), _last_stage_losses(_clean(mode)), range(FAIL_STEP, STEPS)
        )
    print(
        f"\nmean relative loss deviation vs fault-free over steps {FAIL_STEP}..{STEPS - 1}: "
        f"placement-invariant RNG {deviations['placement_invariant']:.3e}, "
        f"per-rank RNG (switch off) {deviations['per_rank']:.3e}"
    )
    assert deviations["placement_invariant"] <= 1e-4
    assert deviations["per_rank"] > 10 * deviations["placement_invariant"]


class _Recorder:
    """Participant that records the protocol's calls (the protocol, not the state, is under test)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def on_commit(self, step: int) -> None:
        self.calls.append(("commit", step))

    def on_rollback(self) -> None:
        self.calls.append(("rollback", -1))

    def before_vote(self) -> None:
        self.calls.append(("before_vote", -1))

    def check_plan(self, plan: Plan, lost: frozenset[int]) -> None:
        self.calls.append(("check", plan.epoch))

    def on_plan(self, plan: Plan, lost: frozenset[int], committed_step: int) -> int:
        self.calls.append(("plan", plan.epoch))
        return committed_step


def _protocols(port: int, n: int, timeout_s: float = 5.0) -> list[StepProtocol]:
    import threading

    comms: list[Communicator | None] = [None] * n

    def build(w: int) -> None:
        comms[w] = Communicator(
            connect_store("127.0.0.1", port), w, {"dp/0": tuple(range(n))}, timeout_s=timeout_s
        )

    threads = [threading.Thread(target=build, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return [StepProtocol(c, _Recorder(), timeout_s=timeout_s) for c in comms if c is not None]


def _decide_all(protos: list[StepProtocol], **kw: Any) -> list[bool]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(protos)) as pool:
        return list(pool.map(lambda p: p.should_commit(**kw), protos))


@pytest.mark.timeout(60)
def test_commit_decision_is_one_value_for_all() -> None:
    server = start_store()
    try:
        protos = _protocols(server.port, 3)
        for p in protos:
            p.begin_step(0)
        assert _decide_all(protos) == [True, True, True]
        for p in protos:
            p.commit()
        for p in protos:
            p.begin_step(1)
        # worker 2 hangs and never votes: the others decide abort at the timeout instead of
        # hanging, and the late voter reads that same decision
        assert _decide_all(protos[:2], timeout_s=0.5) == [False, False]
        assert protos[2].should_commit() is False
        for p in protos:
            p.rollback()
            p.begin_step(1)  # the replay gets its own decision
        protos[2].report_failure(PeerFailure("dp/0", "connection closed"))
        assert _decide_all(protos) == [False, False, False]  # one failure aborts everyone
        for p in protos:
            p.rollback()
        # an abort is sticky until the groups are edited: a plan (here: same layout) moves on
        layout = make_uniform_layout(4, 1, 3, global_batch=6, num_micro_batches=1, layer_numel=(8,) * 4)
        plan = Plan(1, layout, layout, ("transient failure",), 0.0)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(3) as pool:
            reports = list(pool.map(lambda p: p.apply_plan(plan), protos))
        assert all(r.reused == ("dp/0",) for r in reports)  # nothing was left half-matched
        for p in protos:
            p.begin_step(1)
        assert _decide_all(protos) == [True, True, True]
        calls = protos[0].participant.calls  # type: ignore[attr-defined]
        # before each of its 4 votes the participant finishes its in-flight work
        assert [c for c in calls if c[0] != "before_vote"] == [
            ("commit", 0),
            ("rollback", -1),
            ("rollback", -1),
            ("check", 1),
            ("plan", 1),
        ]
        assert calls.count(("before_vote", -1)) == 4
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_protocol_refuses_out_of_order_use() -> None:
    from executor.step_protocol import StepProtocolError

    server = start_store()
    try:
        (proto,) = _protocols(server.port, 1)
        with pytest.raises(StepProtocolError, match="begin_step"):
            proto.should_commit()
        with pytest.raises(StepProtocolError, match="last committed step is -1"):
            proto.begin_step(3)
        old = base_layout("placement_invariant")
        stale = Plan(0, old, old, ("stale",), 0.0)
        with pytest.raises(StepProtocolError, match="not newer"):
            proto.apply_plan(stale)
        assert proto.plan_epoch == 0 and proto.participant.calls == []  # type: ignore[attr-defined]
    finally:
        server.stop()


def test_plan_publication_roundtrip() -> None:
    old = base_layout("placement_invariant")
    new = resize_after_loss(old, {VICTIM}).layout
    plan = Plan(1, old, new, ("lost",), 0.0)
    assert Plan.from_json(plan.to_json()) == plan
    assert new.stages[1].ranks == (3, 5) and new.stages[0].ranks == (0, 1, 2)
    assert timedelta(seconds=TIMEOUT_S).total_seconds() == TIMEOUT_S
