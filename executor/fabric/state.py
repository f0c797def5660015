"""The ZeRO-1 state one rank owns: per unit (a block, the embedding, the head), an element
interval of the unit's flat parameter vector, with those parameters and their Adam moments.

`ShardState` is the fabric's exchange format (snapshots, remap). It is independent of how the
engine stores its optimizer; the engine converts to and from it at the step boundary.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from executor.fabric.device_copy import SKETCH_PROJECTIONS, sketch_distance, tensor_digest, tensor_sketch

FIELDS = ("param", "exp_avg", "exp_avg_sq")


@dataclass
class UnitShard:
    """Elements [start, stop) of one unit's flat parameter vector and their Adam moments."""

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
                raise ValueError(
                    f"{name} must be a 1-D float32 tensor of {n} elements, got "
                    f"{t.dtype} {tuple(t.shape)} for interval [{self.start}, {self.stop})"
                )

    def clone(self) -> UnitShard:
        return UnitShard(self.start, self.stop, *(getattr(self, f).clone() for f in FIELDS))

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
    units: dict[str, UnitShard] = field(default_factory=dict)

    def clone(self) -> ShardState:
        return ShardState(self.step, {k: v.clone() for k, v in self.units.items()})

    def bitwise_equal(self, other: ShardState) -> bool:
        if self.step != other.step or sorted(self.units) != sorted(other.units):
            return False
        for k, a in self.units.items():
            b = other.units[k]
            if (a.start, a.stop) != (b.start, b.stop):
                return False
            if not all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS):
                return False
        return True

    def checksum(self) -> str:
        """SHA-256 over the step, the intervals and each tensor's bit digest, which is computed
        on the device the tensor lives on (`device_copy.tensor_digest`): a live shard in device
        memory and its backup in host memory compare without copying the shard."""
        h = hashlib.sha256(str(self.step).encode())
        for k in sorted(self.units):
            s = self.units[k]
            h.update(f"|{k}:{s.start}:{s.stop}".encode())
            for f in FIELDS:
                h.update(tensor_digest(getattr(s, f)))
        return h.hexdigest()

    def sketch(self) -> torch.Tensor:
        """The round-off tolerant counterpart of `checksum` (`device_copy.tensor_sketch`): float64,
        the step and a 32-bit digest of the intervals, then each unit's (param, exp_avg,
        exp_avg_sq) norms and projections, units in sorted order; `sketch_numel` long."""
        intervals = "|".join(f"{k}:{self.units[k].start}:{self.units[k].stop}" for k in sorted(self.units))
        layout = int.from_bytes(hashlib.sha256(intervals.encode()).digest()[:4], "big")
        parts = [torch.tensor([float(self.step), float(layout)], dtype=torch.float64)]
        for k in sorted(self.units):
            u = self.units[k]
            parts.append(tensor_sketch(tuple(getattr(u, f) for f in FIELDS), u.start).reshape(-1))
        return torch.cat(parts)

    @staticmethod
    def sketch_numel(units: int) -> int:
        """Elements of the `sketch` of a shard of `units` units."""
        return 2 + units * len(FIELDS) * (1 + SKETCH_PROJECTIONS)

    @staticmethod
    def sketch_drift(a: torch.Tensor, b: torch.Tensor) -> float:
        """How far (relative, the worst unit and field) the shard behind sketch `b` is estimated
        to be from the one behind `a`; inf where their steps or intervals differ."""
        if a.shape != b.shape or not torch.equal(a[:2], b[:2]):
            return float("inf")
        rows = 1 + SKETCH_PROJECTIONS
        return sketch_distance(a[2:].reshape(-1, rows), b[2:].reshape(-1, rows))

    # ----- wire format: a JSON header (uint8 tensor) and one float32 payload tensor -------------
    def header(self) -> torch.Tensor:
        rows = [[k, self.units[k].start, self.units[k].stop] for k in sorted(self.units)]
        raw = json.dumps({"step": self.step, "units": rows}).encode()
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    def payload(self) -> torch.Tensor:
        parts = [getattr(self.units[k], f) for k in sorted(self.units) for f in FIELDS]
        return torch.cat(parts) if parts else torch.empty(0)

    @staticmethod
    def _parse(header: torch.Tensor) -> dict[str, Any]:
        return json.loads(bytes(header.tolist()).decode())

    @staticmethod
    def payload_numel(header: torch.Tensor) -> int:
        return sum(3 * (stop - start) for _, start, stop in ShardState._parse(header)["units"])

    @staticmethod
    def from_wire(header: torch.Tensor, payload: torch.Tensor) -> ShardState:
        h = ShardState._parse(header)
        return ShardState.from_payload(int(h["step"]), {n: (a, b) for n, a, b in h["units"]}, payload)

    @staticmethod
    def from_payload(step: int, intervals: dict[str, tuple[int, int]], payload: torch.Tensor) -> ShardState:
        """The state whose `payload()` is `payload`, given its units' intervals (a receiver that
        knows them from the layout needs no header)."""
        if payload.numel() != sum(3 * (b - a) for a, b in intervals.values()):
            raise ValueError(
                f"a payload of {payload.numel()} elements does not hold 3 rows of the intervals {intervals}"
            )
        state, pos = ShardState(step=step), 0
        for name in sorted(intervals):
            start, stop = intervals[name]
            n = stop - start
            rows = [payload[pos + j * n : pos + (j + 1) * n].clone() for j in range(3)]
            state.units[name] = UnitShard(start, stop, *rows)
            pos += 3 * n
        return state

    def intervals(self) -> dict[str, tuple[int, int]]:
        """unit -> the [start, stop) it holds."""
        return {k: (u.start, u.stop) for k, u in self.units.items()}

    def to_numpy(self) -> dict[str, tuple[int, int, np.ndarray]]:
        """Picklable copy for tests and reports: unit -> (start, stop, 3 x n array)."""
        return {
            k: (s.start, s.stop, s.slice(s.start, s.stop).cpu().numpy().copy()) for k, s in self.units.items()
        }
