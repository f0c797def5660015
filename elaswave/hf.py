"""`transformers` decoder-only models as ElasWave units (docs/huggingface.md).

    units = elaswave.hf.causal_lm(LlamaConfig(...))          # or a model, or a local directory
    elaswave.train(units, elaswave.hf.token_loss, elaswave.data.TokenFile("train.bin", 256), ...)

`causal_lm` cuts a Llama, Qwen2, Qwen3, Mistral or GPT-2 model into units `embed`, `layer0` ..
`layer<L-1>`, `head` (elaswave.hf_units) whose parameter names map one-to-one onto the model's
state dict (`to_hf_key`, `from_hf_key`). An input embedding tied to the LM head (the config's
`tie_word_embeddings`) becomes a declared tied pair (executor.tied). The extra `elaswave[hf]`
(`transformers`, `tokenizers`, `safetensors`) is imported only when these functions are called;
nothing is ever downloaded: configs are built in code and directories are read with
`local_files_only=True`.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from elaswave import hf_units
from executor.units import UnitModel

FAMILIES = {"llama": "rotary", "mistral": "rotary", "qwen2": "rotary", "qwen3": "rotary", "gpt2": "gpt2"}
KNOWN_ATTENTION = {"full_attention", "sliding_attention"}


class UnsupportedModel(ValueError):
    """A model `causal_lm` cannot cut into units (another architecture, or a config it cannot split)."""


def token_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-sample loss for `train`: the mean token cross-entropy of each sequence, shape `(rows,)`.

    `targets[i, t]` is the token that follows position t (already shifted, as `TokenFile` serves
    them); positions whose target is `ignore_index` count neither in the sum nor in the mean (a
    sequence with none left has loss 0)."""
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"token_loss needs logits (rows, T, vocab) and targets (rows, T); got {tuple(logits.shape)} "
            f"and {tuple(targets.shape)}"
        )
    rows, t, vocab = logits.shape
    ce = F.cross_entropy(
        logits.reshape(rows * t, vocab).float(),
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction="none",
    ).view(rows, t)
    counted = (targets != ignore_index).sum(dim=1).clamp(min=1)
    return ce.sum(dim=1) / counted


def _family(config: Any) -> str:
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        raise UnsupportedModel(
            f"model type {kind!r} is not supported by elaswave.hf.causal_lm (supported: "
            f"{', '.join(sorted(FAMILIES))}); describe it as units yourself with "
            "elaswave.Units(names, build_unit) (docs/huggingface.md, 'Other models')"
        )
    return FAMILIES[kind]


def check_splittable(config: Any) -> None:
    """UnsupportedModel saying why when the config's layers cannot be separate units."""
    _family(config)
    layers = getattr(config, "num_hidden_layers", None)
    problems = []
    if not isinstance(layers, int) or layers < 1:
        problems.append(f"num_hidden_layers must be >= 1, got {layers!r}")
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        problems.append("cross-attention needs the encoder's states in every layer")
    kinds = set(getattr(config, "layer_types", None) or ()) - KNOWN_ATTENTION
    if kinds:
        problems.append(f"layer_types {sorted(kinds)} (known: {sorted(KNOWN_ATTENTION)})")
    if problems:
        raise UnsupportedModel(
            f"{config.model_type} config cannot be split into units: " + "; ".join(problems)
        )


def unit_names(config: Any) -> tuple[str, ...]:
    return ("embed", *(f"layer{i}" for i in range(config.num_hidden_layers)), "head")


def _base(config: Any) -> str:
    return "transformer." if _family(config) == "gpt2" else "model."


def to_hf_key(config: Any, key: str) -> str:
    """The `transformers` state-dict key of a units key (`"<unit>.<parameter>"`)."""
    unit, rest = key.split(".", 1)
    base = _base(config)
    if unit == "embed":
        return base + rest
    if unit == "head":
        return rest if rest.startswith("lm_head.") else base + rest
    if unit.startswith("layer") and unit[5:].isdigit():
        return f"{base}{'h' if base == 'transformer.' else 'layers'}.{int(unit[5:])}.{rest}"
    raise KeyError(f"{key!r} is not a key of elaswave.hf units")


