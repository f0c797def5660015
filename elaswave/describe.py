"""Describe mode: what the launcher learns about a script's model before any worker starts.

Every unit is built once (one at a time) and run on one micro-batch of real data on this
process's device (the job's device kind, under its precision's autocast): its parameter count and bytes, the activation it emits, its forward and backward
seconds per sample (the profiled costs the initial partition balances, ElasWave §4.2 / eq. 1),
and a fingerprint of its initial weights, which every rank can compare with its own build.
"""

from __future__ import annotations

import time

import torch

from executor.devices import synchronize
from executor.trainer import TrainSpec, _to_device
from executor.units import Activation, ActivationSpec, TupleRule, as_tuple, call_unit, fingerprint
from wire.worker_env import ModelDescription, UnitDescription

PROFILE_ROWS = 4  # samples per timed micro-batch: enough to dilute the per-call overhead
REPEATS = 3  # timed runs per unit after one untimed warm-up; the fastest counts (others were disturbed)


def describe(spec: TrainSpec, global_batch: int, micro_batches: int, steps: int) -> ModelDescription:
    """Build, run and time every unit (see the module docstring)."""
    probes = spec.unit_probes()
    sampler = spec.sampler(global_batch)
    rows = min(PROFILE_ROWS, global_batch)
    batch = sampler.rows(0, 0, rows)
    assert batch.inputs is not None
    device = spec.local_device()
    x: Activation = _to_device(batch.inputs, device)
    units, prints = [], {}
    for i, (name, probe) in enumerate(zip(spec.model.names, probes, strict=True)):
        unit = spec.model.build(i)
        prints[name] = fingerprint(unit)  # of the host build: what every rank compares
        unit = unit.to(device)
        with spec.precision.autocast(device):
            # the first call warms caches up
            timings = [_time_unit(unit, x, device, spec.model.tuple_rule) for _ in range(REPEATS + 1)][1:]
        fwd, bwd = min(t[0] for t in timings), min(t[1] for t in timings)
        out = timings[-1][2]
        units.append(
            UnitDescription(
                name,
                probe.numel,
                probe.param_bytes,
                fwd / rows,
                bwd / rows,
                ActivationSpec.of(out).bytes_per_sample(),
            )
        )
        x = tuple(t.detach() for t in out) if isinstance(out, tuple) else out.detach()
    return ModelDescription(tuple(units), global_batch, micro_batches, sampler.num_samples, steps, prints)


def _time_unit(
    unit: torch.nn.Module, x: Activation, device: torch.device, rule: TupleRule = "unpack"
) -> tuple[float, float, Activation]:
    """(forward seconds, backward seconds, output) of one call on `x` (device work included)."""
    x_in = _leaf(x)
    synchronize(device)
    t0 = time.perf_counter()
    out = call_unit(unit, x_in, rule)
    synchronize(device)
    t1 = time.perf_counter()
    floats = [t for t in as_tuple(out) if t.requires_grad]
    if floats:
        torch.autograd.backward(floats, [torch.ones_like(t) for t in floats])
    synchronize(device)
    t2 = time.perf_counter()
    unit.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1, out


def _leaf(x: Activation) -> Activation:
    items = tuple(t.detach().requires_grad_(t.dtype.is_floating_point) for t in as_tuple(x))
    return items if isinstance(x, tuple) else items[0]
