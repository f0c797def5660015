"""torch's fused Adam/AdamW kernel over ZeRO-1 slices, in a few torch calls per slice (issue 23).

The kernel (`torch._fused_adamw_`) computes a CPU vector loop and a scalar tail that round the
last bit differently, so every element it updates must lie in a length that is a multiple of
`FUSED_PAD` (docs/engine.md, "The optimizer update"). A slice of a unit's flat vector is cut by
weight decay into runs (decay on matrices, none on norms and biases): updating each run's
padded body in place and its ragged end in a slot of a scratch block took a dozen torch calls
per run, ~0.2 ms of Python for a transformer block's ten runs at any size (a snapshot holder
replays it for its neighbour every step, `executor.fabric.snapshot`).

`plan_slice` lays the same arithmetic out in fewer calls. Where the slice trains whole (no
frozen element, the gradient aligned with it), the decay that holds most of its elements is
applied *in place over the slice's whole padded body*; the elements that body covers under
another decay, and the slice's ragged end, are first gathered with one `index_select` per
tensor into rows of 64-aligned slots (a slot's padding repeats an element of its run: computed,
then dropped), updated there with their own decay, and written back with `index_copy_` over
what the in-place call left. Every element still takes the vector loop, on its own values and
the step alone: the bits are those of the run-by-run update (tests/executor/test_optim_update.py).
Elsewhere (frozen runs, a gradient of the trainable runs only) each run's body is updated in
place as before and only the ragged ends are gathered. The caller caches each plan by the
slice's shape (`executor.optim._slice_layout`); a plan keeps its index tensors per device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# The fused kernels' length quantum: 64 fp32 elements is 4 AVX-512 vectors, 8 AVX2 ones.
FUSED_PAD = 64
# The in-place body under one decay is used while the elements gathered around it are at most
# this share of the slice (they are copied four times in and three times out) and at most
# MAX_GATHERED elements: past that the calls saved are a small part of the update's own time,
# and a cached plan's index tensors (8 bytes per gathered element, three or four of them) stay
# small however many slices a rank updates and backs up.
MAX_GATHERED_SHARE = 0.25
MAX_GATHERED = 8192

# (start, stop, weight decay, offset of start in the gradient) of a trainable piece of a slice,
# relative to the slice's first element (`executor.optim._update_pieces`, shifted)
Piece = tuple[int, int, float, int]


@dataclass(frozen=True)
class InPlace:
    """Elements `[start, start + length)` of the slice (gradient from `grad_at`), updated where
    they lie under `wd`; `length` is a multiple of FUSED_PAD."""

    start: int
    length: int
    wd: float
    grad_at: int


@dataclass(eq=False)
class Gathered:
    """The elements of one decay updated in a gathered row: `src[i]` is the slice element (and
    `grad_src[i]` its gradient element) at row position i; `kept` are the row positions that
    hold a real element (not a slot's padding), written back to slice elements `dest`."""

    wd: float
    src: torch.Tensor
    grad_src: torch.Tensor
    kept: torch.Tensor
    dest: torch.Tensor
    _on: dict[torch.device, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(src, grad_src, kept, dest) on `device` (copied there once)."""
        if device.type == "cpu":
            return self.src, self.grad_src, self.kept, self.dest
        if device not in self._on:
            self._on[device] = tuple(t.to(device) for t in (self.src, self.grad_src, self.kept, self.dest))
        src, grad_src, kept, dest = self._on[device]
        return src, grad_src, kept, dest


@dataclass(frozen=True)
class SlicePlan:
    in_place: tuple[InPlace, ...]
    gathered: tuple[Gathered, ...]


def plan_slice(pieces: tuple[Piece, ...], numel: int) -> SlicePlan:
    """The update of a slice of `numel` elements with these trainable `pieces` (pure; the caller
    caches it per slice shape, `executor.optim._slice_layout`)."""
    whole = _whole_body(pieces, numel)
    if whole is not None:
        return whole
    in_place, rest = [], []
    for a, b, wd, at in pieces:
        body = (b - a) - (b - a) % FUSED_PAD
        if body:
            in_place.append(InPlace(a, body, wd, at))
        if a + body < b:
            rest.append((a + body, b, wd, at + body))
    return SlicePlan(tuple(in_place), _gather(rest))


def _whole_body(pieces: tuple[Piece, ...], numel: int) -> SlicePlan | None:
    """The plan with one in-place call over the padded body, or None where it does not apply."""
    body = numel - numel % FUSED_PAD
    trains_whole = sum(b - a for a, b, _, _ in pieces) == numel and all(a == at for a, _, _, at in pieces)
    if not body or not trains_whole or len(pieces) < 2:
        return None
    in_body: dict[float, int] = {}
    for a, b, wd, _ in pieces:
        in_body[wd] = in_body.get(wd, 0) + max(0, min(b, body) - a)
    main = max(in_body, key=lambda wd: in_body[wd])
    rest = []
    for a, b, wd, at in pieces:
        start = a if wd != main else max(a, body)
        if start < b:
            rest.append((start, b, wd, at + start - a))
    gathered = sum(b - a for a, b, _, _ in rest)
    if gathered > MAX_GATHERED_SHARE * numel or gathered > MAX_GATHERED:
        return None
    return SlicePlan((InPlace(0, body, main, 0),), _gather(rest))


def _gather(runs: Sequence[Piece]) -> tuple[Gathered, ...]:
    """Each run in slots of FUSED_PAD of its decay's row; a slot's padding repeats the run's last
    element (its result is dropped)."""
    by_wd: dict[float, list[Piece]] = {}
    for run in runs:
        by_wd.setdefault(run[2], []).append(run)
    out = []
    for wd, of_wd in by_wd.items():
        src: list[int] = []
        grad_src: list[int] = []
        kept: list[int] = []
        for a, b, _, at in of_wd:
            k = b - a
            slot = -(-k // FUSED_PAD) * FUSED_PAD
            kept.extend(range(len(src), len(src) + k))
            src.extend([*range(a, b), *[b - 1] * (slot - k)])
            grad_src.extend([*range(at, at + k), *[at + k - 1] * (slot - k)])
        dest = [src[i] for i in kept]
        index = _index(src)
        grad_index = index if grad_src == src else _index(grad_src)
        out.append(Gathered(wd, index, grad_index, _index(kept), _index(dest)))
    return tuple(out)


def _index(positions: list[int]) -> torch.Tensor:
    return torch.tensor(positions, dtype=torch.long)
