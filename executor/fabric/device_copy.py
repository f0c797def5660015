"""Shard backups from device memory (docs/accelerators.md): pinned host copies on a side stream,
and integrity digests computed where the tensors live.

`HostStager.stage` copies device tensors into pinned host buffers on a side CUDA stream that
first waits for the compute stream (the tensors are final there), so the copy overlaps whatever
the compute stream does next; `wait` blocks until the copies landed (the snapshot calls it at the
step's commit, not before). On the CPU there is nothing to copy and the tensors are returned as
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


class HostStager:
    """Device -> pinned host copies on a side stream; see the module docstring."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._events: list[Any] = []

    def stage(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of `t` that is complete after `wait()` (`t` itself when on the CPU)."""
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

    def wait(self) -> None:
        """Block until every staged copy has landed in host memory."""
        for event in self._events:
            event.synchronize()
        self._events.clear()

    @property
    def pending(self) -> int:
        return len(self._events)
