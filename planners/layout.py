"""The Layout: the single description of how a job is laid out (docs/architecture.md ("The central idea")).

A Layout says which layers each pipeline stage holds, which ranks serve each stage (in DP order),
which global-batch samples every rank processes in every micro-batch slot (as an exact split
rule), how ZeRO shards are owned, the RNG mode and device frequencies. A Plan is `old layout -> new layout` plus reasons and
predictions. Validation lives in `planners.validation`, diffs in `planners.diff`, ZeRO ownership
in `planners.zero`; `planners` re-exports all of them.

Micro-batch slot convention: slot m of *every* stage covers the same global samples
`[m*B//M, (m+1)*B//M)` (B = global batch, M = micro-batches per step), split exactly among that
stage's ranks. Stages may have different DP sizes, so activations are routed between stages by
sample range, never by rank index.

Everything here is a frozen, hashable dataclass over ints, floats, strings and tuples, so a Layout
can be compared, hashed, cached and shipped as stable JSON (`Plan.layout_json` in the protobuf).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import lru_cache
from itertools import chain
from typing import Any, Literal

from planners.jsonfields import (
    as_float,
    as_int,
    as_list,
    field_value,
    int_field,
    int_pair,
    list_field,
    load_object,
)

ZeroLayoutKind = Literal["interleaved", "contiguous"]
RngMode = Literal["placement_invariant", "per_rank"]
ZERO_LAYOUTS: tuple[str, ...] = ("interleaved", "contiguous")
RNG_MODES: tuple[str, ...] = ("placement_invariant", "per_rank")
LAYOUT_JSON_VERSION = 1


@dataclass(frozen=True, order=True)
class SampleRange:
    """Half-open range `[start, stop)` of global-batch sample indices (0-based within a step)."""

    start: int
    stop: int

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    @property
    def size(self) -> int:
        return len(self)

    def intersect(self, other: SampleRange) -> SampleRange:
        """The overlap of two ranges; empty ranges are normalised to `[start, start)`."""
        lo, hi = max(self.start, other.start), min(self.stop, other.stop)
        return SampleRange(lo, max(lo, hi))

    def __contains__(self, sample: object) -> bool:
        return isinstance(sample, int) and self.start <= sample < self.stop


def slot_range(global_batch: int, num_micro_batches: int, slot: int) -> SampleRange:
    """Global samples of micro-batch slot `slot`: `[m*B//M, (m+1)*B//M)` (same for every stage)."""
    if not 0 <= slot < num_micro_batches:
        raise ValueError(f"slot {slot} out of range [0, {num_micro_batches})")
    return SampleRange(
        slot * global_batch // num_micro_batches, (slot + 1) * global_batch // num_micro_batches
    )


def split_evenly(samples: SampleRange, parts: int) -> tuple[SampleRange, ...]:
    """Split `samples` into `parts` consecutive ranges whose sizes differ by at most one.

    The first `len % parts` ranges get the extra sample. When `parts > len(samples)` the trailing
    ranges are empty: that is valid, the rank then contributes a zero gradient for that slot but
    still takes part in its stage's gradient reduction.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(len(samples), parts)
    out, pos = [], samples.start
    for j in range(parts):
        size = base + (1 if j < extra else 0)
        out.append(SampleRange(pos, pos + size))
        pos += size
    return tuple(out)


def split_weighted(samples: SampleRange, weights: tuple[float, ...]) -> tuple[SampleRange, ...]:
    """Split `samples` into consecutive ranges proportional to `weights` (largest remainder).

    Sizes sum exactly to `len(samples)`; ties go to the lower index so the split is deterministic.
    """
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {weights}")
    total, n = sum(weights), len(samples)
    exact = [n * w / total for w in weights]
    sizes = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda j: (-(exact[j] - sizes[j]), j))
    for j in order[: n - sum(sizes)]:
        sizes[j] += 1
    out, pos = [], samples.start
    for size in sizes:
        out.append(SampleRange(pos, pos + size))
        pos += size
    return tuple(out)


