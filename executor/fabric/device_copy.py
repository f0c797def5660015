"""Shard backups from device memory (docs/accelerators.md): pinned host copies on a side stream,
and integrity digests computed where the tensors live.

`HostStager.stage` copies device tensors into pinned host buffers on a side CUDA stream that
first waits for the compute stream (the tensors are final there), so the copy overlaps whatever
the compute stream does next. `take` hands the copies staged so far over as one `StagedCopies`,
whose `wait` blocks until they landed: the snapshot's background updater waits for them right
before it replays the update on the host copy, so neither the step nor its commit waits for the
link (ElasWave §5.1, Fig. 6b: the backup's traffic is hidden behind the next step's compute; a
GPU run measured the copy awaited at the commit at +77 % of a 0.11 s step, docs/accelerators.md).
A staged tensor must not be written again before its copy lands: the snapshot stages the
buffers it received, one set per step, and the caching allocator keeps them alive for the side
stream (`record_stream`). On the CPU there is nothing to copy and the tensors are returned as
they are, so the CPU path is unchanged. Ascend has no side-stream API here: torch_npu copies are
made synchronously to host (correct, not overlapped).

`tensor_digest` is an integrity check computed on the tensor's own device: the tensor's bits read
as integers, summed plainly and weighted by position, in int64 (exact and order-free modulo 2^64,
so every device and every reduction order gives the same 16 bytes). Any single changed bit changes
the plain sum; moved or compensating changes the weighted one. Only the 16 bytes travel to the
host. It detects corruption and divergence; it is not a cryptographic hash.

`tensor_sketch` is the check where a copy may differ from its original by round-off (a backup
replayed on the host, its shard updated on a GPU: docs/accelerators.md): the tensor's 2-norm and
its projections on SKETCH_PROJECTIONS patterns of +-1 fixed by each element's position in its
unit, in float64, on the tensor's own device. Two sketches estimate how far apart their tensors
are (`sketch_distance`): for a difference d each projection differs by a sum of d's elements
with pseudo-random signs, whose square is ||d||^2 on average, and a single changed element of
size e moves every projection by exactly e; the norms differ by at most ||d||. So a copy within
round-off passes, one whose drift grew past a tolerance, or that has a corrupted element of that
size, fails.
"""

from __future__ import annotations

from typing import Any

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Four: a drift at the remap's bound (4x the verify's tolerance) is estimated under the tolerance
# with probability P(chi2_4 < 0.25) ~ 0.7 % per unit and row (two projections: 6 %).
SKETCH_PROJECTIONS = 4
_SKETCH_CHUNK = 1 << 21  # elements hashed at a time: the signs' float64 rows stay under 64 MiB
_MIX = 0x45D9F3B  # a 32-bit integer mixer's multiplier (products stay below 2^59: no overflow)
_LOW32 = 0xFFFFFFFF


def tensor_digest(t: torch.Tensor) -> bytes:
    """16 bytes over the exact bits of `t`, computed on `t`'s device (module docstring)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return bytes(16)
    ints = flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)
    weights = torch.arange(1, ints.numel() + 1, device=ints.device, dtype=torch.int64)
    sums = torch.stack([ints.sum(), (ints * weights).sum()])
    return sums.cpu().numpy().tobytes()


def _position_signs(start: int, n: int, device: torch.device) -> torch.Tensor:
    """SKETCH_PROJECTIONS x n float64 +-1: bits of a 32-bit hash of positions start..start+n-1,
    the same on every device (integer arithmetic only)."""
    h = torch.arange(start, start + n, device=device, dtype=torch.int64) & _LOW32
    for _ in range(2):
        h = (((h >> 16) ^ h) * _MIX) & _LOW32
    h = (h >> 16) ^ h
    return torch.stack([((h >> j) & 1).to(torch.float64) * 2 - 1 for j in range(SKETCH_PROJECTIONS)])


def tensor_sketch(tensors: tuple[torch.Tensor, ...], start: int) -> torch.Tensor:
    """For each of `tensors` (1-D, equal length, elements start.. of one unit), its 2-norm and
    its SKETCH_PROJECTIONS projections (module docstring): float64, len(tensors) x (1 +
    SKETCH_PROJECTIONS), computed on the tensors' device and returned on the host."""
    flats = [t.detach().reshape(-1) for t in tensors]
    n = flats[0].numel() if flats else 0
    device = flats[0].device if flats else torch.device("cpu")
    sq = torch.zeros(len(flats), dtype=torch.float64, device=device)
    proj = torch.zeros(len(flats), SKETCH_PROJECTIONS, dtype=torch.float64, device=device)
    for lo in range(0, n, _SKETCH_CHUNK):
        hi = min(n, lo + _SKETCH_CHUNK)
        signs = _position_signs(start + lo, hi - lo, device)  # shared by the tensors
        for i, flat in enumerate(flats):
            x = flat[lo:hi].to(torch.float64)
            sq[i] += x.dot(x)
            proj[i] += signs @ x
    return torch.cat([sq.sqrt().unsqueeze(1), proj], dim=1).cpu()


def sketch_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far apart (relative to `a`'s norm, the largest over the rows) the tensors behind two
    `tensor_sketch`es of the same positions are estimated to be; inf where not finite."""
    norm_a, norm_b = a[:, 0], b[:, 0]
    spread = ((a[:, 1:] - b[:, 1:]) ** 2).mean(dim=1).sqrt()
    gap = torch.maximum(spread, (norm_a - norm_b).abs()) / norm_a.clamp_min(1e-30)
    worst = float(gap.max()) if gap.numel() else 0.0
    return worst if worst == worst and worst != float("inf") else float("inf")  # NaN: inf


class StagedCopies:
    """Copies handed over by one `HostStager.take`: in host memory once `wait` returns.
    `events`: what each copy's completion is waited on by (`synchronize()`), with the CUDA device
    its stream runs on (None where there is none)."""

    def __init__(self, events: list[tuple[Any, torch.device | None]]) -> None:
        self._events = events

    def wait(self) -> None:
        """Block until every copy has landed (at once where none was made: the CPU). Safe to call
        from any thread (the waiting thread makes the copy's device current first), and more
        than once."""
        for event, device in self._events:
            if device is None:
                event.synchronize()
            else:
                with torch.cuda.device(device):
                    event.synchronize()
        self._events = []

    def __len__(self) -> int:
        return len(self._events)


class HostStager:
    """Device -> pinned host copies on a side stream; see the module docstring."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._events: list[tuple[Any, torch.device | None]] = []

    def stage(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of `t`, complete once the `StagedCopies` that the next `take` returns is
        waited for (`t` itself when on the CPU). Never blocks on the copy."""
        if t.device.type == "cpu":
            return t
        if t.device.type != "cuda":
            return t.cpu()
        stream = self._streams.get(t.device)
        if stream is None:
            stream = self._streams[t.device] = torch.cuda.Stream(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the caching allocator must not reuse t before the copy
            event = torch.cuda.Event(blocking=True)  # a waiting updater sleeps, not spins on a core
            event.record(stream)
        self._events.append((event, t.device))
        return host

    def take(self) -> StagedCopies:
        """The copies staged since the last `take`, to be waited for where they are used."""
        taken, self._events = StagedCopies(self._events), []
        return taken

    def wait(self) -> None:
        """Block until every copy staged so far has landed in host memory."""
        self.take().wait()

    @property
    def pending(self) -> int:
        return len(self._events)