def from_hf_key(config: Any, key: str) -> str:
    """The units key of a `transformers` state-dict key (the inverse of `to_hf_key`)."""
    base = _base(config)
    if key.startswith("lm_head."):
        return f"head.{key}"
    if not key.startswith(base):
        raise KeyError(f"{key!r} is not a key of a {config.model_type} causal LM")
    rest = key[len(base) :]
    blocks = "h." if base == "transformer." else "layers."
    if rest.startswith(blocks):
        index, inner = rest[len(blocks) :].split(".", 1)
        return f"layer{index}.{inner}"
    if rest.split(".", 1)[0] in ("norm", "ln_f"):
        return f"head.{rest}"
    return f"embed.{rest}"


def tied_keys(config: Any) -> list[tuple[str, str]]:
    if not getattr(config, "tie_word_embeddings", False):
        return []
    embed = "embed.wte.weight" if _family(config) == "gpt2" else "embed.embed_tokens.weight"
    return [(embed, "head.lm_head.weight")]


class _Source:
    """The whole `transformers` model, made once per process on first use, that units are copied
    from (a config is instantiated under `init_seed`, so every process draws the same weights)."""

    def __init__(self, model_or_config: Any, init_seed: int) -> None:
        self._given, self._seed = model_or_config, init_seed
        self._model: nn.Module | None = None
        self._lock = threading.Lock()

    def model(self) -> nn.Module:
        with self._lock:
            if self._model is None:
                self._model = _instantiate(self._given, self._seed)
            return self._model

    def __getstate__(self) -> dict[str, Any]:  # rank processes receive the recipe, not the model
        return {"_given": self._given, "_seed": self._seed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["_given"], state["_seed"])  # type: ignore[misc]


class _Builder:
    """`build_unit` of `causal_lm` units (a class, not a closure: it is pickled to rank processes)."""

    def __init__(self, source: _Source, config: Any) -> None:
        self.source, self.config = source, config

    def __call__(self, name: str) -> nn.Module:
        return _build(self.source, self.config, name)


def _instantiate(given: Any, seed: int) -> nn.Module:
    import transformers  # noqa: PLC0415 - the optional extra elaswave[hf]

    if isinstance(given, nn.Module):
        return given
    if isinstance(given, str | Path):
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(given), local_files_only=True, dtype=torch.float32
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(given, dtype=torch.float32)


def load_config(model_or_config: Any) -> Any:
    """The `transformers` config of a model, a config, or a local model directory."""
    import transformers  # noqa: PLC0415

    if isinstance(model_or_config, str | Path):
        path = Path(model_or_config)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: give a local from_pretrained directory")
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    if isinstance(model_or_config, nn.Module):
        config = getattr(model_or_config, "config", None)
        if config is None:
            raise UnsupportedModel(f"{type(model_or_config).__name__} has no transformers config")
        return config
    if not isinstance(model_or_config, transformers.PretrainedConfig):
        raise TypeError(
            "causal_lm takes a transformers model, a transformers config or a local model directory, "
            f"got {type(model_or_config).__name__}"
        )
    return model_or_config


