"""Weight-transfer matching with Kuhn-Munkres (chameleon.txt §IV-B, Fig. 3).

When dynamic parallelism re-lays out the model, surviving node i (holding layers `old[i]`) can
take any slot j of the new plan (which needs layers `new[j]`). `Cost[i][j]` is what node i must
receive to serve slot j: the layers of `new[j]` it does not hold yet, weighted by their bytes.
Layers it holds but no longer needs are dropped for free. The assignment of minimum total cost
is a linear assignment problem, solved by `scipy.optimize.linear_sum_assignment`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment


@dataclass(frozen=True)
class Matching:
    """`slot_of_node[i]` = new slot served by surviving node i (-1: node left idle)."""

    slot_of_node: tuple[int, ...]
    total_cost: float
    identity_cost: float
    reason: str


def transfer_cost_matrix(old: Sequence[frozenset[int]], new: Sequence[frozenset[int]],
                         layer_bytes: Sequence[float] | None = None) -> np.ndarray:
    """`Cost[i][j]` = bytes node i must receive to hold exactly the layers of new slot j."""
    def weight(layer: int) -> float:
        if layer_bytes is None:
            return 1.0
        if not 0 <= layer < len(layer_bytes):
            raise ValueError(f"layer {layer} has no entry in layer_bytes (len {len(layer_bytes)})")
        return float(layer_bytes[layer])

    cost = np.zeros((len(old), len(new)))
    for i, held in enumerate(old):
        for j, needed in enumerate(new):
            cost[i, j] = sum(weight(layer) for layer in needed - held)
    return cost


def match_weight_transfer(old: Sequence[frozenset[int]], new: Sequence[frozenset[int]],
                          layer_bytes: Sequence[float] | None = None) -> Matching:
    """Minimum-cost assignment of surviving nodes to the slots of the new plan.

    Needs at least as many surviving nodes as new slots. `identity_cost` is the cost of the naive
    assignment node i -> slot i, reported so callers can show what the matching saved.
    """
    if len(new) > len(old):
        raise ValueError(f"new plan has {len(new)} slots but only {len(old)} surviving nodes")
    if not new:
        return Matching(tuple(-1 for _ in old), 0.0, 0.0, "empty plan: nothing to transfer")
    cost = transfer_cost_matrix(old, new, layer_bytes)
    rows, cols = linear_sum_assignment(cost)
    slot_of_node = [-1] * len(old)
    for r, c in zip(rows, cols, strict=True):
        slot_of_node[int(r)] = int(c)
    total = float(cost[rows, cols].sum())
    identity = float(sum(cost[j, j] for j in range(len(new))))
    return Matching(tuple(slot_of_node), total, identity,
                    f"Kuhn-Munkres over a {len(old)}x{len(new)} cost matrix: {total:.6g} vs "
                    f"{identity:.6g} for the identity assignment")
