"""GPT-style decoder split into pipeline stages; transformer blocks are the unit of migration.

A stage builds only what it holds: the token+position embedding (first stage), blocks
`[layer_start, layer_stop)`, and the final norm + LM head (last stage). Nothing is tied across
stages. Every unit is initialised from a generator keyed by `(init_seed, unit name)`, so a block
has the same initial weights whichever stage builds it — a layout change never changes the model.

Units are named `"embed"`, `"block_<i>"` and `"head"`; the optimizer shards and the layer
migration work unit by unit, in `unit_order`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from executor.rng import EMBED_LAYER, SITE_ATTN, SITE_EMBED, SITE_MLP, DropoutRng, apply_dropout, mix64

EMBED = "embed"
HEAD = "head"


def block_name(layer: int) -> str:
    return f"block_{layer}"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 64
    seq_len: int = 16
    hidden: int = 32
    num_heads: int = 4
    num_layers: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0
    init_seed: int = 1234

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.seq_len, self.hidden, self.num_heads, self.num_layers) < 1:
            raise ValueError(f"model sizes must be positive: {self}")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by num_heads {self.num_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


@dataclass
class ForwardContext:
    """What a forward pass needs besides activations: the global ids of the rows, and the RNG."""

    samples: Sequence[int]
    rng: DropoutRng | None


def _init_unit(module: nn.Module, name: str, init_seed: int) -> None:
    """GPT-2 style init, drawn from a generator keyed by the unit name (placement-independent)."""
    gen = torch.Generator().manual_seed(mix64(init_seed, *name.encode()))
    with torch.no_grad():
        for pname, p in module.named_parameters():
            if pname.endswith("bias"):
                p.zero_()
            elif ".ln" in f".{pname}" or pname.startswith("ln"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)

    def forward(self, tokens: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)[None]
        return apply_dropout(x, self.cfg.dropout, ctx.rng, EMBED_LAYER, SITE_EMBED, ctx.samples)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention + MLP, dropout on both residual branches."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)  # a key bias has an exactly-zero gradient (softmax shift), which Adam would turn into round-off-driven updates
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        nh = self.cfg.num_heads
        q, k, v = self.qkv(x).view(b, t, 3, nh, h // nh).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(h // nh)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, h))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        p = self.cfg.dropout
        x = x + apply_dropout(self._attention(self.ln1(x)), p, ctx.rng, self.layer, SITE_ATTN, ctx.samples)
        mlp = self.out(F.gelu(self.fc(self.ln2(x))))
        return x + apply_dropout(mlp, p, ctx.rng, self.layer, SITE_MLP, ctx.samples)


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln_f(x))


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of each sample: shape (batch,)."""
    b, t, v = logits.shape
    return F.cross_entropy(logits.reshape(b * t, v), targets.reshape(b * t), reduction="none").view(b, t).mean(1)


def forward_units(units: Sequence[tuple[str, nn.Module]], x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """Run `units` in order (a stage's own units, or that list with a migrating block's shadow)."""
    for name, unit in units:
        x = unit(x) if name == HEAD else unit(x, ctx)
    return x


def build_unit(cfg: ModelConfig, name: str) -> nn.Module:
    """One freshly initialised unit; identical bits wherever it is built."""
    if name == EMBED:
        unit: nn.Module = Embedding(cfg)
    elif name == HEAD:
        unit = Head(cfg)
    elif name.startswith("block_"):
        layer = int(name.split("_", 1)[1])
        if not 0 <= layer < cfg.num_layers:
            raise ValueError(f"{name}: layer out of range [0, {cfg.num_layers})")
        unit = Block(cfg, layer)
    else:
        raise ValueError(f"unknown model unit {name!r}")
    _init_unit(unit, name, cfg.init_seed)
    return unit


def unit_order(num_layers: int, layer_start: int, layer_stop: int) -> list[str]:
    """Units a stage holding blocks `[layer_start, layer_stop)` owns, in forward order."""
    names = [EMBED] if layer_start == 0 else []
    names += [block_name(i) for i in range(layer_start, layer_stop)]
    if layer_stop == num_layers:
        names.append(HEAD)
    return names


def block_numel(cfg: ModelConfig) -> int:
    """Parameters of one block: what `Layout.layer_numel` must say for this model."""
    return sum(p.numel() for p in Block(cfg, 0).parameters())


class StageModel(nn.Module):
    """The units of one pipeline stage; `forward` runs them in order and returns the activations
    (or, on the last stage, the logits)."""

    def __init__(self, cfg: ModelConfig, layer_start: int, layer_stop: int,
                 reuse: Mapping[str, nn.Module] | None = None) -> None:
        """Build the units of `[layer_start, layer_stop)`; units named in `reuse` are taken as they
        are (a layout change keeps the modules it already has instead of re-initialising them)."""
        super().__init__()
        if not 0 <= layer_start < layer_stop <= cfg.num_layers:
            raise ValueError(f"stage layers [{layer_start}, {layer_stop}) invalid for {cfg.num_layers} layers")
        self.cfg = cfg
        self.layer_start, self.layer_stop = layer_start, layer_stop
        self.units = nn.ModuleDict()
        reuse = reuse or {}
        for name in unit_order(cfg.num_layers, layer_start, layer_stop):
            self.units[name] = reuse[name] if name in reuse else build_unit(cfg, name)

    @property
    def is_first(self) -> bool:
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        return self.layer_stop == self.cfg.num_layers

    def unit_names(self) -> list[str]:
        return list(self.units.keys())

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return forward_units(list(self.units.items()), x, ctx)
