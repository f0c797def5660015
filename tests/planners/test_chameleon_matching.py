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
    return min(sum(cost[perm[j], j] for j in range(len(new))) for perm in permutations(range(len(old)), len(new)))


@settings(max_examples=80, deadline=None)
@given(layer_sets, st.data())
def test_matching_is_optimal_and_never_worse_than_identity(old: list[frozenset[int]], data: st.DataObject) -> None:
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
