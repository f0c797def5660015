"""Validate a Layout before it is applied (docs/architecture.md ("The central idea")): every problem, each with a clear message.

Checked always (cost O(ranks + stages x slots + layers), fine at 100,000 ranks):
  * every layer held by exactly one stage, stages contiguous and in order, each non-empty;
  * no rank in two stages (or twice in one), every stage has a rank;
  * the micro-batch split rule of every stage is well formed (so every sample of the global batch
    is processed exactly once per stage per step), 1 <= M <= B;
  * per-layer element counts, frequencies and memory caps well formed;
  * per-stage memory within its cap when a memory model and caps are given. The model prices
    the job as ElasWave §5.1 runs it, one backup copy per shard; with `backup_copies` = k > 1
    the copies 2..k that the stage's most loaded rank keeps are added
    (`planners.backup.extra_copy_bytes`), so every copy is counted.
With `exhaustive=True` it also enumerates every rank's sample range in every slot and every ZeRO
owned interval and checks exact coverage explicitly (the executor does this at small scale; the
planner's hot path relies on the split rules being exact by construction, which tests prove).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from planners.backup import extra_copy_bytes
from planners.layout import Layout, SampleRange, StageLayout
from planners.zero import ownership_problems


class MemoryModel(Protocol):
    """Predicts the peak memory of a stage (parameters, optimizer state, activations) in bytes."""

    def stage_memory_bytes(self, layout: Layout, stage: int) -> float: ...


@dataclass(frozen=True)
class ValidationReport:
    ok: bool
    problems: tuple[str, ...]

    @property
    def reason(self) -> str:
        return "layout is valid" if self.ok else "; ".join(self.problems)


class InvalidLayout(ValueError):
    """A layout failed validation; the message lists every problem."""

    def __init__(self, problems: tuple[str, ...]) -> None:
        self.problems = problems
        super().__init__("invalid layout: " + "; ".join(problems))


def validate(
    layout: Layout, memory_model: MemoryModel | None = None, *, exhaustive: bool = False
) -> ValidationReport:
    problems = [*_global_problems(layout), *_layer_problems(layout), *_rank_problems(layout)]
    problems += _split_problems(layout)
    problems += _frequency_problems(layout)
    structural_ok = not problems
    if structural_ok and exhaustive:
        problems += _coverage_problems(layout)
        problems += ownership_problems(layout)
    if structural_ok and memory_model is not None and layout.stage_mem_cap_bytes is not None:
        problems += _memory_problems(layout, memory_model)
    return ValidationReport(not problems, tuple(problems))


def ensure_valid(
    layout: Layout, memory_model: MemoryModel | None = None, *, exhaustive: bool = False
) -> Layout:
    """Return `layout` unchanged if valid, else raise InvalidLayout listing every problem."""
    report = validate(layout, memory_model, exhaustive=exhaustive)
    if not report.ok:
        raise InvalidLayout(report.problems)
    return layout


def _global_problems(layout: Layout) -> list[str]:
    out = []
    if layout.num_layers < 1:
        out.append(f"num_layers must be >= 1, got {layout.num_layers}")
    if layout.global_batch < 1:
        out.append(f"global_batch must be >= 1, got {layout.global_batch}")
    if not 1 <= layout.num_micro_batches <= max(layout.global_batch, 1):
        out.append(
            f"num_micro_batches must be in [1, global_batch={layout.global_batch}], "
            f"got {layout.num_micro_batches}"
        )
    if len(layout.layer_numel) != layout.num_layers:
        out.append(f"layer_numel has {len(layout.layer_numel)} entries for {layout.num_layers} layers")
    bad = [i for i, n in enumerate(layout.layer_numel) if n < 0]
    if bad:
        out.append(f"layer_numel is negative for layers {bad[:8]}")
    caps = layout.stage_mem_cap_bytes
    if caps is not None and len(caps) != layout.num_stages:
        out.append(f"stage_mem_cap_bytes has {len(caps)} entries for {layout.num_stages} stages")
    if caps is not None and any(c <= 0 for c in caps):
        out.append(f"stage_mem_cap_bytes must be positive, got {list(caps)}")
    if layout.backup_copies < 1:
        out.append(f"backup_copies must be >= 1, got {layout.backup_copies}")
    return out


def _layer_problems(layout: Layout) -> list[str]:
    if not layout.stages:
        return ["layout has no stages"]
    out, expected_start = [], 0
    for p, s in enumerate(layout.stages):
        if s.stage != p:
            out.append(f"stage at position {p} is numbered {s.stage}")
        if s.layer_start != expected_start:
            kind = "gap: layers" if s.layer_start > expected_start else "overlap: layers"
            lo, hi = sorted((expected_start, s.layer_start))
            out.append(
                f"stage {p} starts at layer {s.layer_start}, expected {expected_start} "
                f"({kind} [{lo}, {hi}) {'held by no stage' if 'gap' in kind else 'held twice'})"
            )
        if s.layer_stop <= s.layer_start:
            out.append(f"stage {p} holds no layers ([{s.layer_start}, {s.layer_stop}))")
        expected_start = max(expected_start, s.layer_stop)
    if layout.stages[-1].layer_stop != layout.num_layers:
        out.append(
            f"last stage ends at layer {layout.stages[-1].layer_stop}, "
            f"expected num_layers={layout.num_layers}"
        )
    return out


def _rank_problems(layout: Layout) -> list[str]:
    # Fast path in C (set union, min) for the usual valid case; the loop below names the culprits.
    total = sum(len(s.ranks) for s in layout.stages)
    if (
        all(s.ranks and min(s.ranks) >= 0 for s in layout.stages)
        and len(set().union(*(s.ranks for s in layout.stages))) == total
    ):
        return []
    out: list[str] = []
    seen: dict[int, int] = {}
    for s in layout.stages:
        if not s.ranks:
            out.append(f"stage {s.stage} has no ranks")
        for r in s.ranks:
            if r < 0:
                out.append(f"stage {s.stage} has negative rank {r}")
            if r in seen:
                where = "twice in stage" if seen[r] == s.stage else f"in stages {seen[r]} and"
                out.append(f"rank {r} is {where} {s.stage}")
            seen[r] = s.stage
    return out


def _split_problems(layout: Layout) -> list[str]:
    out = []
    for s in layout.stages:
        w = s.sample_weights
        if not w:
            continue
        if len(w) != len(s.ranks):
            out.append(f"stage {s.stage} has {len(w)} sample_weights for {len(s.ranks)} ranks")
        elif any(x < 0 for x in w) or sum(w) <= 0:
            out.append(f"stage {s.stage} sample_weights must be >= 0 with a positive sum")
    return out


def _frequency_problems(layout: Layout) -> list[str]:
    if not layout.frequencies_mhz:
        return []
    ranks = set(layout.ranks())
    freq_ranks, clocks = zip(*layout.frequencies_mhz, strict=True)  # unzipped in C
    if min(clocks) > 0 and len(set(freq_ranks)) == len(freq_ranks) and ranks.issuperset(freq_ranks):
        return []  # the usual valid case without a Python step per entry
    out: list[str] = []
    seen: set[int] = set()
    for rank, mhz in layout.frequencies_mhz:
        if rank not in ranks:
            out.append(f"frequency set for rank {rank}, which is in no stage")
        if rank in seen:
            out.append(f"frequency set twice for rank {rank}")
        if mhz <= 0:
            out.append(f"frequency of rank {rank} must be positive, got {mhz} MHz")
        seen.add(rank)
    return out


def _coverage_problems(layout: Layout) -> list[str]:
    out = []
    for s in layout.stages:
        for m, ranges in enumerate(layout.micro_batch_ranges(s.stage)):
            out += _slot_cover_problems(s, m, layout.slot_range(m), ranges)
    return out


def _slot_cover_problems(
    stage: StageLayout, m: int, slot: SampleRange, ranges: tuple[SampleRange, ...]
) -> list[str]:
    if len(ranges) != len(stage.ranks):
        return [f"stage {stage.stage} slot {m}: {len(ranges)} ranges for {len(stage.ranks)} ranks"]
    pos = slot.start
    for r, rng in zip(stage.ranks, ranges, strict=True):
        if rng.start != pos or rng.stop < rng.start:
            return [
                f"stage {stage.stage} slot {m}: rank {r} gets [{rng.start}, {rng.stop}), expected to "
                f"start at {pos}; samples would be skipped or processed twice"
            ]
        pos = rng.stop
    if pos != slot.stop:
        return [f"stage {stage.stage} slot {m}: ranges end at {pos}, slot ends at {slot.stop}"]
    return []


def _memory_problems(layout: Layout, memory_model: MemoryModel) -> list[str]:
    out = []
    extra = extra_copy_bytes(layout) if layout.backup_copies > 1 else {}
    for s, cap in zip(layout.stages, layout.stage_mem_cap_bytes or (), strict=True):
        held = max((extra.get(r, 0) for r in s.ranks), default=0)
        need = memory_model.stage_memory_bytes(layout, s.stage) + held
        if need > cap:
            why = f" ({held:.4g} of them extra shard backup copies)" if held else ""
            out.append(f"stage {s.stage} needs {need:.4g} bytes{why}, over its cap of {cap:.4g} bytes")
    return out
