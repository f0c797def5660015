"""Logical communication groups and the pure decision of which ones an edit rebuilds (§6.1).

A membership maps a logical group name to its ordered worker ids. Workers are stable ids
(they never get renumbered when someone leaves), so a group whose member list is unchanged is the
same group before and after an event and can be reused as is (ElasWave Fig. 8).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from executor.comm.errors import MembershipError
from executor.comm.ledger import LedgerRecord, group_is_clean, survivors_are_quiet

Membership = Mapping[str, tuple[int, ...]]


def dp_group_name(stage: int) -> str:
    return f"dp/{stage}"


def pp_group_name(stage: int) -> str:
    """The group of stage `stage` and stage `stage + 1` (activations / gradients between them)."""
    return f"pp/{stage}-{stage + 1}"


WORLD_GROUP = "world"


def groups_for_stages(
    stage_workers: Sequence[Sequence[int]], world: bool = False
) -> dict[str, tuple[int, ...]]:
    """One DP group per stage (in DP-rank order) and one group per pair of adjacent stages; with
    `world`, one group of every worker (stage-major order) for job-wide reductions (the global
    gradient norm of clipping)."""
    if not stage_workers or any(len(ws) == 0 for ws in stage_workers):
        raise MembershipError(f"every stage needs at least one worker, got {list(map(list, stage_workers))}")
    seen = [w for ws in stage_workers for w in ws]
    if len(seen) != len(set(seen)):
        raise MembershipError(f"a worker appears in two stages: {list(map(list, stage_workers))}")
    groups: dict[str, tuple[int, ...]] = {}
    for s, ws in enumerate(stage_workers):
        groups[dp_group_name(s)] = tuple(ws)
        if s + 1 < len(stage_workers):
            groups[pp_group_name(s)] = tuple(ws) + tuple(stage_workers[s + 1])
    if world:
        groups[WORLD_GROUP] = tuple(seen)
    return groups


def transfer_groups(pairs: Sequence[tuple[int, int]]) -> dict[str, tuple[int, ...]]:
    """One two-worker group per pair of workers in stages that are not adjacent that a re-layout
    moves state between (`planners.applicability.far_pairs`): the rebuild's point-to-point
    transfers need a group holding both (`Communicator.group_with`)."""
    out: dict[str, tuple[int, ...]] = {}
    for a, b in pairs:
        lo, hi = sorted((a, b))
        out[f"xfer/{lo}-{hi}"] = (lo, hi)
    return out


def link_name(a: int, b: int) -> str:
    """The two-worker group of one pipeline link (ordered by worker id)."""
    lo, hi = sorted((a, b))
    return f"link/{lo}-{hi}"


def _pp_stages(name: str) -> tuple[int, int] | None:
    if not name.startswith("pp/"):
        return None
    first, second = name[3:].split("-")
    return int(first), int(second)


def physical_groups(membership: Membership, pp_links: bool) -> dict[str, tuple[int, ...]]:
    """The gloo groups that serve a logical membership.

    With `pp_links`, a stage pair `pp/s-t` is not one group of both stages but one two-worker
    group per (stage-s worker, stage-t worker) link: the pipeline only ever talks point to point,
    and losing a worker then touches only its own links (ElasWave Fig. 8: neighbours reconnect,
    every other link is reused). Other groups map to themselves.
    """
    out: dict[str, tuple[int, ...]] = {}
    for name, workers in membership.items():
        stages = _pp_stages(name) if pp_links else None
        left = membership.get(dp_group_name(stages[0])) if stages else None
        right = membership.get(dp_group_name(stages[1])) if stages else None
        if left is None or right is None:
            out[name] = tuple(workers)
            continue
        for a in left:
            for b in right:
                out[link_name(a, b)] = tuple(sorted((a, b)))
    return out


def validate_membership(membership: Membership) -> None:
    for name, workers in membership.items():
        if not workers:
            raise MembershipError(f"group {name!r} has no members")
        if len(set(workers)) != len(workers):
            raise MembershipError(f"group {name!r} lists a worker twice: {workers}")
        if any(w < 0 for w in workers):
            raise MembershipError(f"group {name!r} has a negative worker id: {workers}")


def all_workers(membership: Membership) -> frozenset[int]:
    return frozenset(w for ws in membership.values() for w in ws)


# Backends whose communicators can drop members in place (torch's Backend.shrink; for NCCL,
# ncclCommShrink, NCCL >= 2.27). Gloo cannot: an edit rebuilds its groups.
SHRINKING_BACKENDS: frozenset[str] = frozenset({"nccl"})


@dataclass(frozen=True)
class EditDecision:
    """Which of `me`'s groups an edit rebuilds, shrinks in place, reuses and drops, and why."""

    rebuild: tuple[str, ...]
    reuse: tuple[str, ...]
    drop: tuple[str, ...]
    reason: str
    shrink: tuple[str, ...] = ()


