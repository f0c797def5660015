"""What the runtime builds lazily, built before a worker's first step (issue 23, item 3).

The first step after a recovery cost ~3x a fault-free step (`bench.mttr`, one kill at
PP=2 x DP=4 on 2 CPU cores: 290-380 ms against ~100). Timing each pipeline operation of that
step found two causes, neither in the engine's own work:

- **A lazy import in the backward.** `torch.autograd.backward` imports
  `torch.fx.experimental.symbolic_shapes`, and with it sympy, the first time it is given
  explicit output gradients (`torch.autograd._make_grads`). A first or middle pipeline stage
  does that from its first step; a last stage never does. A rank that a plan moves off the
  last stage (a regroup into more stages) paid ~0.3 s of import inside its first backward,
  and every other rank waited for it through the pipeline. `warm_autograd` imports those
  modules. It runs no backward: a backward initialises CUDA, and a zygote or fork server must
  not, or the workers it forks cannot use the GPU.
- **Full garbage collections.** Python's generation-2 collection walks every object the
  interpreter tracks: ~180,000 once torch and the engine are imported, 0.3-0.4 s per collection
  with 8 workers on 2 cores. A recovery allocates enough (plans, groups, new buffers) to trigger
  one, so it landed in the apply or the first step of every worker at about the same time.
  `freeze_imports` collects once and moves what exists into the permanent generation
  (`gc.freeze`), out of every later collection's walk.

What is frozen is what the imports built: modules, classes, functions, the warm-up's own
objects, and what the user's script made before it handed over (its data, its unit factories).
A frozen object is still freed when its last reference goes; only a reference cycle among
frozen objects is never collected. The worker freezes before it builds its units, groups or
optimizer, so those stay fully collectable: a unit a plan moves away is freed even if it sits
in a reference cycle.

`agent.zygote` calls `prepare_zygote` after preloading this module: the import and the freeze
are then paid once per node, and a forked worker's own `prepare_runtime` only walks what the
fork added. Frozen objects are also never written by the collector, so the forked workers keep
sharing those pages with the zygote (copy-on-write).
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.context import ForkServerContext


@dataclass(frozen=True)
class RuntimeWarmup:
    """What `prepare_runtime` did, for the worker's results."""

    autograd_s: float  # the imports of a backward with explicit gradients
    freeze_s: float  # the collection before the freeze
    frozen_objects: int  # objects in the permanent generation after it


# What `torch.autograd.backward` imports the first time it is given explicit output gradients
# (`torch.autograd._make_grads`); tests/executor/test_warm_runtime.py checks that a backward
# after the warm-up imports nothing more.
LAZY_BACKWARD_IMPORTS = ("torch.fx.experimental.symbolic_shapes", "torch.nested._internal.nested_tensor")


def warm_autograd() -> None:
    """Import what a backward with explicit output gradients imports lazily, without running one.

    A backward would start the autograd engine's device threads, which ask CUDA how many devices
    there are; that initialises the CUDA driver in this process, and a process forked from it
    (every worker of a zygote or a fork server) then fails its own CUDA initialisation
    ("CUDA error: initialization error", seen by `make gpu-check` (c) on an H200).
    """
    for module in LAZY_BACKWARD_IMPORTS:
        importlib.import_module(module)


def freeze_imports() -> int:
    """Collect once, then move every tracked object out of later collections' walk; returns
    how many objects are frozen. Call it before building what may become garbage (module
    docstring)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def prepare_runtime() -> RuntimeWarmup:
    """`warm_autograd`, then `freeze_imports` (so the import's objects are frozen too)."""
    start = time.perf_counter()
    warm_autograd()
    warmed = time.perf_counter()
    frozen = freeze_imports()
    return RuntimeWarmup(warmed - start, time.perf_counter() - warmed, frozen)


def prepare_zygote() -> None:
    """`agent.zygote`'s hook for a preloaded module: what every forked worker would build."""
    prepare_runtime()


def warm_forkserver(preload: Sequence[str]) -> ForkServerContext:
    """The `forkserver` multiprocessing context, its server set to import `preload` and then
    `executor.forkserver_warm` (last, so what `preload` imports is frozen too): every process it
    forks starts as warm as a worker `agent.zygote` forks. Takes effect if this process's fork
    server has not started yet (it is shared by every caller)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*preload, "executor.forkserver_warm"])
    return ctx
