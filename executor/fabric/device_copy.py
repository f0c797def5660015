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
"""

from __future__ import annotations

from typing import Any

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_digest(t: torch.Tensor) -> bytes:
    """16 bytes over the exact bits of `t`, computed on `t`'s device (module docstring)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return bytes(16)
    ints = flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)
    weights = torch.arange(1, ints.numel() + 1, device=ints.device, dtype=torch.int64)
    sums = torch.stack([ints.sum(), (ints * weights).sum()])
    return sums.cpu().numpy().tobytes()


class StagedCopies:
    """Copies handed over by one `HostStager.take`: in host memory once `wait` returns."""

    def __init__(self, events: list[Any]) -> None:
        self._events = events

    def wait(self) -> None:
        """Block until every copy has landed (at once where none was made: the CPU). Safe to call
        from any thread, and more than once."""
        for event in self._events:
            event.synchronize()
        self._events = []

    def __len__(self) -> int:
        return len(self._events)


class HostStager:
    """Device -> pinned host copies on a side stream; see the module docstring."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._events: list[Any] = []

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
            event = torch.cuda.Event()
            event.record(stream)
        self._events.append(event)
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
