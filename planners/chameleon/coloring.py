"""Asymmetric all-reduce rounds by greedy graph colouring (Chameleon §IV-B, Fig. 4).

After dynamic parallelism the pipelines of a job may split the layers differently, so the DP
all-reduce of each layer spans a different set of devices. Layers held by the same device
cannot all-reduce at the same time on it, so they conflict: the conflict graph has a vertex per
layer and an edge between two layers that share a device. A proper colouring groups layers into
rounds that can run in parallel; fewer colours mean fewer serial rounds. Greedy colouring in
order of decreasing degree (Welsh-Powell), O(L^2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class AllReduceRounds:
    """`rounds[k]` = layers whose all-reduces run together in round k."""

    rounds: tuple[tuple[int, ...], ...]
    colour_of_layer: Mapping[int, int]
    reason: str


def conflict_graph(layers_of_device: Sequence[frozenset[int]]) -> dict[int, set[int]]:
    """Adjacency of the layer conflict graph: an edge joins two layers held by one device."""
    graph: dict[int, set[int]] = {}
    for held in layers_of_device:
        for layer in held:
            graph.setdefault(layer, set()).update(held - {layer})
    return graph


def colour_all_reduce_rounds(layers_of_device: Sequence[frozenset[int]]) -> AllReduceRounds:
    """Greedy (Welsh-Powell) colouring of the conflict graph into all-reduce rounds."""
    graph = conflict_graph(layers_of_device)
    order = sorted(graph, key=lambda v: (-len(graph[v]), v))
    colour: dict[int, int] = {}
    for v in order:
        taken = {colour[u] for u in graph[v] if u in colour}
        colour[v] = next(c for c in range(len(graph) + 1) if c not in taken)
    n_colours = max(colour.values(), default=-1) + 1
    rounds = tuple(tuple(sorted(v for v in colour if colour[v] == c)) for c in range(n_colours))
    max_degree = max((len(n) for n in graph.values()), default=0)
    return AllReduceRounds(
        rounds,
        colour,
        f"greedy colouring of {len(graph)} layers: {n_colours} rounds "
        f"(max degree {max_degree}, so at most {max_degree + 1})",
    )


def is_proper(rounds: AllReduceRounds, layers_of_device: Sequence[frozenset[int]]) -> bool:
    """True when no round holds two layers of one device and every held layer has a round."""
    seen = [layer for r in rounds.rounds for layer in r]
    if len(seen) != len(set(seen)):
        return False
    every = set().union(*layers_of_device) if layers_of_device else set()
    if set(seen) != every:
        return False
    for held in layers_of_device:
        colours = [rounds.colour_of_layer[layer] for layer in held]
        if len(colours) != len(set(colours)):
            return False
    return True


def rounds_time(rounds: AllReduceRounds, layer_time_s: Mapping[int, float]) -> float:
    """Serial rounds, parallel within a round: the sum over rounds of the slowest all-reduce."""
    return sum(max((layer_time_s[layer] for layer in r), default=0.0) for r in rounds.rounds)
