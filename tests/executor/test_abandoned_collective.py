"""A collective issued and never waited for makes the edit rebuild its group (`Communicator.issue`).

ZeRO-1 posts a bucket's reduce-scatter from the backward's hook, as soon as autograd has that
bucket's gradients, and waits for all of them after the backward. A step abandoned in between (a
pipeline peer lost mid-backward) leaves the DP members with different numbers of posted exchanges:
one posted a bucket, its peer had not reached it. Gloo pairs a group's collectives by their order,
so a group reused as it is then pairs the next step's first exchange with the stale one, and
that step hangs for the whole group timeout (seen in `bench.mttr`: 20 s after one kill at
PP=4 x DP=2, 3 runs of about 40). Here worker 0 posts an exchange that it abandons; the edit
that follows must rebuild the group on both workers, and the next exchange must deliver the
right values at once.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch.distributed import AllToAllOptions

from executor.comm import Communicator
from executor.engine_comm import WorkSet
from executor.store_server import connect_store
from tests.executor.ft_procs import run_on_store

GROUPS = {"dp/0": (0, 1), "dp/1": (0, 1)}


def _exchange(comm: Communicator, worker: int, group: str) -> list[float]:
    """One personalised exchange on `group` as ZeRO posts it: issued, then waited for."""
    sent = torch.tensor([10.0 * worker, 10.0 * worker + 1])
    out = torch.empty(2)
    work = comm.issue(group, lambda pg: pg.alltoall_base(out, sent, [1, 1], [1, 1], AllToAllOptions()))
    comm.wait(group, WorkSet([work]), issued=1)
    return out.tolist()


def _worker(worker: int, port: int) -> dict[str, Any]:
    store = connect_store("127.0.0.1", port)
    comm = Communicator(store, worker, GROUPS, timeout_s=8.0)
    first = {name: _exchange(comm, worker, name) for name in sorted(GROUPS)}
    if worker == 0:  # the bucket worker 0 posted before the step was abandoned; worker 1 never did
        stale_out, stale_in = torch.empty(2), torch.zeros(2)
        comm.issue(
            "dp/0", lambda pg: pg.alltoall_base(stale_out, stale_in, [1, 1], [1, 1], AllToAllOptions())
        )
    report = comm.apply_edit(GROUPS)
    started = time.monotonic()
    after = {name: _exchange(comm, worker, name) for name in sorted(GROUPS)}
    return {
        "first": first,
        "after": after,
        "seconds": time.monotonic() - started,
        "rebuilt": sorted(report.rebuilt),
        "reused": sorted(report.reused),
    }


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_an_exchange_posted_and_abandoned_by_one_member_gets_its_group_rebuilt() -> None:
    got = run_on_store(_worker, [0, 1], 60)
    for worker in (0, 1):
        r = got[worker]
        expected = [10.0 * 0 + worker, 10.0 * 1 + worker]  # element `worker` of each member's send
        assert r["first"] == {"dp/0": expected, "dp/1": expected}
        assert r["rebuilt"] == ["dp/0"], r  # both members decide alike, from both ledgers
        assert r["reused"] == ["dp/1"], r  # the group without a stale op stays as it is
        assert r["after"] == {"dp/0": expected, "dp/1": expected}, r
        assert r["seconds"] < 4.0, r  # not a wait for the group timeout (8 s)
