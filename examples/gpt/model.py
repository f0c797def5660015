"""A small GPT-style decoder written against the public API, as any user's model would be.

The model is a list of units: `"embed"` (token + position embedding), `"block_<i>"` (pre-norm
transformer blocks) and `"head"` (final norm + LM head). Nothing is tied across units (the LM
head has its own weight). `gpt_units(cfg)` hands them to ElasWave; the engine builds each unit
under a seed that depends only on its name, so `_init_unit`'s generator (keyed by the name too)
gives the same GPT-2-style initial weights whichever rank builds it. Dropout is
`elaswave.dropout`, whose mask for a sample does not depend on which rank runs it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import elaswave

SITE_EMBED, SITE_ATTN, SITE_MLP = 0, 1, 2

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


def _init_unit(module: nn.Module, name: str, init_seed: int) -> None:
    """GPT-2 style init, drawn from a generator keyed by the unit name (placement-independent)."""
    gen = torch.Generator().manual_seed(elaswave.unit_seed(init_seed, name))
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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)[None]
        return elaswave.dropout(x, self.cfg.dropout, SITE_EMBED, self.training)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention + MLP, dropout on both residual branches."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(
            cfg.hidden, 3 * cfg.hidden, bias=False
        )  # a key bias has an exactly-zero gradient (softmax shift), which Adam would turn into round-off-driven updates
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.cfg.dropout
        x = x + elaswave.dropout(self._attention(self.ln1(x)), p, SITE_ATTN, self.training)
        mlp = self.out(F.gelu(self.fc(self.ln2(x))))
        return x + elaswave.dropout(mlp, p, SITE_MLP, self.training)


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
    return (
        F.cross_entropy(logits.reshape(b * t, v), targets.reshape(b * t), reduction="none").view(b, t).mean(1)
    )


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


def unit_names(cfg: ModelConfig) -> list[str]:
    """Every unit of the model, in forward order."""
    return [EMBED, *(block_name(i) for i in range(cfg.num_layers)), HEAD]


def block_numel(cfg: ModelConfig) -> int:
    """Parameters of one block."""
    return sum(p.numel() for p in Block(cfg, 0).parameters())


def gpt_units(cfg: ModelConfig) -> elaswave.Units:
    """The model as ElasWave units (what a training script hands to `elaswave.train`)."""
    return elaswave.Units(unit_names(cfg), functools.partial(build_unit, cfg), init_seed=cfg.init_seed)
