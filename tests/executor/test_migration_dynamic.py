"""Non-blocking layer migration (ElasWave §6.2, Fig. 9) on the dynamic communicator (§6.1).

The dynamic communicator serves each pipeline pair by per-link groups (`link/a-b`), so the
migration's tagged transfers and paybacks must travel on the link of the two ranks, posted and
waited through the communicator (ledger, abort flag, bounded wait) like every other op.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from executor.comm import Communicator, MembershipError, PeerFailure, groups_for_stages
from executor.launch import JobSpec, job_losses, merged_state, run_job
from executor.nonblocking_migration import MIGRATE_TAG
from executor.store_server import connect_store
from tests.executor.engine_cases import gpt_block_numel, gpt_spec, layout, max_state_diff, states_equal
from tests.executor.ft_procs import run_on_store

RANKS = [(0, 1), (2, 3)]
STEPS = 7


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_nonblocking_migration_on_dynamic_communicator_is_bit_identical() -> None:
    """PP=2 x DP=2 on executor.comm.Communicator: block 1 (unit 2) moves to stage 1 before step 2,
    blocks 1 and 2 (units 2, 3) move to stage 0 before step 5, both non-blocking (shadow + payback over k=2 slots).
    Losses and final parameters and moments are bit-identical to the run without moves."""
    cfg = gpt_spec(dropout=0.1)
    start = layout([(0, 3), (3, 6)], RANKS)
    relayouts = ((2, layout([(0, 2), (2, 6)], RANKS)), (5, layout([(0, 4), (4, 6)], RANKS)))
    base = run_job(JobSpec(cfg, start, STEPS, comm_kind="dynamic", timeout_s=30.0))
    moved = run_job(
        JobSpec(
            cfg,
            start,
            STEPS,
            relayouts=relayouts,
            migration="nonblocking",
            shadow_slots=2,
            comm_kind="dynamic",
            timeout_s=30.0,
        )
    )
    assert job_losses(moved) == job_losses(base)
    assert states_equal(merged_state(moved), merged_state(base)), max_state_diff(
        merged_state(moved), merged_state(base)
    )
    numel = gpt_block_numel()
    for rank, res in moved.items():
        assert [m["mode"] for m in res.migrations] == ["nonblocking", "nonblocking"]
        first, second = res.migrations
        source, target = (first, second) if rank in (0, 1) else (second, first)
        # Everything posted was delivered: full parameters + this rank's half of the moments +
        # the payback gradient per moved block, rank j of one stage to rank j of the other.
        for rep, side in ((source, "elements_sent"), (target, "elements_received")):
            assert rep[side] == len(rep["moved_layers"]) * (numel + 2 * (numel // 2) + numel), (rank, rep)


HUNG_TIMEOUT_S = 2.0


def _posted_link_worker(worker: int, port: int) -> dict[str, object]:
    """Stages [[0], [1, 2]]. Worker 1 posts a migration-tagged receive from worker 0 on `pp/0-1`,
    which worker 0 never sends: the wait must end in PeerFailure on the link within the timeout,
    and the edit that follows must rebuild that link (its ledger has the failed op) and reuse the
    others."""
    store = connect_store("127.0.0.1", port)
    comm = Communicator(store, worker, groups_for_stages([[0], [1, 2]]), timeout_s=HUNG_TIMEOUT_S)
    channels = {}
    for peer in [1, 2] if worker == 0 else [0]:  # the other stage's workers
        name, pg, peer_rank = comm.p2p_group("pp/0-1", peer)
        channels[peer] = (name, pg.size(), peer_rank)
    out: dict[str, object] = {"channels": channels}
    if worker == 1:
        try:
            comm.p2p_group("pp/0-1", 2)  # same stage: no link between them
        except MembershipError as exc:
            out["same_stage_error"] = str(exc)
        t0 = time.monotonic()
        ops = comm.post_exchange([], [("pp/0-1", torch.zeros(4), 0, MIGRATE_TAG + 1)])
        try:
            comm.complete(ops)
            out["failure"] = None
        except PeerFailure as exc:
            out["failure"], out["reason"] = exc.group, exc.reason
        out["seconds"] = time.monotonic() - t0
        store.set("released", "1")
    store.wait(["released"], timedelta(seconds=30))
    report = comm.apply_edit(groups_for_stages([[0], [1, 2]]))
    out["rebuilt"], out["reused"] = sorted(report.rebuilt), sorted(report.reused)
    sums = {}
    for name in comm.names():  # every group works after the edit
        t = torch.ones(1)
        comm.all_reduce(name, t)
        sums[name] = t.item()
    out["sums"] = sums
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_posted_link_ops_are_guarded_and_counted() -> None:
    got = run_on_store(_posted_link_worker, [0, 1, 2], 45)
    assert got[0]["channels"] == {1: ("link/0-1", 2, 1), 2: ("link/0-2", 2, 1)}
    assert got[1]["channels"] == {0: ("link/0-1", 2, 0)}
    assert got[2]["channels"] == {0: ("link/0-2", 2, 0)}
    assert "no group" in got[1]["same_stage_error"]
    assert got[1]["failure"] == "link/0-1", got[1]
    assert got[1]["seconds"] < HUNG_TIMEOUT_S + 1.5, got[1]  # bounded, not a hang
    # the posted receive was in link/0-1's ledger: that link is rebuilt on both ends, all else reused
    assert got[0]["rebuilt"] == ["link/0-1"] and got[0]["reused"] == ["dp/0", "link/0-2"]
    assert got[1]["rebuilt"] == ["link/0-1"] and got[1]["reused"] == ["dp/1"]
    assert got[2]["rebuilt"] == [] and got[2]["reused"] == ["dp/1", "link/0-2"]
    assert got[0]["sums"] == {"dp/0": 1.0, "link/0-1": 2.0, "link/0-2": 2.0}
    assert got[1]["sums"] == {"dp/1": 2.0, "link/0-1": 2.0}
