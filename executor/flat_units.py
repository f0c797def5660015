"""Flat per-unit buffers: a unit's parameters and gradients as views of one contiguous vector each.

The ZeRO-1 stage (executor.zero) addresses every unit as its flat vector (`parameters()`
concatenated in order, ElasWave §6.3): owners hold element intervals of it, the reduce-scatter
sends each owner its interval of the gradient, the all-gather writes each owner's interval of the
parameters back. When the parameters *are* views of one buffer (and their `.grad` of another),
every one of those intervals is a plain slice: no step flattens, concatenates or copies what it
can address in place, which is what DDP's bucket views give it (issue 23).

The buffers are a layout-local detail. `FlatUnit` adopts a unit when a stage takes it (its
parameters' values are copied once into a new buffer and the parameters re-pointed at it; a unit
that is already flat is taken as it is), and checks before each use that nothing re-pointed a
parameter since (a load with `assign=True`, a tie, a move to another device): it then adopts the
unit again. Gradients that someone replaced (`p.grad = ...`: the cross-stage tie sync, a
non-blocking migration's payback) or dropped (`p.grad = None`) are copied into, or cleared from,
the gradient buffer when it is read, so the buffer always holds what `.grad` says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import is_
from typing import TypeGuard

import torch
from torch import nn


def as_flat_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D view of the tensors when they lie back to back, in order, in one storage (same
    dtype and device, each contiguous); None otherwise. No copy: writes go to the tensors."""
    if not tensors:
        return None
    first = tensors[0].detach()
    ptr, start = first.untyped_storage().data_ptr(), first.storage_offset()
    pos = start
    for t in tensors:
        if (
            t.dtype != first.dtype
            or t.device != first.device
            or not t.is_contiguous()
            or t.storage_offset() != pos
            or t.untyped_storage().data_ptr() != ptr
        ):
            return None
        pos += t.numel()
    return first.as_strided((pos - start,), (1,), start)


