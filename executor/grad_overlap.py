"""Start each unit's ZeRO-1 reduce-scatter while the rest of the backward still runs (issue 23).

DDP hides most of its gradient all-reduce behind the backward: a bucket's all-reduce starts as
soon as autograd has produced the bucket's last gradient. The ZeRO-1 stage (executor.zero_exchange)
does the same per bucket of units (a large unit is a bucket of its own): armed right before the
step's last backward on this rank (the gradients of the earlier micro-batches are not final yet),
a post-accumulate-grad hook on every trainable parameter counts its bucket down, and a bucket
whose parameters have all accumulated is final. (Below, "unit" is whatever the caller launches.)

Collectives on a group must be issued in the same order on every rank, whatever order autograd
happens to finish the units in, so exchanges start along one fixed order (the stage's units in
reverse, the order a backward finishes them): a unit starts when it and every unit before it in
that order are final, like DDP's bucket order. Whatever has not started when the backward is over
(a unit with a parameter that got no gradient, a step that was not armed) starts then, in the same
order. Starting early changes when the exchange runs, never what it sums: the sums are formed
after the waits, in DP order, exactly as without the overlap.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch
from torch.utils.hooks import RemovableHandle


class OverlapLauncher:
    """Starts `launch(unit)` for the units of `order`, in that order, each as soon as it may."""

    def __init__(self, order: Sequence[str], launch: Callable[[str], None]) -> None:
        self.order, self.launch = list(order), launch
        self._next = 0
        self._waiting: dict[str, int] = {}
        self._hooks: list[RemovableHandle] = []

    @property
    def started(self) -> int:
        """How many units of `order` have started this step."""
        return self._next

    def arm(self, params: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """Before the last backward: count down `params[unit]` (its trainable parameters) as
        autograd accumulates them; a unit not in `params` starts only at `finish`."""
        self.disarm()
        for name in self.order:
            trainable = [p for p in params.get(name, ()) if p.requires_grad]
            if not trainable:
                continue
            self._waiting[name] = len(trainable)
            for p in trainable:
                self._hooks.append(p.register_post_accumulate_grad_hook(partial(self._accumulated, name)))

    def _accumulated(self, name: str, _param: torch.Tensor) -> None:
        self._waiting[name] -= 1
        if self._waiting[name] == 0:
            self._advance(flush=False)
        elif self._waiting[name] < 0:  # a second accumulation in one backward: a late gradient
            raise RuntimeError(
                f"unit {name!r}: a parameter accumulated a gradient twice in the last backward, "
                "possibly after its reduce-scatter started; turn the overlap off "
                "(Trainer.overlap_exchange = False) for this model"
            )

    def _advance(self, flush: bool) -> None:
        while self._next < len(self.order):
            name = self.order[self._next]
            if not flush and self._waiting.get(name, 1) != 0:
                return
            self._next += 1  # first: a launch that raises must not be retried out of order
            self.launch(name)

    def finish(self) -> None:
        """After the backward: start every unit not started yet, in order; drop the hooks."""
        self.disarm()
        self._advance(flush=True)

    def disarm(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._waiting.clear()

    def reset(self) -> None:
        """A new step: nothing started (also after a step that failed half-way)."""
        self.disarm()
        self._next = 0
