"""Preload module for a `multiprocessing` fork server: warm the runtime once, before any fork.

A fork server can only import the modules it is told to preload, so this module's import does
the work: `executor.warm_runtime.prepare_runtime` (torch's lazy imports of a backward with
explicit output gradients, then a freeze of what the imports built). Every rank the server forks
inherits both, as the workers `agent.zygote` forks do; without it each first or middle pipeline
stage rank imported sympy (~480 modules, ~0.5 s of CPU) inside its first backward.

Use `executor.warm_runtime.warm_forkserver(preload)`, which preloads this module last.
"""

from __future__ import annotations

from executor.warm_runtime import RuntimeWarmup, prepare_runtime

WARMUP: RuntimeWarmup = prepare_runtime()
