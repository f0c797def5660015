"""The one AdamW update both the live ZeRO shard and its ring snapshot apply (ElasWave §5.1).

A snapshot can only equal the live shard bit for bit if both run the same kernel on the same
operands in the same order, so there is exactly one function for it: torch's own single-tensor
AdamW (`foreach=False, fused=False`) on flat fp32 shard tensors, updated in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw


@dataclass(frozen=True)
class AdamWHyper:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        if self.lr < 0 or self.eps <= 0 or not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"invalid AdamW hyper-parameters {self}")


def adamw_shard_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    hp: AdamWHyper,
) -> None:
    """Apply AdamW step number `step` (1-based) to one flat shard, in place."""
    if step < 1:
        raise ValueError(f"AdamW step numbers start at 1, got {step}")
    if not (param.shape == grad.shape == exp_avg.shape == exp_avg_sq.shape):
        raise ValueError(
            f"shard shapes differ: param {tuple(param.shape)}, grad {tuple(grad.shape)}, "
            f"exp_avg {tuple(exp_avg.shape)}, exp_avg_sq {tuple(exp_avg_sq.shape)}"
        )
    # torch increments the step tensor before using it, so hand it the previous step count.
    state_step = torch.tensor(float(step - 1))
    adamw(
        [param], [grad], [exp_avg], [exp_avg_sq], [], [state_step],
        foreach=False, fused=False, capturable=False, differentiable=False,
        amsgrad=False, beta1=hp.beta1, beta2=hp.beta2, lr=hp.lr,
        weight_decay=hp.weight_decay, eps=hp.eps, maximize=False,
    )
