"""Initial placement of a job: stage boundaries, DP sizes and which node runs each rank.

`elaswave run` (and the Core's rendezvous for multi-node jobs) calls `plan_placement` once, before
any worker starts, with the units the script's describe run measured. It decides:

* **DP per stage.** W = nodes x procs-per-node workers over P stages: W // P each, and when P
  does not divide W the first W % P stages take one more rank. The engine routes activations by
  sample range, so stages of different DP sizes are valid; the partition below accounts for them.
* **Stage boundaries.** Contiguous unit ranges minimising the slowest stage's per-step compute,
  sum(fwd + bwd seconds per sample) x samples per rank (B / D_p), Algorithm 1
  (`planners.partition.minimax_partition`). Measured times are noisy, so among the partitions
  within `time_tolerance` of that optimum the one with the smallest largest stage in parameter
  bytes is taken (a second minimax with the time as the constraint).
* **Ranks to nodes.** Node n runs ranks n*K .. n*K+K-1 (torchrun's numbering). Ranks are handed
  to stages from the node-interleaved order (node 0's first rank, node 1's first, ..., node 0's
  second, ...), each stage a window of that order, so a stage of D ranks spans min(D, N) nodes
  and one node loss never empties a stage when every stage has >= 2 ranks and N >= 2. Where that
  is impossible the result's `warnings` name the stages a single node loss would empty. A stage's
  DP order is that window's order, not the rank order: DP neighbours sit on different nodes, so
  the ring snapshot of a shard (kept by its DP predecessor, ElasWave §5.1) is never on the node
  that holds the shard. Where a stage sits on one node, its shards are backed up in a
  neighbouring stage on another node (`planners.backup`, whose cost `backup` reports), so one
  node's loss always leaves a copy of every lost shard (`planners.applicability`).
* **Memory.** With a per-worker cap, only partitions whose every stage fits are considered
  (Algorithm 1's memory constraint). A worker of stage p holding units with P parameter bytes
  (fp32: n = P / 4 elements) keeps the weights, their gradients and the step's rollback copy
  (3 P), its ZeRO-1 share of the two optimizer states and their rollback copy (16 n / D_p bytes),
  the shard backups it keeps for others (parameters and both states of each: 12 n / D_p for its
  ring neighbour's share, or a neighbouring stage's shares, as `planners.backup` places them;
  with `backup_copies` = k, every one of the k copies of every shard counted where it lives;
  checked against the cap once the ranks are placed), and the activations of
  the micro-batches in flight under 1F1B: min(P_stages - p, M) of them, B / (M D_p) samples each,
  at the units' measured activation bytes per sample. `stage_mem_bytes` reports the estimate.

Pure: no I/O, no clocks; bad input raises `PlacementError` saying what to change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planners.backup import BackupCost, backup_cost
from planners.layout import Layout, StageLayout
from planners.partition import PartitionResult, minimax_partition
from planners.validation import validate


class PlacementError(ValueError):
    """The job cannot be laid out as asked; the message says what to change."""


@dataclass(frozen=True)
class UnitCost:
    """One unit (a layer of the layout) as the describe run measured it."""

    name: str
    numel: int
    param_bytes: int
    seconds_per_sample: float  # forward + backward, on the describing machine
    activation_bytes_per_sample: int = 0  # the output the unit keeps for its backward


@dataclass(frozen=True)
class Placement:
    """The initial layout, where every rank runs, and why."""

    layout: Layout
    rank_node: tuple[int, ...]  # rank_node[r] = node that runs global rank r
    stage_step_s: tuple[float, ...]  # predicted compute seconds per step of each stage (one rank)
    stage_param_bytes: tuple[int, ...]
    stage_mem_bytes: tuple[float, ...]  # estimated peak bytes of one worker of each stage (module doc)
    exposed_stages: tuple[int, ...]  # stages whose ranks all sit on one node
    warnings: tuple[str, ...]
    reason: str
    backup: BackupCost | None = None  # host memory of the shard backups (planners.backup)

    def ranks_on_node(self, node: int) -> tuple[int, ...]:
        return tuple(r for r, n in enumerate(self.rank_node) if n == node)

    def stage_nodes(self, stage: int) -> tuple[int, ...]:
        return tuple(sorted({self.rank_node[r] for r in self.layout.stages[stage].ranks}))


def plan_placement(
    units: Sequence[UnitCost],
    *,
    global_batch: int,
    micro_batches: int,
    nnodes: int,
    nproc_per_node: int,
    pp: int = 1,
    time_tolerance: float = 0.01,
    mem_cap_bytes: float | None = None,
    backup_copies: int = 1,
) -> Placement:
    """Lay `units` out over `nnodes` x `nproc_per_node` workers in `pp` stages (see module doc);
    with `mem_cap_bytes`, every worker's estimated memory must fit it, counting every one of the
    `backup_copies` copies of the shards it backs up (`planners.backup`)."""
    _check_input(units, global_batch, micro_batches, nnodes, nproc_per_node, pp, time_tolerance)
    if backup_copies < 1:
        raise PlacementError(f"backup_copies must be >= 1 (copies of every ZeRO shard), got {backup_copies}")
    if mem_cap_bytes is not None and not (math.isfinite(mem_cap_bytes) and mem_cap_bytes > 0):
        raise PlacementError(
            f"the memory cap per worker must be a positive number of bytes, got {mem_cap_bytes}"
        )
    world = nnodes * nproc_per_node
    dp_sizes = tuple(world // pp + (1 if p < world % pp else 0) for p in range(pp))
    cost = np.array([u.seconds_per_sample for u in units], dtype=float)
    size = np.array([u.param_bytes for u in units], dtype=float)
    memory = StageMemory(
        size,
        np.array([u.activation_bytes_per_sample for u in units], dtype=float),
        dp_sizes,
        global_batch,
        micro_batches,
    )
    result = balanced_partition(
        cost, size, tuple(global_batch / d for d in dp_sizes), time_tolerance, memory, mem_cap_bytes
    )
    edges = (0, *result.boundaries, len(units))
    stage_ranks = _spread_ranks(dp_sizes, nnodes, nproc_per_node)
    rank_node = tuple(r // nproc_per_node for r in range(world))
    stages = tuple(StageLayout(p, edges[p], edges[p + 1], stage_ranks[p]) for p in range(pp))
    layout = Layout(
        num_layers=len(units),
        global_batch=global_batch,
        num_micro_batches=micro_batches,
        stages=stages,
        layer_numel=tuple(u.numel for u in units),
        zero_layout="interleaved",
        frequencies_mhz=(),
        rng_mode="placement_invariant",
        rank_nodes=tuple(enumerate(rank_node)),  # where shard backups go (planners.backup)
        backup_copies=backup_copies,
    )
    report = validate(layout)
    if not report.ok:  # a bug here, never the user's input: say so plainly
        raise PlacementError(f"internal error: the planned layout does not validate: {report.reason}")
    step_s = tuple(float(cost[edges[p] : edges[p + 1]].sum()) * global_batch / dp_sizes[p] for p in range(pp))
    stage_bytes = tuple(int(size[edges[p] : edges[p + 1]].sum()) for p in range(pp))
    backup = backup_cost(layout)
    stage_mem = _with_backups(layout, memory, edges, stage_bytes, backup, mem_cap_bytes)
    exposed = tuple(p for p, s in enumerate(stages) if len({rank_node[r] for r in s.ranks}) < 2)
    warnings = _warnings(layout, rank_node, exposed, nnodes)
    return Placement(
        layout,
        rank_node,
        step_s,
        stage_bytes,
        stage_mem,
        exposed,
        warnings,
        _reason(layout, units, rank_node, step_s, dp_sizes, nnodes, nproc_per_node) + "; " + backup.reason,
        backup,
    )


@dataclass(frozen=True)
class StageMemory:
    """The per-worker memory estimate of the module docstring, as Algorithm 1's segment tables."""

    param_bytes: np.ndarray  # per unit
    activation_bytes: np.ndarray  # per unit, per sample
    dp_sizes: tuple[int, ...]
    global_batch: int
    micro_batches: int

    def matrix(self, stage: int) -> np.ndarray:
        """(L+1, L+1): [k, l] = bytes of one worker of `stage` holding units k..l-1."""
        d = self.dp_sizes[stage]
        in_flight = min(len(self.dp_sizes) - stage, self.micro_batches)
        samples = self.global_batch / (self.micro_batches * d)
        per_unit = (
            3.0 * self.param_bytes + 7.0 * self.param_bytes / d + self.activation_bytes * samples * in_flight
        )
        return _segment_sums(per_unit)


