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
from operator import is_

import torch
from torch.utils.hooks import RemovableHandle


class OverlapLauncher:
    """Starts `launch(unit)` for the units of `order`, in that order, each as soon as it may.

    The hooks stay on the parameters from one step to the next and count only while armed: a
    step's `arm` registers them again only when the set of trainable parameters changed (a unit
    adopted again, a parameter frozen or unfrozen). Registering and removing one hook per
    parameter every step cost ~0.15 ms of Python a step on a 49-parameter model, more than the
    unarmed hooks cost in the earlier backwards (a call that returns at once). `release` removes
    them: a step that raised and an exchange that a new layout replaces (`UnitExchange.abandon_step`)."""

    def __init__(self, order: Sequence[str], launch: Callable[[str], None]) -> None:
        self.order, self.launch = list(order), launch
        self._next = 0
        self._armed = False
        self._waiting: dict[str, int] = {}
        self._counts: dict[str, int] = {}  # unit -> how many hooked parameters it waits for
        self._hooked: dict[str, tuple[torch.Tensor, ...]] = {}  # what carries a hook, per unit
        self._hooks: list[RemovableHandle] = []

    @property
    def started(self) -> int:
        """How many units of `order` have started this step."""
        return self._next

    @property
    def hooks(self) -> int:
        """How many parameters carry a hook of this launcher (armed or not)."""
        return len(self._hooks)

    def arm(self, params: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """Before the last backward: count down `params[unit]` (its trainable parameters) as
        autograd accumulates them; a unit not in `params` starts only at `finish`."""
        trainable = {name: tuple(p for p in params.get(name, ()) if p.requires_grad) for name in self.order}
        trainable = {name: ps for name, ps in trainable.items() if ps}
        if not self._same_as_hooked(trainable):
            self.release()
            for name, ps in trainable.items():
                for p in ps:
                    self._hooks.append(p.register_post_accumulate_grad_hook(partial(self._accumulated, name)))
            self._hooked = trainable
            self._counts = {name: len(ps) for name, ps in trainable.items()}
        self._waiting = dict(self._counts)
        self._armed = True

    def _same_as_hooked(self, trainable: Mapping[str, tuple[torch.Tensor, ...]]) -> bool:
        """Whether exactly these parameters carry the hooks (by identity: a parameter object
        replaced under the same unit has no hook, and `==` would compare values)."""
        hooked = self._hooked
        if trainable.keys() != hooked.keys():
            return False
        for name, ps in trainable.items():
            old = hooked[name]
            if len(ps) != len(old) or not all(map(is_, ps, old)):
                return False
        return True

    def _accumulated(self, name: str, _param: torch.Tensor) -> None:
        if not self._armed:  # an earlier micro-batch's backward, or a step that did not arm
            return
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
        """After the backward: start every unit not started yet, in order; the hooks stop
        counting (they stay on the parameters for the next step's `arm`)."""
        self.disarm()
        self._advance(flush=True)

    def disarm(self) -> None:
        """The hooks stop counting; nothing is removed."""
        self._armed = False
        self._waiting.clear()

    def reset(self) -> None:
        """A new step: nothing started, nothing armed."""
        self.disarm()
        self._next = 0

    def release(self) -> None:
        """Disarm and remove every hook from the parameters (a step that raised in the middle of
        an armed backward, or an exchange replaced by a new layout's)."""
        self.disarm()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._hooked, self._counts = {}, {}