def holds_copy_of(
    copy: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> TypeGuard[torch.Tensor]:
    """Whether `copy` can be overwritten with a tensor of this shape, dtype and device."""
    return copy is not None and copy.shape == tuple(shape) and copy.dtype == dtype and copy.device == device


def holds_flat_copy_of(copy: torch.Tensor | None, unit: nn.Module) -> bool:
    """Whether `copy` can be an earlier flat copy of the unit's parameters (`flat_params`)."""
    params = list(unit.parameters())
    numel = sum(p.numel() for p in params)
    return bool(params) and holds_copy_of(copy, (numel,), params[0].dtype, params[0].device)


def copy_reusing(src: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    """A copy of `src`: written into `into` where it fits (same shape, dtype and device), else a
    fresh clone. A copy taken every step (the rollback copy) reuses the memory of the copy it
    replaces: on the host a fresh allocation of this size faults its pages in again, which cost
    several times the copy itself (10x at 40 MB on the CI machine)."""
    if holds_copy_of(into, src.shape, src.dtype, src.device):
        return into.copy_(src)
    return src.clone()


def flat_params(unit: nn.Module, into: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of the unit's parameters concatenated in `parameters()` order (empty for a unit
    without any): one copy of its flat buffer where it has one (executor.flat_units), written
    into `into` where that fits (`copy_reusing`)."""
    params = [p.detach() for p in unit.parameters()]
    view = as_flat_view(params)
    if view is not None:
        return copy_reusing(view, into)
    return torch.cat([p.reshape(-1) for p in params]) if params else torch.empty(0)


def copy_runs(unit: nn.Module, into: torch.Tensor, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """`into` (a copy of the unit's flat parameters, `flat_params`) brought up to date on the
    element runs `runs` only: the rollback copy of a unit that trains in part, whose frozen
    elements the copy being reused already holds."""
    params = [p.detach() for p in unit.parameters()]
    view = as_flat_view(params)
    for a, b in runs:
        if view is not None:
            into[a:b].copy_(view[a:b])
        else:
            pos = a
            for piece in range_views(params, a, b):
                into[pos : pos + piece.numel()].copy_(piece.reshape(-1))
                pos += piece.numel()
    return into


def range_views(tensors: Sequence[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
    """Elements `[lo, hi)` of the tensors' flat concatenation, as pieces of the tensors
    themselves (views where a tensor is contiguous), in order: what the ZeRO glue reads and
    writes instead of flattening a whole unit first."""
    pieces, pos = [], 0
    for t in tensors:
        n = t.numel()
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            pieces.append(t.reshape(-1)[a - pos : b - pos])
        pos += n
        if pos >= hi:
            break
    return pieces


def flat_slice(unit: nn.Module, lo: int, hi: int) -> torch.Tensor:
    """A copy of elements `[lo, hi)` of the unit's flat parameters, without flattening the rest."""
    params = [p.detach() for p in unit.parameters()]
    view = as_flat_view(params)
    if view is not None:
        return view[lo:hi].clone()
    pieces = range_views(params, lo, hi)
    return torch.cat(pieces) if pieces else torch.empty(0)


def flat_grads(unit: nn.Module) -> torch.Tensor:
    """A concatenated copy of the unit's gradients (zeros for a parameter without one)."""
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in unit.parameters()]
    return torch.cat(grads) if grads else torch.empty(0)


def assign_flat(unit: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector into the unit's parameters (exact bits)."""
    numel = sum(p.numel() for p in unit.parameters())
    if flat.numel() != numel:
        raise ValueError(f"flat vector has {flat.numel()} elements, unit has {numel}")
    offset = 0
    with torch.no_grad():
        view = as_flat_view([p.detach() for p in unit.parameters()])
        if view is not None:  # a flat unit: one copy into its buffer
            view.copy_(flat)
            return
        for p in unit.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def flattenable(unit: nn.Module) -> bool:
    """Whether a unit can live in one flat buffer: it has parameters, all floating point, of one
    dtype and on one device."""
    params = list(unit.parameters())
    return bool(params) and all(
        p.is_floating_point() and p.dtype == params[0].dtype and p.device == params[0].device for p in params
    )


_Structure = tuple[tuple[nn.Module, tuple[object, ...], tuple[object, ...]], ...]


def _structure(unit: nn.Module) -> _Structure:
    """Every module of `unit` (each once, as `named_modules` visits them) with the objects in
    its submodule and parameter slots."""
    seen: set[int] = set()
    out: list[tuple[nn.Module, tuple[object, ...], tuple[object, ...]]] = []
    stack = [unit]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        children = tuple(module._modules.values())
        out.append((module, children, tuple(module._parameters.values())))
        stack.extend(c for c in children if c is not None)
    return tuple(out)


def _unchanged(structure: _Structure) -> bool:
    """Whether every slot of `structure` still holds the same object (compared by identity:
    `==` on two parameters would compare their values)."""
    for module, children, params in structure:
        now_children, now_params = module._modules.values(), module._parameters.values()
        if len(now_children) != len(children) or len(now_params) != len(params):
            return False
        if not all(map(is_, now_children, children)) or not all(map(is_, now_params, params)):
            return False
    return True


class FlatUnit:
    """One unit's parameters and gradients as views of two flat buffers (module docstring)."""

    def __init__(self, unit: nn.Module) -> None:
        if not flattenable(unit):
            raise ValueError("a flat unit needs floating-point parameters of one dtype and device")
        self.unit = unit
        self._adopt()

    def _adopt(self) -> None:
        self.params = list(self.unit.parameters())
        sizes = [p.numel() for p in self.params]
        view = as_flat_view(self.params)
        if view is None:  # copy the values once into a new buffer and re-point the parameters
            first = self.params[0]
            view = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
            with torch.no_grad():
                for p, part in zip(self.params, view.split(sizes), strict=True):
                    part.copy_(p.detach().reshape(-1))
                    p.data = part.view_as(p)
        self.flat = view
        self.numel = view.numel()
        self.grad = torch.zeros_like(view)
        self._grad_views = [g.view_as(p) for g, p in zip(self.grad.split(sizes), self.params, strict=True)]
        self._ptrs = [p.data_ptr() for p in self.params]
        self._structure = _structure(self.unit)
        # A unit that trains in part (LoRA, BitFit): only the regions that can hold a gradient
        # are cleared, those of parameters that train or trained at the last clear
        self._partial = not all(p.requires_grad for p in self.params)
        self._trained: set[int] = set()
        self._copied: set[int] = set()  # gradient regions a replaced `.grad` was copied into

    def intact(self) -> bool:
        """Whether every parameter is still the view it was made (the same tensors, in place).
        Asked several times a step, so it compares the module tree recorded at adoption rather
        than walking `parameters()` again (a third of the cost on a transformer block): the
        same submodules and parameter slots give the same `parameters()`."""
        return _unchanged(self._structure) and all(
            p.data_ptr() == ptr for p, ptr in zip(self.params, self._ptrs, strict=True)
        )

    def ensure(self) -> None:
        """Adopt the unit again if a parameter was re-pointed since (its values are kept)."""
        if not self.intact():
            if not flattenable(self.unit):
                raise ValueError("a flat unit's parameters changed dtype or device and can no longer be flat")
            self._adopt()

    def relocate(self) -> torch.Tensor:
        """Move the parameters into a fresh buffer holding the same values (and a fresh gradient
        buffer) and return the old parameter buffer. A receive posted into the old buffer and
        never completed (a step abandoned on a failure) can still land there, from a peer that
        has not yet seen the failure: it must not land in the state a rollback restores. The
        caller keeps the old buffer for as long as a collective may still write it (on gloo,
        dropping the work cancels the receive; a device collective runs until its group is
        aborted, `UnitExchange._release_receiving`)."""
        old = self.flat
        fresh = old.clone()
        with torch.no_grad():
            for p, part in zip(self.params, fresh.split([p.numel() for p in self.params]), strict=True):
                p.data = part.view_as(p)
        self._adopt()
        return old

    def zero_grads(self) -> None:
        """Clear the gradient buffer and make it every trainable parameter's `.grad`, so backward
        accumulates straight into it (autograd adds into an existing `.grad` in place). Call
        `ensure` first when a parameter may have been re-pointed (`UnitExchange._flat` does, once
        a step)."""
        if not self._partial:
            self.grad.zero_()
        for i, (p, g) in enumerate(zip(self.params, self._grad_views, strict=True)):
            if self._partial and (p.requires_grad or i in self._copied or i in self._trained):
                g.zero_()  # a frozen region stays zero: nothing accumulates into it
            p.grad = g if p.requires_grad else None
        self._copied.clear()
        self._trained = {i for i, p in enumerate(self.params) if p.requires_grad}

    def grads(self) -> torch.Tensor:
        """The flat gradient: the buffer itself, after copying in any `.grad` that is not its view
        and clearing the regions of dropped ones (zeros for a parameter without a gradient).
        `ensure` first, as for `zero_grads`."""
        for i, (p, g) in enumerate(zip(self.params, self._grad_views, strict=True)):
            mine = p.grad
            if mine is None:
                if p.requires_grad or i in self._copied:
                    g.zero_()
            elif mine.data_ptr() != g.data_ptr() or mine.shape != g.shape:
                g.copy_(mine)
                self._copied.add(i)
        return self.grad


def flat_units(units: Mapping[str, nn.Module]) -> dict[str, FlatUnit]:
    """Flat buffers for every unit of a stage that can have one: flattenable, and sharing no
    parameter with another unit of the stage (a tie on one stage is one parameter in two units,
    which one buffer per unit cannot hold; those units keep the copying path)."""
    owners: dict[int, set[str]] = {}
    for name, unit in units.items():
        for p in unit.parameters():
            owners.setdefault(id(p), set()).add(name)
    shared = {n for names in owners.values() if len(names) > 1 for n in names}
    return {n: FlatUnit(u) for n, u in units.items() if n not in shared and flattenable(u)}
