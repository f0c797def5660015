"""Plain data the recovery policies work on: the job, its per-layer profile, the cluster state,
the MTTR assumptions, and the candidate plans the policies produce.

Ranks are pipeline-stage workers (a TP group of `tp` devices). Rank ids are replica-major:
rank `d * pp + s` is stage s of DP replica d, so a replica's ranks are contiguous, as in
Megatron's default order with TP innermost (ElasWave §7.2: losing an integer multiple of a
replica's devices removes whole replicas).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class JobShape:
    """(TP, PP, DP), micro-batch size per rank and the global batch (ElasWave Table 2)."""

    pp: int
    dp: int
    micro_batch: int
    global_batch: int
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "micro_batch", "global_batch", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"JobShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(
                f"JobShape.global_batch {self.global_batch} is not a multiple of "
                f"dp x micro_batch = {self.dp * self.micro_batch}"
            )

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def num_ranks(self) -> int:
        return self.pp * self.dp

    @property
    def num_devices(self) -> int:
        return self.num_ranks * self.tp

    def rank(self, replica: int, stage: int) -> int:
        return replica * self.pp + stage

    def position(self, rank: int) -> tuple[int, int]:
        """(replica, stage) of a rank id."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} out of range [0, {self.num_ranks})")
        return divmod(rank, self.pp)


@dataclass(frozen=True)
class JobProfile:
    """Per-layer costs: seconds per sample at the nominal frequency, bytes per device (after TP)."""

    layer_fwd_s: tuple[float, ...]
    layer_bwd_s: tuple[float, ...]
    layer_param_bytes: tuple[float, ...]
    layer_act_bytes: tuple[float, ...]
    mem_cap_bytes: float
    p2p_s_per_sample: float = 0.0
    allreduce_bytes_per_s: float = 25e9
    migrate_bytes_per_s: float = 25e9
    optimizer_bytes_per_param_byte: float = 6.0  # fp32 master + Adam m, v (12 B) per bf16 param (2 B)
    freq_nominal_mhz: int = 1400
    freq_max_mhz: int = 1650
    freq_step_mhz: int = 10

    def __post_init__(self) -> None:
        n = len(self.layer_fwd_s)
        if n < 1:
            raise ValueError("JobProfile.layer_fwd_s must list at least one layer")
        for name in ("layer_bwd_s", "layer_param_bytes", "layer_act_bytes"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"JobProfile.{name} has {len(getattr(self, name))} entries, expected {n}")
        for name in ("layer_fwd_s", "layer_bwd_s", "layer_param_bytes", "layer_act_bytes"):
            if min(getattr(self, name)) < 0:
                raise ValueError(f"JobProfile.{name} must be non-negative")
        if self.mem_cap_bytes <= 0:
            raise ValueError(f"JobProfile.mem_cap_bytes must be > 0, got {self.mem_cap_bytes}")
        if not 0 < self.freq_nominal_mhz <= self.freq_max_mhz:
            raise ValueError(
                f"JobProfile needs 0 < freq_nominal_mhz <= freq_max_mhz, got "
                f"{self.freq_nominal_mhz}, {self.freq_max_mhz}"
            )
        if self.allreduce_bytes_per_s <= 0 or self.migrate_bytes_per_s <= 0:
            raise ValueError("JobProfile bandwidths must be > 0")

    @property
    def num_layers(self) -> int:
        return len(self.layer_fwd_s)


@dataclass(frozen=True)
class MttrModel:
    """Seconds of no progress after a change, per policy (documented in the README, "Recovery-time assumptions").

    ElasWave: detection to next step in about a second (docs/architecture.md ("Promises and rules"): 0.15-0.37 s
    communicator edit) plus layer migration at `migrate_bytes_per_s`. TorchFT: ~20 s full restart
    (ElasWave §7.6). ReCycle: reroutes without moving parameters. Chameleon's dynamic
    parallelism: restart plus matched weight transfer (8.2-11.2 s measured, chameleon §V-C).
    Oobleck: re-instantiation from templates, restart plus unmatched transfer.
    """

    elaswave_base_s: float = 1.0
    recycle_s: float = 1.0
    torchft_restart_s: float = 20.0
    reparallel_restart_s: float = 6.0
    oobleck_restart_s: float = 20.0


