"""How many copies of every ZeRO shard to keep: the redundancy k of the shard backups.

ElasWave §5.1 keeps one in-memory copy of each shard, on another node. A burst that takes b
nodes at once (spot capacity reclaimed from a zone, a rack's switch) can take a shard and its
only copy together, and the stage then has nothing to recover from but a durable checkpoint (a
RESTORE). With k copies on k distinct other nodes a shard survives any k nodes lost in one
step, so the policy sizes k to the largest burst the job has seen, as far as memory allows:

- history: the node losses the Core saw, each with its time; losses no more than `window_s`
  apart form one burst (a chain), and only bursts within `memory_s` of now count (an old burst
  says little about the cluster today);
- want: k = the largest recent burst's size in nodes, clamped to [1, `max_copies`] and to the
  failure domains the layout has (a copy never shares a node with its shard, so at most
  nodes - 1 copies are distinct);
- prior: before a burst is seen, one of `prior_burst_nodes` nodes is assumed possible where the
  layout has a failure-domain model (`Layout.rank_nodes`, from the placement): spot capacity is
  reclaimed several nodes at a time, and the first such burst would otherwise take a shard and
  its only copy together (a RESTORE) before the history could raise k. A layout without a node
  map sizes k from the losses seen only;
- fit: k copies cost k x the per-copy bytes `planners.backup.backup_cost` reports for every
  holder, and every rank must have that much headroom below its memory cap (the same check the
  placement makes, `planners.placement`); k drops until it fits, and k = 1 is kept regardless
  (the backup ElasWave always has);
- idle memory (`idle_share`, off by default): copies beyond what the bursts ask for, up to
  `max_copies`, as long as they take at most that share of every rank's free memory (layouts
  with a node map only). Memory is not their only cost: every copy's holder receives the
  owner's gradient shard every step (`executor.fabric.snapshot`), which the simulator charges
  (`simulator.layouts.extra_copy_traffic_s`); measured on the issue-25 tables, copies kept for
  idle memory alone cost more in that traffic than the RESTOREs they avoided
  (docs/benchmarks.md), hence off.

A job's first layout (`initial_copies`, the Core's rendezvous placement) has no history yet: the
prior alone sizes k there, and the placement's own memory check (every copy counted) decides
whether the copies fit.

Pure: time and history come in as arguments; `choose_copies` returns k and the reason the plan
and the job view show.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from planners.backup import backup_cost
from planners.layout import Layout
from planners.placement import Placement, PlacementError


@dataclass(frozen=True)
class NodeLoss:
    """Nodes the Core saw lost together at `time_s` (seconds on the caller's clock)."""

    time_s: float
    nodes: frozenset[str]

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("a NodeLoss needs at least one node")


@dataclass(frozen=True)
class RedundancySettings:
    window_s: float = 60.0  # losses this close form one burst
    memory_s: float = 6 * 3600.0  # bursts older than this are forgotten
    max_copies: int = 3
    # The burst size assumed before one is seen, for layouts with a node map (1: none assumed).
    prior_burst_nodes: int = 2
    # Copies beyond what the bursts ask for, up to `max_copies`, that idle memory holds: at most
    # this share of every rank's free memory (the rest stays free for a later plan's larger
    # shares); layouts with a node map only. 0: the bursts alone size k.
    idle_share: float = 0.0

    def __post_init__(self) -> None:
        if self.window_s < 0 or self.memory_s <= 0 or self.max_copies < 1 or self.prior_burst_nodes < 1:
            raise ValueError(
                f"need window_s >= 0, memory_s > 0, max_copies >= 1 and prior_burst_nodes >= 1, got "
                f"{self.window_s}, {self.memory_s}, {self.max_copies}, {self.prior_burst_nodes}"
            )
        if not 0 <= self.idle_share <= 1:
            raise ValueError(f"idle_share must be in [0, 1], got {self.idle_share}")


@dataclass(frozen=True)
class RedundancyInput:
    """What the policy sizes k from: the node losses seen, now (same clock), and every rank's
    memory cap (None: unknown, k stays 1)."""

    history: tuple[NodeLoss, ...]
    now_s: float
    mem_cap_bytes: float | None
    settings: RedundancySettings = RedundancySettings()


@dataclass(frozen=True)
class RedundancyChoice:
    copies: int
    reason: str
    largest_burst: int  # nodes in the largest recent burst (0: no loss seen)


def bursts(history: Iterable[NodeLoss], window_s: float) -> list[tuple[float, frozenset[str]]]:
    """(start time, nodes) of each burst: losses chained by gaps of at most `window_s`."""
    out: list[tuple[float, frozenset[str]]] = []
    last = float("-inf")
    for loss in sorted(history, key=lambda x: x.time_s):
        if out and loss.time_s - last <= window_s:
            out[-1] = (out[-1][0], out[-1][1] | loss.nodes)
        else:
            out.append((loss.time_s, loss.nodes))
        last = loss.time_s
    return out


def largest_recent_burst(history: Sequence[NodeLoss], now_s: float, settings: RedundancySettings) -> int:
    recent = [b for b in bursts(history, settings.window_s) if now_s - b[0] <= settings.memory_s]
    return max((len(nodes) for _, nodes in recent), default=0)


def failure_domains(layout: Layout) -> int:
    """Distinct nodes of the layout's ranks (a rank without a node is a domain of its own)."""
    nodes = dict(layout.rank_nodes)
    return len({nodes.get(r, -1 - r) for r in layout.ranks()})


def copy_bytes(layout: Layout) -> dict[int, int]:
    """rank -> bytes of ONE copy of the shards it backs up (`planners.backup.backup_cost`)."""
    return dict(backup_cost(layout).per_rank_bytes)


def choose_copies(
    layout: Layout,
    history: Sequence[NodeLoss],
    now_s: float,
    headroom_bytes: Mapping[int, float] | None,
    settings: RedundancySettings = RedundancySettings(),
) -> RedundancyChoice:
    """k for `layout` (see the module docstring). `headroom_bytes`: rank -> bytes free below its
    memory cap before any backup; None when the caps are unknown (k then stays 1)."""
    burst = largest_recent_burst(history, now_s, settings)
    seen = (
        f"largest burst {burst} node(s) within {settings.window_s:g} s in the last "
        f"{settings.memory_s / 3600:g} h"
        if burst
        else "no node loss seen"
    )
    domains = failure_domains(layout)
    prior = settings.prior_burst_nodes if layout.rank_nodes else 1
    if prior > burst:
        seen += f"; bursts of {prior} nodes assumed possible (prior_burst_nodes, {domains} nodes)"
    sized = max(burst, prior)
    cap = max(1, min(settings.max_copies, domains - 1))
    want = min(sized, cap)
    # Idle memory (layouts with a node map only: the failure domains are known) holds copies
    # beyond what the bursts ask for, up to `idle_share` of every rank's free memory.
    idle = bool(layout.rank_nodes) and settings.idle_share > 0 and cap > want
    if want == 1 and not idle:
        if sized <= 1:
            why = "a single copy covers it"
        elif domains - 1 < 2:
            why = f"only {domains} failure domain(s)"
        else:
            why = f"max_copies is {settings.max_copies}"
        return RedundancyChoice(1, f"backup copies k=1: {seen}; {why}", burst)
    if headroom_bytes is None:
        return RedundancyChoice(
            1, f"backup copies k=1: {seen}, but no memory cap is known to fit {max(want, 2)} copies", burst
        )
    per_copy = copy_bytes(layout)
    gib = 2**30
    top = max(per_copy.values(), default=0)

    def short(k: int, share: float) -> list[int]:
        return [r for r, b in per_copy.items() if k * b > share * headroom_bytes.get(r, 0.0)]

    k, tight = want, -1
    while k > 1 and (missing := short(k, 1.0)):
        tight, k = missing[0], k - 1
    spare = (
        max((n for n in range(k + 1, cap + 1) if not short(n, settings.idle_share)), default=0) if idle else 0
    )
    if spare > k:
        limit = f"; max_copies is {settings.max_copies}" if cap == settings.max_copies else ""
        limit = f"; only {domains} failure domains" if cap == domains - 1 < settings.max_copies else limit
        why = (
            f"idle memory holds {spare} copies ({spare * top / gib:.2f} GiB on the busiest holder, within "
            f"{settings.idle_share:.0%} of every rank's free memory){limit}"
        )
        return RedundancyChoice(
            spare, f"backup copies k={spare} (bursts ask for {want}): {seen}; {why}", burst
        )
    if want == 1:
        why = f"a second copy does not fit in {settings.idle_share:.0%} of the free memory"
        return RedundancyChoice(1, f"backup copies k=1: {seen}; {why}", burst)
    if k == want:
        why = f"{k} copies fit ({k * top / gib:.2f} GiB on the busiest holder)"
    else:
        need = (k + 1) * per_copy[tight] / gib
        free = headroom_bytes.get(tight, 0.0) / gib
        why = f"{k + 1} copies do not fit: rank {tight} needs {need:.2f} GiB, has {free:.2f} GiB free"
    return RedundancyChoice(k, f"backup copies k={k} (wanted {want}): {seen}; {why}", burst)


def headroom_from_model(
    layout: Layout, stage_memory_bytes: Sequence[float], cap_bytes: float
) -> dict[int, float]:
    """rank -> cap minus its stage's estimated memory (the placement's estimate, no backup)."""
    return {r: cap_bytes - stage_memory_bytes[s.stage] for s in layout.stages for r in s.ranks}


def initial_copies(
    place: Callable[[int], Placement],
    mem_cap_bytes: float | None,
    settings: RedundancySettings = RedundancySettings(),
) -> tuple[Placement, RedundancyChoice]:
    """A job's first placement with the k copies the prior asks for before any loss is seen.
    `place(k)`: the placement with k copies of every shard (`planners.placement.plan_placement`),
    whose memory check has the last word; k = 1 when it refuses more, with its message."""
    first = place(1)
    headroom = None
    if mem_cap_bytes is not None:
        backed = first.backup.per_rank_bytes if first.backup is not None else {}
        layout = first.layout
        headroom = {  # below the cap before any backup (the estimate counts one copy)
            r: mem_cap_bytes - first.stage_mem_bytes[layout.stage_of_rank(r)] + backed.get(r, 0)
            for r in layout.ranks()
        }
    choice = choose_copies(first.layout, (), 0.0, headroom, settings)
    if choice.copies == 1:
        return first, choice
    try:
        return place(choice.copies), choice
    except PlacementError as exc:
        why = f"backup copies k=1 (wanted {choice.copies}): the placement's memory check refused them: {exc}"
        return first, RedundancyChoice(1, why, 0)
