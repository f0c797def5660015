"""Greedy colouring of asymmetric all-reduce rounds is always proper."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners.chameleon.coloring import colour_all_reduce_rounds, conflict_graph, is_proper, rounds_time

devices = st.lists(st.frozensets(st.integers(0, 15), min_size=1, max_size=6), min_size=1, max_size=10)


@settings(max_examples=150, deadline=None)
@given(devices)
def test_colouring_is_proper(layers_of_device: list[frozenset[int]]) -> None:
    rounds = colour_all_reduce_rounds(layers_of_device)
    assert is_proper(rounds, layers_of_device)
    for held in layers_of_device:  # no two all-reduces of one device in the same round
        for r in rounds.rounds:
            assert len(held & set(r)) <= 1
    graph = conflict_graph(layers_of_device)
    assert len(rounds.rounds) <= max(len(n) for n in graph.values()) + 1
    assert len(rounds.rounds) >= max(len(h) for h in layers_of_device)  # a device's layers are a clique


def test_symmetric_pipelines_need_one_round_per_layer_of_a_stage() -> None:
    stages = [frozenset({0, 1, 2}), frozenset({3, 4, 5})]
    rounds = colour_all_reduce_rounds(stages * 4)  # 4 identical replicas
    assert len(rounds.rounds) == 3


def test_paper_example_asymmetric_split() -> None:
    # Chameleon Fig. 4: replica 1 holds (1,2)(3,4); replica 2 re-split as (1)(2,3)(4).
    devs = [frozenset({1, 2}), frozenset({3, 4}), frozenset({1}), frozenset({2, 3}), frozenset({4})]
    rounds = colour_all_reduce_rounds(devs)
    assert is_proper(rounds, devs)
    assert len(rounds.rounds) == 2
    assert rounds_time(rounds, {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}) == pytest.approx(
        sum(max({1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}[x] for x in r) for r in rounds.rounds)
    )


def test_improper_colourings_are_detected() -> None:
    devs = [frozenset({0, 1})]
    rounds = colour_all_reduce_rounds(devs)
    bad = type(rounds)(((0, 1),), {0: 0, 1: 0}, "forced")
    assert is_proper(rounds, devs) and not is_proper(bad, devs)
