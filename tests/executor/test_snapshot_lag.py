"""The backups' host replay off the step, and bounded (ElasWave §5.1, Fig. 6b).

On an accelerator the received gradient shards are copied to host memory on a side stream; the
background updater, not the commit, waits for those copies before it replays the update. Where
the host replay is slower than the step (a GPU step against host cores), the updater falls
behind by at most `max_lag` committed steps: `commit` then waits for it (stats.lag_wait_s), so
what it keeps for the updater stays bounded. Either way the backup ends bitwise equal to the
live shard it protects.

Real processes over the real store and gloo. The host copies of a GPU run are stood for by the
one thing the protocol sees of them, a completion to wait for (`StagedCopies` of objects with
`synchronize`), which takes COPY_S to land; the CUDA path itself runs in `make gpu-check` (d)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import torch

from executor.fabric import snapshot as snapshot_module
from executor.fabric.device_copy import StagedCopies
from executor.fabric.snapshot import RingSnapshot
from executor.optim import UnitSlice
from tests.executor.fabric_workload import (
    grads_for,
    live_update,
    seeded_ring,
    update_fn,
)
from tests.executor.ft_procs import run_on_store

WORKERS = (0, 1)
STEPS = 12
COPY_S = 0.05  # one step's staged copy landing on the host
REPLAY_S = 0.03  # per unit: 3 units, 0.09 s a step, several times the workload's step
MAX_LAG = 2


class _LandingCopy:
    """A copy in flight that lands COPY_S after it was issued (what a CUDA event waits for)."""

    def __init__(self) -> None:
        self.issued = time.monotonic()
        self.waited_on: list[str] = []

    def synchronize(self) -> None:
        self.waited_on.append(threading.current_thread().name)
        time.sleep(max(0.0, self.issued + COPY_S - time.monotonic()))


def _lagging_worker(
    worker: int, port: int, max_lag: int = MAX_LAG, lag_wait_s: float = 0.0
) -> dict[str, object]:
    if lag_wait_s:
        snapshot_module.LAG_WAIT_S = lag_wait_s  # this process only: a bound the slow replay overruns
    applied: dict[int, int] = {}  # step -> units replayed

    def slow_update(slices: Sequence[UnitSlice], step: int) -> None:
        time.sleep(REPLAY_S * len(slices))
        update_fn(slices, step)
        applied[step] = applied.get(step, 0) + len(slices)

    snap, live = seeded_ring(worker, port, WORKERS, slow_update, max_lag=max_lag)
    copies: list[_LandingCopy] = []

    def take() -> StagedCopies:
        copies.append(_LandingCopy())
        return StagedCopies([(copies[-1], None)])

    snap._stager.take = take  # type: ignore[method-assign]  # the copies of a GPU run (docstring)
    units = len(live.units)
    commit_s, behind = [], []
    for step in range(1, STEPS + 1):
        grads = grads_for(live, step)
        snap.exchange_grads(step, grads)
        live_update(live, step, grads)
        snap.finish_exchange()
        t0 = time.monotonic()
        snap.commit(step)
        commit_s.append(time.monotonic() - t0)
        done = max((s for s, n in applied.items() if n == units), default=0)
        behind.append(step - done)
    first_commit_s = commit_s[0]
    snapshot = snap.state()  # flushes
    return {
        "live": live.to_numpy(),
        "snapshot": snapshot.to_numpy(),
        "step": snapshot.step,
        "first_commit_s": first_commit_s,
        "behind": behind,
        "lag_wait_s": snap.stats.lag_wait_s,
        "overruns": snap.stats.lag_overruns,
        "slots_free": snap._lag._value,  # every slot given back once the updates are applied
        "waited_on": [c.waited_on for c in copies],
        "main": threading.current_thread().name,
    }


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_slow_host_replay_waits_off_the_step_and_falls_behind_at_most_max_lag() -> None:
    got = run_on_store(_lagging_worker, list(WORKERS), 90)
    for w in WORKERS:
        r, holder = got[w], got[1 - w]
        # the commit never waits for a step's copies: the updater does, once, before it replays
        assert r["first_commit_s"] < COPY_S / 2, r["first_commit_s"]
        assert all(names == [names[0]] and names[0] != r["main"] for names in r["waited_on"])
        assert len(r["waited_on"]) == STEPS
        # slower than the steps: it fell behind, never by more than MAX_LAG, and the step waited
        assert max(r["behind"]) == MAX_LAG, r["behind"]
        assert r["lag_wait_s"] > 0.0 and r["overruns"] == 0 and r["slots_free"] == MAX_LAG
        # and the backup is the live shard, bit for bit
        assert holder["step"] == STEPS
        for unit, (lo, hi, rows) in r["live"].items():
            h_lo, h_hi, h_rows = holder["snapshot"][unit]
            assert (lo, hi) == (h_lo, h_hi)
            assert torch.equal(torch.from_numpy(rows), torch.from_numpy(h_rows)), (w, unit)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_an_updater_behind_past_the_wait_bound_gets_its_update_queued_not_the_step_failed() -> None:
    """The step has committed on every rank when `commit` runs: an updater still `max_lag` behind
    after LAG_WAIT_S (here 20 ms, against a 90 ms replay) gets the update queued past the bound,
    counted, and the backup still ends bitwise equal to the live shard."""
    got = run_on_store(_lagging_worker, list(WORKERS), 90, 1, 0.02)
    for w in WORKERS:
        r, holder = got[w], got[1 - w]
        assert r["overruns"] > 0 and max(r["behind"]) > 1, (r["overruns"], r["behind"])
        assert r["slots_free"] == 1  # no slot lost or given back twice
        assert holder["step"] == STEPS
        for unit, (_lo, _hi, rows) in r["live"].items():
            assert torch.equal(torch.from_numpy(rows), torch.from_numpy(holder["snapshot"][unit][2])), unit


def test_max_lag_below_one_is_refused() -> None:
    class TwoWorkers:
        worker = 0

        def workers(self, name: str) -> tuple[int, ...]:
            return (0, 1)

    from executor.fabric.snapshot import SnapshotError

    with pytest.raises(SnapshotError, match="max_lag must be >= 1 committed step, got 0"):
        RingSnapshot(TwoWorkers(), "dp/0", update_fn, max_lag=0)  # type: ignore[arg-type]
