"""When a plan nobody needs is worth its cost: the payback rule and the per-unit cool-down.

A plan for a lost rank or a joining spare is needed whatever it costs. A plan for a fail-slow
worker (or one that recovered) is optional: it buys a shorter step and costs a pause (every
executor stops at a step boundary and rebuilds its groups) plus the state it moves (each moved
unit's parameters and Adam moments, ElasWave §4.2). On a noisy machine such plans used to chase
measurement noise: unit 3 went stage 1->0 and back 0->1 again and again (issue 27). Two rules
settle them:

- payback: an optional plan is adopted only when its predicted gain per step, over
  `payback_steps` steps, is at least its cost (`plan_pause_s` + moved bytes / `state_bytes_per_s`);
- cool-down: an optional plan may not move a unit that another optional plan moved in the last
  `cooldown_steps` steps (moves forced by a loss or a join start no cool-down: they answer a
  new condition, not noise).
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

from planners.elaswave_graph import block_moves, describe
from planners.elaswave_reasons import Outcome, Reason, Step
from planners.layout import Layout

# Parameters plus Adam's two moments, fp32: what moves with a unit (ElasWave §4.2).
STATE_BYTES_PER_ELEMENT = 12


@dataclass(frozen=True)
class PaybackSettings:
    payback_steps: int = 100  # an optional plan must pay back its cost within this many steps
    cooldown_steps: int = 200  # a unit that moved stays put this many steps (optional plans)
    plan_pause_s: float = 0.2  # what one plan pauses the job for (the Core passes its measurement)
    state_bytes_per_s: float = 1e9  # how fast moved state travels

    def __post_init__(self) -> None:
        if self.payback_steps < 1 or self.cooldown_steps < 0:
            raise ValueError(
                f"payback_steps must be >= 1 and cooldown_steps >= 0, got {self.payback_steps}, "
                f"{self.cooldown_steps}"
            )
        if not (self.plan_pause_s >= 0 and self.state_bytes_per_s > 0):
            raise ValueError(
                f"plan_pause_s must be >= 0 and state_bytes_per_s > 0, got {self.plan_pause_s}, "
                f"{self.state_bytes_per_s}"
            )


def moved_bytes(old: Layout, new: Layout) -> int:
    """State one copy of every moved unit carries (parameters and Adam moments)."""
    return sum(old.layer_numel[b] * STATE_BYTES_PER_ELEMENT for b, _, _ in block_moves(old, new))


def judge_optional(
    old: Layout,
    new: Layout,
    t_before: float,
    t_after: float,
    unit: str,
    cooling: Set[int],
    settings: PaybackSettings,
) -> Reason | None:
    """Why the optional plan `old -> new` is not adopted (a DECLINED reason), or None to adopt it.
    `cooling`: units still in their cool-down; `unit`: the unit of `t_before`/`t_after`."""
    moves = block_moves(old, new)
    hot = [m for m in moves if m[0] in cooling]
    if hot:
        return Reason(
            Step.PAYBACK,
            Outcome.DECLINED,
            f"plan not adopted: it would move {describe(hot)}, which moved less than "
            f"{settings.cooldown_steps} steps ago (cool-down per unit)",
        )
    if not moves and _clocks_only_go_down(old, new):
        return None  # gives an up-clock back (energy, ElasWave §4.3): moves nothing, costs no speed
    if unit != "s":
        return None  # an uncalibrated model prices no pause: only the cool-down applies
    gain = t_before - t_after
    state = moved_bytes(old, new)
    cost = settings.plan_pause_s + state / settings.state_bytes_per_s
    if gain * settings.payback_steps >= cost:
        return None
    pays = f"in {cost / gain:.0f} steps" if gain > 0 else "never"
    return Reason(
        Step.PAYBACK,
        Outcome.DECLINED,
        f"plan not adopted: its predicted gain {gain:.4g} s per step pays back its cost {cost:.3g} s "
        f"(a {settings.plan_pause_s:.3g} s pause, {state:,} bytes of state moved) {pays}, "
        f"not within {settings.payback_steps} steps (payback rule)",
    )


def _clocks_only_go_down(old: Layout, new: Layout) -> bool:
    """Some rank's pinned clock changes and every change lowers it or unpins it (the device's
    default): an up-clock given back. A newly pinned rank counts as going up."""
    before, after = dict(old.frequencies_mhz), dict(new.frequencies_mhz)
    changed = [r for r in before.keys() | after.keys() if before.get(r) != after.get(r)]
    return bool(changed) and all(r in before and (r not in after or after[r] < before[r]) for r in changed)
