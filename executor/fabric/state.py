"""The ZeRO-1 state one rank owns: per layer, an element interval of the layer's flat vector.

`ShardState` is the fabric's exchange format (snapshots, remap). It is independent of how the
engine stores its optimizer; the engine converts to and from it at the step boundary.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

FIELDS = ("param", "exp_avg", "exp_avg_sq")


@dataclass
class LayerShard:
    """Elements [start, stop) of one layer's flat parameter vector and their Adam moments."""

    start: int
    stop: int
    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    def __post_init__(self) -> None:
        n = self.stop - self.start
        for name in FIELDS:
            t = getattr(self, name)
            if t.dim() != 1 or t.numel() != n or t.dtype != torch.float32:
                raise ValueError(f"{name} must be a 1-D float32 tensor of {n} elements, got "
                                 f"{t.dtype} {tuple(t.shape)} for interval [{self.start}, {self.stop})")

    def clone(self) -> LayerShard:
        return LayerShard(self.start, self.stop, *(getattr(self, f).clone() for f in FIELDS))

    def slice(self, start: int, stop: int) -> torch.Tensor:
        """The (param, exp_avg, exp_avg_sq) rows of elements [start, stop), stacked (3 x n)."""
        if not self.start <= start <= stop <= self.stop:
            raise ValueError(f"[{start}, {stop}) is not inside this shard [{self.start}, {self.stop})")
        lo, hi = start - self.start, stop - self.start
        return torch.stack([getattr(self, f)[lo:hi] for f in FIELDS])


@dataclass
class ShardState:
    """What one rank owns after committed step `step` (0 = before the first update)."""

    step: int
    layers: dict[int, LayerShard] = field(default_factory=dict)

    def clone(self) -> ShardState:
        return ShardState(self.step, {k: v.clone() for k, v in self.layers.items()})

    def bitwise_equal(self, other: ShardState) -> bool:
        if self.step != other.step or sorted(self.layers) != sorted(other.layers):
            return False
        for k, a in self.layers.items():
            b = other.layers[k]
            if (a.start, a.stop) != (b.start, b.stop):
                return False
            if not all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS):
                return False
        return True

    def checksum(self) -> str:
        """SHA-256 over the step, the intervals and the raw bytes (bitwise, not approximate)."""
        h = hashlib.sha256(str(self.step).encode())
        for k in sorted(self.layers):
            s = self.layers[k]
            h.update(f"|{k}:{s.start}:{s.stop}".encode())
            for f in FIELDS:
                h.update(getattr(s, f).contiguous().numpy().tobytes())
        return h.hexdigest()

    # ----- wire format: one int64 header tensor and one float32 payload tensor -------------
    def header(self) -> torch.Tensor:
        rows = [self.step, len(self.layers)]
        for k in sorted(self.layers):
            rows += [k, self.layers[k].start, self.layers[k].stop]
        return torch.tensor(rows, dtype=torch.int64)

    def payload(self) -> torch.Tensor:
        parts = [getattr(self.layers[k], f) for k in sorted(self.layers) for f in FIELDS]
        return torch.cat(parts) if parts else torch.empty(0)

    @staticmethod
    def payload_numel(header: torch.Tensor) -> int:
        h = header.tolist()
        return sum(3 * (h[2 + 3 * i + 2] - h[2 + 3 * i + 1]) for i in range(h[1]))

    @staticmethod
    def from_wire(header: torch.Tensor, payload: torch.Tensor) -> ShardState:
        h = header.tolist()
        state, pos = ShardState(step=h[0]), 0
        for i in range(h[1]):
            layer, start, stop = h[2 + 3 * i: 5 + 3 * i]
            n = stop - start
            rows = [payload[pos + j * n: pos + (j + 1) * n].clone() for j in range(3)]
            state.layers[layer] = LayerShard(start, stop, *rows)
            pos += 3 * n
        return state

    def to_numpy(self) -> dict[int, tuple[int, int, np.ndarray]]:
        """Picklable copy for tests and reports: layer -> (start, stop, 3 x n array)."""
        return {k: (s.start, s.stop, s.slice(s.start, s.stop).numpy().copy()) for k, s in self.layers.items()}
