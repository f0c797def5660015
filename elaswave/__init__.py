"""ElasWave: elastic-native hybrid-parallel (DP x PP x ZeRO) training.

The public API is this package (docs/api.md): describe the model as units, give a per-sample
loss, a dataset and an optimizer, and call `elaswave.train(...)` in every process; launch with
`elaswave run`. Names are loaded on first use, so `import wire.worker_env` (the launcher's and
agent's side) never pays for torch.

- `Units(names, build_unit, init_seed=0, state_dict=None)`, `Units.from_modules(...)`
- `train(...)` -> `TrainResult`
- `AdamW(...)`, `Adam(...)`, `SGD(...)`, `warmup_cosine(...)`, `no_decay_norms_and_biases`
- `dropout(x, p, site=0, training=True)`: placement-invariant dropout for units
- `load_model_state(checkpoint_dir)`: the whole model's state dict from a checkpoint
- `elaswave.hf`: `transformers` causal LMs as units; `elaswave.data`: token files
- `DeviceUnavailable`: `train(device=...)` names a device this process cannot see
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Units": ("executor.units", "UnitModel"),
    "unit_seed": ("executor.units", "unit_seed"),
    "train": ("elaswave.api", "train"),
    "TrainResult": ("elaswave.api", "TrainResult"),
    "AdamW": ("elaswave.optimizers", "AdamW"),
    "Adam": ("elaswave.optimizers", "Adam"),
    "SGD": ("elaswave.optimizers", "SGD"),
    "OptimizerConfig": ("executor.optim", "OptimizerConfig"),
    "warmup_cosine": ("executor.optim", "warmup_cosine"),
    "no_decay_norms_and_biases": ("executor.optim", "no_decay_norms_and_biases"),
    "dropout": ("executor.rng", "placement_invariant_dropout"),
    "load_model_state": ("executor.checkpoint", "load_model_state"),
    "CheckpointError": ("executor.checkpoint", "CheckpointError"),
    "DeviceUnavailable": ("executor.devices", "DeviceUnavailable"),
    "DEFAULT_VERIFY_EVERY": ("planners.backup", "DEFAULT_VERIFY_EVERY"),
}

if TYPE_CHECKING:
    from elaswave.api import TrainResult, train
    from elaswave.optimizers import SGD, Adam, AdamW
    from executor.checkpoint import CheckpointError, load_model_state
    from executor.devices import DeviceUnavailable
    from executor.optim import OptimizerConfig, no_decay_norms_and_biases, warmup_cosine
    from executor.rng import placement_invariant_dropout as dropout
    from executor.units import UnitModel as Units
    from executor.units import unit_seed
    from planners.backup import DEFAULT_VERIFY_EVERY


_SUBMODULES = ("data", "hf")  # elaswave.hf / elaswave.data: the optional extra elaswave[hf]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"elaswave.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'elaswave' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "DEFAULT_VERIFY_EVERY",
    "SGD",
    "Adam",
    "AdamW",
    "CheckpointError",
    "DeviceUnavailable",
    "OptimizerConfig",
    "TrainResult",
    "Units",
    "dropout",
    "load_model_state",
    "no_decay_norms_and_biases",
    "train",
    "unit_seed",
    "warmup_cosine",
]
