"""Layout-independent checkpoints: written on one layout, resumed on another, the next steps are
those of the uninterrupted run (fp32 round-off; bitwise on the same layout); a checkpoint killed
mid-write never becomes the latest; what is not a checkpoint is refused with a clear error."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest
import torch

from executor.checkpoint import (
    CheckpointError,
    StagePayload,
    latest_checkpoint,
    load_model_state,
    read_meta,
)
from executor.launch import JobSpec, job_losses, merged_state, run_job
from executor.reference import run_reference, single_rank_trainer
from executor.trainer import Trainer, checkpoint_payload, checkpoint_writer, load_checkpoint
from tests.api.test_user_model import BATCH, REL, SLOTS, assert_close_states, toy_layout
from tests.api.toy_model import UNITS, toy_spec

STEPS, AT = 7, 2  # checkpoint after step 2: resume trains steps 3..6


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float], dict]:
    """A PP=2 x DP=2 run of all steps that checkpoints after step AT (the uninterrupted run)."""
    root = tmp_path_factory.mktemp("ckpt")
    results = run_job(
        JobSpec(
            toy_spec(STEPS),
            toy_layout([(0, 3), (3, 6)], [(0, 1), (2, 3)]),
            STEPS,
            checkpoint_dir=str(root),
            checkpoint_steps=(AT,),
            timeout_s=60.0,
        )
    )
    return root, job_losses(results), merged_state(results)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_checkpoint_is_plain_torch_and_complete(written: tuple[Path, list[float], dict]) -> None:
    root, _, _ = written
    ckpt = latest_checkpoint(root)
    meta = read_meta(root)
    assert ckpt.name == "step-00000003" and meta.next_step == AT + 1 and meta.step_count == AT + 1
    assert meta.units == UNITS and meta.num_stages == 2
    state = load_model_state(root)
    # plain torch: the whole model's state dict loads into freshly built units
    spec = toy_spec(STEPS)
    for i, name in enumerate(UNITS):
        unit = spec.model.build(i)
        unit.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(f"{name}.")})
    assert not list(root.glob(".tmp-*")), "a committed checkpoint leaves no temporary directory"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "bounds, ranks",
    [
        ([(0, 6)], [(0, 1, 2)]),  # PP=1 x DP=3
        ([(0, 3), (3, 4), (4, 6)], [(0,), (1,), (2,)]),  # PP=3 x DP=1
    ],
    ids=["pp1xdp3", "pp3xdp1"],
)
def test_resume_on_another_layout(
    written: tuple[Path, list[float], dict], bounds: list[tuple[int, int]], ranks: list[tuple[int, ...]]
) -> None:
    root, losses, final = written
    results = run_job(
        JobSpec(toy_spec(STEPS), toy_layout(bounds, ranks), STEPS, resume_dir=str(root), timeout_s=60.0)
    )
    assert job_losses(results) == pytest.approx(losses[AT + 1 :], rel=REL)
    assert_close_states(merged_state(results), final)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_resume_on_the_same_layout_is_bitwise(written: tuple[Path, list[float], dict]) -> None:
    root, losses, final = written
    results = run_job(
        JobSpec(
            toy_spec(STEPS),
            toy_layout([(0, 3), (3, 6)], [(0, 1), (2, 3)]),
            STEPS,
            resume_dir=str(root),
            timeout_s=60.0,
        )
    )
    assert job_losses(results) == losses[AT + 1 :]
    state = merged_state(results)
    for name in UNITS:
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state["units"][name][key], final["units"][name][key]), (name, key)


def _single_rank_payload(trainer: Trainer) -> StagePayload:
    payload = checkpoint_payload(trainer)
    assert payload is not None  # a single-rank trainer is its stage's first rank
    return payload


def test_single_process_resume_is_bitwise(tmp_path: Path) -> None:
    spec = toy_spec(STEPS)
    full = run_reference(spec, BATCH, SLOTS, STEPS)
    trainer = single_rank_trainer(spec, BATCH, SLOTS)
    for step in range(AT + 1):
        trainer.train_step(step)
    writer = checkpoint_writer(spec, tmp_path, BATCH, "test")
    payload = checkpoint_payload(trainer)
    assert payload is not None
    writer.submit(payload)
    writer.wait(60.0)
    resumed = single_rank_trainer(toy_spec(STEPS), BATCH, SLOTS)
    assert load_checkpoint(resumed, tmp_path).next_step == AT + 1
    assert [resumed.train_step(s).loss for s in range(AT + 1, STEPS)] == full.losses[AT + 1 :]


def _write_slowly(root: str, started: Event) -> None:
    """Child: starts the checkpoint of step 5 and is killed while saving its units."""
    import executor.checkpoint as ck

    original = ck._save

    def slow(obj, path):  # noqa: ANN001, ANN202
        started.set()
        time.sleep(0.5)
        original(obj, path)

    ck._save = slow
    spec = toy_spec(STEPS)
    trainer = single_rank_trainer(spec, BATCH, SLOTS)
    for step in range(5):
        trainer.train_step(step)
    writer = checkpoint_writer(spec, Path(root), BATCH, "child")
    writer.submit(_single_rank_payload(trainer))
    writer.wait(60.0)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_checkpoint_killed_mid_write_leaves_the_previous_one(tmp_path: Path) -> None:
    spec = toy_spec(STEPS)
    trainer = single_rank_trainer(spec, BATCH, SLOTS)
    for step in range(AT + 1):
        trainer.train_step(step)
    writer = checkpoint_writer(spec, tmp_path, BATCH, "test")
    writer.submit(_single_rank_payload(trainer))
    writer.wait(60.0)
    before = load_model_state(tmp_path)
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    child = ctx.Process(target=_write_slowly, args=(str(tmp_path), started))
    child.start()
    assert started.wait(60.0), "the child never started writing"
    assert child.pid is not None  # started
    os.kill(child.pid, signal.SIGKILL)
    child.join(10.0)
    assert list(tmp_path.glob(".tmp-step-00000005-child")), "the killed write left its temporary directory"
    assert latest_checkpoint(tmp_path).name == "step-00000003"
    after = load_model_state(tmp_path)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    resumed = single_rank_trainer(toy_spec(STEPS), BATCH, SLOTS)
    assert load_checkpoint(resumed, tmp_path).next_step == AT + 1
    # A later run saves that step for real: the killed run's leftovers are not counted, and go.
    for step in range(AT + 1, 5):
        resumed.train_step(step)
    again = checkpoint_writer(toy_spec(STEPS), tmp_path, BATCH, "again")
    again.submit(_single_rank_payload(resumed))
    again.wait(60.0)
    assert latest_checkpoint(tmp_path).name == "step-00000005" and not list(tmp_path.glob(".tmp-*"))


def test_not_a_checkpoint_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        latest_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        latest_checkpoint(tmp_path / "missing")


def test_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    spec = toy_spec(STEPS)
    trainer = single_rank_trainer(spec, BATCH, SLOTS)
    trainer.train_step(0)
    writer = checkpoint_writer(spec, tmp_path, BATCH, "test")
    writer.submit(_single_rank_payload(trainer))
    writer.wait(60.0)
    other = single_rank_trainer(toy_spec(STEPS), BATCH * 2, SLOTS)
    with pytest.raises(CheckpointError, match="global batch"):
        load_checkpoint(other, tmp_path)
    adam = toy_spec(STEPS)
    adam.optimizer = dataclasses.replace(adam.optimizer, kind="adam")
    with pytest.raises(CheckpointError, match="optimizer 'sgd'.*this job uses 'adam'"):
        load_checkpoint(single_rank_trainer(adam, BATCH, SLOTS), tmp_path)
