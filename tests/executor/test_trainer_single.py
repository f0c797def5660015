"""The trainer in one process (PP=1, DP=1, a one-member gloo group): reference equality and bad input."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed import HashStore

from executor.checkpoint import latest_checkpoint
from executor.engine_comm import StaticComm, groups_for_stage_ranks
from executor.reference import run_reference
from executor.trainer import Trainer, check_layout, checkpoint_payload, checkpoint_writer
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


def _states_equal(a: dict, b: dict) -> bool:
    return a["step_count"] == b["step_count"] and all(
        torch.equal(a["units"][n][k], b["units"][n][k])
        for n in a["units"]
        for k in ("param", "exp_avg", "exp_avg_sq")
    )


def test_restore_layout_reloads_a_checkpoint_or_the_initial_state_in_place(tmp_path: Path) -> None:
    """What a RESTORE plan does on each worker: the same process, its state replaced by the
    agreed checkpoint's (or the job's initial state), bitwise, and training goes on from there."""
    trainer = _trainer()
    initial = trainer.gather_full_state()
    for step in range(3):
        trainer.train_step(step)
    at_3 = trainer.gather_full_state()
    writer = checkpoint_writer(trainer.spec, tmp_path, trainer.layout.global_batch, "run")
    payload = checkpoint_payload(trainer)
    assert payload is not None
    writer.submit(payload)
    writer.wait(timeout_s=60)
    replay = trainer.train_step(3).loss
    trainer.train_step(4)
    meta = trainer.restore_layout(trainer.layout, trainer.comm, latest_checkpoint(tmp_path))
    assert meta is not None and meta.next_step == 3 and trainer.next_step == 3
    assert _states_equal(trainer.gather_full_state(), at_3)
    assert trainer.train_step(3).loss == replay
    assert trainer.restore_layout(trainer.layout, trainer.comm, None) is None
    assert trainer.next_step == 0 and _states_equal(trainer.gather_full_state(), initial)