@dataclass(frozen=True)
class StageLayout:
    """One pipeline stage: layers `[layer_start, layer_stop)` (0-based transformer blocks), its
    ranks in DP order, and how each micro-batch slot is split among them.

    `sample_weights[j]` is rank `ranks[j]`'s integer share of *every* slot (empty = equal shares);
    the exact ranges come from `split_evenly` / `split_weighted` of the slot, so they always cover
    the slot exactly once. The split is stored as a rule, not as M x D ranges, so a layout of
    100,000 ranks stays small and a single failure re-plans without touching every rank.
    """

    stage: int
    layer_start: int
    layer_stop: int
    ranks: tuple[int, ...]
    sample_weights: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return self.layer_stop - self.layer_start

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_stop)

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    def dp_index(self, rank: int) -> int:
        """Position of `rank` in this stage's DP order (its ZeRO shard index when interleaved)."""
        try:
            return self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in stage {self.stage} (ranks {self.ranks})") from None

    def split_slot(self, samples: SampleRange) -> tuple[SampleRange, ...]:
        """Exact split of one slot's samples among this stage's ranks (same order as `ranks`)."""
        if self.sample_weights:
            return _split_weighted_cached(samples, self.sample_weights)
        return split_evenly(samples, len(self.ranks))

    def samples_in_slot(self, samples: SampleRange, rank: int) -> SampleRange:
        """The part of `samples` (one slot) that `rank` processes; O(1) for equal shares."""
        j = self.dp_index(rank)
        if self.sample_weights:
            return self.split_slot(samples)[j]
        base, extra = divmod(len(samples), len(self.ranks))
        start = samples.start + j * base + min(j, extra)
        return SampleRange(start, start + base + (1 if j < extra else 0))


@lru_cache(maxsize=256)
def _split_weighted_cached(samples: SampleRange, weights: tuple[int, ...]) -> tuple[SampleRange, ...]:
    return split_weighted(samples, tuple(float(w) for w in weights))


@dataclass(frozen=True)
class Layout:
    """How the whole job is laid out; see the module docstring for the conventions."""

    num_layers: int
    global_batch: int
    num_micro_batches: int
    stages: tuple[StageLayout, ...]
    layer_numel: tuple[int, ...]
    zero_layout: ZeroLayoutKind = "interleaved"
    frequencies_mhz: tuple[tuple[int, int], ...] = ()
    rng_mode: RngMode = "placement_invariant"
    stage_mem_cap_bytes: tuple[float, ...] | None = None
    # (rank, node) pairs: which node (host index) runs a rank. Empty: unknown, every rank is taken
    # to be on a node of its own. Decides where shard backups go (`planners.backup`).
    rank_nodes: tuple[tuple[int, int], ...] = ()
    # How many copies of every ZeRO shard are kept in other ranks' host memory (ElasWave §5.1
    # keeps one; more survive bursts that take a shard and its first holder together).
    backup_copies: int = 1

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def dp_sizes(self) -> tuple[int, ...]:
        return tuple(s.dp_size for s in self.stages)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """Right boundaries b_1..b_{P-1} in Algorithm 1's 1-based convention (= layer_stop)."""
        return tuple(s.layer_stop for s in self.stages[:-1])

    def stage_of_layer(self, layer: int) -> int:
        for s in self.stages:
            if s.layer_start <= layer < s.layer_stop:
                return s.stage
        raise ValueError(f"layer {layer} is held by no stage (num_layers={self.num_layers})")

    def ranks(self) -> tuple[int, ...]:
        """Every rank of the job, stage by stage, each stage in DP order."""
        return tuple(chain.from_iterable(s.ranks for s in self.stages))

    def stage_of_rank(self, rank: int) -> int:
        for s in self.stages:
            if rank in s.ranks:  # tuple membership runs in C, fine for 100,000 ranks
                return s.stage
        raise ValueError(f"rank {rank} is in no stage of this layout")

    def stage_layout_of_rank(self, rank: int) -> StageLayout:
        return self.stages[self.stage_of_rank(rank)]

    def samples_of(self, rank: int, slot: int) -> SampleRange:
        """Samples `rank` processes in micro-batch slot `slot`."""
        return self.stage_layout_of_rank(rank).samples_in_slot(self.slot_range(slot), rank)

    def micro_batch_ranges(self, stage: int) -> tuple[tuple[SampleRange, ...], ...]:
        """`[m][j]` = samples that rank `stages[stage].ranks[j]` processes in slot m."""
        s = self.stages[stage]
        return tuple(s.split_slot(self.slot_range(m)) for m in range(self.num_micro_batches))

    def slot_range(self, slot: int) -> SampleRange:
        return slot_range(self.global_batch, self.num_micro_batches, slot)

    def node_of(self, rank: int) -> int | None:
        """The node running `rank`, or None when the layout does not say."""
        return dict(self.rank_nodes).get(rank)

    def frequency_of(self, rank: int) -> int | None:
        """Locked frequency of `rank` in MHz, or None for the device default."""
        return dict(self.frequencies_mhz).get(rank)

    def replace(self, **changes: Any) -> Layout:
        return replace(self, **changes)

    def to_json(self) -> str:
        return layout_to_json(self)

    @staticmethod
    def from_json(data: str | bytes) -> Layout:
        return layout_from_json(data)


