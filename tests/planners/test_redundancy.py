"""Backup redundancy k (planners.redundancy): sized from bursts of node losses, capped by memory,
and set on the layouts the ElasWave policy publishes with its reason."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from planners.elaswave_model import uniform_model
from planners.elaswave_policy import ElasWaveInput, plan_elaswave
from planners.elaswave_reasons import Outcome, Step
from planners.layout import make_uniform_layout
from planners.placement import Placement, UnitCost, plan_placement
from planners.redundancy import (
    NodeLoss,
    RedundancyInput,
    RedundancySettings,
    bursts,
    choose_copies,
    copy_bytes,
    initial_copies,
)

LAYOUT = make_uniform_layout(
    num_layers=8, num_stages=2, dp=4, global_batch=16, num_micro_batches=2, layer_numel=(1 << 20,) * 8
)
BURST = (NodeLoss(100.0, frozenset({"a", "b"})), NodeLoss(130.0, frozenset({"c"})))
SPREAD = (NodeLoss(100.0, frozenset({"a"})), NodeLoss(1000.0, frozenset({"b"})))


def test_losses_within_the_window_chain_into_one_burst() -> None:
    assert [len(n) for _, n in bursts(BURST, 60.0)] == [3]
    assert [len(n) for _, n in bursts(SPREAD, 60.0)] == [1, 1]


def test_a_burst_raises_k_when_memory_allows_and_says_why() -> None:
    choice = choose_copies(LAYOUT, BURST, 200.0, dict.fromkeys(LAYOUT.ranks(), 1e12))
    assert choice.copies == 3 and choice.largest_burst == 3
    assert "largest burst 3 node(s) within 60 s" in choice.reason and "3 copies fit" in choice.reason


def test_without_headroom_k_stays_one_and_says_why() -> None:
    per_copy = copy_bytes(LAYOUT)
    tight = {r: 1.5 * b for r, b in per_copy.items()}  # one copy fits, two do not
    choice = choose_copies(LAYOUT, BURST, 200.0, tight)
    assert choice.copies == 1
    assert "2 copies do not fit" in choice.reason and "GiB free" in choice.reason
    unknown = choose_copies(LAYOUT, BURST, 200.0, None)
    assert unknown.copies == 1 and "no memory cap is known" in unknown.reason


def test_single_spread_losses_and_old_bursts_keep_one_copy() -> None:
    roomy = dict.fromkeys(LAYOUT.ranks(), 1e12)
    assert choose_copies(LAYOUT, SPREAD, 2000.0, roomy).copies == 1
    old = choose_copies(LAYOUT, BURST, 100.0 + 7 * 3600, roomy)
    assert old.copies == 1 and "no node loss seen" in old.reason
    capped = choose_copies(LAYOUT, BURST, 200.0, roomy, RedundancySettings(max_copies=2))
    assert capped.copies == 2


def test_copies_never_exceed_the_failure_domains() -> None:
    nodes = tuple((r, r // 4) for r in LAYOUT.ranks())  # two nodes of four ranks
    two_nodes = replace(LAYOUT, rank_nodes=nodes)
    choice = choose_copies(two_nodes, BURST, 200.0, dict.fromkeys(LAYOUT.ranks(), 1e12))
    assert choice.copies == 1 and "only 2 failure domain(s)" in choice.reason


@pytest.mark.parametrize(("cap", "copies"), [(1e15, 3), (None, 1)])
def test_the_policy_publishes_k_with_its_reason(cap: float | None, copies: int) -> None:
    model = uniform_model(LAYOUT, [], "test")
    inp = ElasWaveInput(LAYOUT, (5,), model, redundancy=RedundancyInput(BURST, 200.0, cap))
    plan = plan_elaswave(inp)
    assert plan.action == "publish" and plan.layout is not None
    assert plan.layout.backup_copies == copies
    said = [r for r in plan.reasons if r.step is Step.REDUNDANCY]
    assert len(said) == 1 and said[0].text.startswith(f"backup copies k={copies}")
    assert said[0].outcome is (Outcome.CHANGED if copies > 1 else Outcome.KEPT)
    assert ("backup copies 1->3" in plan.summary) == (copies == 3)


def test_the_policy_without_redundancy_input_leaves_k_alone() -> None:
    layout = replace(LAYOUT, backup_copies=2)
    plan = plan_elaswave(ElasWaveInput(layout, (5,), uniform_model(layout, [], "test")))
    assert plan.layout is not None and plan.layout.backup_copies == 2
    assert all(r.step is not Step.REDUNDANCY for r in plan.reasons)


NODES4 = replace(LAYOUT, rank_nodes=tuple((r, r % 4) for r in LAYOUT.ranks()))  # four nodes


def test_a_layout_with_a_node_map_assumes_bursts_of_two_before_one_is_seen() -> None:
    roomy = dict.fromkeys(LAYOUT.ranks(), 1e12)
    choice = choose_copies(NODES4, (), 0.0, roomy)
    assert choice.copies == 2 and choice.largest_burst == 0
    assert "no node loss seen; bursts of 2 nodes assumed possible" in choice.reason, choice.reason
    assert "2 copies fit" in choice.reason
    # A burst larger than the prior still sizes k; without the prior (1) only losses count.
    assert choose_copies(NODES4, BURST, 200.0, roomy).copies == 3
    assert choose_copies(NODES4, (), 0.0, roomy, RedundancySettings(prior_burst_nodes=1)).copies == 1
    # No node map (each rank a node of its own, as in a test layout): no prior.
    assert choose_copies(LAYOUT, (), 0.0, roomy).copies == 1


def test_the_prior_keeps_one_copy_without_headroom_or_domains_and_says_why() -> None:
    tight = {r: 1.5 * b for r, b in copy_bytes(NODES4).items()}
    choice = choose_copies(NODES4, (), 0.0, tight)
    assert choice.copies == 1 and "2 copies do not fit" in choice.reason, choice.reason
    unknown = choose_copies(NODES4, (), 0.0, None)
    assert unknown.copies == 1 and "no memory cap is known" in unknown.reason
    two_nodes = replace(LAYOUT, rank_nodes=tuple((r, r % 2) for r in LAYOUT.ranks()))
    few = choose_copies(two_nodes, (), 0.0, dict.fromkeys(LAYOUT.ranks(), 1e12))
    assert few.copies == 1 and "only 2 failure domain(s)" in few.reason, few.reason


def test_prior_burst_nodes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="prior_burst_nodes >= 1"):
        RedundancySettings(prior_burst_nodes=0)


UNITS = [UnitCost(f"u{i}", numel=10_000, param_bytes=40_000, seconds_per_sample=0.01) for i in range(4)]


def _place(nnodes: int, cap: float | None) -> Callable[[int], Placement]:
    def place(copies: int) -> Placement:
        return plan_placement(
            UNITS,
            global_batch=16,
            micro_batches=2,
            nnodes=nnodes,
            nproc_per_node=2,
            pp=2,
            mem_cap_bytes=cap,
            backup_copies=copies,
        )

    return place


def test_the_first_placement_keeps_the_prior_copies_where_memory_allows() -> None:
    roomy = 1e12
    placement, choice = initial_copies(_place(4, roomy), roomy)
    assert placement.layout.backup_copies == 2 == choice.copies
    assert "no node loss seen; bursts of 2 nodes assumed possible" in choice.reason
    assert placement.backup is not None and "2 copies of every shard, all counted" in placement.backup.reason
    # Two nodes: no second failure domain for a second copy; no cap: nothing says it fits.
    assert initial_copies(_place(2, roomy), roomy)[0].layout.backup_copies == 1
    unknown_place, unknown = initial_copies(_place(4, None), None)
    assert unknown_place.layout.backup_copies == 1 and "no memory cap is known" in unknown.reason


def test_the_first_placement_keeps_one_copy_when_the_memory_check_refuses_more() -> None:
    one = _place(4, None)(1)
    cap = max(one.stage_mem_bytes) + 1  # one copy fits; a second does not
    placement, choice = initial_copies(_place(4, cap), cap)
    assert placement.layout.backup_copies == 1 == choice.copies
    assert "2 copies do not fit" in choice.reason or "memory check refused" in choice.reason, choice.reason


IDLE = RedundancySettings(idle_share=0.5)


def test_idle_memory_holds_copies_beyond_the_bursts_when_asked_and_says_why() -> None:
    per_copy = copy_bytes(NODES4)
    roomy = {r: 10 * b for r, b in per_copy.items()}  # half of it holds 5 copies; 3 domains left
    choice = choose_copies(NODES4, (), 0.0, roomy, IDLE)
    assert choice.copies == 3, choice.reason
    assert "(bursts ask for 2)" in choice.reason and "idle memory holds 3 copies" in choice.reason
    assert "within 50% of every rank's free memory" in choice.reason
    assert "only 4 failure domains" in choice.reason or "max_copies is 3" in choice.reason
    # Off by default: the bursts (here the prior) alone size k.
    assert choose_copies(NODES4, (), 0.0, roomy).copies == 2


def test_a_burst_raises_k_past_the_idle_share_when_memory_allows() -> None:
    per_copy = copy_bytes(NODES4)
    # Half the free memory holds one copy, all of it three: without a burst the prior's 2 copies;
    # with a burst of three nodes, 3 copies (the history, not idle memory, is the reason).
    three = {r: 3 * b for r, b in per_copy.items()}
    quiet = choose_copies(NODES4, (), 0.0, three, replace(IDLE, prior_burst_nodes=1))
    assert quiet.copies == 1 and "a second copy does not fit in 50% of the free memory" in quiet.reason
    burst = choose_copies(NODES4, BURST, 200.0, three, IDLE)
    assert burst.copies == 3 and "largest burst 3 node(s)" in burst.reason and "3 copies fit" in burst.reason


def test_without_headroom_idle_memory_keeps_one_copy_and_says_why() -> None:
    tight = {r: 1.5 * b for r, b in copy_bytes(NODES4).items()}
    choice = choose_copies(NODES4, (), 0.0, tight, IDLE)
    assert choice.copies == 1 and "2 copies do not fit" in choice.reason, choice.reason
    unknown = choose_copies(NODES4, (), 0.0, None, IDLE)
    assert unknown.copies == 1 and "no memory cap is known" in unknown.reason
    # No node map: no failure domains known, idle memory keeps no extra copy.
    assert choose_copies(LAYOUT, (), 0.0, dict.fromkeys(LAYOUT.ranks(), 1e12), IDLE).copies == 1


def test_idle_share_must_be_a_share() -> None:
    with pytest.raises(ValueError, match="idle_share"):
        RedundancySettings(idle_share=1.5)