def balanced_partition(
    cost: np.ndarray,
    size: np.ndarray,
    samples_per_rank: Sequence[float],
    time_tolerance: float = 0.01,
    memory: StageMemory | None = None,
    mem_cap_bytes: float | None = None,
) -> PartitionResult:
    """Contiguous partition of units into len(samples_per_rank) stages: minimax stage time
    (sum of per-sample cost x samples per rank) among the partitions whose every worker fits
    `mem_cap_bytes` (by `memory`), then, within `time_tolerance` of that optimum, minimax stage
    size. Stage p's boundaries are `result.boundaries` (Algorithm 1's convention)."""
    L, P = len(cost), len(samples_per_rank)
    seg_cost, seg_size = _segment_sums(cost), _segment_sums(size)
    times = [seg_cost * s for s in samples_per_rank]
    no_cap = [math.inf] * P
    if memory is not None and mem_cap_bytes is not None:
        mems = [memory.matrix(p) for p in range(P)]
        fitting = minimax_partition(L, P, times.__getitem__, mems.__getitem__, [mem_cap_bytes] * P)
        if not fitting.feasible:
            raise PlacementError(_over_cap(mems, mem_cap_bytes, L, P))
        if not all(m <= mem_cap_bytes for m in _stage_values(mems, fitting)):
            raise PlacementError(fitting.reason)
        # Within the cap, the time optimum is the answer: balancing bytes could break the cap.
        return fitting
    fastest = minimax_partition(L, P, times.__getitem__, lambda p: seg_size, no_cap)
    if not fastest.feasible:
        raise PlacementError(fastest.reason)
    # Second pass: bytes are the objective, time the constraint; the absolute slack keeps the
    # first pass's own optimum feasible despite float round-off in the prefix sums.
    cap = fastest.worst_stage_time * (1.0 + time_tolerance) + 1e-12 * max(1.0, fastest.worst_stage_time)
    balanced = minimax_partition(L, P, lambda p: seg_size, times.__getitem__, [cap] * P)
    return balanced if balanced.feasible else fastest


