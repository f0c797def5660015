"""Activation recomputation: a unit's forward is run again in its backward instead of keeping
its intermediate activations (`Units(..., recompute=True | [names])`).

The forward runs under `torch.utils.checkpoint` (non-reentrant). The recomputed forward must be
the same computation bit for bit, so it re-enters the unit's call context (executor.rng): the
placement-invariant dropout sees the same (step, unit, samples), and torch's generator is
re-seeded with the same seed, so `nn.Dropout` draws the same mask. Results with and without
recomputation are therefore identical, not merely close (tests/api/test_hf.py checks bitwise).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from executor.units import Activation, TupleRule, call_unit


def run_unit(
    unit: nn.Module,
    x: Activation,
    rule: TupleRule,
    recompute: bool,
    context: Callable[[], AbstractContextManager[Any]],
) -> Activation:
    """`call_unit(unit, x, rule)` inside `context()`; with `recompute` (and autograd on), under
    activation checkpointing that re-enters `context()` for the recomputation."""
    if not recompute or not torch.is_grad_enabled():
        with context():
            return _as_activation(call_unit(unit, x, rule))
    is_tuple = isinstance(x, tuple)

    def forward(*args: torch.Tensor) -> Activation:
        with context():
            return _as_activation(call_unit(unit, tuple(args) if is_tuple else args[0], rule))

    args = x if isinstance(x, tuple) else (x,)
    out: Activation = checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False)
    return out


def _as_activation(out: Any) -> Activation:
    return tuple(out) if isinstance(out, list) else out
