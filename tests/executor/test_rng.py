from __future__ import annotations

import pytest
import torch

from executor.rng import (
    DropoutRng,
    UnitCall,
    apply_dropout,
    current_unit_call,
    mix64,
    placement_invariant_dropout,
    unit_call,
)


def test_mix64_is_deterministic_and_separates_tuples() -> None:
    assert mix64(1, 2, 3) == mix64(1, 2, 3)
    seeds = {
        mix64(0, step, layer, site, sample)
        for step in range(3)
        for layer in range(-1, 3)
        for site in range(3)
        for sample in range(8)
    }
    assert len(seeds) == 3 * 4 * 3 * 8
    assert all(0 <= s < 1 << 63 for s in seeds)


def test_placement_invariant_mask_depends_only_on_the_sample_not_the_batch() -> None:
    a, b = DropoutRng(7, "placement_invariant", rank=0), DropoutRng(7, "placement_invariant", rank=3)
    a.begin_step(5)
    b.begin_step(5)
    whole = a.keep_mask(0.3, layer=2, site=1, samples=list(range(10, 16)), shape=(4, 8))
    part = b.keep_mask(0.3, layer=2, site=1, samples=[13, 14], shape=(4, 8))
    reordered = b.keep_mask(0.3, layer=2, site=1, samples=[15, 10], shape=(4, 8))
    assert torch.equal(whole[3:5], part)
    assert torch.equal(whole[[5, 0]], reordered)


def test_placement_invariant_mask_changes_with_every_key_part() -> None:
    rng = DropoutRng(7)
    rng.begin_step(1)
    base = rng.keep_mask(0.5, 0, 1, [4], (64,))
    assert not torch.equal(base, rng.keep_mask(0.5, 1, 1, [4], (64,)))  # layer
    assert not torch.equal(base, rng.keep_mask(0.5, 0, 2, [4], (64,)))  # site
    assert not torch.equal(base, rng.keep_mask(0.5, 0, 1, [5], (64,)))  # sample
    rng.begin_step(2)
    assert not torch.equal(base, rng.keep_mask(0.5, 0, 1, [4], (64,)))  # step
    assert not torch.equal(base, DropoutRng(8).keep_mask(0.5, 0, 1, [4], (64,)))  # seed


def test_per_rank_mask_depends_on_rank_and_batch_composition() -> None:
    a, b = DropoutRng(7, "per_rank", rank=0), DropoutRng(7, "per_rank", rank=1)
    whole = a.keep_mask(0.3, 2, 1, list(range(10, 16)), (4, 8))
    assert not torch.equal(whole, b.keep_mask(0.3, 2, 1, list(range(10, 16)), (4, 8)))
    a.begin_step(0)
    assert not torch.equal(whole[3:5], a.keep_mask(0.3, 2, 1, [13, 14], (4, 8)))


def test_per_rank_stream_restarts_with_the_step_so_a_replay_draws_the_same() -> None:
    rng = DropoutRng(3, "per_rank", rank=2)
    rng.begin_step(9)
    first = [rng.keep_mask(0.2, 0, 1, [0, 1], (5,)) for _ in range(3)]
    rng.begin_step(9)
    again = [rng.keep_mask(0.2, 0, 1, [0, 1], (5,)) for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))


def test_mask_values_and_keep_rate() -> None:
    mask = DropoutRng(0).keep_mask(0.25, 0, 1, list(range(64)), (32, 32))
    assert torch.equal(mask.unique(), torch.tensor([0.0, 1.0]) / 0.75)
    keep = (mask > 0).float().mean().item()
    assert abs(keep - 0.75) < 0.01


def test_apply_dropout_is_identity_when_off_and_checks_rows() -> None:
    x = torch.randn(3, 4)
    assert apply_dropout(x, 0.0, DropoutRng(0), 0, 1, [0, 1, 2]) is x
    assert apply_dropout(x, 0.5, None, 0, 1, [0, 1, 2]) is x
    with pytest.raises(ValueError, match="3 rows but 2 sample ids"):
        apply_dropout(x, 0.5, DropoutRng(0), 0, 1, [0, 1])


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="rng mode"):
        DropoutRng(0, "global")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dropout probability"):
        DropoutRng(0).keep_mask(1.0, 0, 1, [0], (2,))


def test_placement_invariant_dropout_takes_its_key_from_the_unit_call() -> None:
    """`elaswave.dropout` in a user's unit: the mask of a row depends on (seed, step, unit, site,
    global sample), whichever rank runs it and whatever else is in its batch."""
    x = torch.ones(4, 16)
    assert placement_invariant_dropout(x, 0.5) is x  # outside an engine forward: identity
    a, b = DropoutRng(7, "placement_invariant", rank=0), DropoutRng(7, "placement_invariant", rank=5)
    a.begin_step(3)
    b.begin_step(3)
    with unit_call(UnitCall(3, 2, (10, 11, 12, 13), a), None):
        assert current_unit_call() == UnitCall(3, 2, (10, 11, 12, 13), a)
        whole = placement_invariant_dropout(x, 0.5, site=1)
        assert placement_invariant_dropout(x, 0.5, site=1, training=False) is x
    assert current_unit_call() is None
    with unit_call(UnitCall(3, 2, (12, 13), b), None):
        part = placement_invariant_dropout(x[:2], 0.5, site=1)
    assert torch.equal(whole[2:], part)
    assert torch.equal(whole, apply_dropout(x, 0.5, a, 2, 1, [10, 11, 12, 13]))
    with unit_call(UnitCall(3, 3, (10, 11, 12, 13), a), None):  # another unit: another mask
        assert not torch.equal(whole, placement_invariant_dropout(x, 0.5, site=1))


def test_unit_call_reseeds_torch_for_user_rng_and_nests() -> None:
    """`nn.Dropout` (torch's global generator) repeats under the same seed (a replay on the same
    layout); unit calls nest and restore the outer call."""
    outer = UnitCall(0, 0, (0,), None)
    with unit_call(outer, 123):
        first = torch.rand(5)
        with unit_call(UnitCall(0, 1, (0,), None), 123):
            assert current_unit_call().unit_index == 1  # type: ignore[union-attr]
            assert torch.equal(torch.rand(5), first)
        assert current_unit_call() is outer
