"""Tiny `transformers` models with tied embeddings, their token data, and the reference: a plain
`transformers` + `torch.optim` loop (tests/api/test_hf*.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the optional extra elaswave[hf]")

import transformers  # noqa: E402

from elaswave.data import TokenFile, write_tokens  # noqa: E402
from elaswave.hf import causal_lm, from_hf_key, token_loss  # noqa: E402
from executor.optim import OptimizerConfig  # noqa: E402
from executor.sampler import GlobalBatchSampler  # noqa: E402
from executor.trainer import TrainSpec  # noqa: E402

VOCAB, SEQ, BATCH, SLOTS = 64, 12, 8, 2
LR, WD = 3e-3, 0.01
UNITS = ("embed", "layer0", "layer1", "head")


def tiny_config(kind: str = "llama", tied: bool = True, **kw: Any) -> Any:
    """A 2-layer model of hidden size 32 (the units: embed, layer0, layer1, head)."""
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": tied,
        **kw,
    }
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=tied, **kw
        )
    return transformers.AutoConfig.for_model(kind, **common)


def token_file(directory: Path, num_tokens: int = 2048, seed: int = 0) -> Path:
    """A flat uint16 token file of a random walk over the vocabulary (learnable, not uniform)."""
    rng = np.random.default_rng(seed)
    steps = rng.integers(-2, 3, size=num_tokens)
    path = directory / "tokens.bin"
    write_tokens((np.cumsum(steps) % VOCAB).tolist(), path)
    return path


def adamw() -> OptimizerConfig:
    return OptimizerConfig("adamw", lr=LR, weight_decay=WD)


def hf_spec(config: Any, data: Path, recompute: bool = False) -> TrainSpec:
    return TrainSpec(causal_lm(config, recompute=recompute), token_loss, TokenFile(data, SEQ), adamw())


def reference(
    config: Any, data: Path, steps: int, max_grad_norm: float | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain loop: `AutoModelForCausalLM.from_config` drawn as `causal_lm` draws it (seed 0),
    `torch.optim.AdamW`, the global batches in the engine's sample order. Returns the losses and
    the final state with units keys."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    sampler = GlobalBatchSampler(TokenFile(data, SEQ), BATCH)
    losses = []
    for step in range(steps):
        rows = sampler.rows(step, 0, BATCH)
        opt.zero_grad()
        loss = token_loss(model(rows.inputs).logits, rows.targets).mean()
        loss.backward()
        if max_grad_norm is not None:  # parameters(): the tied weight counted once
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        losses.append(float(loss.detach()))
    state = {from_hf_key(config, k): v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state


def tied_pair(config: Any) -> tuple[str, str]:
    embed = "embed.wte.weight" if config.model_type == "gpt2" else "embed.embed_tokens.weight"
    return embed, "head.lm_head.weight"


def unit_state(units: Any, flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`"<unit>.<param>"` tensors from flat unit vectors (a merged job state's `param`s)."""
    out = {}
    for i, name in enumerate(units.names):
        unit = units.build(i)
        pos = 0
        for pname, p in unit.named_parameters():
            out[f"{name}.{pname}"] = flat[name][pos : pos + p.numel()].view_as(p)
            pos += p.numel()
    return out


def assert_states_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 2e-5
) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    worst = {k: float((got[k] - want[k]).abs().max()) for k in want}
    assert max(worst.values()) <= atol, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