class PlanMode(StrEnum):
    """How executors reach a plan's new layout (docs/architecture.md ("Recovery")).

    IN_PLACE: from the committed in-memory state (live remap from ring snapshots, migration);
    `planners.applicability.judge` says when that is possible. RESTORE: every copy of some state
    is gone, so the workers of the new layout reload the job's latest durable checkpoint in
    place (no process restarts) and replay the steps after it."""

    IN_PLACE = "in_place"
    RESTORE = "restore"


@dataclass(frozen=True)
class Plan:
    """One planned change: `old -> new` at `epoch`, why, and what the planner predicts.

    The one plan record from the Core's engine to the executors: the registry stores
    `to_json()`, `ExecutorService` streams it (`Plan.plan_json` in the protobuf) and the executor
    decodes it with `from_json`. `old` is the layout the Core planned from (its last committed
    layout); an executor applies the plan from the layout it last committed."""

    epoch: int
    old: Layout | None
    new: Layout
    reasons: tuple[str, ...]
    predicted_step_time_s: float
    predicted_stage_mem_bytes: tuple[float, ...] = field(default=())
    job: str = ""
    policy: str = ""
    mode: PlanMode = PlanMode.IN_PLACE
    created_unix: float = 0.0
    # (rank, worker_id) of every rank that `new` adds to `old` (a spare taken in, growth issue):
    # a joining worker finds its rank here by its worker id; sorted by rank.
    joiners: tuple[tuple[int, str], ...] = field(default=())
    # Ranks of `old` that `new` drops while they are alive (a whole DP replica dropped, issue 25):
    # they hand their live state over in place and wait as spares until a later plan takes them
    # back (`joiners`). Any other rank `new` lacks is lost: its state is read from its backups.
    standby: tuple[int, ...] = field(default=())

    def rank_of_joiner(self, worker_id: str) -> int | None:
        """The rank this plan gives the joining worker `worker_id` (None: it does not join here)."""
        return next((rank for rank, w in self.joiners if w == worker_id), None)

    def to_json(self) -> str:
        return json.dumps(
            {
                "epoch": self.epoch,
                "old": None if self.old is None else layout_to_dict(self.old),
                "new": layout_to_dict(self.new),
                "reasons": list(self.reasons),
                "predicted_step_time_s": self.predicted_step_time_s,
                "predicted_stage_mem_bytes": list(self.predicted_stage_mem_bytes),
                "job": self.job,
                "policy": self.policy,
                "mode": self.mode.value,
                "created_unix": self.created_unix,
                "joiners": [[rank, worker] for rank, worker in self.joiners],
            }
            | ({"standby": list(self.standby)} if self.standby else {}),
            sort_keys=True,
            separators=(",", ":"),
        )

    @staticmethod
    def from_json(data: str | bytes) -> Plan:
        d = load_object(data, "plan")
        old = d.get("old")
        mode = d.get("mode", PlanMode.IN_PLACE.value)
        if mode not in {m.value for m in PlanMode}:
            raise ValueError(f"plan.mode must be one of {[m.value for m in PlanMode]}, got {mode!r}")
        return Plan(
            epoch=int_field(d, "epoch", "plan"),
            old=None if old is None else layout_from_dict(old),
            new=layout_from_dict(field_value(d, "new", "plan")),
            reasons=tuple(str(r) for r in list_field(d, "reasons", "plan")),
            predicted_step_time_s=as_float(
                field_value(d, "predicted_step_time_s", "plan"), "plan.predicted_step_time_s"
            ),
            predicted_stage_mem_bytes=tuple(
                as_float(x, "plan.predicted_stage_mem_bytes")
                for x in list_field(d, "predicted_stage_mem_bytes", "plan")
            ),
            job=str(d.get("job", "")),
            policy=str(d.get("policy", "")),
            mode=PlanMode(mode),
            created_unix=as_float(d.get("created_unix", 0.0), "plan.created_unix"),
            joiners=_joiners(d.get("joiners", [])),
            standby=_standby(d.get("standby", [])),
        )


