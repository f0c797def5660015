"""The 1F1B program and sample-range routing, checked on a rendezvous (blocking send) simulator."""

from __future__ import annotations

import itertools
from typing import Literal

import pytest

from executor.pipeline import Op, compute_order, routes, stage_program
from planners.layout import Layout, SampleRange
from tests.executor.engine_cases import NUM_UNITS, layout

Message = tuple[str, int, int, int, int]  # (direction, slot, sender, receiver, first sample)


def _rank_ops(lay: Layout, rank: int, program: list[Op]) -> list[tuple[str, Message]]:
    """Expand one rank's program into its blocking sends/recvs, as PipelineRunner issues them."""
    ops: list[tuple[str, Message]] = []
    for op in program:
        if len(lay.samples_of(rank, op.slot)) == 0 or op.kind in ("fwd", "bwd"):
            continue
        toward: Literal["next", "prev"] = "next" if op.kind in ("send_f", "recv_b") else "prev"
        direction = "f" if op.kind in ("send_f", "recv_f") else "b"
        for r in routes(lay, rank, op.slot, toward):
            sender, receiver = (rank, r.peer) if op.kind.startswith("send") else (r.peer, rank)
            ops.append(
                (
                    "send" if op.kind.startswith("send") else "recv",
                    (direction, op.slot, sender, receiver, r.samples.start),
                )
            )
    return ops


def rendezvous_deadlocks(per_rank: dict[int, list[tuple[str, Message]]]) -> bool:
    """True if blocking sends/recvs (a send waits for its receive) cannot all complete."""
    heads = dict.fromkeys(per_rank, 0)
    progressed = True
    while progressed:
        progressed = False
        for rank, ops in per_rank.items():
            if heads[rank] >= len(ops) or ops[heads[rank]][0] != "send":
                continue
            msg = ops[heads[rank]][1]
            peer_ops, peer_head = per_rank[msg[3]], heads[msg[3]]
            if peer_head < len(peer_ops) and peer_ops[peer_head] == ("recv", msg):
                heads[rank] += 1
                heads[msg[3]] += 1
                progressed = True
    return any(heads[r] < len(ops) for r, ops in per_rank.items())


def _naive_program(num_stages: int, stage: int, num_slots: int) -> list[Op]:
    """1F1B with recv right before each compute (no hoisting): deadlocks on rendezvous sends."""
    first, last = stage == 0, stage == num_stages - 1
    ops: list[Op] = []
    for kind, m in compute_order(num_stages, stage, num_slots):
        if kind == "F":
            ops += ([] if first else [Op("recv_f", m)]) + [Op("fwd", m)] + ([] if last else [Op("send_f", m)])
        else:
            ops += ([] if last else [Op("recv_b", m)]) + [Op("bwd", m)] + ([] if first else [Op("send_b", m)])
    return ops


def _uniform(p: int, dp: list[int], batch: int, slots: int) -> Layout:
    bounds = [(s, s + 1) for s in range(p - 1)] + [(p - 1, NUM_UNITS)]
    ranks, nxt = [], 0
    for d in dp:
        ranks.append(tuple(range(nxt, nxt + d)))
        nxt += d
    return layout(bounds, ranks, global_batch=batch, num_micro_batches=slots)


def _all_ops(lay: Layout, program=stage_program) -> dict[int, list[tuple[str, Message]]]:
    return {
        r: _rank_ops(lay, r, program(lay.num_stages, lay.stage_of_rank(r), lay.num_micro_batches))
        for r in lay.ranks()
    }


def test_compute_order_is_1f1b() -> None:
    assert compute_order(4, 0, 6) == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("F", 3),
        ("B", 0),
        ("F", 4),
        ("B", 1),
        ("F", 5),
        ("B", 2),
        ("B", 3),
        ("B", 4),
        ("B", 5),
    ]
    assert compute_order(4, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    for p, s, m in itertools.product(range(1, 5), range(4), range(1, 7)):
        if s < p:
            seq = compute_order(p, s, m)
            assert sorted(seq) == sorted([("F", k) for k in range(m)] + [("B", k) for k in range(m)])
            assert all(seq.index(("F", k)) < seq.index(("B", k)) for k in range(m))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6])
def test_program_is_deadlock_free_with_blocking_sends(p: int, m: int) -> None:
    assert not rendezvous_deadlocks(_all_ops(_uniform(p, [1] * p, batch=m, slots=m)))


@pytest.mark.parametrize("dp", [[2, 1], [1, 2], [2, 3], [3, 1, 2], [2, 2, 1, 3]])
@pytest.mark.parametrize("batch, slots", [(6, 3), (7, 2), (5, 5), (9, 4)])
def test_program_with_uneven_dp_routing_is_deadlock_free(dp: list[int], batch: int, slots: int) -> None:
    lay = _uniform(len(dp), dp, batch, slots)
    ops = _all_ops(lay)
    assert not rendezvous_deadlocks(ops)
    # Every activation and gradient slice is sent exactly once per (slot, sample run).
    sends = [msg for rank_ops in ops.values() for kind, msg in rank_ops if kind == "send"]
    assert len(sends) == len(set(sends))


def test_the_simulator_catches_the_naive_order() -> None:
    """Without hoisting the next forward's receive, a 3-stage 1F1B deadlocks on gloo's rendezvous sends."""
    assert rendezvous_deadlocks(_all_ops(_uniform(3, [1, 1, 1], batch=4, slots=4), _naive_program))


def test_routes_cover_each_slice_exactly_and_agree_between_ends() -> None:
    lay = layout(
        [(0, 3), (3, 6)],
        [(0, 1, 2), (3, 4)],
        global_batch=11,
        num_micro_batches=2,
        weights=[(3, 1, 2), (1, 1)],
    )
    for slot in range(2):
        for rank in lay.ranks():
            mine = lay.samples_of(rank, slot)
            for toward in ("next", "prev"):
                if (toward == "next") == (lay.stage_of_rank(rank) == 1):
                    continue
                rs = routes(lay, rank, slot, toward)
                covered = [s for r in rs for s in range(r.samples.start, r.samples.stop)]
                assert covered == list(range(mine.start, mine.stop))
                assert all(r.offset == r.samples.start - mine.start for r in rs)
                for r in rs:  # the peer sees the same slice coming back
                    back = {
                        x.peer: x.samples
                        for x in routes(lay, r.peer, slot, "prev" if toward == "next" else "next")
                    }
                    assert back[rank] == r.samples


def test_routing_fan_out_and_fan_in() -> None:
    lay = layout([(0, 3), (3, 6)], [(0,), (1, 2)], global_batch=8, num_micro_batches=2)
    assert [(r.peer, r.samples, r.offset) for r in routes(lay, 0, 1, "next")] == [
        (1, SampleRange(4, 6), 0),
        (2, SampleRange(6, 8), 2),
    ]
    assert [(r.peer, r.samples, r.offset) for r in routes(lay, 2, 1, "prev")] == [(0, SampleRange(6, 8), 0)]


def test_bad_program_requests() -> None:
    with pytest.raises(ValueError, match="no stage"):
        stage_program(2, 2, 4)
    lay = layout([(0, NUM_UNITS)], [(0,)])
    with pytest.raises(ValueError, match="no next stage"):
        routes(lay, 0, 0, "next")
