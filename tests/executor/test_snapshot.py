"""Per-step ring snapshots (ElasWave §5.1): after 20 AdamW steps (one of them rolled back) the
neighbour's host snapshot equals the live shard bitwise; the checksum check agrees and catches a
single flipped element. Shown twice: on a synthetic ZeRO-1 workload (one DP group, gradients that
depend only on the step) and on the real engine (a PP=2 x DP=2 Trainer through the step protocol,
snapshots fed by the trainer's own reduce-scatter through `FabricParticipant`)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from executor.comm import Communicator, groups_for_stages
from executor.fabric.snapshot import RingSnapshot, SnapshotError, ring_holder
from executor.fabric.state import ShardState
from executor.fabric.trainer_state import FabricParticipant, shard_state_of
from executor.step_protocol import StepProtocol
from executor.store_server import connect_store
from executor.trainer import Trainer
from tests.executor import engine_cases
from tests.executor.fabric_workload import (
    grads_for,
    initial_state,
    layout_for,
    live_update,
    seeded_ring,
    update_fn,
)
from tests.executor.ft_procs import run_on_store

WORKERS = (0, 1, 2)
STEPS = 20
ROLLED_BACK_STEP = 11


def _snapshot_worker(worker: int, port: int) -> dict[str, object]:
    snap, live = seeded_ring(worker, port, WORKERS)
    for step in range(1, STEPS + 1):
        if step == ROLLED_BACK_STEP:  # a step that fails after the gradient exchange: rolled back
            snap.exchange_grads(step, grads_for(live, step, scale=-3.0))
            snap.finish_exchange()  # the step protocol finishes it before the commit vote
            snap.discard()
        grads = grads_for(live, step)
        snap.exchange_grads(step, grads)
        live_update(live, step, grads)
        snap.commit(step)
    verified = snap.verify(live)
    tampered = live.clone()
    if worker == 0:
        tampered.units["block_1"].exp_avg_sq.view(torch.int32)[0] ^= 1  # flip the lowest mantissa bit
    verified_tampered = snap.verify(tampered)
    return {
        "live": live.to_numpy(),
        "snapshot": snap.state().to_numpy(),
        "step": snap.state().step,
        "protected": snap.protected,
        "verified": verified,
        "verified_tampered": verified_tampered,
    }


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_ring_snapshot_equals_live_shard_bitwise() -> None:
    got = run_on_store(_snapshot_worker, list(WORKERS), 90)
    for w in WORKERS:
        holder = ring_holder(WORKERS, w)
        assert got[holder]["protected"] == w and got[holder]["step"] == STEPS
        live, snap = got[w]["live"], got[holder]["snapshot"]
        assert sorted(live) == sorted(snap) == ["block_0", "block_1", "block_2"]
        initial = initial_state(layout_for(WORKERS), w)
        for layer, (start, stop, rows) in live.items():
            s_start, s_stop, s_rows = snap[layer]
            assert (start, stop) == (s_start, s_stop)
            assert torch.equal(torch.from_numpy(rows), torch.from_numpy(s_rows)), (w, layer)
            assert rows.tobytes() == s_rows.tobytes()
            assert not torch.equal(torch.from_numpy(rows[0]), initial.units[layer].param)  # it trained
        assert got[w]["verified"] is True
        assert got[w]["verified_tampered"] is False  # one element of worker 0 changed: all see it


ENGINE_WORKERS = [0, 1, 2, 3]
ENGINE_VERIFY_EVERY = 7  # checksums at committed steps 7 and 14; a mismatch would re-seed, so it must stay 0


def _engine_layout() -> Any:
    return engine_cases.layout([(0, 3), (3, 6)], [(0, 1), (2, 3)], global_batch=8, num_micro_batches=2)


def _vote(proto: StepProtocol, store: Any, worker: int, step: int) -> bool:
    """The commit vote; in ROLLED_BACK_STEP worker 3 votes only after the others gave up on it
    (a hung peer, as the protocol sees it), so that attempt aborts on every worker after its
    gradient exchange completed, deterministically, without flagging an abort on the groups."""
    if step != ROLLED_BACK_STEP:
        return proto.should_commit()
    if worker != 3:
        decided = proto.should_commit(timeout_s=0.3)
        store.set(f"test/late/{worker}", "decided")
        return decided
    store.wait([f"test/late/{w}" for w in ENGINE_WORKERS if w != 3])
    return proto.should_commit()


def _engine_snapshot_worker(worker: int, port: int, fine_tune: bool = False) -> dict[str, object]:
    """Train the real engine for STEPS committed steps with ring snapshots on (one attempt of
    ROLLED_BACK_STEP rolled back and replayed), then report the live shard and the snapshot.
    `fine_tune`: every matrix frozen (BitFit), so every unit trains in part or not at all."""
    layout = _engine_layout()
    store = connect_store("127.0.0.1", port)
    comm = Communicator(store, worker, groups_for_stages([s.ranks for s in layout.stages]), timeout_s=30.0)
    spec = engine_cases.gpt_spec(dropout=0.1)
    trainer = Trainer(engine_cases.with_weights_frozen(spec) if fine_tune else spec, layout, worker, comm)
    initial = shard_state_of(trainer).to_numpy()
    participant = FabricParticipant(trainer, comm, verify_every=ENGINE_VERIFY_EVERY)
    proto = StepProtocol(comm, participant, timeout_s=30.0)
    step, rollbacks = 0, 0
    while step < STEPS:
        proto.begin_step(step)
        trainer.train_step(step)
        if _vote(proto, store, worker, step):
            proto.commit()
            step += 1
        else:
            proto.rollback()  # no plan: the groups are intact, the replay gets its own decision
            rollbacks += 1
    snap = participant.snapshot
    assert snap is not None
    return {
        "live": shard_state_of(trainer).to_numpy(),
        "initial": initial,
        "snapshot": snap.state().to_numpy(),
        "protected": snap.protected_ranks[0],
        "snapshot_step": snap.state().step,
        "rollbacks": rollbacks,
        "mismatches": participant.checksum_mismatches,
        "verified": list(participant.verified_steps),
        "sent_per_step": snap.stats.sent_numel / snap.stats.steps,
        "trainable_owned": {
            n: int(torch.cat(_elements(trainer.model.units[n]))[sh.lo : sh.hi].sum())
            for n, sh in trainer.optimizer.shards.items()
        },
    }


def _elements(unit: torch.nn.Module) -> list[torch.Tensor]:
    """Per parameter, whether each of its elements trains (flat, in `parameters()` order)."""
    return [torch.full((p.numel(),), p.requires_grad) for p in unit.parameters()]


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fine_tune", [False, True], ids=["full", "bitfit"])
def test_engine_ring_snapshot_equals_live_shard_bitwise(fine_tune: bool) -> None:
    """The real trainer (PP=2 x DP=2, dropout on, ZeRO-1 interleaved) for 20 committed steps, one
    more attempt rolled back: every neighbour's snapshot equals the live shard it protects bit
    for bit, the live shards moved away from their initial values, and the checksums agreed.
    As a BitFit fine-tune, the gradient exchange carries the trainable elements only, and the
    copies still follow bit for bit (the frozen elements never move)."""
    got = run_on_store(functools.partial(_engine_snapshot_worker, fine_tune=fine_tune), ENGINE_WORKERS, 90)
    dp_groups = [s.ranks for s in _engine_layout().stages]
    for w in ENGINE_WORKERS:
        (group,) = [g for g in dp_groups if w in g]
        holder = got[ring_holder(group, w)]
        assert holder["protected"] == w and holder["snapshot_step"] == STEPS
        assert got[w]["rollbacks"] == 1 and got[w]["mismatches"] == 0 and got[w]["verified"] == [7, 14]
        live, snap, initial = got[w]["live"], holder["snapshot"], got[w]["initial"]
        assert sorted(live) == sorted(snap) and live, w
        for unit, (lo, hi, rows) in live.items():
            assert (lo, hi) == snap[unit][:2], (w, unit)
            assert rows.tobytes() == snap[unit][2].tobytes(), (w, unit)  # param, exp_avg, exp_avg_sq
            trains = got[w]["trainable_owned"][unit] > 0  # BitFit: some intervals hold frozen elements only
            assert (rows[0].tobytes() != initial[unit][2][0].tobytes()) == trains, (w, unit)
        if fine_tune:
            assert got[w]["sent_per_step"] == sum(got[w]["trainable_owned"].values()) > 0, w
        else:
            assert got[w]["sent_per_step"] == sum(hi - lo for lo, hi, _ in live.values()), w


def test_snapshot_rejects_out_of_order_use() -> None:
    class OneGroup:
        worker = 0

        def workers(self, name: str) -> tuple[int, ...]:
            return (0,)

    with pytest.raises(SnapshotError, match="at least two"):
        RingSnapshot(OneGroup(), "dp/0", update_fn)  # type: ignore[arg-type]
    state = ShardState(step=3)
    assert ShardState.from_wire(state.header(), state.payload()).bitwise_equal(state)
