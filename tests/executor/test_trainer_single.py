"""The trainer in one process (PP=1, DP=1, a one-member gloo group): reference equality and bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed import HashStore

from executor.engine_comm import StaticComm, groups_for_stage_ranks
from executor.reference import run_reference
from executor.trainer import Trainer, check_layout
from executor.zero import ShardState
from tests.executor.engine_cases import NUM_UNITS, gpt_spec, layout


def _trainer(dropout: float = 0.1) -> Trainer:
    lay = layout([(0, NUM_UNITS)], [(0,)])
    comm = StaticComm(HashStore(), 0, groups_for_stage_ranks([(0,)]), timeout_s=10)
    return Trainer(gpt_spec(dropout), lay, 0, comm)


def test_single_rank_trainer_equals_the_reference_bit_for_bit() -> None:
    trainer = _trainer()
    losses = [trainer.train_step(s).loss for s in range(4)]
    ref = run_reference(gpt_spec(0.1), 8, 4, 4)
    assert losses == ref.losses
    state = trainer.gather_full_state()
    assert all(
        torch.equal(state["units"][n][k], ref.state["units"][n][k])
        for n in ref.state["units"]
        for k in ("param", "exp_avg", "exp_avg_sq")
    )


def test_rollback_restores_parameters_moments_and_step() -> None:
    trainer = _trainer()
    trainer.train_step(0)
    snapshot = trainer.state_dict_for_rollback()
    first = trainer.train_step(1).loss
    trainer.train_step(2)
    trainer.load_rollback_state(snapshot)
    assert trainer.next_step == 1
    assert trainer.train_step(1).loss == first


def test_layouts_that_do_not_fit_the_model_are_rejected() -> None:
    spec = gpt_spec()
    good = layout([(0, NUM_UNITS)], [(0,)])
    with pytest.raises(ValueError, match="layer_numel"):
        check_layout(spec, dataclasses.replace(good, layer_numel=(5,) * NUM_UNITS))
    with pytest.raises(ValueError, match="6 layers, the model has 5 units"):
        check_layout(gpt_spec(num_layers=3), good)
    with pytest.raises(ValueError, match="in order"):
        check_layout(spec, layout([(0, 2), (3, NUM_UNITS)], [(0,), (1,)]))
    with pytest.raises(ValueError, match="not in|in no stage"):
        Trainer(spec, good, 5, StaticComm(HashStore(), 0, groups_for_stage_ranks([(0,)])))


def test_bad_remapped_state_changes_nothing() -> None:
    trainer = _trainer()
    trainer.train_step(0)
    before = trainer.state_dict_for_rollback()
    params = trainer.unit_params()
    shards = {n: ShardState(0, 3, torch.zeros(3), torch.zeros(3)) for n in params}
    with pytest.raises(ValueError, match="owns"):
        trainer.reset_layout(trainer.layout, trainer.comm, params, shards, 1, 1)
    with pytest.raises(ValueError, match="rollback state"):
        trainer.load_rollback_state({**before, "layout": layout([(0, 3), (3, 6)], [(0,), (1,)])})
    after = trainer.state_dict_for_rollback()
    assert all(torch.equal(before["params"][n], after["params"][n]) for n in params)
    assert trainer.next_step == 1
