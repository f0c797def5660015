"""What a worker builds before its first step (executor.warm_runtime), in a fresh interpreter
each: torch's lazy import of a backward with explicit gradients is done, the imports are frozen
out of the collector's walk, and what is built afterwards is still collected. A rank forked from
a fork server that preloads `executor.forkserver_warm` inherits all of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from executor.warm_runtime import LAZY_BACKWARD_IMPORTS, warm_autograd

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]

PROBE = """\
import dataclasses, gc, json, sys, weakref
import torch
from executor.warm_runtime import prepare_runtime

MODE = globals().get("MODE") or sys.argv[1]  # "forked": run by FORKED in its forked rank
warmup = prepare_runtime() if MODE == "prepared" else None
before = set(sys.modules)
x = torch.ones(3, requires_grad=True)
torch.autograd.backward([x * 3.0], [torch.full((3,), 2.0)])  # a middle stage's backward
imported = sorted(set(sys.modules) - before)

class Unit:  # a unit a plan moves away, caught in a reference cycle
    pass

a, b = Unit(), Unit()
a.peer, b.peer = b, a
gone = weakref.ref(a)
del a, b
gc.collect()
print(json.dumps({
    "imported": imported,
    "grad": x.grad.tolist(),
    "cycle_freed": gone() is None,
    "frozen": gc.get_freeze_count(),
    "warmup": dataclasses.asdict(warmup) if warmup else None,
}), flush=True)
"""

# One rank forked from a fork server that preloads the warm-up (`warm_forkserver`), as `tests/executor/ft_procs.py`
# and `executor.launch` start theirs; the rank runs PROBE.
FORKED = """\
import sys
from executor.warm_runtime import warm_forkserver
ctx = warm_forkserver(["torch"])
if __name__ == "__main__":
    rank = ctx.Process(target=exec, args=(sys.argv[1], {"__name__": "probe", "MODE": "forked"}))
    rank.start()
    rank.join(90)
    sys.exit(rank.exitcode)
"""


def _probe(mode: str) -> dict:
    argv = ["-c", FORKED, PROBE] if mode == "forked" else ["-c", PROBE, mode]
    out = subprocess.run(
        [sys.executable, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    )
    return json.loads(out.stdout)


def test_after_prepare_a_backward_with_gradients_imports_nothing_and_later_cycles_are_collected() -> None:
    cold, prepared = _probe("cold"), _probe("prepared")
    # The lazy import the first step after a regroup paid (this torch does it; see the module).
    assert "torch.fx.experimental.symbolic_shapes" in cold["imported"]
    assert cold["frozen"] == 0
    assert prepared["imported"] == []
    assert prepared["grad"] == cold["grad"] == [6.0, 6.0, 6.0]
    assert prepared["frozen"] == prepared["warmup"]["frozen_objects"] > 10_000
    assert prepared["cycle_freed"] and cold["cycle_freed"]


def test_a_rank_forked_from_a_warmed_fork_server_imports_nothing_in_its_first_backward() -> None:
    forked = _probe("forked")
    assert forked["imported"] == []
    assert forked["grad"] == [6.0, 6.0, 6.0]
    assert forked["frozen"] > 10_000  # the fork server's freeze, inherited
    assert forked["cycle_freed"]


def test_the_warm_up_imports_what_a_backward_would_without_running_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backward initialises CUDA (the autograd engine counts the devices for its threads): a
    zygote or fork server that ran one forks workers whose CUDA initialisation fails
    (make gpu-check (c) on an H200). The warm-up only imports."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the warm-up ran a backward")

    monkeypatch.setattr(torch.autograd, "backward", refuse)
    monkeypatch.setattr(torch.autograd, "grad", refuse)
    monkeypatch.setattr(torch.Tensor, "backward", refuse)
    warm_autograd()
    assert all(name in sys.modules for name in LAZY_BACKWARD_IMPORTS)
