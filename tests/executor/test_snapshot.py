"""Per-step ring snapshots (ElasWave §5.1): after 20 AdamW steps (one of them rolled back) the
neighbour's host snapshot equals the live shard bitwise; the checksum check agrees and catches a
single flipped element."""

from __future__ import annotations

import pytest
import torch

from executor.comm import Communicator
from executor.fabric.snapshot import RingSnapshot, SnapshotError, ring_holder
from executor.fabric.state import ShardState
from executor.store_server import StoreServer, connect_store
from tests.executor.fabric_workload import HYPER, grads_for, initial_state, layout_for, live_update
from tests.executor.ft_procs import collect, spawn

WORKERS = (0, 1, 2)
STEPS = 20
ROLLED_BACK_STEP = 11


def _snapshot_worker(worker: int, port: int) -> dict[str, object]:
    comm = Communicator(connect_store("127.0.0.1", port), worker, {"dp/0": WORKERS}, timeout_s=30.0)
    live = initial_state(layout_for(WORKERS), worker)
    snap = RingSnapshot(comm, "dp/0", HYPER)
    snap.seed(live)
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
    return {"live": live.to_numpy(), "snapshot": snap.state().to_numpy(), "step": snap.state().step,
            "protected": snap.protected, "verified": verified, "verified_tampered": verified_tampered}


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_ring_snapshot_equals_live_shard_bitwise() -> None:
    server = StoreServer.start()
    try:
        procs, results = spawn(_snapshot_worker, list(WORKERS), server.port)
        got = collect(procs, results, list(WORKERS), timeout_s=90)
    finally:
        server.stop()
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


def test_snapshot_rejects_out_of_order_use() -> None:
    class OneGroup:
        worker = 0

        def workers(self, name: str) -> tuple[int, ...]:
            return (0,)

    with pytest.raises(SnapshotError, match="at least two"):
        RingSnapshot(OneGroup(), "dp/0", HYPER)  # type: ignore[arg-type]
    state = ShardState(step=3)
    assert ShardState.from_wire(state.header(), state.payload()).bitwise_equal(state)