def make_uniform_layout(
    num_layers: int,
    num_stages: int,
    dp: int,
    global_batch: int,
    num_micro_batches: int,
    layer_numel: tuple[int, ...] | None = None,
    zero_layout: ZeroLayoutKind = "interleaved",
    rng_mode: RngMode = "placement_invariant",
    stage_mem_cap_bytes: tuple[float, ...] | None = None,
) -> Layout:
    """The usual starting layout: layers split as evenly as possible (earlier stages get the extra
    layer), ranks numbered stage-major (stage p holds ranks p*dp .. p*dp+dp-1), samples split evenly."""
    if num_stages < 1 or dp < 1 or num_layers < num_stages:
        raise ValueError(
            f"need 1 <= num_stages <= num_layers and dp >= 1, got L={num_layers}, P={num_stages}, dp={dp}"
        )
    if not 1 <= num_micro_batches <= global_batch:
        raise ValueError(
            f"need 1 <= num_micro_batches <= global_batch, got M={num_micro_batches}, B={global_batch}"
        )
    blocks = split_evenly(SampleRange(0, num_layers), num_stages)
    stages = tuple(
        StageLayout(p, b.start, b.stop, tuple(range(p * dp, (p + 1) * dp))) for p, b in enumerate(blocks)
    )
    numel = layer_numel if layer_numel is not None else (1,) * num_layers
    return Layout(
        num_layers,
        global_batch,
        num_micro_batches,
        stages,
        tuple(numel),
        zero_layout,
        (),
        rng_mode,
        stage_mem_cap_bytes,
    )


# ---------------------------------------------------------------------------------------- JSON


def layout_to_dict(layout: Layout) -> dict[str, Any]:
    return (
        {
            "version": LAYOUT_JSON_VERSION,
            "num_layers": layout.num_layers,
            "global_batch": layout.global_batch,
            "num_micro_batches": layout.num_micro_batches,
            "stages": [
                {
                    "stage": s.stage,
                    "layer_start": s.layer_start,
                    "layer_stop": s.layer_stop,
                    "ranks": list(s.ranks),
                    "sample_weights": list(s.sample_weights),
                }
                for s in layout.stages
            ],
            "layer_numel": list(layout.layer_numel),
            "zero_layout": layout.zero_layout,
            "frequencies_mhz": list(map(list, layout.frequencies_mhz)),  # C-level: 25,000 pairs in ~1 ms
            "rng_mode": layout.rng_mode,
            "stage_mem_cap_bytes": None
            if layout.stage_mem_cap_bytes is None
            else list(layout.stage_mem_cap_bytes),
        }
        | ({"rank_nodes": list(map(list, layout.rank_nodes))} if layout.rank_nodes else {})
        | ({"backup_copies": layout.backup_copies} if layout.backup_copies != 1 else {})
    )


def layout_to_json(layout: Layout) -> str:
    """Stable JSON: sorted keys, no whitespace, so equal layouts give equal bytes."""
    return json.dumps(layout_to_dict(layout), sort_keys=True, separators=(",", ":"))


def layout_from_json(data: str | bytes) -> Layout:
    return layout_from_dict(load_object(data, "layout"))


