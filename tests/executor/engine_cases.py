"""Shared small configurations for the training-engine tests (tiny widths, float32, CPU/gloo).

The model under test is the GPT example (examples/gpt): 4 blocks, so 6 units — unit 0 is
`embed`, units 1..4 are `block_0..block_3`, unit 5 is `head` — and every layout over it has 6
layers. `gpt_spec` is the TrainSpec equivalent of the engine's former built-in defaults (AdamW
lr 3e-3, weight decay 0.01, a 2^14-token Markov corpus of seed 0, vocabulary 64, 16 tokens per
sample).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

from examples.gpt.data import MarkovWindows
from examples.gpt.model import ModelConfig, block_numel, gpt_units, per_sample_loss
from executor.optim import OptimizerConfig
from executor.trainer import TrainSpec
from executor.units import UnitModel
from planners.layout import Layout, RngMode, StageLayout, ZeroLayoutKind

NUM_BLOCKS = 4
NUM_UNITS = NUM_BLOCKS + 2  # embed, block_0..block_3, head
EMBED, HEAD = 0, NUM_UNITS - 1


def block_unit(k: int) -> int:
    """The unit index (layout layer) of block k."""
    return 1 + k


def model_config(dropout: float = 0.0, **kw: Any) -> ModelConfig:
    sizes = {"vocab_size": 64, "seq_len": 16, "hidden": 32, "num_heads": 4, "num_layers": NUM_BLOCKS, **kw}
    return ModelConfig(dropout=dropout, **sizes)


@lru_cache(maxsize=8)
def markov_dataset(vocab_size: int = 64, seq_len: int = 16) -> MarkovWindows:
    return MarkovWindows(vocab_size, seq_len, num_tokens=1 << 14, seed=0)


def gpt_spec(dropout: float = 0.0, optimizer: OptimizerConfig | None = None, **model_kw: Any) -> TrainSpec:
    """The GPT example as a TrainSpec (a fresh spec each call; the dataset is shared, read-only)."""
    cfg = model_config(dropout, **model_kw)
    opt = optimizer if optimizer is not None else OptimizerConfig("adamw", lr=3e-3, weight_decay=0.01)
    spec = TrainSpec(gpt_units(cfg), per_sample_loss, markov_dataset(cfg.vocab_size, cfg.seq_len), opt)
    spec.probes = _probes(
        cfg.vocab_size, cfg.seq_len, cfg.hidden, cfg.num_heads, cfg.num_layers, cfg.mlp_ratio
    )
    return spec


def with_first_unit_frozen(spec: TrainSpec) -> TrainSpec:
    """`spec` with its first unit (the embedding) frozen, as a fine-tune freezes it; its dry run
    is left to run again (the probes record which parameters are frozen)."""
    units = spec.model
    first = units.names[0]

    def build(name: str) -> torch.nn.Module:
        unit = units._build(name)
        return unit.requires_grad_(False) if name == first else unit

    model = UnitModel(units.names, build, init_seed=units.init_seed)
    return dataclasses.replace(spec, model=model, probes=None)


def with_weights_frozen(spec: TrainSpec) -> TrainSpec:
    """`spec` as a BitFit fine-tune: every matrix frozen, the biases and norms trainable, so
    every block trains in part (trainable runs between frozen ones) and the embedding is
    wholly frozen."""
    units = spec.model

    def build(name: str) -> torch.nn.Module:
        unit = units._build(name)
        for p in unit.parameters():
            p.requires_grad_(p.dim() < 2)
        return unit

    model = UnitModel(units.names, build, init_seed=units.init_seed)
    return dataclasses.replace(spec, model=model, probes=None)


@lru_cache(maxsize=8)
def _probes(
    vocab_size: int, seq_len: int, hidden: int, num_heads: int, num_layers: int, mlp_ratio: int
) -> Any:
    # The dry run's findings do not depend on dropout or the init seed: run it once per shape.
    cfg = ModelConfig(vocab_size, seq_len, hidden, num_heads, num_layers, mlp_ratio)
    return TrainSpec(gpt_units(cfg), per_sample_loss, markov_dataset(vocab_size, seq_len)).unit_probes()


def unit_numels() -> tuple[int, ...]:
    return gpt_spec().unit_numels()


def layout(
    bounds: Sequence[tuple[int, int]],
    ranks: Sequence[tuple[int, ...]],
    global_batch: int = 8,
    num_micro_batches: int = 4,
    zero_layout: ZeroLayoutKind = "interleaved",
    rng_mode: RngMode = "placement_invariant",
    weights: Sequence[tuple[int, ...]] | None = None,
) -> Layout:
    """A layout over the test model: stage p holds units bounds[p] (0 = embed, 1..4 = blocks,
    5 = head) and ranks ranks[p]."""
    stages = tuple(
        StageLayout(p, lo, hi, tuple(r), tuple(weights[p]) if weights else ())
        for p, ((lo, hi), r) in enumerate(zip(bounds, ranks, strict=True))
    )
    return Layout(
        NUM_UNITS, global_batch, num_micro_batches, stages, unit_numels(), zero_layout, (), rng_mode
    )


def gpt_block_numel() -> int:
    """Parameters of one block of the test model (every block has as many)."""
    return block_numel(model_config())


def max_state_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Largest absolute difference per (unit, tensor) between two full states."""
    assert set(a["units"]) == set(b["units"]), (sorted(a["units"]), sorted(b["units"]))
    return {
        f"{n}.{k}": float((a["units"][n][k] - b["units"][n][k]).abs().max())
        for n in a["units"]
        for k in ("param", "exp_avg", "exp_avg_sq")
    }


def states_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["step_count"] == b["step_count"]
        and set(a["units"]) == set(b["units"])
        and all(
            torch.equal(a["units"][n][k], b["units"][n][k])
            for n in a["units"]
            for k in ("param", "exp_avg", "exp_avg_sq")
        )
    )