@dataclass(frozen=True)
class ClusterState:
    """What a policy decides from: the job, which ranks are gone or slow, and how long until the
    next event is expected (eq. 8's effective-time horizon)."""

    shape: JobShape
    profile: JobProfile
    failed: frozenset[int] = frozenset()
    slowdown: tuple[tuple[int, float], ...] = ()
    boundaries: tuple[int, ...] = ()
    expected_time_to_next_event_s: float = 3600.0
    mttr: MttrModel = field(default_factory=MttrModel)
    # (rank, layer_start, layer_stop) each rank holds under the plan in force, for planners that
    # plan from their previous plan (the transfer into a new plan is priced from it); empty: every
    # rank holds its configured stage's layers.
    held_layers: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.profile.num_layers < self.shape.pp:
            raise ValueError(f"{self.profile.num_layers} layers cannot fill {self.shape.pp} stages")
        bad = [r for r in self.failed if not 0 <= r < self.shape.num_ranks]
        if bad:
            raise ValueError(f"failed ranks {sorted(bad)} out of range [0, {self.shape.num_ranks})")
        for rank, factor in self.slowdown:
            if not 0 <= rank < self.shape.num_ranks or factor <= 0:
                raise ValueError(f"slowdown entry ({rank}, {factor}) needs a valid rank and factor > 0")
        b = self.boundaries
        if b and (
            len(b) != self.shape.pp - 1
            or list(b) != sorted(set(b))
            or b[0] < 1
            or b[-1] >= self.profile.num_layers
        ):
            raise ValueError(
                f"boundaries {self.boundaries} must be {self.shape.pp - 1} increasing values in "
                f"[1, {self.profile.num_layers - 1}]"
            )
        if self.expected_time_to_next_event_s <= 0:
            raise ValueError("expected_time_to_next_event_s must be > 0")
        for rank, start, stop in self.held_layers:
            if not 0 <= rank < self.shape.num_ranks or not 0 <= start <= stop <= self.profile.num_layers:
                raise ValueError(
                    f"held_layers entry ({rank}, {start}, {stop}) needs a valid rank and layer span"
                )

    @cached_property
    def alive(self) -> tuple[int, ...]:
        """Live rank ids in increasing order (built once per state, in C: 100,000 ranks cost ~1 ms)."""
        alive = np.delete(np.arange(self.shape.num_ranks, dtype=np.int64), sorted(self.failed))
        return tuple(alive.tolist())

    @property
    def num_alive(self) -> int:
        return self.shape.num_ranks - len(self.failed)

    @cached_property
    def slowdown_map(self) -> dict[int, float]:
        return dict(self.slowdown)

    def slowdown_of(self, rank: int) -> float:
        return self.slowdown_map.get(rank, 1.0)

    def stage_ranks(self, stage: int) -> list[int]:
        """Live ranks of configured stage `stage` in replica order (`stage, pp + stage, ...`),
        built with a C-level range and only the failed ranks of that stage removed."""
        pp = self.shape.pp
        ranks = list(range(stage, self.shape.num_ranks, pp))
        for r in sorted((r for r in self.failed if r % pp == stage), reverse=True):
            del ranks[r // pp]
        return ranks

    def worst_share(self, ranks: Sequence[int], samples: Sequence[int]) -> float:
        """max_j samples[j] x slowdown(ranks[j]): the slowest rank's work per slot. O(1) Python steps
        per slowed rank, not per rank (`samples` is scanned in C)."""
        worst = float(max(samples, default=0))
        if not self.slowdown:
            return worst
        slowed = [(r, f) for r, f in self.slowdown if r in ranks]  # tuple/list membership runs in C
        if not slowed:
            return worst
        if any(f < 1 for _, f in slowed):  # a sped-up rank may hold the largest share: scan exactly
            return max((n * self.slowdown_of(r) for r, n in zip(ranks, samples, strict=True)), default=0.0)
        position = {r: j for j, r in enumerate(ranks)} if len(slowed) > 8 else None
        for r, f in slowed:
            j = position[r] if position is not None else ranks.index(r)
            worst = max(worst, samples[j] * f)
        return worst


@dataclass(frozen=True)
class StagePlan:
    """One stage of one pipeline: layers [layer_start, layer_stop), its ranks and their samples
    per micro-batch slot, its frequency, per-slot forward/backward time of its slowest rank, the
    exposed activation transfer per slot, and peak memory per device (eq. 14)."""

    layer_start: int
    layer_stop: int
    ranks: tuple[int, ...]
    samples_per_slot: tuple[int, ...]
    freq_mhz: int
    fwd_s: float
    bwd_s: float
    p2p_s: float
    mem_bytes: float

    @property
    def ministep_s(self) -> float:
        """ElasWave eq. (1) with no compute/communication overlap (sigma = 0)."""
        return self.fwd_s + self.bwd_s + 2 * self.p2p_s

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_stop)


@dataclass(frozen=True)
class PipelinePlan:
    stages: tuple[StagePlan, ...]
    num_slots: int

    @property
    def boundaries(self) -> tuple[int, ...]:
        return tuple(s.layer_stop for s in self.stages[:-1])


@dataclass(frozen=True)
class Candidate:
    """A policy's proposed post-event plan with its predicted cost; infeasible ones say why."""

    policy: str
    feasible: bool
    reason: str
    pipelines: tuple[PipelinePlan, ...] = ()
    step_time_s: float = float("inf")
    samples_per_step: int = 0
    transition_s: float = 0.0
    bytes_moved: float = 0.0
    devices_used: int = 0

    @property
    def throughput(self) -> float:
        """Samples per second in the steady state after the change (eq. 7)."""
        if not self.feasible or self.step_time_s <= 0 or self.step_time_s == float("inf"):
            return 0.0
        return self.samples_per_step / self.step_time_s


def infeasible(policy: str, reason: str) -> Candidate:
    return Candidate(policy, False, reason)
