"""The dry run: one sample through every unit before the job starts (docs/api.md, "Model as units").

`discover_boundaries` builds the units one at a time, runs one sample through each on the job's
device, and records each unit's parameters and the per-sample spec of its output, which the
pipeline's buffers and the planners' memory model use. It also refuses what would break later
and silently, with what to change: parameters shared without a declared tie, and units whose
forward writes state of its own.

ElasWave moves and rebuilds units in place: a moved layer, a joiner's units and a restored stage
are built by `UnitModel.build` and receive the parameters and the optimizer state, nothing else
(ElasWave §4.2, §6.2). A unit whose forward writes state of its own would leave that state
behind on every recovery, and the replicas would drift apart. Three kinds are refused:

- a BatchNorm: the trainer runs every unit in training mode, where BatchNorm normalises over the
  rank's micro-batch, so its output depends on the layout (and its running statistics move);
- a buffer that a forward changes again on the same input (running statistics, a step counter);
  a buffer filled on first use and left alone after (a cache, a mask) is a function of the unit
  and its input, which a rebuilt unit recomputes, and is allowed;
- a parameter written by a forward (data-dependent initialisation): each rank would initialise
  it from its own first micro-batch.

Writes are found through tensor identities, version counters and a digest of the values (two
reductions per tensor), so a forward that writes nothing (the common case) costs no copy of the
unit and no second pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

from executor.tied import get_param
from executor.units import (
    RULE_TEXT,
    Activation,
    ActivationSpec,
    TupleRule,
    UnitBuildError,
    UnitModel,
    call_unit,
    check_shared,
    describe,
)


@dataclass(frozen=True)
class UnitProbe:
    """What the dry run learned of one unit."""

    numel: int
    param_bytes: int
    output: ActivationSpec
    params: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (name, shape) in parameters() order
    frozen: tuple[str, ...] = ()  # parameters that do not require grad

    def meta_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Stand-ins of the unit's parameters (no storage), for rules that look at names, shapes
        and whether they train."""
        return [
            (n, nn.Parameter(torch.empty(shape, device="meta"), requires_grad=n not in self.frozen))
            for n, shape in self.params
        ]


def discover_boundaries(
    model: UnitModel, sample_input: Activation, device: torch.device | str = "cpu"
) -> tuple[UnitProbe, ...]:
    """Run one sample through every unit on `device`, one unit built at a time, and record each
    unit's parameters and output spec. The parameters stay referenced until the end, so a build
    function that hands two units the same tensor is refused (unless the pair is declared tied)
    even when the two would sit on different stages."""
    probes: list[UnitProbe] = []
    ActivationSpec.of(sample_input)  # a clear TypeError before slicing what is not a batch
    x: Activation = (
        tuple(t[:1] for t in sample_input) if isinstance(sample_input, tuple) else sample_input[:1]
    )
    declared = {frozenset((p.leader, p.follower)) for p in model.tied}
    built: dict[str, nn.Module] = {}
    for i, name in enumerate(model.names):
        unit = model.build(i, device)
        built[name] = unit
        check_shared(built, declared)
        refuse_lazy(unit, name)
        refuse_batch_norm(unit, name)
        unit.train()  # as the trainer runs it: what a forward writes in training mode is what counts
        x = check_forward_writes(unit, name, partial(_real_forward, unit, name, x, model.tuple_rule))
        probes.append(
            UnitProbe(
                sum(p.numel() for p in unit.parameters()),
                sum(p.numel() * p.element_size() for p in unit.parameters()),
                ActivationSpec.of(x),
                tuple((n, tuple(p.shape)) for n, p in unit.named_parameters()),
                tuple(n for n, p in unit.named_parameters() if not p.requires_grad),
            )
        )
    for pair in model.tied:
        a = get_param(built[pair.leader[0]], pair.leader[1])
        b = get_param(built[pair.follower[0]], pair.follower[1])
        if a.requires_grad != b.requires_grad:
            raise UnitBuildError(
                f"tied parameters {pair.keys}: one is frozen, the other trains; freeze both or neither"
            )
    return tuple(probes)


def _real_forward(unit: nn.Module, name: str, x: Activation, rule: TupleRule = "unpack") -> Activation:
    try:
        with torch.no_grad():
            out = call_unit(unit, x, rule)
    except Exception as exc:
        hint = ""
        if isinstance(x, tuple) and isinstance(exc, TypeError):
            other = "an nn.Sequential" if rule == "unpack" else "Units(...), a list or a dict"
            hint = (
                f" (rule applied: {RULE_TEXT[rule]}; make forward take "
                f"{'the tuple as one argument' if rule == 'whole' else f'{len(x)} tensor arguments'}, "
                f"or give the units as {other})"
            )
        raise UnitBuildError(
            f"unit {name!r} failed on one sample of input {describe(x)}: {type(exc).__name__}: {exc}{hint}"
        ) from exc
    if isinstance(out, list):
        out = tuple(out)
    try:
        ActivationSpec.of(out)
    except TypeError as exc:
        raise UnitBuildError(f"unit {name!r}: {exc}") from exc
    return out


