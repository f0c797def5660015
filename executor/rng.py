"""Dropout randomness that does not depend on placement (ElasWave §4.4, "RNG resharding").

The paper carries RNG states with the layers and samples when they move. We get the same
guarantee more simply by making every draw a pure function of a counter: the mask that dropout
site `site` of layer `layer` applies to global sample `sample` at step `step` is drawn from a
generator seeded by `mix64(seed, step, layer, site, sample)`. Whichever rank runs that sample
through that layer, under whatever micro-batch size, draws the same mask, so a layer migration
or a micro-batch resize changes no random number.

`rng_mode="per_rank"` is the conventional behaviour kept as the measurable baseline: one
generator per rank (re-seeded from `(seed, rank, step)` each step so a replayed step draws the
same stream), consumed in whatever order that rank happens to process its samples — the mask a
sample receives then depends on which rank runs it and on what that rank ran before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

RngMode = Literal["placement_invariant", "per_rank"]
RNG_MODES: tuple[str, ...] = ("placement_invariant", "per_rank")

_MASK64 = (1 << 64) - 1
# Seeds handed to torch.Generator must fit a signed 64-bit int.
_MASK63 = (1 << 63) - 1

# Dropout sites inside one layer; the embedding is layer EMBED_LAYER.
SITE_EMBED = 0
SITE_ATTN = 1
SITE_MLP = 2
EMBED_LAYER = -1


def _splitmix64(x: int) -> int:
    """One round of SplitMix64 (Steele et al. 2014): a bijective 64-bit mixer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix64(*parts: int) -> int:
    """Hash a tuple of (possibly negative) ints into a 63-bit generator seed."""
    h = 0x6A09E667F3BCC908
    for p in parts:
        h = _splitmix64(h ^ (p & _MASK64))
    return h & _MASK63


class DropoutRng:
    """Source of dropout masks for one rank and one step; see the module docstring."""

    def __init__(self, seed: int, mode: RngMode = "placement_invariant", rank: int = 0) -> None:
        if mode not in RNG_MODES:
            raise ValueError(f"rng mode must be one of {RNG_MODES}, got {mode!r}")
        self.seed = seed
        self.mode: RngMode = mode
        self.rank = rank
        self.step = 0
        self._per_rank = torch.Generator()
        self._per_sample = torch.Generator()
        self.begin_step(0)

    def begin_step(self, step: int) -> None:
        """Start drawing for `step`; a replayed step draws exactly what it drew the first time."""
        self.step = step
        self._per_rank.manual_seed(mix64(self.seed, self.rank, step, 0x5EED))

    def keep_mask(
        self, p: float, layer: int, site: int, samples: Sequence[int], shape: Sequence[int]
    ) -> torch.Tensor:
        """Scaled keep-mask of shape `(len(samples), *shape)`: 0 where dropped, 1/(1-p) elsewhere."""
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        full = (len(samples), *shape)
        if self.mode == "per_rank":
            uniform = torch.rand(full, generator=self._per_rank)
        else:
            uniform = torch.empty(full)
            for row, sample in enumerate(samples):
                self._per_sample.manual_seed(mix64(self.seed, self.step, layer, site, sample))
                uniform[row] = torch.rand(tuple(shape), generator=self._per_sample)
        return (uniform >= p).to(torch.float32) / (1.0 - p)


def apply_dropout(
    x: torch.Tensor, p: float, rng: DropoutRng | None, layer: int, site: int, samples: Sequence[int]
) -> torch.Tensor:
    """Dropout on `x` (batch-first, one row per sample in `samples`); identity when off."""
    if rng is None or p == 0.0:
        return x
    if x.shape[0] != len(samples):
        raise ValueError(f"dropout input has {x.shape[0]} rows but {len(samples)} sample ids")
    # Masks are always drawn on the CPU generators, so a sample gets the same mask on any device.
    return x * rng.keep_mask(p, layer, site, samples, tuple(x.shape[1:])).to(x.device)


# ------------------------------------------------------------------ the forward pass's context


@dataclass(frozen=True)
class UnitCall:
    """What the engine is running right now on this thread: which unit, for which global samples,
    at which step, with which dropout source (None outside an engine forward)."""

    step: int
    unit_index: int
    samples: tuple[int, ...]
    rng: DropoutRng | None


_current = threading.local()


def current_unit_call() -> UnitCall | None:
    return getattr(_current, "call", None)


@contextmanager
def unit_call(call: UnitCall, torch_seed: int | None) -> Iterator[None]:
    """Run one unit's forward under `call`. `torch_seed` re-seeds torch's global generator first,
    so a user module drawing from it (`nn.Dropout`) draws the same numbers when a step is
    replayed on the same layout; only `placement_invariant_dropout` is the same on any layout."""
    previous = current_unit_call()
    _current.call = call
    if torch_seed is not None:
        # The CPU generator directly: torch.manual_seed also queues lazy seeds for every
        # accelerator backend, which costs ~60 us a call on a CPU-only build (per unit, per slot).
        torch.default_generator.manual_seed(torch_seed)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.manual_seed(torch_seed)
    try:
        yield
    finally:
        _current.call = previous


def placement_invariant_dropout(
    x: torch.Tensor, p: float, site: int = 0, training: bool = True
) -> torch.Tensor:
    """Dropout whose mask for a sample depends only on (seed, step, unit, site, global sample):
    the same on any layout, after any migration or micro-batch resize (ElasWave §4.4). Outside an
    engine forward (or with `training=False`) it is the identity."""
    call = current_unit_call()
    if not training or call is None:
        return x
    return apply_dropout(x, p, call.rng, call.unit_index, site, call.samples)
