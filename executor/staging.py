"""Point-to-point tensors placed where the backend moves them (docs/accelerators.md).

gloo moves host memory: its send/recv read and write raw pointers, so a device tensor handed to
them must be staged through a host copy (the collectives of gloo handle CUDA tensors themselves).
NCCL and HCCL move device memory only: a host tensor is staged through the current device. A
tensor already where its backend wants it travels as is, so on gloo over CPU tensors (every CPU
job) and on NCCL over device tensors (the engine's activations, gradients, shards) nothing is
copied. Staged receives are copied back into the caller's tensor once the op has completed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def backend_device(backend: str) -> torch.device:
    """Where `backend` moves tensors from: the host for gloo, the current device otherwise."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "hccl":
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")


def needs_staging(tensor: torch.Tensor, backend: str) -> bool:
    on_host = tensor.device.type == "cpu"
    return not on_host if backend == "gloo" else on_host


@dataclass
class Staging:
    """The staged copies of one exchange's receives, copied back by `finish` (after completion)."""

    backend: str
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def send(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, or its copy where the backend can send it from."""
        return tensor.to(backend_device(self.backend)) if needs_staging(tensor, self.backend) else tensor

    def recv(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, or a buffer where the backend can receive into (copied back by `finish`)."""
        if not needs_staging(tensor, self.backend):
            return tensor
        staged = torch.empty_like(tensor, device=backend_device(self.backend))
        self.copy_back.append((tensor, staged))
        return staged

    def finish(self) -> None:
        for target, staged in self.copy_back:
            target.copy_(staged)
        self.copy_back.clear()

    def wait(self, timeout: object = None) -> None:
        """As a last "work" of an op list (StaticComm.complete waits on each): copy back."""
        self.finish()
