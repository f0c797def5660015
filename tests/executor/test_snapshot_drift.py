"""The periodic verify of backups replayed off the live device (docs/accelerators.md): within
round-off they pass and nothing is re-sent, where a bitwise check failed every one of them (on a
GPU every check re-seeded every pair and counted a mismatch); a backup drifted past the tolerance
or with one corrupted element fails on both sides of its pair, and `repair` makes it the live
shard again.

Real processes, the real store and gloo, on the synthetic ZeRO-1 workload; the holders' replay
drifts by one ulp per element and step, as a host replay of a GPU update does by round-off."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from executor.fabric.remap import VERIFY_DRIFT_REL
from executor.optim import UnitSlice
from tests.executor.fabric_workload import (
    grads_for,
    live_update,
    seeded_ring,
    update_fn,
)
from tests.executor.ft_procs import run_on_store

WORKERS = (0, 1, 2)
STEPS = 12
TAMPERED_OWNER = 2  # its backup (on worker 1) gets one element moved by 1e-3 of the unit's norm


def _drifting_update(slices: Sequence[UnitSlice], step: int) -> None:
    update_fn(slices, step)
    for s in slices:
        for t in (s.param, s.exp_avg, s.exp_avg_sq):  # the parameters and both moments, one ulp up
            t.copy_(torch.nextafter(t, torch.full_like(t, math.inf)))


def _worker(worker: int, port: int) -> dict[str, object]:
    snap, live = seeded_ring(worker, port, WORKERS, _drifting_update)
    for step in range(1, STEPS + 1):
        grads = grads_for(live, step)
        snap.exchange_grads(step, grads)
        live_update(live, step, grads)
        snap.commit(step)
    out: dict[str, object] = {
        "bitwise": snap.verify(live),
        "tolerant": snap.verify(live, VERIFY_DRIFT_REL),
        "drift": snap.stats.verify_drift,
    }
    if snap.protected == TAMPERED_OWNER:
        with snap._lock:  # the copy this worker keeps: one element corrupted (a flipped bit, say)
            unit = snap._states[TAMPERED_OWNER].units["block_1"]
            unit.exp_avg[3] += 1e-3 * float(unit.exp_avg.norm())
    out["tampered"] = snap.verify(live, VERIFY_DRIFT_REL)
    snap.repair(live)
    out["repaired"] = snap.verify(live)  # bitwise: the pair that failed was re-seeded exactly
    out["live"], out["snapshot"] = live.to_numpy(), snap.state().to_numpy()
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_round_off_drift_passes_and_a_corrupted_backup_is_found_and_repaired() -> None:
    got = run_on_store(_worker, list(WORKERS), 90)
    for w, r in got.items():
        assert r["bitwise"] is False, w  # every backup drifted: a bitwise check fails them all
        assert r["tolerant"] is True, w  # within round-off: nothing to re-send
        assert 0.0 < r["drift"] < VERIFY_DRIFT_REL / 10, (w, r["drift"])  # measured, well inside
        assert r["tampered"] is False, w  # one pair bad: the ring's verdict is every worker's
        assert r["repaired"] is False, w  # the other pairs still drift; only the bad one was re-sent
    holder = next(w for w, r in got.items() if w != TAMPERED_OWNER and _protects(w, TAMPERED_OWNER))
    live, repaired = got[TAMPERED_OWNER]["live"], got[holder]["snapshot"]
    for unit, (lo, hi, rows) in live.items():
        assert (lo, hi) == repaired[unit][:2]
        assert rows.tobytes() == repaired[unit][2].tobytes(), unit


def _protects(worker: int, owner: int) -> bool:
    from executor.fabric.snapshot import ring_protected

    return ring_protected(WORKERS, worker) == owner