def _stage_values(mats: Sequence[np.ndarray], result: PartitionResult) -> list[float]:
    edges = (0, *result.boundaries, mats[0].shape[0] - 1)
    return [float(m[edges[p], edges[p + 1]]) for p, m in enumerate(mats)]


def _over_cap(mems: Sequence[np.ndarray], cap: float, L: int, P: int) -> str:
    """What to change when no partition fits: the least memory any split needs per worker."""
    best = minimax_partition(L, P, mems.__getitem__, mems.__getitem__, [math.inf] * P)
    need = best.worst_stage_time  # the minimax objective here is memory itself
    return (
        f"no split of the {L} units over {P} stage(s) fits {cap / 2**30:.3g} GiB per worker: the best split "
        f"needs {need / 2**30:.3g} GiB on its largest stage (weights, gradients and rollback copy; ZeRO-1 "
        "optimizer share, its copy and the neighbour's snapshot; activations in flight). Use more stages "
        "(--pp), more workers per stage, a smaller global batch or more micro-batches, or a larger cap"
    )


def _segment_sums(per_unit: np.ndarray) -> np.ndarray:
    """(L+1, L+1) matrix: [k, l] = sum of per_unit[k:l] (meaningless for k >= l; masked there)."""
    prefix = np.concatenate(([0.0], np.cumsum(per_unit)))
    return prefix[None, :] - prefix[:, None]


def _spread_ranks(dp_sizes: Sequence[int], nnodes: int, nproc: int) -> tuple[tuple[int, ...], ...]:
    """Stage p's ranks in DP order: a window of the node-interleaved rank order, kept in that order
    (DP neighbours on different nodes: see the module docstring)."""
    order = [node * nproc + local for local in range(nproc) for node in range(nnodes)]
    out, pos = [], 0
    for d in dp_sizes:
        out.append(tuple(order[pos : pos + d]))
        pos += d
    return tuple(out)


def _check_input(
    units: Sequence[UnitCost],
    global_batch: int,
    micro_batches: int,
    nnodes: int,
    nproc_per_node: int,
    pp: int,
    time_tolerance: float,
) -> None:
    if nnodes < 1 or nproc_per_node < 1:
        raise PlacementError(f"--nnodes and --nproc-per-node must be >= 1, got {nnodes} and {nproc_per_node}")
    if pp < 1:
        raise PlacementError(f"--pp must be >= 1, got {pp}")
    if not units:
        raise PlacementError("the model has no units: pass at least one unit to elaswave.train(units=...)")
    world = nnodes * nproc_per_node
    if pp > len(units):
        raise PlacementError(
            f"--pp {pp} needs at least {pp} units (one per stage), but the model has "
            f"{len(units)}: lower --pp or split the model into more units"
        )
    if pp > world:
        raise PlacementError(
            f"--pp {pp} needs at least {pp} workers (one per stage), but {nnodes} node(s) x "
            f"{nproc_per_node} = {world}: lower --pp or raise --nproc-per-node/--nnodes"
        )
    if global_batch < 1 or not 1 <= micro_batches <= global_batch:
        raise PlacementError(
            f"need global_batch >= 1 and 1 <= micro_batches <= global_batch, got "
            f"global_batch={global_batch}, micro_batches={micro_batches}"
        )
    if not (time_tolerance >= 0 and math.isfinite(time_tolerance)):
        raise PlacementError(f"time_tolerance must be a finite number >= 0, got {time_tolerance}")
    for i, u in enumerate(units):
        if u.numel < 0 or u.param_bytes < 0:
            raise PlacementError(
                f"unit {i} ({u.name!r}) has a negative size: numel={u.numel}, param_bytes={u.param_bytes}"
            )
        if not (math.isfinite(u.seconds_per_sample) and u.seconds_per_sample >= 0):
            raise PlacementError(
                f"unit {i} ({u.name!r}) has a bad measured time {u.seconds_per_sample!r} "
                "(need a finite number of seconds >= 0)"
            )


