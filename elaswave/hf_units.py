"""The unit modules `elaswave.hf.causal_lm` cuts a `transformers` decoder-only model into.

Every unit registers the `transformers` submodules it runs *as its own children*, under their
`transformers` names, so a unit's `state_dict` keys are the model's keys minus one prefix
(`elaswave.hf.to_hf_key`): `layer3.self_attn.q_proj.weight` is `model.layers.3.self_attn.q_proj.weight`.

Between units the activation is a tuple `(hidden, position_ids[, attention_mask])`: the hidden
states (float, carries the gradient), the integer position ids and, when the data has one, the
integer padding mask. Each decoder-layer unit derives what its layer needs from them exactly as
the `transformers` model's own forward does (rotary cos/sin from the position ids, the causal or
sliding-window mask from the padding mask), so the units compute what the model computes.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

Carry = tuple[torch.Tensor, ...]


def _positions(input_ids: torch.Tensor) -> torch.Tensor:
    """`arange(T)` for every sample: position ids cross unit boundaries with a sample dimension."""
    b, t = input_ids.shape
    return torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t).contiguous()


def _carry(hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> Carry:
    return (hidden, positions) if mask is None else (hidden, positions, mask)


def attention_kind(config: Any, index: int) -> str:
    """ "full_attention" or "sliding_attention" for decoder layer `index`, as the model decides."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return str(types[index])
    if config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


def _mask(
    config: Any, index: int, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None
) -> Any:
    from transformers import masking_utils  # noqa: PLC0415 - the optional extra elaswave[hf]

    fn = (
        masking_utils.create_sliding_window_causal_mask
        if attention_kind(config, index) == "sliding_attention"
        else masking_utils.create_causal_mask
    )
    cache_arg = "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"
    kwargs = {"config": config, "inputs_embeds": hidden, "attention_mask": mask, cache_arg: None}
    return fn(position_ids=positions[:1], **kwargs)


def _hidden(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # transformers 4.x layers return tuples


class _Adopting(nn.Module):
    """Registers the children of a `transformers` module as its own (same names, same order) and
    keeps the module itself, unregistered, to call its forward."""

    inner: nn.Module

    def _adopt(self, module: nn.Module) -> None:
        for name, child in module.named_children():
            self.add_module(name, child)
        for name, p in module.named_parameters(recurse=False):
            self.register_parameter(name, p)
        object.__setattr__(self, "inner", module)


class RotaryEmbed(nn.Module):
    """Unit "embed" of the Llama / Qwen2 / Qwen3 / Mistral families: the token embedding."""

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Carry:
        return _carry(self.embed_tokens(input_ids), _positions(input_ids), attention_mask)


class RotaryLayer(_Adopting):
    """Unit "layer<i>": one decoder layer, with the model's rotary embedding (buffers only)."""

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config: Any, index: int) -> None:
        super().__init__()
        self._adopt(layer)
        self.rotary_emb = rotary_emb
        object.__setattr__(self, "config", config)
        self.index = index

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None
    ) -> Carry:
        row = positions[:1]  # the model's own (1, T) position ids, broadcast over the samples
        out = self.inner(
            hidden,
            attention_mask=_mask(self.config, self.index, hidden, positions, mask),
            position_ids=row,
            position_embeddings=self.rotary_emb(hidden, row),
        )
        return _carry(_hidden(out), positions, mask)


class RotaryHead(nn.Module):
    """Unit "head": the final norm and the LM head; returns the logits `(rows, T, vocab)`."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        return logits


class Gpt2Embed(nn.Module):
    """Unit "embed" of GPT-2: token and learned position embeddings, then the embedding dropout."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Carry:
        positions = _positions(input_ids)
        hidden = self.drop(self.wte(input_ids) + self.wpe(positions[:1]))
        return _carry(hidden, positions, attention_mask)


class Gpt2Layer(_Adopting):
    """Unit "layer<i>" of GPT-2: one block."""

    def __init__(self, block: nn.Module, config: Any, index: int) -> None:
        super().__init__()
        self._adopt(block)
        object.__setattr__(self, "config", config)
        self.index = index

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None
    ) -> Carry:
        causal = _mask(self.config, self.index, hidden, positions, mask)
        out = self.inner(hidden, None, causal, position_ids=positions[:1])
        return _carry(_hidden(out), positions, mask)


class Gpt2Head(nn.Module):
    """Unit "head" of GPT-2: the final LayerNorm and the LM head."""

    def __init__(self, ln_f: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.ln_f(hidden))
        return logits