def layout_from_dict(d: Any) -> Layout:
    """Parse the structure; raises ValueError naming the field. Semantics are `validate`'s job."""
    if not isinstance(d, dict):
        raise ValueError(f"layout must be a JSON object, got {type(d).__name__}")
    version = d.get("version", LAYOUT_JSON_VERSION)
    if version != LAYOUT_JSON_VERSION:
        raise ValueError(f"layout.version {version!r} is not supported (expected {LAYOUT_JSON_VERSION})")
    zero_layout = str(field_value(d, "zero_layout"))
    if zero_layout not in ZERO_LAYOUTS:
        raise ValueError(f"layout.zero_layout must be one of {ZERO_LAYOUTS}, got {zero_layout!r}")
    rng_mode = str(field_value(d, "rng_mode"))
    if rng_mode not in RNG_MODES:
        raise ValueError(f"layout.rng_mode must be one of {RNG_MODES}, got {rng_mode!r}")
    caps = d.get("stage_mem_cap_bytes")
    return Layout(
        num_layers=int_field(d, "num_layers"),
        global_batch=int_field(d, "global_batch"),
        num_micro_batches=int_field(d, "num_micro_batches"),
        stages=tuple(_stage_from_dict(s, i) for i, s in enumerate(list_field(d, "stages"))),
        layer_numel=tuple(as_int(x, "layer_numel") for x in list_field(d, "layer_numel")),
        zero_layout=zero_layout,  # type: ignore[arg-type]
        frequencies_mhz=tuple(int_pair(x, "frequencies_mhz") for x in list_field(d, "frequencies_mhz")),
        rng_mode=rng_mode,  # type: ignore[arg-type]
        stage_mem_cap_bytes=None
        if caps is None
        else tuple(
            as_float(c, "layout.stage_mem_cap_bytes") for c in as_list(caps, "layout.stage_mem_cap_bytes")
        ),
        rank_nodes=tuple(
            int_pair(x, "rank_nodes") for x in as_list(d.get("rank_nodes", []), "layout.rank_nodes")
        ),
        backup_copies=as_int(d.get("backup_copies", 1), "layout.backup_copies"),
    )


def _stage_from_dict(d: Any, index: int) -> StageLayout:
    where = f"stages[{index}]"
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be an object")
    return StageLayout(
        stage=int_field(d, "stage", where),
        layer_start=int_field(d, "layer_start", where),
        layer_stop=int_field(d, "layer_stop", where),
        ranks=tuple(as_int(r, f"{where}.ranks") for r in list_field(d, "ranks", where)),
        sample_weights=tuple(
            as_int(w, f"{where}.sample_weights")
            for w in as_list(d.get("sample_weights", []), f"{where}.sample_weights")
        ),
    )


def _standby(raw: Any) -> tuple[int, ...]:
    """`plan.standby` from JSON: distinct ranks >= 0, sorted."""
    if not isinstance(raw, list) or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in raw):
        raise ValueError(f"plan.standby must be a list of ranks >= 0, got {raw!r}")
    if len(set(raw)) != len(raw):
        raise ValueError(f"plan.standby names a rank twice: {raw!r}")
    return tuple(sorted(raw))


def _joiners(raw: Any) -> tuple[tuple[int, str], ...]:
    """`plan.joiners` from JSON: [[rank, worker_id], ...], ranks distinct and >= 0."""
    if not isinstance(raw, list):
        raise ValueError(f"plan.joiners must be a list of [rank, worker_id] pairs, got {type(raw).__name__}")
    out: list[tuple[int, str]] = []
    for item in raw:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or isinstance(item[0], bool)
            or not isinstance(item[0], int)
            or item[0] < 0
            or not isinstance(item[1], str)
            or not item[1]
        ):
            raise ValueError(f"plan.joiners entries must be [rank >= 0, worker_id], got {item!r}")
        out.append((item[0], item[1]))
    if len({r for r, _ in out}) != len(out) or len({w for _, w in out}) != len(out):
        raise ValueError(f"plan.joiners names a rank or a worker twice: {raw!r}")
    return tuple(sorted(out))