def _with_backups(
    layout: Layout,
    memory: StageMemory,
    edges: tuple[int, ...],
    stage_bytes: tuple[int, ...],
    backup: BackupCost,
    mem_cap_bytes: float | None,
) -> tuple[float, ...]:
    """Each stage's peak per-worker bytes with the backups each rank really keeps: the estimate
    counts a copy of the rank's own share (3 P / D); a rank backing up a neighbouring stage, or
    none, keeps what `planners.backup` says instead. Raises PlacementError over the cap."""
    out = []
    for p, stage in enumerate(layout.stages):
        base = float(memory.matrix(p)[edges[p], edges[p + 1]]) - 3.0 * stage_bytes[p] / stage.dp_size
        need = max(base + backup.per_rank_bytes.get(r, 0) for r in stage.ranks)
        if mem_cap_bytes is not None and need > mem_cap_bytes:
            raise PlacementError(
                f"stage {p}: a worker needs {need / 2**20:.1f} MiB with the shard backups it keeps "
                f"({backup.stage_max_bytes(layout, p) / 2**20:.1f} MiB), over the cap of "
                f"{mem_cap_bytes / 2**20:.1f} MiB: use more workers per stage or more nodes"
            )
        out.append(need)
    return tuple(out)


def _warnings(
    layout: Layout, rank_node: tuple[int, ...], exposed: tuple[int, ...], nnodes: int
) -> tuple[str, ...]:
    out: list[str] = []
    if exposed and nnodes == 1:
        out.append(
            f"all {len(rank_node)} workers run on one node: losing it empties every stage "
            f"({', '.join(map(str, exposed))}) and ends the job"
        )
    elif exposed:
        where = "; ".join(
            f"stage {p} (ranks {list(layout.stages[p].ranks)}, all on node "
            f"{rank_node[layout.stages[p].ranks[0]]})"
            for p in exposed
        )
        out.append(
            f"losing one node would empty {where}; their shards are backed up in a neighbouring stage, "
            "so the Core hands the emptied stage's units to its neighbours in place, at the cost of a "
            "shallower pipeline: give every stage >= 2 ranks (a smaller --pp or more workers) to avoid it"
        )
    per_slot = layout.global_batch // layout.num_micro_batches
    starved = [s.stage for s in layout.stages if s.dp_size > per_slot]
    if starved:
        out.append(
            f"stage(s) {starved} have more ranks than the {per_slot} samples of a micro-batch, so some "
            "ranks get no samples in a slot: raise global_batch or lower micro_batches"
        )
    return tuple(out)


def _reason(
    layout: Layout,
    units: Sequence[UnitCost],
    rank_node: tuple[int, ...],
    step_s: tuple[float, ...],
    dp_sizes: tuple[int, ...],
    nnodes: int,
    nproc: int,
) -> str:
    world = nnodes * nproc
    dp = (
        f"DP {dp_sizes[0]} per stage"
        if len(set(dp_sizes)) == 1
        else f"DP {list(dp_sizes)} ({world} workers do not split evenly over {len(dp_sizes)} stages: the "
        "first stages take one more rank)"
    )
    stages = "; ".join(
        f"stage {s.stage}: units {s.layer_start}..{s.layer_stop - 1} ({units[s.layer_start].name}.."
        f"{units[s.layer_stop - 1].name}) on ranks {list(s.ranks)} (nodes "
        f"{sorted({rank_node[r] for r in s.ranks})}), {step_s[s.stage] * 1e3:.3g} ms/step"
        for s in layout.stages
    )
    worst = max(range(len(step_s)), key=step_s.__getitem__)
    return (
        f"PP={layout.num_stages} x {dp} over {nnodes} node(s) x {nproc}; boundaries minimise the slowest "
        f"stage's measured fwd+bwd time (stage {worst}, {step_s[worst] * 1e3:.3g} ms/step), ties toward "
        f"balanced parameter bytes; {stages}"
    )
