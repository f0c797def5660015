"""What a worker builds before its first step (executor.warm_runtime), in a fresh interpreter
each: torch's lazy import of a backward with explicit gradients is done, the imports are frozen
out of the collector's walk, and what is built afterwards is still collected."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]

PROBE = """\
import dataclasses, gc, json, sys, weakref
import torch
from executor.warm_runtime import prepare_runtime

warmup = prepare_runtime() if sys.argv[1] == "prepared" else None
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
}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
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
