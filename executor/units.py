"""The user's model as an ordered list of named units (docs/api.md, "Model as units").

A unit is any `nn.Module`; units may differ in size and kind. Unit `i` is layer `i` of the
job's Layout (`Layout.layer_numel[i]` is its parameter count), the unit of pipeline partitioning
and of layer migration (ElasWave §4.2, §6.2). Every rank that holds unit `i` builds it with
`UnitModel.build(i)`: the user's constructor runs under a torch seed that depends only on the
unit's name (and the job's `init_seed`), or the unit is loaded from the user's own state dict,
so unit `i` is the same tensor on every rank that builds it. The engine never re-initialises it.

The activation between units is a tensor or a tuple of tensors whose first dimension is the
sample; a unit is called `unit(x)` with a tensor, `unit(*x)` with a tuple. Per-sample shapes and
dtypes at every unit boundary are discovered by a dry run (`discover_boundaries`: the units are
built one at a time and run on one sample on the CPU).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from executor.rng import mix64

Activation = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an activation: its shape without the sample dimension, and its dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def carries_grad(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex

    def bytes_per_sample(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ActivationSpec:
    """What crosses one unit boundary: one tensor, or a tuple of tensors (`is_tuple`)."""

    tensors: tuple[TensorSpec, ...]
    is_tuple: bool

    @staticmethod
    def of(x: Activation) -> ActivationSpec:
        items = x if isinstance(x, tuple) else (x,)
        if not items or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in items):
            raise TypeError(
                "an activation must be a tensor, or a tuple of tensors, whose first dimension is the "
                f"sample; got {_describe(x)}"
            )
        return ActivationSpec(
            tuple(TensorSpec(tuple(t.shape[1:]), t.dtype) for t in items), isinstance(x, tuple)
        )

    def bytes_per_sample(self) -> int:
        return sum(t.bytes_per_sample() for t in self.tensors)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor {tuple(x.shape)} {x.dtype}"
    if isinstance(x, tuple | list):
        return f"{type(x).__name__} of ({', '.join(_describe(v) for v in x)})"
    return type(x).__name__


def as_tuple(x: Activation) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def call_unit(unit: nn.Module, x: Activation) -> Activation:
    """Run one unit: `unit(*x)` for a tuple activation, `unit(x)` for a tensor."""
    return unit(*x) if isinstance(x, tuple) else unit(x)


class UnitBuildError(ValueError):
    """A unit could not be built, or is not what the model says it is."""


def unit_seed(init_seed: int, name: str) -> int:
    """The torch seed a unit is built under: a function of the job's seed and the name only."""
    return mix64(init_seed, *name.encode())


