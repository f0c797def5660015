"""Where a rank computes: the device kind, its collective backend, and this process's device.

`elaswave.train(device=...)` names a kind; each process then runs on one device of that kind,
the one the launcher gave its local rank (`elaswave.device_map`, `$ELASWAVE_DEVICE_INDEX`):

- "auto": CUDA when torch sees a GPU, else an Ascend NPU when torch_npu is installed and sees
  one (torch_npu is imported only then, never otherwise), else the CPU;
- the backend follows the device: nccl on CUDA, hccl on Ascend, gloo on the CPU, and gloo as
  well when several ranks share one device (NCCL refuses two ranks on one GPU);
- a rank asked for a device its process cannot see fails before its first step, naming the
  device, how many it sees and the visibility variable (`DeviceUnavailable`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any, Literal

import torch

from wire.worker_env import DEVICE_INDEX_ENV, DEVICE_SHARED_ENV, HOST_THREADS_ENV, VISIBLE_ENV

DeviceKind = Literal["cpu", "cuda", "npu"]
DEVICE_CHOICES: tuple[str, ...] = ("auto", "cpu", "cuda", "npu")
BACKEND_OF: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class DeviceUnavailable(RuntimeError):
    """This process cannot run on the device it was asked for."""


def npu_installed() -> bool:
    """Whether torch_npu is installed (looked up, not imported)."""
    return importlib.util.find_spec("torch_npu") is not None


def _npu() -> Any:
    """torch.npu, after importing torch_npu (which registers it); only called for Ascend."""
    importlib.import_module("torch_npu")
    return torch.npu  # type: ignore[attr-defined]


def resolve_kind(requested: str) -> DeviceKind:
    """The device kind `requested` ("auto", "cpu", "cuda" or "npu") means on this machine.

    An explicit kind is returned as is (whether it is usable is checked per rank by
    `rank_device`); "auto" picks CUDA, else Ascend, else the CPU."""
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {requested!r}")
    if requested != "auto":
        return requested  # type: ignore[return-value]
    if torch.cuda.is_available():
        return "cuda"
    if npu_installed() and _npu().is_available():
        return "npu"
    return "cpu"


def device_count(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "npu":
        return int(_npu().device_count()) if npu_installed() else 0
    return 1


def backend_for(kind: str, shared: bool = False) -> str:
    """The collective backend of a job on `kind` devices (gloo when ranks share a device)."""
    return "gloo" if shared else BACKEND_OF[kind]


def local_device_index() -> int:
    """This worker's device ordinal from the launcher (0 for a plain `python script.py`)."""
    raw = os.environ.get(DEVICE_INDEX_ENV, "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise ValueError(f"${DEVICE_INDEX_ENV} must be a device ordinal >= 0, got {raw!r}")
    return int(raw)


def shares_device() -> bool:
    return os.environ.get(DEVICE_SHARED_ENV, "") == "1"


def intra_op_threads(kind: str) -> int:
    """torch intra-op threads for this worker: one on the CPU (the cores run the ranks, and a
    step's compute is its thread's CPU time: executor.compute_clock); on an accelerator the
    launcher's share of the node's CPUs ($ELASWAVE_HOST_THREADS, default 1), which the backups'
    host replay of each step's update runs on. ValueError on a value that is not >= 1."""
    if kind == "cpu":
        return 1
    raw = os.environ.get(HOST_THREADS_ENV, "").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"${HOST_THREADS_ENV} must be a thread count >= 1, got {raw!r}")
    return int(raw)


def rank_device(kind: str, index: int | None = None) -> torch.device:
    """This process's device of `kind` (ordinal `index`, default from the launcher), made the
    current device. Raises DeviceUnavailable, naming it, when the process cannot see it."""
    if kind == "cpu":
        return torch.device("cpu")
    index = local_device_index() if index is None else index
    seen = device_count(kind)
    if index >= seen:
        var = VISIBLE_ENV[kind]
        shown = os.environ.get(var)
        raise DeviceUnavailable(
            f"asked to run on {kind}:{index}, but this process sees {seen} {kind} device(s) "
            f"(${var}={shown!r}"
            + ("" if kind != "npu" or npu_installed() else "; torch_npu is not installed")
            + "): give the node as many devices as ranks (--devices-per-node) or pick device='cpu'"
        )
    device = torch.device(kind, index)
    if kind == "cuda":
        torch.cuda.set_device(device)
    else:
        _npu().set_device(device)
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timings and host reads of device results)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        _npu().synchronize(device)


def describe_device(device: torch.device) -> str:
    """A human-readable name for the first log line ("cuda:0 (NVIDIA H100 80GB HBM3)")."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "npu":
        return f"{device} (Ascend {_npu().get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"
