"""Kuhn-Munkres weight-transfer matching: never worse than identity, optimal on small cases."""

from __future__ import annotations

from itertools import permutations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners.chameleon.matching import match_weight_transfer, transfer_cost_matrix

layer_sets = st.lists(st.frozensets(st.integers(0, 9), max_size=5), min_size=1, max_size=6)


def brute_force(old: list[frozenset[int]], new: list[frozenset[int]], weights: list[float]) -> float:
    cost = transfer_cost_matrix(old, new, weights)
    return min(
        sum(cost[perm[j], j] for j in range(len(new))) for perm in permutations(range(len(old)), len(new))
    )


@settings(max_examples=80, deadline=None)
@given(layer_sets, st.data())
def test_matching_is_optimal_and_never_worse_than_identity(
    old: list[frozenset[int]], data: st.DataObject
) -> None:
    new = data.draw(st.lists(st.frozensets(st.integers(0, 9), max_size=5), min_size=1, max_size=len(old)))
    weights = data.draw(st.lists(st.floats(0.0, 100.0), min_size=10, max_size=10))
    m = match_weight_transfer(old, new, weights)
    assert m.total_cost <= m.identity_cost + 1e-9
    assert m.total_cost == pytest.approx(brute_force(old, new, weights), abs=1e-9)
    slots = [s for s in m.slot_of_node if s >= 0]
    assert sorted(slots) == list(range(len(new)))  # every slot served exactly once


def test_paper_example_keeps_layers_in_place() -> None:
    # Chameleon Fig. 3: a node holding (1,2,3) that moves to a (1,2) slot receives nothing.
    old = [frozenset({1, 2, 3}), frozenset({4, 5, 6})]
    new = [frozenset({4, 5}), frozenset({1, 2})]
    m = match_weight_transfer(old, new)
    assert m.slot_of_node == (1, 0)
    assert m.total_cost == 0 and m.identity_cost == 4


def test_more_slots_than_nodes_is_refused() -> None:
    with pytest.raises(ValueError, match="2 slots but only 1 surviving"):
        match_weight_transfer([frozenset({1})], [frozenset({1}), frozenset({2})])
    with pytest.raises(ValueError, match="layer 3 has no entry"):
        transfer_cost_matrix([frozenset()], [frozenset({3})], [1.0])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_class_level_transportation_equals_kuhn_munkres(data: st.DataObject) -> None:
    """Above `dense_limit` the optimum comes from the transportation problem between classes of
    interchangeable nodes and slots: same optimal cost, every slot served once, no node twice."""
    kinds = data.draw(st.lists(st.frozensets(st.integers(0, 7), max_size=4), min_size=1, max_size=4))
    old = data.draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=12))
    new = data.draw(st.lists(st.sampled_from(kinds + [frozenset({0, 1})]), min_size=1, max_size=len(old)))
    weights = data.draw(st.lists(st.integers(0, 100), min_size=8, max_size=8))
    dense = match_weight_transfer(old, new, weights)
    classes = match_weight_transfer(old, new, weights, dense_limit=0)
    assert classes.total_cost == pytest.approx(dense.total_cost, abs=1e-9)
    assert classes.identity_cost == pytest.approx(dense.identity_cost, abs=1e-9)
    slots = [s for s in classes.slot_of_node if s >= 0]
    assert sorted(slots) == list(range(len(new)))
    cost = transfer_cost_matrix(old, new, weights)
    assert sum(cost[i, j] for i, j in enumerate(classes.slot_of_node) if j >= 0) == pytest.approx(
        classes.total_cost
    )
    assert "transportation" in classes.reason


def test_hundred_thousand_nodes_match_in_class_space() -> None:
    """32 old stages x 3,125 replicas onto 3,226 pipelines of 31: never a 10^10-entry matrix."""
    old = [frozenset(range(4 * (r % 32), 4 * (r % 32) + 4)) for r in range(100_000)]
    new = [frozenset(range(4 * (k % 31), 4 * (k % 31) + 5)) for k in range(31 * 3225)]
    m = match_weight_transfer(old, new, [1.0] * 160)
    assert sorted(s for s in m.slot_of_node if s >= 0) == list(range(len(new)))
    assert m.total_cost <= m.identity_cost
