"""The overlap's hooks (executor.grad_overlap, issue 23): registered once and kept from step to
step, counting only while armed; registered again when the trainable parameters change; removed
by `release`. In-process: two small units and their backward, no peers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from executor.grad_overlap import OverlapLauncher


def _units() -> dict[str, nn.Linear]:
    torch.manual_seed(0)
    return {"a": nn.Linear(3, 4), "b": nn.Linear(4, 2)}


def _params(units: Mapping[str, nn.Module]) -> dict[str, list[torch.Tensor]]:
    return {n: list(u.parameters()) for n, u in units.items()}


def _backward(units: Mapping[str, nn.Module]) -> None:
    x = torch.ones(2, 3)
    units["b"](units["a"](x)).sum().backward()


def _hooks_on(p: torch.Tensor) -> int:
    return len(p._post_accumulate_grad_hooks or {})


def _launcher(launched: list[str]) -> OverlapLauncher:
    return OverlapLauncher(["b", "a"], launched.append)  # a backward finishes b first


def _counting_registrations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count every post-accumulate-grad hook registered from now on."""
    calls: list[int] = []
    real: Callable[..., Any] = torch.Tensor.register_post_accumulate_grad_hook

    def counted(self: torch.Tensor, hook: Any) -> Any:
        calls.append(1)
        return real(self, hook)

    monkeypatch.setattr(torch.Tensor, "register_post_accumulate_grad_hook", counted)
    return calls


def _step(launcher: OverlapLauncher, units: Mapping[str, nn.Module], launched: list[str]) -> list[str]:
    """One step of two micro-batches: an unarmed backward, then the armed last one. Returns
    what started during the armed backward (before `finish`)."""
    launcher.reset()
    _backward(units)  # the first micro-batch: the hooks fire unarmed and count nothing
    assert launched == []
    launcher.arm(_params(units))
    _backward(units)
    during = list(launched)
    launcher.finish()
    return during


def test_the_hooks_are_registered_once_and_count_only_while_armed(monkeypatch: pytest.MonkeyPatch) -> None:
    units = _units()
    registered = _counting_registrations(monkeypatch)
    launched: list[str] = []
    launcher = _launcher(launched)
    for _ in range(3):
        launched.clear()
        assert _step(launcher, units, launched) == ["b", "a"]  # both started inside the backward
        assert launched == ["b", "a"]
    assert len(registered) == 4 == launcher.hooks  # once, for the first step
    assert all(_hooks_on(p) == 1 for u in units.values() for p in u.parameters())
    launched.clear()
    _backward(units)  # after `finish` the hooks are on the parameters but count nothing
    assert launched == [] and launcher.started == 2


def test_a_parameter_that_accumulates_twice_while_armed_still_fails_the_step() -> None:
    units = _units()
    launched: list[str] = []
    launcher = _launcher(launched)
    launcher.arm(_params(units))
    x = torch.ones(2, 3)
    units["a"](x).sum().backward()
    with pytest.raises(RuntimeError, match="accumulated a gradient twice"):
        units["a"](x).sum().backward()  # a second backward into the armed step


def test_a_replaced_parameter_moves_the_hook_to_the_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    units = _units()
    launched: list[str] = []
    launcher = _launcher(launched)
    _step(launcher, units, launched)
    old = units["a"].weight
    units["a"].weight = nn.Parameter(old.detach().clone())  # a load with assign=True
    registered = _counting_registrations(monkeypatch)
    launched.clear()
    # the new weight counts: unit a starts inside the backward, not only at `finish`
    assert _step(launcher, units, launched) == ["b", "a"]
    assert len(registered) == 4 == launcher.hooks
    assert _hooks_on(old) == 0 and _hooks_on(units["a"].weight) == 1


def test_a_frozen_parameter_is_not_waited_for_and_an_unfrozen_one_is(monkeypatch: pytest.MonkeyPatch) -> None:
    units = _units()
    launched: list[str] = []
    launcher = _launcher(launched)
    _step(launcher, units, launched)
    units["a"].bias.requires_grad_(False)
    launched.clear()
    assert _step(launcher, units, launched) == ["b", "a"]  # a waits for its weight alone
    assert launcher.hooks == 3 and _hooks_on(units["a"].bias) == 0
    units["a"].bias.requires_grad_(True)
    registered = _counting_registrations(monkeypatch)
    launched.clear()
    assert _step(launcher, units, launched) == ["b", "a"]
    assert len(registered) == 4 == launcher.hooks


def test_release_removes_every_hook_and_the_next_arm_registers_them_again() -> None:
    units = _units()
    launched: list[str] = []
    launcher = _launcher(launched)
    _step(launcher, units, launched)
    launcher.arm(_params(units))  # armed, then the step raises: released
    launcher.release()
    assert launcher.hooks == 0
    assert all(_hooks_on(p) == 0 for u in units.values() for p in u.parameters())
    launched.clear()
    launcher.reset()
    _backward(units)
    assert launched == []  # nothing counts a released launcher's backward
    launched.clear()
    assert _step(launcher, units, launched) == ["b", "a"]
    assert launcher.hooks == 4
