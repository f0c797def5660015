"""Whether the executor applies a change in place: the Core's and the executor's own rule.

The simulator credits `elaswave` with an in-place recovery only where the executor would make
one, so it asks the functions they do: `planners.applicability.lost_without_copy` (a copy of
every lost shard survives among its `Layout.backup_copies` copies, placed by
`planners.backup.backup_holder_sets`, the placement `executor.fabric.snapshot` forms its backup
pairs from) and `structural_problem` (the change is one the engine makes). Only when every copy
of a lost shard is gone is a RESTORE needed.

The lost ranks are passed in, not derived from `old` and `new` as `applicability.judge` does:
in the simulator a rank is a device position, so a node swapped for a spare loses its ranks'
state while the same rank ids stay in the new layout (the Core gives the spare new ranks).
Ranks a plan drops while they are alive (a dropped replica, `Plan.standby`) are not in `lost`:
they hand their live state over and need no copy.
"""

from __future__ import annotations

from planners.applicability import lost_without_copy, structural_problem
from planners.layout import Layout


def in_place(old: Layout, new: Layout, lost: frozenset[int]) -> bool:
    """Whether `old -> new` applies in place when `lost` (ranks of `old` whose state died) are gone."""
    return not lost_without_copy(old, lost) and structural_problem(old, new) is None
