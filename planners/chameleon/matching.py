"""Weight-transfer matching with Kuhn-Munkres (Chameleon §IV-B, Fig. 3).

When dynamic parallelism re-lays out the model, surviving node i (holding layers `old[i]`) can
take any slot j of the new plan (which needs layers `new[j]`). `Cost[i][j]` is what node i must
receive to serve slot j: the layers of `new[j]` it does not hold yet, weighted by their bytes.
Layers it holds but no longer needs are dropped for free. The assignment of minimum total cost
is a linear assignment problem, solved by `scipy.optimize.linear_sum_assignment`.

At scale the problem is bounded by its classes, not its nodes: every node of one old stage
holds the same layers and every slot of one (pipeline length, stage) needs the same layers, so
nodes (slots) with equal layer sets are interchangeable. The cost matrix is computed once per
pair of classes (a few dozen x a few dozen, one matrix product) and expanded by indexing. Up to
`DENSE_LIMIT` node-slot pairs Kuhn-Munkres runs on the expanded matrix; above it the same optimum
is found as a transportation problem between classes (supplies = nodes per class, demands =
slots per class): a linear program over classes x classes variables whose dual-simplex vertex is
integral because the constraint matrix is totally unimodular (`scipy.optimize.milp` is the
fallback), expanded into a node-to-slot assignment. 100,000 nodes in 32 classes cost
milliseconds instead of an O(n^3) assignment over a 10^10-entry matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# scipy is imported where it is used: it costs ~1 s of CPU per process, and the Core, the
# launcher and every agent import this module without ever matching (see docs/development.md).

DENSE_LIMIT = 40_000  # node x slot pairs above which the class-level transportation problem is solved


@dataclass(frozen=True)
class Matching:
    """`slot_of_node[i]` = new slot served by surviving node i (-1: node left idle)."""

    slot_of_node: tuple[int, ...]
    total_cost: float
    identity_cost: float
    reason: str


def _classes(sets: Sequence[frozenset[int]]) -> tuple[list[frozenset[int]], np.ndarray]:
    """Distinct layer sets in first-seen order and, for every entry, the index of its class."""
    index: dict[frozenset[int], int] = {}
    ids = np.fromiter((index.setdefault(x, len(index)) for x in sets), dtype=np.int64, count=len(sets))
    return list(index), ids


def _class_cost(
    old: list[frozenset[int]], new: list[frozenset[int]], layer_bytes: Sequence[float] | None
) -> np.ndarray:
    """Cost between distinct sets: `sum_l w_l [l in new_j] [l not in old_i]`, one matrix product."""
    layers = sorted(set().union(*old, *new))
    if layer_bytes is not None:
        bad = [x for x in layers if not 0 <= x < len(layer_bytes)]
        if bad:
            raise ValueError(f"layer {bad[0]} has no entry in layer_bytes (len {len(layer_bytes)})")
    col = {x: k for k, x in enumerate(layers)}
    w = np.ones(len(layers)) if layer_bytes is None else np.array([float(layer_bytes[x]) for x in layers])

    def incidence(sets: list[frozenset[int]]) -> np.ndarray:
        out = np.zeros((len(sets), len(layers)))
        for i, held in enumerate(sets):
            out[i, [col[x] for x in held]] = 1.0
        return out

    missing = 1.0 - incidence(old)  # (old classes, layers)
    return missing @ (incidence(new) * w).T  # non-negative terms only: no cancellation


def transfer_cost_matrix(
    old: Sequence[frozenset[int]], new: Sequence[frozenset[int]], layer_bytes: Sequence[float] | None = None
) -> np.ndarray:
    """`Cost[i][j]` = bytes node i must receive to hold exactly the layers of new slot j."""
    old_u, old_ids = _classes(old)
    new_u, new_ids = _classes(new)
    return _class_cost(old_u, new_u, layer_bytes)[np.ix_(old_ids, new_ids)]


def match_weight_transfer(
    old: Sequence[frozenset[int]],
    new: Sequence[frozenset[int]],
    layer_bytes: Sequence[float] | None = None,
    *,
    dense_limit: int = DENSE_LIMIT,
) -> Matching:
    """Minimum-cost assignment of surviving nodes to the slots of the new plan.

    Needs at least as many surviving nodes as new slots. `identity_cost` is the cost of the naive
    assignment node i -> slot i, reported so callers can show what the matching saved. Above
    `dense_limit` node-slot pairs the optimum comes from the class-level transportation problem
    (module docstring); the total cost is the same optimum, the tie-breaking may differ.
    """
    if len(new) > len(old):
        raise ValueError(f"new plan has {len(new)} slots but only {len(old)} surviving nodes")
    if not new:
        return Matching(tuple(-1 for _ in old), 0.0, 0.0, "empty plan: nothing to transfer")
    old_u, old_ids = _classes(old)
    new_u, new_ids = _classes(new)
    return match_classes(
        class_cost_matrix(old_u, new_u, layer_bytes), old_ids, new_ids, dense_limit=dense_limit
    )


def class_cost_matrix(
    old: Sequence[frozenset[int]], new: Sequence[frozenset[int]], layer_bytes: Sequence[float] | None = None
) -> np.ndarray:
    """`transfer_cost_matrix` between distinct layer sets (classes), for `match_classes`."""
    return _class_cost(list(old), list(new), layer_bytes)


def match_classes(
    cost: np.ndarray, old_ids: np.ndarray, new_ids: np.ndarray, *, dense_limit: int = DENSE_LIMIT
) -> Matching:
    """`match_weight_transfer` for callers that already know the classes: node i holds the layers
    of class `old_ids[i]`, slot j needs those of class `new_ids[j]`, and `cost` is the
    `class_cost_matrix` between classes (rows old, columns new). O(nodes) numpy work."""
    n, m = len(old_ids), len(new_ids)
    if m > n:
        raise ValueError(f"new plan has {m} slots but only {n} surviving nodes")
    if m == 0:
        return Matching((-1,) * n, 0.0, 0.0, "empty plan: nothing to transfer")
    identity = float(cost[old_ids[:m], new_ids].sum())
    if n * m <= dense_limit:
        full = cost[np.ix_(old_ids, new_ids)]
        from scipy.optimize import linear_sum_assignment

        rows, cols = linear_sum_assignment(full)
        slot_of_node = np.full(n, -1, dtype=np.int64)
        slot_of_node[rows] = cols
        total = float(full[rows, cols].sum())
        how = f"Kuhn-Munkres over a {n}x{m} cost matrix"
    else:
        slot_of_node, total = _transportation(cost, old_ids, new_ids)
        how = (
            f"transportation over {cost.shape[0]}x{cost.shape[1]} classes of interchangeable nodes "
            f"and slots (the {n}x{m} assignment problem, solved exactly)"
        )
    return Matching(
        tuple(slot_of_node.tolist()),
        total,
        identity,
        f"{how}: {total:.6g} vs {identity:.6g} for the identity assignment",
    )


def _transportation(cost: np.ndarray, old_ids: np.ndarray, new_ids: np.ndarray) -> tuple[np.ndarray, float]:
    """Optimal class-to-class flows (every slot served, no node used twice), expanded to nodes."""
    from scipy import sparse
    from scipy.optimize import Bounds, LinearConstraint, linprog, milp

    n_old, n_new = cost.shape
    supply = np.bincount(old_ids, minlength=n_old)
    demand = np.bincount(new_ids, minlength=n_new)
    # x[u, v] flattened row-major: rows u sum to <= supply[u], columns v sum to == demand[v].
    rows = sparse.kron(sparse.eye(n_old), np.ones((1, n_new))).tocsr()
    cols = sparse.kron(np.ones((1, n_old)), sparse.eye(n_new)).tocsr()
    # Dual simplex returns a vertex, integral because the constraint matrix is totally unimodular;
    # the integer program is the fallback should a solver ever return a fractional point.
    res = linprog(
        cost.ravel(), A_ub=rows, b_ub=supply, A_eq=cols, b_eq=demand, bounds=(0, None), method="highs-ds"
    )
    x = res.x if res.status == 0 else None
    if x is None or np.abs(x - np.rint(x)).max(initial=0.0) > 1e-6:
        res = milp(
            cost.ravel(),
            integrality=np.ones(cost.size),
            constraints=[LinearConstraint(rows, 0, supply), LinearConstraint(cols, demand, demand)],
            bounds=Bounds(0, np.inf),
        )
        x = res.x
    if x is None:  # cannot happen when there are at least as many nodes as slots
        raise RuntimeError(f"transportation problem failed: {res.message}")
    flow = np.rint(x).astype(np.int64).reshape(n_old, n_new)
    if np.any(flow.sum(axis=1) > supply) or np.any(flow.sum(axis=0) != demand):
        raise RuntimeError("transportation solution is not integral; refusing to expand it")
    nodes_of = [np.flatnonzero(old_ids == u) for u in range(n_old)]
    slots_of = [np.flatnonzero(new_ids == v) for v in range(n_new)]
    used_nodes, used_slots = np.zeros(n_old, dtype=np.int64), np.zeros(n_new, dtype=np.int64)
    slot_of_node = np.full(len(old_ids), -1, dtype=np.int64)
    for u, v in zip(*np.nonzero(flow), strict=True):
        f = flow[u, v]
        a, b = used_nodes[u], used_slots[v]
        slot_of_node[nodes_of[u][a : a + f]] = slots_of[v][b : b + f]
        used_nodes[u], used_slots[v] = a + f, b + f
    return slot_of_node, float((flow * cost).sum())