def shrink_exclusions(old: Sequence[int], new: Sequence[int]) -> tuple[int, ...] | None:
    """Group ranks (positions in `old`) to exclude if `new` is `old` minus some workers, order kept.

    None if `new` is not such a strict subsequence (a worker added, reordered, or nothing lost):
    then a shrink cannot produce it, because the shrunk communicator numbers the survivors in
    their old order."""
    kept = [w for w in old if w in set(new)]
    if len(new) == len(old) or kept != list(new):
        return None
    return tuple(i for i, w in enumerate(old) if w not in set(new))


def shrink_is_possible(backend: str, can_shrink: bool, full: bool) -> bool:
    """Whether an edit may shrink groups at all (the full-rebuild baseline never does)."""
    return backend in SHRINKING_BACKENDS and can_shrink and not full


def decide_edit(
    old: Membership,
    new: Membership,
    me: int,
    ledgers: Mapping[int, LedgerRecord],
    full: bool,
    backend: str = "gloo",
    can_shrink: bool = False,
) -> EditDecision:
    """Reuse a group only if its member list is unchanged and every member's op ledger balances.

    A group whose members are unchanged can still be unusable: an op abandoned mid-step (another
    survivor aborted) leaves it half-matched, so reusing it would pair the replayed step's first
    op with a stale one. `full=True` is the full-rebuild baseline (rebuild everything).

    Shrink (NCCL, where the installed torch/NCCL support it: `can_shrink`): a group whose new
    member list is its old one minus lost workers is shrunk in place instead of rebuilt (§6.1:
    keep the survivors' links), if it is quiescent among the survivors (`survivors_are_quiet`).
    Every survivor of the group reaches the same verdict from the same inputs, which matters
    because a shrink is collective over them.
    """
    mine_old = {n for n, ws in old.items() if me in ws}
    mine_new = {n for n, ws in new.items() if me in ws}
    may_shrink = shrink_is_possible(backend, can_shrink, full)
    reuse, rebuild, shrink, dirty = [], [], [], []
    for name in sorted(mine_new):
        same = name in mine_old and tuple(old[name]) == tuple(new[name])
        clean = same and group_is_clean(name, new[name], ledgers)
        if same and not clean:
            dirty.append(name)
        if same and clean and not full:
            reuse.append(name)
        elif (
            may_shrink
            and name in mine_old
            and shrink_exclusions(old[name], new[name]) is not None
            and survivors_are_quiet(name, new[name], ledgers)
        ):
            shrink.append(name)
        else:
            rebuild.append(name)
    drop = tuple(sorted(mine_old - set(reuse) - set(shrink)))
    reason = (
        "full rebuild baseline"
        if full
        else (
            f"rebuild groups whose members changed or whose ops were left unmatched ({', '.join(dirty) or 'none'})"
            + (f"; shrink in place {', '.join(shrink)}" if shrink else "")
        )
    )
    return EditDecision(
        rebuild=tuple(rebuild), reuse=tuple(reuse), drop=drop, reason=reason, shrink=tuple(shrink)
    )
