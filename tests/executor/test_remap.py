"""Live remap (ElasWave §5.2): a DP group of 3 loses a worker; its shard is rebuilt from the ring
neighbour's snapshot and redistributed over the new 2-way layout. Parameters and optimizer state
gathered over the new layout equal the pre-failure state bitwise; only owner-changing intervals move."""

from __future__ import annotations

import numpy as np
import pytest

from executor.comm import Communicator
from executor.fabric.overlap import UnrecoverableLoss, remap_plan
from executor.fabric.remap import live_remap
from executor.fabric.snapshot import RingSnapshot
from executor.fabric.state import ShardState
from executor.store_server import connect_store
from planners.zero import layout_ownership, shard_transfers
from tests.executor.fabric_workload import (
    LAYER_NUMEL,
    grads_for,
    initial_state,
    layout_for,
    live_update,
    unit_name,
    update_fn,
)
from tests.executor.ft_procs import run_on_store

OLD, NEW, LOST, STEPS, MORE = (0, 1, 2), (0, 2), 1, 5, 3


def _train(live: ShardState, snap: RingSnapshot, first: int, last: int) -> None:
    for step in range(first, last + 1):
        grads = grads_for(live, step)
        snap.exchange_grads(step, grads)
        live_update(live, step, grads)
        snap.commit(step)


def _remap_worker(worker: int, port: int) -> dict[str, object]:
    comm = Communicator(connect_store("127.0.0.1", port), worker, {"dp/0": OLD}, timeout_s=30.0)
    live = initial_state(layout_for(OLD), worker)
    snap = RingSnapshot(comm, "dp/0", update_fn)
    snap.seed(live)
    _train(live, snap, 1, STEPS)
    pre = live.to_numpy()
    if worker == LOST:
        return {"pre": pre}  # this worker is gone from here on
    report = comm.apply_edit({"dp/0": NEW})
    new_state = live_remap(comm, layout_for(OLD), layout_for(NEW), {LOST}, live, snap.state(), step=STEPS)
    post = new_state.to_numpy()
    ring = RingSnapshot(comm, "dp/0", update_fn)  # the ring re-forms over the survivors
    ring.seed(new_state)
    _train(new_state, ring, STEPS + 1, STEPS + MORE)
    return {"pre": pre, "post": post, "rebuilt": report.rebuilt, "verified_after": ring.verify(new_state)}


def _gather(parts: list[dict[str, tuple[int, int, np.ndarray]]]) -> dict[str, np.ndarray]:
    full = {unit_name(k): np.full((3, n), np.nan, dtype=np.float32) for k, n in enumerate(LAYER_NUMEL)}
    for part in parts:
        for layer, (start, stop, rows) in part.items():
            assert np.isnan(full[layer][:, start:stop]).all(), "two workers own the same elements"
            full[layer][:, start:stop] = rows
    return full


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_lost_worker_rebuilt_from_snapshot_bitwise() -> None:
    got = run_on_store(_remap_worker, list(OLD), 90)
    before = _gather([got[w]["pre"] for w in OLD])
    after = _gather([got[w]["post"] for w in NEW])
    for layer in before:
        assert not np.isnan(after[layer]).any()
        assert before[layer].tobytes() == after[layer].tobytes(), f"layer {layer} differs after remap"
    new_owned = layout_ownership(layout_for(NEW))
    for w in NEW:
        assert {(k, s, e) for k, (s, e, _) in got[w]["post"].items()} == {
            (unit_name(iv.layer), iv.start, iv.stop)
            for ivs in new_owned.values()
            for iv in ivs
            if iv.rank == w
        }
        assert got[w]["rebuilt"] == ("dp/0",)
        assert got[w]["verified_after"] is True


def test_plan_moves_only_changed_owners_and_reads_lost_from_snapshot() -> None:
    old, new = layout_for(OLD), layout_for(NEW)
    plan = remap_plan(old, new, {LOST})
    old_owner = {
        (iv.layer, e): iv.rank
        for ivs in layout_ownership(old).values()
        for iv in ivs
        for e in range(iv.start, iv.stop)
    }
    new_owner = {
        (iv.layer, e): iv.rank
        for ivs in layout_ownership(new).values()
        for iv in ivs
        for e in range(iv.start, iv.stop)
    }
    moved = {(int(t.unit.split("_")[1]), e) for t in plan for e in range(t.lo, t.hi)}
    assert moved == {k for k in new_owner if old_owner[k] != new_owner[k]}
    for t in plan:
        assert t.from_snapshot == (t.owner == LOST)
        assert t.src == (0 if t.owner == LOST else t.owner)  # worker 0 holds worker 1's snapshot
    # the generic overlap over blocks is exactly the planners' overlap matrix
    assert [(int(t.unit.split("_")[1]), t.lo, t.hi, t.owner, t.dst) for t in plan] == [
        (t.layer, t.start, t.stop, t.src_rank, t.dst_rank) for t in shard_transfers(old, new)
    ]


def test_integrity_check_refuses_unrecoverable_loss() -> None:
    with pytest.raises(UnrecoverableLoss, match="snapshot holder"):
        remap_plan(layout_for((0, 1, 2)), layout_for((2,)), {0, 1})
    with pytest.raises(ValueError, match="still appear"):
        remap_plan(layout_for(OLD), layout_for(OLD), {1})