def fingerprint(module: nn.Module) -> str:
    """A digest of a module's parameters (names, shapes and exact bits)."""
    h = hashlib.blake2b(digest_size=12)
    for pname, p in module.named_parameters():
        h.update(pname.encode())
        h.update(str(tuple(p.shape)).encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class UnitModel:
    """An ordered list of named units and the way to build any of them on any rank.

    `build_unit(name)` is called under `torch.manual_seed(unit_seed(init_seed, name))` (the
    caller's RNG state is restored afterwards); `state_dict`, when given, holds each unit's
    weights under `"<unit name>.<parameter>"` and overrides what the constructor drew."""

    def __init__(
        self,
        names: Sequence[str],
        build_unit: Callable[[str], nn.Module],
        init_seed: int = 0,
        state_dict: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        names = tuple(names)
        if not names:
            raise UnitBuildError("the model has no units")
        if len(set(names)) != len(names):
            raise UnitBuildError(f"unit names must be unique, got {list(names)}")
        bad = [n for n in names if not isinstance(n, str) or not n or "." in n]
        if bad:
            raise UnitBuildError(f"unit names must be non-empty strings without '.', got {bad}")
        self.names, self._build, self.init_seed = names, build_unit, init_seed
        self._state = dict(state_dict) if state_dict is not None else None
        if self._state is not None:
            unknown = sorted({k.split(".", 1)[0] for k in self._state} - set(names))
            if unknown:
                raise UnitBuildError(f"state_dict has keys for units {unknown} that the model does not have")

    @staticmethod
    def from_modules(modules: nn.Sequential | Sequence[nn.Module] | Mapping[str, nn.Module]) -> UnitModel:
        """Units from modules the script already built (an `nn.Sequential`, a list, or a dict).

        Their weights are whatever the script drew, so the script must draw them the same way in
        every process (seed before building: `torch.manual_seed(0)`); the launcher compares the
        units' fingerprints across processes and refuses a job whose processes disagree."""
        if isinstance(modules, nn.Sequential | nn.ModuleDict | Mapping):
            named = dict(modules.named_children() if isinstance(modules, nn.Module) else modules.items())
        else:
            named = {str(i): m for i, m in enumerate(modules)}
        for name, m in named.items():
            if not isinstance(m, nn.Module):
                raise UnitBuildError(f"unit {name!r} is a {type(m).__name__}, not an nn.Module")
        # Checked before the deep copies below, which would silently untie a shared weight.
        UnitModel.check_untied(named)
        return UnitModel(tuple(named), lambda name: copy.deepcopy(named[name]))

    def __len__(self) -> int:
        return len(self.names)

    def index(self, name: str) -> int:
        return self.names.index(name)

    def build(self, index: int, device: torch.device | str = "cpu") -> nn.Module:
        """Unit `index`, built as the module docstring says, on `device`."""
        name = self.names[index]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(unit_seed(self.init_seed, name))
            try:
                unit = self._build(name)
            except Exception as exc:
                raise UnitBuildError(f"building unit {name!r} failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(unit, nn.Module):
            raise UnitBuildError(f"build_unit({name!r}) returned {type(unit).__name__}, not an nn.Module")
        self._load_user_state(name, unit)
        return unit.to(device)

    def _load_user_state(self, name: str, unit: nn.Module) -> None:
        if self._state is None:
            return
        prefix = f"{name}."
        mine = {k[len(prefix) :]: v for k, v in self._state.items() if k.startswith(prefix)}
        try:
            unit.load_state_dict(mine, strict=True)
        except RuntimeError as exc:
            raise UnitBuildError(f"state_dict does not fit unit {name!r}: {exc}") from exc

    @staticmethod
    def check_untied(units: Mapping[str, nn.Module]) -> None:
        """Refuse parameters shared between units: a tied weight (an embedding reused by the head)
        would be updated twice, once on each stage that holds a copy."""
        owner: dict[int, str] = {}
        for name, unit in units.items():
            for p in unit.parameters():
                other = owner.setdefault(id(p), name)
                if other != name:
                    raise UnitBuildError(
                        f"units {other!r} and {name!r} share a parameter: tied weights across units "
                        "are not supported; give each unit its own copy (untie them)"
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
    function that hands two units the same tensor is refused even when the two would sit on
    different stages (a tied weight would be updated once per stage holding it)."""
    probes: list[UnitProbe] = []
    ActivationSpec.of(sample_input)  # a clear TypeError before slicing what is not a batch
    x: Activation = (
        tuple(t[:1] for t in sample_input) if isinstance(sample_input, tuple) else sample_input[:1]
    )
    owners: dict[int, tuple[str, nn.Parameter]] = {}
    for i, name in enumerate(model.names):
        unit = model.build(i, device)
        for p in unit.parameters():
            other = owners.setdefault(id(p), (name, p))[0]
            if other != name:
                raise UnitBuildError(
                    f"units {other!r} and {name!r} share a parameter: tied weights across units "
                    "are not supported; give each unit its own copy (untie them)"
                )
        x = _real_forward(unit, name, x)
        probes.append(
            UnitProbe(
                sum(p.numel() for p in unit.parameters()),
                sum(p.numel() * p.element_size() for p in unit.parameters()),
                ActivationSpec.of(x),
                tuple((n, tuple(p.shape)) for n, p in unit.named_parameters()),
                tuple(n for n, p in unit.named_parameters() if not p.requires_grad),
            )
        )
        del unit
    return tuple(probes)


def _real_forward(unit: nn.Module, name: str, x: Activation) -> Activation:
    try:
        with torch.no_grad():
            out = call_unit(unit, x)
    except Exception as exc:
        raise UnitBuildError(
            f"unit {name!r} failed on one sample of input {_describe(x)}: {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(out, list):
        out = tuple(out)
    try:
        ActivationSpec.of(out)
    except TypeError as exc:
        raise UnitBuildError(f"unit {name!r}: {exc}") from exc
    return out
