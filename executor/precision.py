"""Mixed precision for the engine: autocast compute over fp32 master weights (docs/accelerators.md).

The recipe Megatron-LM and torchtitan use, mapped onto ElasWave's ZeRO-1 stage:

- every unit's parameters stay fp32 (the master weights): `torch.autocast` runs the forward (and
  the user's per-sample loss) in bf16 or fp16, autograd hands back fp32 parameter gradients;
- the activations crossing a stage boundary have the dtype autocast gave them (bf16 halves the
  pipeline's bytes); the dry run runs under the same autocast, so the boundary specs agree;
- the ZeRO-1 reduce-scatter sends each owner its slices in `reduce_dtype` (fp32 by default: no
  rounding before the sum; bf16/fp16 halve the bytes) and the owner adds the D contributions in
  fp32, in DP-rank order, so the sum itself never rounds to 16 bits;
- the Adam moments (the ZeRO-1 shards, their snapshots and the checkpoints) are fp32, as are the
  checkpointed weights, so a checkpoint is independent of the precision that wrote it.

fp16 adds dynamic loss scaling (`LossScaler`, torch.amp.GradScaler's rule): the loss is multiplied
by the scale before backward, every owner checks its reduced slices for inf/NaN, and the verdict
is agreed over the job's world group (every rank gathers every flag and ORs them in rank order),
so an overflow skips the optimizer update on every rank alike; the scale then backs off. The
scaler is replicated: it is part of the committed step (rollback), of a joiner's state and of the
checkpoint, so a replayed step and a resumed job make the same skip decisions.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionConfig:
    """How a job computes: `precision` of the forward/backward math, `reduce_dtype` of the
    gradient slices on the wire (default fp32), and fp16's loss-scaler settings."""

    precision: Precision = "fp32"
    reduce_dtype: Precision = "fp32"
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        problems = []
        if self.precision not in PRECISIONS:
            problems.append(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.reduce_dtype not in PRECISIONS:
            problems.append(f"reduce_dtype must be one of {PRECISIONS}, got {self.reduce_dtype!r}")
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            problems.append(f"init_scale must be a positive number, got {self.init_scale}")
        if not self.growth_factor > 1.0 or not 0.0 < self.backoff_factor < 1.0:
            problems.append(
                f"need growth_factor > 1 and 0 < backoff_factor < 1, got {self.growth_factor}, "
                f"{self.backoff_factor}"
            )
        if self.growth_interval < 1:
            problems.append(f"growth_interval must be >= 1, got {self.growth_interval}")
        if problems:
            raise ValueError("invalid precision settings: " + "; ".join(problems))

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def wire_dtype(self) -> torch.dtype:
        return DTYPES[self.reduce_dtype]

    @property
    def scales_loss(self) -> bool:
        """fp16 needs a loss scaler; bf16 has fp32's exponent range and does not."""
        return self.precision == "fp16"

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """The forward's context on `device`: autocast to the compute dtype, or nothing for fp32
        (the fp32 path runs exactly the code it ran before mixed precision existed)."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)


@dataclass
class LossScaler:
    """Dynamic loss scale (torch.amp.GradScaler's update rule), identical on every rank."""

    scale: float = 2.0**16
    growth_tracker: int = 0  # consecutive finite steps since the last change
    skipped: int = 0  # optimizer updates skipped for overflow so far in this job

    @staticmethod
    def initial(cfg: PrecisionConfig) -> LossScaler:
        return LossScaler(cfg.init_scale)

    def update(self, overflow: bool, cfg: PrecisionConfig) -> None:
        """After a step: back off on overflow, grow after `growth_interval` finite steps."""
        if overflow:
            self.scale *= cfg.backoff_factor
            self.growth_tracker = 0
            self.skipped += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == cfg.growth_interval:
            self.scale *= cfg.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        scale = float(state["scale"])
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss scale must be a positive number, got {scale}")
        self.scale = scale
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped = int(state.get("skipped", 0))

    def as_tensor(self) -> torch.Tensor:
        """(scale, growth_tracker, skipped) as float64, for one all-gather (a joiner's copy)."""
        return torch.tensor([self.scale, self.growth_tracker, self.skipped], dtype=torch.float64)

    @staticmethod
    def from_tensor(t: torch.Tensor) -> LossScaler:
        scale, tracker, skipped = (float(v) for v in t.tolist())
        return LossScaler(scale, int(tracker), int(skipped))


def has_overflow(grads: Iterable[torch.Tensor]) -> bool:
    """Whether any element of `grads` is inf or NaN (computed where the tensors live)."""
    flags = [torch.logical_not(torch.isfinite(g)).any() for g in grads if g.numel()]
    return bool(torch.stack(flags).any()) if flags else False


def unscale_(grads: Iterable[torch.Tensor], scale: float) -> None:
    """Divide the reduced gradient slices by the loss scale in place (torch.amp multiplies by
    the fp32 reciprocal; the scale is a power of two by default, so both are exact)."""
    inv = float(torch.tensor(scale, dtype=torch.float64).reciprocal().float())
    for g in grads:
        g.mul_(inv)