# name -> (identity, version counter, value digest) of a parameter or buffer
Marks = dict[str, tuple[int, int, torch.Tensor]]


def refuse_lazy(unit: nn.Module, name: str) -> None:
    """UnitBuildError if `unit` holds a tensor a Lazy module has not materialised yet: it would be
    initialised at its first forward, outside the seed the unit is built under."""
    for tname, t in [*unit.named_parameters(), *unit.named_buffers()]:
        if is_lazy(t):
            raise UnitBuildError(
                f"unit {name!r}: {name}.{tname} is not initialised yet (a Lazy module). Every rank "
                "builds a unit under the same seed and needs its tensors from the constructor: give "
                "the sizes (nn.Linear(4, 3) for nn.LazyLinear(3)), or run one dummy forward inside "
                "build_unit"
            )


def refuse_batch_norm(unit: nn.Module, name: str) -> None:
    """UnitBuildError if any submodule of `unit` is a BatchNorm (any dimension, Sync or Lazy)."""
    for sub_name, sub in unit.named_modules():
        if isinstance(sub, _BatchNorm):
            where = f"{name}.{sub_name}" if sub_name else name
            raise UnitBuildError(
                f"unit {name!r}: {where} is a {type(sub).__name__}. ElasWave runs units in training "
                "mode, where BatchNorm normalises over each rank's micro-batch: its output would depend "
                "on the layout, and its running statistics are not carried when a unit moves. Use "
                "GroupNorm or LayerNorm, or a frozen affine norm (torchvision.ops.FrozenBatchNorm2d)"
            )


def marks(tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> Marks:
    """What shows a write to each named tensor `tensors()` yields: a write in place bumps the
    version counter, an assignment changes the identity, and a write through `.data` (which
    bypasses the counter) changes the digest, a float32 sum and 2-norm."""
    return {n: (id(t), t._version, _digest(t)) for n, t in tensors()}


def _digest(t: torch.Tensor) -> torch.Tensor:
    v = t.detach()
    if v.is_meta:
        return torch.zeros(2)
    v = torch.view_as_real(v) if v.is_complex() else v
    if not v.is_floating_point():
        v = v.float()  # counters and masks: small
    # Reduced in float32 without a float32 or squared copy of the tensor: a large unit (an
    # embedding) is read twice, not duplicated.
    f32 = torch.float32
    return torch.stack((v.sum(dtype=f32), torch.linalg.vector_norm(v, dtype=f32))).cpu()


def changed(before: Marks, after: Marks) -> list[str]:
    """Names added, removed, replaced or written between two `marks` records."""
    return sorted(
        n
        for n in before.keys() | after.keys()
        if n not in before
        or n not in after
        or before[n][:2] != after[n][:2]
        or not torch.equal(before[n][2], after[n][2])
    )


def check_forward_writes(unit: nn.Module, name: str, forward: Callable[[], Activation]) -> Activation:
    """The output of `forward` (one dry-run pass of `unit`), after refusing the writes the module
    docstring names. `forward` runs once, and a second time only if the first changed a buffer."""
    params_before = marks(unit.named_parameters)
    buffers_before = marks(unit.named_buffers)
    out = forward()
    written = changed(params_before, marks(unit.named_parameters))
    if written:
        raise UnitBuildError(
            f"unit {name!r}: its forward writes parameter(s) {', '.join(written)}. A parameter set from "
            "the data (data-dependent initialisation) would differ on every rank, which sees its own "
            "micro-batch; initialise it in the constructor, or load it (Units(..., state=...))"
        )
    if not changed(buffers_before, marks(unit.named_buffers)):
        return out
    first = {n: b.detach().clone() for n, b in unit.named_buffers()}
    forward()
    second = dict(unit.named_buffers())
    moving = sorted(
        n
        for n in first.keys() | second.keys()
        if n not in first or n not in second or not _same(first[n], second[n])
    )
    if moving:
        raise UnitBuildError(
            f"unit {name!r}: its forward changes buffer(s) {', '.join(moving)} on every call (running "
            "statistics, a counter). Only parameters and optimizer state travel when a unit moves or "
            "a rank joins, so such state would be lost on the first recovery. Keep it out of the "
            "units (a buffer filled once and then only read, such as a cache, is fine)"
        )
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b.to(a.device)))
