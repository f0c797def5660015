"""The per-step cost cuts of issue 23 keep their invariants (docs/engine.md, "What the
fault-tolerant path costs per step"): the rollback copy may be taken as late as the gradient
hook, and the ZeRO glue's slices of a unit's parameters are the flat vector's. (The step loss
that rides on the parameter all-gather is checked against the reference at every step by
test_equivalence.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed import HashStore

from executor.engine_comm import StaticComm, groups_for_stage_ranks
from executor.trainer import Trainer
from executor.zero import flat_params, range_views
from tests.executor.engine_cases import (
    NUM_UNITS,
    gpt_spec,
    layout,
    with_first_unit_frozen,
    with_weights_frozen,
)


def _trainer() -> Trainer:
    lay = layout([(0, NUM_UNITS)], [(0,)])
    comm = StaticComm(HashStore(), 0, groups_for_stage_ranks([(0,)]), timeout_s=10)
    return Trainer(gpt_spec(0.1), lay, 0, comm)


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    same_params = a["params"].keys() == b["params"].keys() and all(
        torch.equal(a["params"][n], b["params"][n]) for n in a["params"]
    )
    sa, sb = a["optimizer"]["shards"], b["optimizer"]["shards"]
    same_shards = all(
        sa[n][:2] == sb[n][:2] and torch.equal(sa[n][2], sb[n][2]) and torch.equal(sa[n][3], sb[n][3])
        for n in sa
    )
    return (
        same_params
        and same_shards
        and a["optimizer"]["step_count"] == b["optimizer"]["step_count"]
        and a["next_step"] == b["next_step"]
    )


def test_the_rollback_copy_taken_at_the_gradient_hook_is_the_committed_state() -> None:
    trainer = _trainer()
    trainer.train_step(0)
    committed = trainer.state_dict_for_rollback()
    copier = trainer.rollback_state_copier()
    late: dict[str, Any] = {}
    # The forward and backward of step 1 have run when the hook is called; the update has not.
    trainer.set_grad_hook(lambda _step, _grads: late.update(copier()))
    trainer.train_step(1)
    assert late and _equal(late, committed)
    # ... and the update that followed did change the state (the comparison can fail).
    assert not _equal(trainer.state_dict_for_rollback(), committed)


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    shards = state["optimizer"]["shards"]
    return [*state["params"].values(), *(t for n in shards for t in shards[n][2:])]


def test_the_rollback_copy_of_a_step_reuses_the_memory_of_the_copy_it_replaces() -> None:
    trainer = _trainer()
    trainer.train_step(0)
    retired = trainer.state_dict_for_rollback()
    trainer.train_step(1)
    committed = trainer.state_dict_for_rollback()
    assert not _equal(retired, committed)  # step 1's update changed what the copy holds
    copy = trainer.rollback_state_copier(reuse=retired)()
    assert _equal(copy, committed)
    # every tensor was written in place: the same memory, now holding step 1's state
    assert [t.data_ptr() for t in _tensors(copy)] == [t.data_ptr() for t in _tensors(retired)]


def test_a_rollback_copy_reusing_a_state_of_other_shapes_copies_afresh() -> None:
    trainer = _trainer()
    trainer.train_step(0)
    committed = trainer.state_dict_for_rollback()
    other = trainer.state_dict_for_rollback()
    first = next(iter(other["params"]))
    other["params"][first] = torch.zeros(3)  # another layout's slice of that unit
    copy = trainer.rollback_state_copier(reuse=other)()
    assert _equal(copy, committed)
    assert copy["params"][first].data_ptr() != other["params"][first].data_ptr()
    assert torch.equal(other["params"][first], torch.zeros(3))  # left as it was


def test_range_views_are_the_flat_vectors_slices_and_write_through() -> None:
    unit = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    flat = flat_params(unit)
    params = [p.detach() for p in unit.parameters()]
    for lo, hi in [(0, 0), (0, 5), (10, 17), (14, 16), (3, flat.numel()), (0, flat.numel())]:
        pieces = range_views(params, lo, hi)
        got = torch.cat(pieces) if pieces else torch.empty(0)
        assert torch.equal(got, flat[lo:hi]), (lo, hi)
    for view in range_views(params, 10, 17):
        view.fill_(7.0)
    after = flat_params(unit)
    assert torch.equal(after[10:17], torch.full((7,), 7.0))
    assert torch.equal(after[:10], flat[:10]) and torch.equal(after[17:], flat[17:])


def _frozen_trainer() -> tuple[Trainer, str]:
    """The GPT example with its first unit (the embedding) frozen."""
    spec = with_first_unit_frozen(gpt_spec(0.1))
    lay = layout([(0, NUM_UNITS)], [(0,)])
    comm = StaticComm(HashStore(), 0, groups_for_stage_ranks([(0,)]), timeout_s=10)
    return Trainer(spec, lay, 0, comm), spec.model.names[0]


def test_a_frozen_units_rollback_copy_is_kept_not_copied_again(monkeypatch: pytest.MonkeyPatch) -> None:
    import executor.trainer as trainer_mod
    import executor.zero as zero_mod

    trainer, frozen = _frozen_trainer()
    copied: list[int] = []  # what the copier copied from: a module's id, a tensor's data pointer

    def counting(copy: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapped(src: Any, *args: Any) -> torch.Tensor:
            copied.append(src.data_ptr() if isinstance(src, torch.Tensor) else id(src))
            return copy(src, *args)

        return wrapped

    trainer.train_step(0)
    retired = trainer.state_dict_for_rollback()
    trainer.train_step(1)
    committed = trainer.state_dict_for_rollback()
    monkeypatch.setattr(trainer_mod, "flat_params", counting(trainer_mod.flat_params))
    monkeypatch.setattr(trainer_mod, "copy_reusing", counting(trainer_mod.copy_reusing))  # flat units
    monkeypatch.setattr(zero_mod, "copy_reusing", counting(zero_mod.copy_reusing))
    copy = trainer.rollback_state_copier(reuse=retired)()
    assert _equal(copy, committed)  # the state of step 1, the frozen unit's included
    shard = trainer.optimizer.shards[frozen]
    units = trainer.model.units

    def sources(name: str) -> set[int]:  # the unit, or its flat buffer
        view = trainer.optimizer.exchange.param_vector(name)
        return {id(units[name])} | ({view.data_ptr()} if view is not None else set())

    assert not sources(frozen) & set(copied)  # its parameters were not copied again
    assert (
        shard.exp_avg.data_ptr() not in copied and shard.exp_avg_sq.data_ptr() not in copied
    )  # nor its moments
    assert all(sources(n) & set(copied) for n in units if n != frozen)  # every other unit was
    # a rollback to that copy restores the committed state, the frozen unit as it was built
    trainer.train_step(2)
    trainer.load_rollback_state(copy)
    assert _equal(trainer.state_dict_for_rollback(), committed)
    built = trainer.spec.model.build(trainer.spec.model.names.index(frozen))
    assert torch.equal(committed["params"][frozen], flat_params(built))


def test_a_rollback_copy_of_units_that_train_in_part_copies_their_trainable_runs_again() -> None:
    """BitFit (every matrix frozen): the copy reuses the retired one's memory, brings only the
    trainable runs up to date, and is the committed state; a rollback to it restores that state
    with every frozen element as built."""
    spec = with_weights_frozen(gpt_spec(0.1))
    lay = layout([(0, NUM_UNITS)], [(0,)])
    comm = StaticComm(HashStore(), 0, groups_for_stage_ranks([(0,)]), timeout_s=10)
    trainer = Trainer(spec, lay, 0, comm)
    assert set(trainer.optimizer.exchange.partial_runs) == set(spec.model.names[1:])
    trainer.train_step(0)
    retired = trainer.state_dict_for_rollback()
    trainer.train_step(1)
    committed = trainer.state_dict_for_rollback()
    assert not _equal(retired, committed)  # step 1 changed the trainable runs
    copy = trainer.rollback_state_copier(reuse=retired)()
    assert all(copy["params"][n] is retired["params"][n] for n in copy["params"])  # written in place
    assert _equal(copy, committed)
    trainer.train_step(2)
    trainer.load_rollback_state(copy)
    assert _equal(trainer.state_dict_for_rollback(), committed)
    for i, name in enumerate(spec.model.names):
        built = spec.model.build(i)
        frozen = torch.cat([torch.full((p.numel(),), not p.requires_grad) for p in built.parameters()])
        assert torch.equal(committed["params"][name][frozen], flat_params(built)[frozen]), name