def _build(source: _Source, config: Any, name: str) -> nn.Module:
    model = source.model()
    inner = getattr(model, "transformer" if _family(config) == "gpt2" else "model")
    lm_head: nn.Linear = model.lm_head  # type: ignore[assignment]
    if _family(config) == "gpt2":
        if name == "embed":
            unit: nn.Module = hf_units.Gpt2Embed(inner.wte, inner.wpe, inner.drop)
        elif name == "head":
            unit = hf_units.Gpt2Head(inner.ln_f, lm_head)
        else:
            index = int(name[5:])
            unit = hf_units.Gpt2Layer(inner.h[index], config, index)
    elif name == "embed":
        unit = hf_units.RotaryEmbed(inner.embed_tokens)
    elif name == "head":
        unit = hf_units.RotaryHead(inner.norm, lm_head)
    else:
        index = int(name[5:])
        unit = hf_units.RotaryLayer(inner.layers[index], inner.rotary_emb, config, index)
    return copy.deepcopy(unit)  # a unit of its own: the tied head is re-linked by the engine


def causal_lm(
    model_or_config: Any,
    *,
    init_seed: int = 0,
    recompute: bool | Sequence[str] = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> UnitModel:
    """A `transformers` causal LM as units `embed`, `layer0..layer<L-1>`, `head`.

    - `model_or_config`: a model instance (its weights are the start), a config (a fresh model
      drawn under `init_seed`, the same in every process), or a local `from_pretrained`
      directory (its weights are the start; nothing is downloaded).
    - `recompute`: True or unit names whose forward is recomputed in the backward.
    - `state_dict`: starting weights, with `transformers` keys or units keys.
    The units' input is `input_ids (rows, T)` or `(input_ids, attention_mask)`; the output is
    the logits `(rows, T, vocab)`: use `token_loss`. Raises UnsupportedModel for another
    architecture or a config that cannot be split."""
    config = load_config(model_or_config)
    check_splittable(config)
    if state_dict is not None:
        state_dict = {
            (k if k.split(".", 1)[0] in unit_names(config) else from_hf_key(config, k)): v
            for k, v in state_dict.items()
        }
    source = _Source(model_or_config, init_seed)
    units = UnitModel(
        unit_names(config),
        _Builder(source, config),
        init_seed,
        state_dict,
        tied=tied_keys(config),
        recompute=recompute,
    )
    units.extra = {"hf_config": config.to_dict()}
    return units


def to_hf_state_dict(config: Any, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A units state dict (`TrainResult.state_dict`, `load_model_state`) with `transformers` keys."""
    return {to_hf_key(config, k): v for k, v in state.items()}


def config_from_dict(raw: Mapping[str, Any]) -> Any:
    import transformers  # noqa: PLC0415

    raw = dict(raw)
    kind = raw.pop("model_type", None)
    if kind not in FAMILIES:
        raise UnsupportedModel(f"checkpoint config has model type {kind!r}; supported: {sorted(FAMILIES)}")
    return transformers.AutoConfig.for_model(kind, **raw)


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    config: Any = None,
    tokenizer: str | Path | None = None,
) -> Path:
    """Write a directory `transformers.AutoModelForCausalLM.from_pretrained(out)` loads: the
    checkpoint's weights as safetensors, the config (from the checkpoint, which `causal_lm`
    units record, or `config`: a config or a directory holding config.json), and the tokenizer
    files of the local directory `tokenizer` when given."""
    import transformers  # noqa: PLC0415

    from executor.checkpoint import load_model_state, read_meta  # noqa: PLC0415

    meta = read_meta(checkpoint)
    if config is None:
        raw = meta.extra.get("hf_config")
        if raw is None:
            raise ValueError(
                f"{checkpoint} records no transformers config (its units were not built by "
                "elaswave.hf.causal_lm): pass --config DIR_WITH_CONFIG_JSON"
            )
        config = config_from_dict(raw)
    elif isinstance(config, str | Path):
        config = load_config(config)
    state = to_hf_state_dict(config, load_model_state(checkpoint))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"{checkpoint} does not fit the {config.model_type} config: {exc}") from exc
    model.eval()
    out = Path(out)
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer is not None:
        tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        tok.save_pretrained(str(out))
    (out / "elaswave.json").write_text(
        json.dumps({"checkpoint": str(checkpoint), "step": meta.next_step}) + "\n"
    )
    return out
