"""The user's model as an ordered list of named units (docs/api.md, "Model as units").

A unit is any `nn.Module`; units may differ in size and kind. Unit `i` is layer `i` of the
job's Layout (`Layout.layer_numel[i]` is its parameter count), the unit of pipeline partitioning
and of layer migration (ElasWave §4.2, §6.2). Every rank that holds unit `i` builds it with
`UnitModel.build(i)`: the user's constructor runs under a torch seed that depends only on the
unit's name (and the job's `init_seed`), or the unit is loaded from the user's own state dict,
so unit `i` is the same tensor on every rank that builds it. The engine never re-initialises it.

The activation between units is a tensor or a tuple of tensors whose first dimension is the
sample. How a unit receives a tuple is one rule per way of building the model (`TupleRule`):
`Units(...)`, a list or a dict unpack it, `unit(*x)`; an `nn.Sequential` passes it whole,
`unit(x)`, as `nn.Sequential.forward` does. Per-sample shapes and dtypes at every unit boundary
are discovered by a dry run (`executor.dry_run`: the units are built one at a time and run on
one sample on the CPU). Declared tied parameters are kept equal by executor.tied; `recompute`
names units whose forward is recomputed in the backward (executor.recompute).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from executor.rng import mix64
from executor.tied import TiedPair, get_param, parse_ties

Activation = torch.Tensor | tuple[torch.Tensor, ...]
# "unpack": a tuple activation is passed as arguments, unit(*x) (Units(...), a list, a dict);
# "whole": it is passed as one argument, unit(x), as nn.Sequential passes it.
TupleRule = Literal["unpack", "whole"]
RULE_TEXT = {
    "unpack": "units given as Units(...), a list or a dict receive a tuple activation unpacked, unit(*x)",
    "whole": "units given as an nn.Sequential receive a tuple activation whole, unit(x), as nn.Sequential does",
}


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
                f"sample; got {describe(x)}"
            )
        return ActivationSpec(
            tuple(TensorSpec(tuple(t.shape[1:]), t.dtype) for t in items), isinstance(x, tuple)
        )

    def bytes_per_sample(self) -> int:
        return sum(t.bytes_per_sample() for t in self.tensors)


def describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor {tuple(x.shape)} {x.dtype}"
    if isinstance(x, tuple | list):
        return f"{type(x).__name__} of ({', '.join(describe(v) for v in x)})"
    return type(x).__name__


def as_tuple(x: Activation) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def call_unit(unit: nn.Module, x: Activation, rule: TupleRule = "unpack") -> Activation:
    """Run one unit: `unit(*x)` for a tuple activation under the "unpack" rule, else `unit(x)`."""
    return unit(*x) if isinstance(x, tuple) and rule == "unpack" else unit(x)


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
    weights under `"<unit name>.<parameter>"` and overrides what the constructor drew.
    `tied`: `("unit.param", "unit.param")` pairs that are one weight (executor.tied); the later
    unit's copy starts as the earlier one's. `recompute`: True (every unit) or the names of the
    units whose forward is recomputed in the backward. `tuple_rule`: see the module docstring."""

    def __init__(
        self,
        names: Sequence[str],
        build_unit: Callable[[str], nn.Module],
        init_seed: int = 0,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        *,
        tied: Sequence[tuple[str, str]] = (),
        recompute: bool | Sequence[str] = False,
        tuple_rule: TupleRule = "unpack",
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
        try:
            self.tied: tuple[TiedPair, ...] = parse_ties(tied, names)
        except ValueError as exc:
            raise UnitBuildError(str(exc)) from exc
        if isinstance(recompute, bool):
            self.recompute = frozenset(names) if recompute else frozenset()
        elif isinstance(recompute, str) or not set(recompute) <= set(names):
            raise UnitBuildError(
                f"recompute must be True, False or a list of unit names of {list(names)}, got {recompute!r}"
            )
        else:
            self.recompute = frozenset(recompute)
        if tuple_rule not in RULE_TEXT:
            raise UnitBuildError(f"tuple_rule must be 'unpack' or 'whole', got {tuple_rule!r}")
        self.tuple_rule: TupleRule = tuple_rule
        self._tied_init: dict[tuple[str, str], torch.Tensor] = {}
        # JSON-able facts about the model that checkpoints record (elaswave.hf: the config).
        self.extra: dict[str, Any] = {}

    def replace(
        self, init_seed: int | None = None, state_dict: Mapping[str, torch.Tensor] | None = None
    ) -> UnitModel:
        """The same model with another `init_seed` and/or starting `state_dict`."""
        out = UnitModel(
            self.names,
            self._build,
            self.init_seed if init_seed is None else init_seed,
            self._state if state_dict is None else state_dict,
            tied=[p.keys for p in self.tied],
            recompute=sorted(self.recompute),
            tuple_rule=self.tuple_rule,
        )
        out.extra = dict(self.extra)
        return out

    @staticmethod
    def from_modules(modules: nn.Sequential | Sequence[nn.Module] | Mapping[str, nn.Module]) -> UnitModel:
        """Units from modules the script already built (an `nn.Sequential`, a list, or a dict).

        Their weights are whatever the script drew, so the script must draw them the same way in
        every process (seed before building: `torch.manual_seed(0)`); the launcher compares the
        units' fingerprints across processes and refuses a job whose processes disagree. A
        parameter shared by exactly two of the modules becomes a tied pair (executor.tied). An
        `nn.Sequential` keeps its own calling rule: a tuple activation is passed whole."""
        if isinstance(modules, nn.Sequential | nn.ModuleDict | Mapping):
            named = dict(modules.named_children() if isinstance(modules, nn.Module) else modules.items())
        else:
            named = {str(i): m for i, m in enumerate(modules)}
        for name, m in named.items():
            if not isinstance(m, nn.Module):
                raise UnitBuildError(f"unit {name!r} is a {type(m).__name__}, not an nn.Module")
        # Found before the deep copies below, which untie a shared weight (the tie re-links it).
        tied = shared_parameters(named)
        rule: TupleRule = "whole" if isinstance(modules, nn.Sequential) else "unpack"
        return UnitModel(tuple(named), lambda name: copy.deepcopy(named[name]), tied=tied, tuple_rule=rule)

    def __len__(self) -> int:
        return len(self.names)

    def index(self, name: str) -> int:
        return self.names.index(name)

    def build(self, index: int, device: torch.device | str = "cpu") -> nn.Module:
        """Unit `index`, built as the class docstring says, on `device`."""
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
        for pair in self.tied:
            if pair.follower[0] == name:
                self._copy_leader(pair, unit)
        return unit.to(device)

    def _copy_leader(self, pair: TiedPair, unit: nn.Module) -> None:
        """The follower's copy starts as the leader's initial value (built once, then kept)."""
        if pair.leader not in self._tied_init:
            leader = self.build(self.index(pair.leader[0]))
            try:
                self._tied_init[pair.leader] = get_param(leader, pair.leader[1]).detach().clone()
            except ValueError as exc:
                raise UnitBuildError(f"tied pair {pair.keys}: unit {pair.leader[0]!r}: {exc}") from exc
        value = self._tied_init[pair.leader]
        try:
            mine = get_param(unit, pair.follower[1])
        except ValueError as exc:
            raise UnitBuildError(f"tied pair {pair.keys}: unit {pair.follower[0]!r}: {exc}") from exc
        if mine.shape != value.shape or mine.dtype != value.dtype:
            raise UnitBuildError(
                f"tied parameters {pair.keys} differ in shape or dtype: {tuple(value.shape)} "
                f"{value.dtype} vs {tuple(mine.shape)} {mine.dtype}"
            )
        with torch.no_grad():
            mine.copy_(value)

    def _load_user_state(self, name: str, unit: nn.Module) -> None:
        if self._state is None:
            return
        prefix = f"{name}."
        mine = {k[len(prefix) :]: v for k, v in self._state.items() if k.startswith(prefix)}
        for pair in self.tied:  # a state dict may hold a tied weight once, under the leader's key
            lead, follow = pair.keys
            if pair.follower[0] == name and lead in self._state:
                if follow in self._state and not torch.equal(self._state[follow], self._state[lead]):
                    raise UnitBuildError(
                        f"state_dict holds different values for the tied weights {pair.keys}"
                    )
                mine.setdefault(pair.follower[1], self._state[lead])
        try:
            unit.load_state_dict(mine, strict=True)
        except RuntimeError as exc:
            raise UnitBuildError(f"state_dict does not fit unit {name!r}: {exc}") from exc

    def check_sharing(self, units: Mapping[str, nn.Module]) -> None:
        """Refuse parameters shared between units unless they are a declared tied pair."""
        declared = {frozenset((p.leader, p.follower)) for p in self.tied}
        check_shared(units, declared)


def shared_parameters(units: Mapping[str, nn.Module]) -> list[tuple[str, str]]:
    """`("unit.param", "unit.param")` of every parameter object held by exactly two units;
    UnitBuildError for one held by more (a tie is a pair)."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for uname, unit in units.items():
        for pname, p in unit.named_parameters():
            holders.setdefault(id(p), []).append((uname, pname))
    pairs = []
    for where in holders.values():
        if len({u for u, _ in where}) > 2:
            keys = [f"{u}.{n}" for u, n in where]
            raise UnitBuildError(
                f"parameter {keys[0]} is shared by {len(keys)} units ({keys}): ElasWave ties pairs of "
                "units only (an embedding and its LM head); give the others their own copy"
            )
        if len(where) == 2:
            pairs.append((f"{where[0][0]}.{where[0][1]}", f"{where[1][0]}.{where[1][1]}"))
    return pairs


def check_shared(units: Mapping[str, nn.Module], declared: set[frozenset[tuple[str, str]]]) -> None:
    owner: dict[int, tuple[str, str]] = {}
    for uname, unit in units.items():
        for pname, p in unit.named_parameters():
            other = owner.setdefault(id(p), (uname, pname))
            if other[0] != uname and frozenset((other, (uname, pname))) not in declared:
                raise UnitBuildError(
                    f"units {other[0]!r} and {uname!r} share a parameter ({other[0]}.{other[1]} is "
                    f"{uname}.{pname}) that is not declared tied: declare it with Units(..., "
                    f"tied=[({other[0] + '.' + other[1]!r}, {uname + '.' + pname!r})]) and ElasWave keeps "
                    "the two copies equal (Megatron-style), or give each unit its own copy"
                )
