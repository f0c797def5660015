from __future__ import annotations

import pytest
import torch

from executor.model import (
    EMBED,
    HEAD,
    ForwardContext,
    ModelConfig,
    StageModel,
    block_name,
    block_numel,
    build_unit,
    per_sample_loss,
    unit_order,
)
from executor.rng import DropoutRng
from executor.zero import flat_params

CFG = ModelConfig(vocab_size=64, seq_len=16, hidden=32, num_heads=4, num_layers=4, dropout=0.2)


def _ctx(n: int, step: int = 0) -> ForwardContext:
    rng = DropoutRng(11)
    rng.begin_step(step)
    return ForwardContext(list(range(100, 100 + n)), rng)


def test_stages_compose_to_the_whole_model_bit_for_bit() -> None:
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    whole = StageModel(CFG, 0, 4)(tokens, _ctx(3))
    for cut in (1, 2, 3):
        first, second = StageModel(CFG, 0, cut), StageModel(CFG, cut, 4)
        assert torch.equal(second(first(tokens, _ctx(3)), _ctx(3)), whole)


def test_units_are_initialised_identically_wherever_they_are_built() -> None:
    a, b = StageModel(CFG, 0, 2), StageModel(CFG, 1, 4)
    assert torch.equal(flat_params(a.units[block_name(1)]), flat_params(b.units[block_name(1)]))
    assert not torch.equal(flat_params(a.units[block_name(0)]), flat_params(a.units[block_name(1)]))
    assert torch.equal(flat_params(build_unit(CFG, HEAD)), flat_params(b.units[HEAD]))


def test_embedding_on_first_stage_head_on_last_only() -> None:
    assert unit_order(4, 0, 2) == [EMBED, "block_0", "block_1"]
    assert unit_order(4, 2, 4) == ["block_2", "block_3", HEAD]
    assert unit_order(4, 1, 3) == ["block_1", "block_2"]
    assert StageModel(CFG, 1, 3).unit_names() == ["block_1", "block_2"]
    assert block_numel(CFG) == sum(p.numel() for p in build_unit(CFG, "block_0").parameters())


def test_attention_is_causal() -> None:
    model = StageModel(ModelConfig(dropout=0.0), 0, 4)
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 64
    a, b = model(tokens, _ctx(1)), model(changed, _ctx(1))
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_dropout_follows_the_sample_not_the_batch() -> None:
    model = StageModel(CFG, 0, 4)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    both = model(tokens, _ctx(4))
    rng = DropoutRng(11)
    alone = model(tokens[2:3], ForwardContext([102], rng))
    assert torch.allclose(both[2:3], alone, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(both, model(tokens, _ctx(4, step=1)))


def test_per_sample_loss_is_mean_token_cross_entropy() -> None:
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    loss = per_sample_loss(logits, targets)
    expected = torch.stack([torch.nn.functional.cross_entropy(logits[i], targets[i]) for i in range(2)])
    assert torch.allclose(loss, expected)


def test_a_stage_can_reuse_modules_it_already_has() -> None:
    old = StageModel(CFG, 0, 2)
    new = StageModel(CFG, 0, 3, reuse=dict(old.units.items()))
    assert new.units["block_1"] is old.units["block_1"]
    assert torch.equal(flat_params(new.units["block_2"]), flat_params(build_unit(CFG, "block_2")))


@pytest.mark.parametrize("kwargs, message", [
    ({"hidden": 30, "num_heads": 4}, "divisible"),
    ({"dropout": 1.0}, "dropout"),
    ({"num_layers": 0}, "positive"),
])
def test_bad_model_config(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_stage_bounds_and_unit_names() -> None:
    with pytest.raises(ValueError, match="invalid"):
        StageModel(CFG, 2, 2)
    with pytest.raises(ValueError, match="unknown model unit"):
        build_unit(CFG, "decoder")
    with pytest.raises(ValueError, match="out of range"):
        build_unit(CFG, "block_9")
