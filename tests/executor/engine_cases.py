"""Shared small configurations for the training-engine tests (tiny widths, float32, CPU/gloo)."""

from __future__ import annotations

from typing import Any

import torch

from executor.model import ModelConfig, block_numel
from executor.trainer import TrainConfig
from planners.layout import Layout, StageLayout

NUM_LAYERS = 4


def train_config(dropout: float = 0.0) -> TrainConfig:
    return TrainConfig(model=ModelConfig(vocab_size=64, seq_len=16, hidden=32, num_heads=4,
                                         num_layers=NUM_LAYERS, dropout=dropout))


def layout(bounds: list[tuple[int, int]], ranks: list[tuple[int, ...]], global_batch: int = 8,
           num_micro_batches: int = 4, zero_layout: str = "interleaved", rng_mode: str = "placement_invariant",
           weights: list[tuple[int, ...]] | None = None) -> Layout:
    """A layout over this test model: stage p holds blocks bounds[p] and ranks ranks[p]."""
    numel = block_numel(train_config().model)
    stages = tuple(StageLayout(p, lo, hi, tuple(r), tuple(weights[p]) if weights else ())
                   for p, ((lo, hi), r) in enumerate(zip(bounds, ranks, strict=True)))
    return Layout(NUM_LAYERS, global_batch, num_micro_batches, stages, (numel,) * NUM_LAYERS,
                  zero_layout, (), rng_mode)  # type: ignore[arg-type]


def max_state_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Largest absolute difference per (unit, tensor) between two full states."""
    assert set(a["units"]) == set(b["units"]), (sorted(a["units"]), sorted(b["units"]))
    return {f"{n}.{k}": float((a["units"][n][k] - b["units"][n][k]).abs().max())
            for n in a["units"] for k in ("param", "exp_avg", "exp_avg_sq")}


def states_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step_count"] == b["step_count"] and set(a["units"]) == set(b["units"]) and all(
        torch.equal(a["units"][n][k], b["units"][n][k]) for n in a["units"] for k in ("param", "exp_avg", "exp_avg_sq"))
