"""The optimizers a script picks, with torch.optim's names and defaults (docs/api.md, "Optimizer").

Each returns an `OptimizerConfig` (executor.optim): the engine applies it to ZeRO-1 slices, on
the live shards and on their ring snapshots alike. `schedule(t)` is the learning-rate factor of
update t (0-based; `warmup_cosine` is ready-made), `no_decay(name, param)` exempts parameters
from weight decay (`no_decay_norms_and_biases` is the usual rule), `max_grad_norm` clips by the
global gradient norm across every stage and shard.
"""

from __future__ import annotations

from executor.optim import NoDecay, OptimizerConfig, Schedule


def AdamW(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,  # noqa: N802
    weight_decay: float = 0.01,
    *,
    schedule: Schedule | None = None,
    no_decay: NoDecay | None = None,
    max_grad_norm: float | None = None,
) -> OptimizerConfig:
    """Adam with decoupled weight decay (torch.optim.AdamW's update and defaults)."""
    return OptimizerConfig(
        "adamw",
        lr,
        betas,
        eps,
        weight_decay,
        schedule=schedule,
        no_decay=no_decay,
        max_grad_norm=max_grad_norm,
    )


def Adam(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,  # noqa: N802
    weight_decay: float = 0.0,
    *,
    schedule: Schedule | None = None,
    no_decay: NoDecay | None = None,
    max_grad_norm: float | None = None,
) -> OptimizerConfig:
    """Adam with L2 weight decay added to the gradient (torch.optim.Adam's update and defaults)."""
    return OptimizerConfig(
        "adam",
        lr,
        betas,
        eps,
        weight_decay,
        schedule=schedule,
        no_decay=no_decay,
        max_grad_norm=max_grad_norm,
    )


def SGD(
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,  # noqa: N802
    nesterov: bool = False,
    *,
    schedule: Schedule | None = None,
    no_decay: NoDecay | None = None,
    max_grad_norm: float | None = None,
) -> OptimizerConfig:
    """SGD with optional (Nesterov) momentum and L2 weight decay (torch.optim.SGD's update)."""
    return OptimizerConfig(
        "sgd",
        lr,
        weight_decay=weight_decay,
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        schedule=schedule,
        no_decay=no_decay,
        max_grad_norm=max_grad_norm,
    )
