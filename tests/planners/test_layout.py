"""Layout, validation and diff (docs/architecture.md ("The central idea"))."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TypedDict, Unpack

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners import (
    InvalidLayout,
    Layout,
    Plan,
    SampleRange,
    StageLayout,
    diff_layouts,
    ensure_valid,
    make_uniform_layout,
    slot_range,
    split_evenly,
    split_weighted,
    validate,
)
from planners.zero import layout_ownership
from tests.planners.strategies import layouts


def _covers_exactly(parts: tuple[SampleRange, ...], whole: SampleRange) -> bool:
    return [i for p in parts for i in range(p.start, p.stop)] == list(range(whole.start, whole.stop))


@given(st.integers(0, 50), st.integers(0, 60), st.integers(1, 9))
def test_split_evenly_is_exact_and_balanced(start: int, size: int, parts: int) -> None:
    whole = SampleRange(start, start + size)
    split = split_evenly(whole, parts)
    assert len(split) == parts and _covers_exactly(split, whole)
    assert max(map(len, split)) - min(map(len, split)) <= 1


@given(st.integers(0, 60), st.lists(st.integers(0, 5), min_size=1, max_size=8).filter(lambda w: sum(w) > 0))
def test_split_weighted_is_exact_and_proportional(size: int, weights: list[int]) -> None:
    whole = SampleRange(3, 3 + size)
    split = split_weighted(whole, tuple(float(w) for w in weights))
    assert _covers_exactly(split, whole)
    for part, w in zip(split, weights, strict=True):
        assert abs(len(part) - size * w / sum(weights)) < 1  # largest remainder: within one sample
        if w == 0:
            assert len(part) == 0


@given(st.integers(1, 100), st.integers(1, 12))
def test_slots_tile_the_global_batch(global_batch: int, num_micro: int) -> None:
    if num_micro > global_batch:
        return
    slots = tuple(slot_range(global_batch, num_micro, m) for m in range(num_micro))
    assert _covers_exactly(slots, SampleRange(0, global_batch))
    assert {len(s) for s in slots} <= {global_batch // num_micro, -(-global_batch // num_micro)}


def test_uniform_layout_helpers() -> None:
    lay = make_uniform_layout(7, 3, 2, global_batch=10, num_micro_batches=3)
    assert [(s.layer_start, s.layer_stop) for s in lay.stages] == [(0, 3), (3, 5), (5, 7)]
    assert lay.boundaries == (3, 5)
    assert lay.ranks() == (0, 1, 2, 3, 4, 5)
    assert lay.stage_of_layer(4) == 1 and lay.stage_of_rank(5) == 2
    assert lay.slot_range(2) == SampleRange(6, 10)
    assert lay.samples_of(4, 2) == SampleRange(6, 8) and lay.samples_of(5, 2) == SampleRange(8, 10)
    assert lay.micro_batch_ranges(0)[0] == (SampleRange(0, 2), SampleRange(2, 3))
    with pytest.raises(ValueError, match="layer 7 is held by no stage"):
        lay.stage_of_layer(7)
    with pytest.raises(ValueError, match="rank 9 is in no stage"):
        lay.stage_of_rank(9)


@settings(max_examples=60)
@given(layouts())
def test_json_roundtrip_is_stable(layout: Layout) -> None:
    text = layout.to_json()
    back = Layout.from_json(text.encode())
    assert back == layout and back.to_json() == text
    assert hash(back) == hash(layout)  # frozen all the way down: usable as a cache key


@settings(max_examples=60)
@given(layouts())
def test_generated_layouts_validate_exhaustively(layout: Layout) -> None:
    assert validate(layout, exhaustive=True) == validate(layout)
    assert validate(layout, exhaustive=True).ok, validate(layout, exhaustive=True).problems
    for p, stage in enumerate(layout.stages):
        for m, ranges in enumerate(layout.micro_batch_ranges(p)):
            assert _covers_exactly(ranges, layout.slot_range(m))
            assert all(layout.samples_of(r, m) == ranges[j] for j, r in enumerate(stage.ranks))


def test_plan_json_roundtrip() -> None:
    old = make_uniform_layout(4, 2, 2, 8, 2)
    new = replace(old, frequencies_mhz=((0, 1500),))
    plan = Plan(3, old, new, ("straggler on rank 0",), 1.25, (1e9, 2e9))
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_json(replace(plan, old=None).to_json()).old is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1]", "must be a JSON object"),
        ("{not json", "not valid JSON"),
        ('{"zero_layout": "interleaved", "rng_mode": "per_rank"}', "layout.num_layers is missing"),
        ('{"zero_layout": "striped", "rng_mode": "per_rank"}', "zero_layout must be one of"),
    ],
)
def test_from_json_rejects_malformed(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Layout.from_json(text)


def test_plan_from_json_names_bad_field() -> None:
    plan = Plan(1, None, make_uniform_layout(2, 1, 1, 2, 1), ("r",), 1.0)
    broken = plan.to_json().replace('"predicted_step_time_s":1.0', '"predicted_step_time_s":"slow"')
    with pytest.raises(ValueError, match="plan.predicted_step_time_s must be a number"):
        Plan.from_json(broken)
    with pytest.raises(ValueError, match="plan.epoch is missing"):
        Plan.from_json("{}")


def test_from_json_names_bad_nested_field() -> None:
    d = make_uniform_layout(4, 2, 2, 8, 2).to_json().replace('"ranks":[0,1]', '"ranks":[0,"x"]')
    with pytest.raises(ValueError, match=r"stages\[0\]\.ranks must be an integer"):
        Layout.from_json(d)


class _PerLayerMemory:
    def __init__(self, per_layer: float) -> None:
        self.per_layer = per_layer

    def stage_memory_bytes(self, layout: Layout, stage: int) -> float:
        return self.per_layer * layout.stages[stage].num_layers


def _base() -> Layout:
    return make_uniform_layout(6, 3, 2, global_batch=12, num_micro_batches=2)


class _StageChanges(TypedDict, total=False):
    """Fields of a StageLayout to replace."""

    stage: int
    layer_start: int
    layer_stop: int
    ranks: tuple[int, ...]
    sample_weights: tuple[int, ...]


def _with_stage(layout: Layout, p: int, **changes: Unpack[_StageChanges]) -> Layout:
    stages = list(layout.stages)
    stages[p] = replace(stages[p], **changes)
    return replace(layout, stages=tuple(stages))


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (
            _with_stage(_base(), 1, layer_start=3),
            r"stage 1 starts at layer 3, expected 2 \(gap: layers \[2, 3\)",
        ),
        (_with_stage(_base(), 1, layer_start=1), r"overlap: layers \[1, 2\) held twice"),
        (_with_stage(_base(), 2, layer_stop=5), "last stage ends at layer 5"),
        (_with_stage(_base(), 1, layer_stop=2, layer_start=2), r"stage 1 holds no layers"),
        (_with_stage(_base(), 1, ranks=(2, 0)), "rank 0 is in stages 0 and 1"),
        (_with_stage(_base(), 1, ranks=(2, 2)), "rank 2 is twice in stage 1"),
        (_with_stage(_base(), 1, ranks=()), "stage 1 has no ranks"),
        (_with_stage(_base(), 0, sample_weights=(1,)), "stage 0 has 1 sample_weights for 2 ranks"),
        (
            _with_stage(_base(), 0, sample_weights=(0, 0)),
            "stage 0 sample_weights must be >= 0 with a positive sum",
        ),
        (_with_stage(_base(), 2, stage=5), "stage at position 2 is numbered 5"),
        (replace(_base(), num_micro_batches=13), r"num_micro_batches must be in \[1, global_batch=12\]"),
        (replace(_base(), layer_numel=(1,) * 5), "layer_numel has 5 entries for 6 layers"),
        (replace(_base(), layer_numel=(1, 1, -1, 1, 1, 1)), r"layer_numel is negative for layers \[2\]"),
        (replace(_base(), frequencies_mhz=((42, 1000),)), "frequency set for rank 42, which is in no stage"),
        (replace(_base(), frequencies_mhz=((1, 0),)), "frequency of rank 1 must be positive"),
        (replace(_base(), stage_mem_cap_bytes=(1.0,)), "stage_mem_cap_bytes has 1 entries for 3 stages"),
    ],
)
def test_validation_reports_each_problem(broken: Layout, message: str) -> None:
    report = validate(broken)
    assert not report.ok
    assert any(re.search(message, p) for p in report.problems), report.problems


def test_memory_cap_violation_is_reported_per_stage() -> None:
    lay = replace(_base(), stage_mem_cap_bytes=(250.0, 150.0, 250.0))
    report = validate(lay, _PerLayerMemory(100.0))
    assert report.problems == ("stage 1 needs 200 bytes, over its cap of 150 bytes",)
    assert validate(lay).ok  # no memory model: caps cannot be checked


def test_ensure_valid_lists_every_problem() -> None:
    broken = _with_stage(_with_stage(_base(), 1, ranks=(0, 2)), 2, layer_stop=5)
    with pytest.raises(InvalidLayout) as err:
        ensure_valid(broken)
    assert len(err.value.problems) == 2
    assert "rank 0 is in stages 0 and 1" in str(err.value) and "last stage ends at layer 5" in str(err.value)
    valid = _base()
    assert ensure_valid(valid) is valid


@settings(max_examples=60)
@given(layouts())
def test_diff_with_itself_is_empty(layout: Layout) -> None:
    d = diff_layouts(layout, layout)
    assert d.is_empty and d.moved_elements == 0


@settings(max_examples=80)
@given(st.data())
def test_zero_transfers_turn_old_ownership_into_new(data: st.DataObject) -> None:
    old = data.draw(layouts(max_layers=6))
    new = data.draw(layouts(max_layers=6))
    new = replace(
        new,
        num_layers=old.num_layers,
        layer_numel=old.layer_numel,
        stages=_reshape_stages(new, old.num_layers),
    )
    if not validate(new).ok:
        return
    owner = {
        (layer, e): iv.rank
        for layer, ivs in layout_ownership(old).items()
        for iv in ivs
        for e in range(iv.start, iv.stop)
    }
    d = diff_layouts(old, new)
    for t in d.zero_transfers:
        for e in range(t.start, t.stop):
            assert owner[(t.layer, e)] == t.src_rank
            owner[(t.layer, e)] = t.dst_rank
    target = {
        (layer, e): iv.rank
        for layer, ivs in layout_ownership(new).items()
        for iv in ivs
        for e in range(iv.start, iv.stop)
    }
    assert owner == target
    assert all(t.src_rank != t.dst_rank for t in d.zero_transfers)


def _reshape_stages(layout: Layout, num_layers: int) -> tuple[StageLayout, ...]:
    """Keep the drawn ranks but give the stages a valid block split of `num_layers`."""
    stages = layout.stages[:num_layers]
    edges = [p * num_layers // len(stages) for p in range(len(stages) + 1)]
    return tuple(replace(s, layer_start=edges[p], layer_stop=edges[p + 1]) for p, s in enumerate(stages))


def test_diff_reports_ranks_stages_layers_and_frequencies() -> None:
    old = make_uniform_layout(6, 3, 2, 12, 2, layer_numel=(10,) * 6)
    new = _with_stage(_with_stage(old, 0, layer_stop=3, ranks=(0,)), 1, layer_start=3, ranks=(2, 3, 9))
    new = replace(new, frequencies_mhz=((2, 1400),))
    d = diff_layouts(old, new)
    assert d.ranks_added == (9,) and d.ranks_removed == (1,)
    assert d.stages_changed == (0, 1)
    assert [(m.layer, m.from_stage, m.to_stage) for m in d.layer_moves] == [(2, 1, 0)]
    assert d.frequency_changes == ((2, None, 1400),)
    assert d.samples_changed and not d.is_empty
    # Layer 2 moves to stage 0 whose only rank is 0: all ten elements land on rank 0.
    assert sum(t.size for t in d.zero_transfers if t.layer == 2 and t.dst_rank == 0) == 10


def test_backup_copies_round_trips_and_defaults_to_one() -> None:
    from planners import make_uniform_layout
    from planners.validation import validate

    base = make_uniform_layout(num_layers=4, num_stages=2, dp=2, global_batch=8, num_micro_batches=2)
    assert base.backup_copies == 1 and "backup_copies" not in base.to_json()
    two = base.replace(backup_copies=2)
    assert Layout.from_json(two.to_json()) == two
    report = validate(base.replace(backup_copies=0))
    assert not report.ok and any("backup_copies must be >= 1" in p for p in report.problems)
