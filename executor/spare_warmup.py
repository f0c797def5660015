"""A warm spare (issue 23, item 4): what a spare process does before it tells the Core it is ready.

A spare learns its rank, stage and layout only from the plan that takes it in; until then it
waits. Everything it can do without them it does *before* it subscribes to plans (which is
what tells the Core it is ready, `core_service.membership.mark_spare_ready`), so the join costs
the survivors one step boundary and the state transfer, not this process's cold start:

- the device context (`torch.empty` on the spare's device: the CUDA/NPU context a first kernel
  would otherwise create inside the join);
- the connection to the job's store, which every group of the join is built over;
- the units' dry run (`TrainSpec.unit_probes`: one sample through every unit, which the trainer
  needs before it can build anything);
- the units themselves, built on the device (`UnitModel.build`) while the whole model's
  parameters fit `PREBUILD_MAX_BYTES`: the trainer then takes its stage's units from here and
  the rest are dropped. Above the bound the stage is built after the plan (a spare of a model
  too large for one device cannot hold it all), and the next item is skipped;
- one forward and backward through those units (eval mode, so no running statistic or dropout
  draw changes; gradients dropped after): the autograd engine's threads, each op's first-use
  kernels and the allocator's first blocks are ready before the first step.

The weights built here never reach training as they are: the plan's rebuild overwrites every
parameter and ZeRO shard of the joiner's stage with the job's committed state from their live
owners (`executor.fabric.rebuild`).

What a spare cannot prepare: its groups. Every group it joins is built at the plan's epoch with
members only the plan names (`Communicator.for_joiner`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from executor.store_server import connect_first_answering
from executor.units import call_unit

# "0" turns the warm-up off (the spare then builds everything once the plan names its rank): for
# measuring what it saves (`bench.join --cold-spare`), never needed otherwise.
WARM_UP_ENV = "ELASWAVE_SPARE_WARMUP"

# Prebuild every unit of a model whose parameters (fp32 master weights) take at most this much;
# a larger one is built per stage once the plan names it (a spare must not hold a model that
# only fits split across stages).
PREBUILD_MAX_BYTES = 2 * 2**30


@dataclass
class WarmSpare:
    """What a spare holds ready while it waits: its store connection, device, prebuilt units."""

    store: Any  # a torch.distributed Store, connected to the job's first store that answered
    device: torch.device
    units: dict[str, nn.Module] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # the warm-up itemised
    warmed_unix: float = 0.0  # when it finished: the spare declares itself ready after this
    store_index: int = 0  # the store's place in the job's store list

    def take_units(self, names: list[str] | tuple[str, ...]) -> dict[str, nn.Module]:
        """The prebuilt units of `names` (the stage the plan gave this spare); the others are
        dropped, freeing their memory. Empty when nothing was prebuilt."""
        taken = {n: self.units[n] for n in names if n in self.units}
        self.units.clear()
        return taken

    def as_dict(self) -> dict[str, Any]:
        """For the worker's results: the phases and when it was warm."""
        return {"seconds": dict(self.seconds), "warmed_unix": self.warmed_unix}


def warm_up_enabled() -> bool:
    return os.environ.get(WARM_UP_ENV, "1") != "0"


def warm_up(spec: Any, store_addresses: Sequence[str], timeout_s: float) -> WarmSpare:
    """Do a spare's expensive start (module docstring) for `spec` (a `TrainSpec`); the store is
    the first of the job's store list (`host:port` each) that answers: those before it died
    since the list was handed out (`executor.store_server.connect_first_answering`). Raises what the user's model raises on its
    dry run (a spare that could not run the model must not say it is ready)."""
    seconds: dict[str, float] = {}

    def timed(name: str, t0: float) -> float:
        now = time.perf_counter()
        seconds[name] = now - t0
        return now

    t = time.perf_counter()
    device = spec.local_device()
    torch.empty(1, device=device)  # creates the device's context (a no-op on CPU)
    t = timed("device_s", t)
    store_index, store = connect_first_answering(store_addresses, timeout_s)
    t = timed("store_s", t)
    probes = spec.unit_probes()
    t = timed("dry_run_s", t)
    units: dict[str, nn.Module] = {}
    if sum(p.param_bytes for p in probes) <= PREBUILD_MAX_BYTES:
        units = {name: spec.model.build(i, device) for i, name in enumerate(spec.model.names)}
        t = timed("build_s", t)
        exercise(spec, units, device)
        timed("exercise_s", t)
    return WarmSpare(store, device, units, seconds, time.time(), store_index)


def exercise(spec: Any, units: dict[str, nn.Module], device: torch.device) -> None:
    """One sample forward and backward through `units` in model order, in eval mode under the
    job's autocast; the units' modes are restored and their gradients dropped afterwards."""
    modes = {name: [m.training for m in unit.modules()] for name, unit in units.items()}
    first = spec.sampler(1).rows(0, 0, 1)
    x: Any = _to_device(first.inputs, device)
    try:
        for unit in units.values():
            unit.eval()
        with spec.precision.autocast(device):
            for name in spec.model.names:
                x = call_unit(units[name], x, spec.model.tuple_rule)
                if isinstance(x, list):
                    x = tuple(x)
        outputs = [
            o for o in (x if isinstance(x, tuple) else (x,)) if o.is_floating_point() and o.requires_grad
        ]
        if outputs:  # nothing to differentiate when every unit is frozen
            torch.stack([o.float().sum() for o in outputs]).sum().backward()
    finally:
        for name, unit in units.items():
            for module, training in zip(unit.modules(), modes[name], strict=True):
                module.training = training
            for p in unit.parameters():
                p.grad = None


def _to_device(inputs: Any, device: torch.device) -> Any:
    if isinstance(inputs, tuple):
        return tuple(t.to(device) for t in inputs)
    return inputs.to(device)
