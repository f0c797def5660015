"""A model that is not the GPT, for the public-API tests: units of different kinds and sizes
(an embedding, a 1-D convolution, an MLP with a tuple activation, a head), a non-cross-entropy
loss (Huber on a regression target), SGD with Nesterov momentum, a warm-up + cosine schedule and
global-norm clipping. Everything is module-level so a spec can be pickled into rank processes."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.data import Dataset

from executor.optim import OptimizerConfig, no_decay_norms_and_biases, warmup_cosine
from executor.trainer import TrainSpec
from executor.units import UnitModel

VOCAB, SEQ = 32, 8
UNITS = ("embed", "conv", "split", "mlp", "merge", "head")


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 12)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens)  # (B, SEQ, 12)


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(12, 16, kernel_size=3, padding=1)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.conv(x.transpose(1, 2))).transpose(1, 2))  # (B, SEQ, 16)


class Split(nn.Module):
    """Emits a tuple: a pooled summary and the sequence, plus an int mask that carries no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mask = (x.sum(-1) > 0).to(torch.int64)
        return self.proj(x.mean(1)), x, mask


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 48), nn.Linear(48, 16)

    def forward(
        self, pooled: torch.Tensor, seq: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return pooled + self.fc2(torch.tanh(self.fc1(pooled))), seq, mask


class Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 16, bias=False)

    def forward(self, pooled: torch.Tensor, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask.unsqueeze(-1).to(seq.dtype)
        return pooled + self.gate((seq * weights).sum(1) / (weights.sum(1) + 1.0))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


BUILDERS = {"embed": Embed, "conv": Conv, "split": Split, "mlp": Mlp, "merge": Merge, "head": Head}


def build_unit(name: str) -> nn.Module:
    return BUILDERS[name]()


def huber_per_sample(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.huber_loss(output, target, reduction="none").mean(1)


class Regression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Token sequences and two regression targets computed from them (learnable)."""

    def __init__(self, n: int = 96, seed: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.y = torch.stack([self.x.float().mean(1) / VOCAB, (self.x[:, 0] % 2).float()], 1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def toy_optimizer(total_steps: int = 8) -> OptimizerConfig:
    return OptimizerConfig(
        "sgd",
        lr=0.2,
        momentum=0.9,
        nesterov=True,
        weight_decay=1e-3,
        schedule=functools.partial(_schedule, total_steps),
        no_decay=no_decay_norms_and_biases,
        max_grad_norm=0.5,
    )


def _schedule(total: int, t: int) -> float:
    return warmup_cosine(2, total, 0.1)(t)


def toy_spec(total_steps: int = 8, seed: int = 0) -> TrainSpec:
    return TrainSpec(
        UnitModel(UNITS, build_unit, init_seed=seed),
        huber_per_sample,
        Regression(),
        toy_optimizer(total_steps),
    )


class LoraLinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update `B @ A` (LoRA, Hu et al. 2021), as
    a parameter-efficient fine-tune wraps a model's projections."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def build_fine_tune(name: str) -> nn.Module:
    """The toy model as a parameter-efficient fine-tune: the embedding and the gate wholly
    frozen, LoRA on the split's projection and both MLP layers (their base weights and biases
    frozen, the adapters trainable: trainable runs between frozen ones), BitFit on the
    convolution (its weight frozen, its bias and norm trainable), the head trainable."""
    unit = build_unit(name)
    if name in ("embed", "merge"):
        unit.requires_grad_(False)
    elif name == "split":
        unit.proj = _lora(unit.proj)
    elif name == "mlp":
        unit.fc1, unit.fc2 = _lora(unit.fc1), _lora(unit.fc2)
    elif name == "conv":
        assert isinstance(unit, Conv)
        unit.conv.weight.requires_grad_(False)
    return unit


def _lora(layer: torch.Tensor | nn.Module) -> LoraLinear:
    """`layer` (a unit's nn.Linear, read as a module attribute) wrapped in LoRA."""
    assert isinstance(layer, nn.Linear)
    return LoraLinear(layer)
