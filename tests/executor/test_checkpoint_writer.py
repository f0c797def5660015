"""The checkpoint writer's commit (executor.checkpoint.CheckpointWriter): the coordinator (stage
0's writer) commits a checkpoint once every stage has written its share, and a checkpoint whose
share is missing waits aside without holding up later ones. Before, the coordinator's writer
thread blocked on the missing share, its queue filled, and training stalled for a worker timeout
(20 s) after every loss of a stage's writer with checkpointing on.

Real writers on a temporary root, two stages, each writer as its own rank would run it; and which
plans make the workers give up a checkpoint in flight at once (a stage's writer gone)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from executor import worker_recovery
from executor.checkpoint import LATEST, CheckpointWriter, StagePayload, read_meta, step_dir_name
from executor.worker_recovery import PlanFollowing
from planners.layout import Layout, Plan, make_uniform_layout

META = {
    "units": ["a", "b"],
    "unit_numel": [3, 3],
    "global_batch": 4,
    "data_seed": 0,
    "rng_seed": 0,
    "init_seed": 0,
    "optimizer": "adamw",
}


def payload(next_step: int, stage: int) -> StagePayload:
    name = "ab"[stage]
    unit = nn.Linear(1, 1, bias=True)
    unit.weight.data.fill_(float(next_step))
    flat = torch.full((2,), float(next_step))
    return StagePayload(next_step, next_step, stage, 2, {name: unit}, {name: (flat, flat)})


def submit_all(writer: CheckpointWriter, payloads: list[StagePayload]) -> None:
    """Submit from a thread and fail if a submission blocks (a full queue behind a commit)."""
    done = threading.Event()

    def run() -> None:
        for p in payloads:
            writer.submit(p)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(10), "submit blocked: the coordinator's queue is held by a commit"


@pytest.fixture
def writers(tmp_path: Path) -> tuple[CheckpointWriter, CheckpointWriter]:
    root = tmp_path / "ckpt"
    return CheckpointWriter(root, META, "run1", max_pending=1), CheckpointWriter(root, META, "run1")


def test_a_missing_share_does_not_hold_up_later_checkpoints_and_is_given_up(
    writers: tuple[CheckpointWriter, CheckpointWriter], tmp_path: Path
) -> None:
    coordinator, stage1 = writers
    root = tmp_path / "ckpt"
    # stage 1's writer never writes step 2 (lost right after gathering it) but writes 4, 6 and 8
    submit_all(coordinator, [payload(s, 0) for s in (2, 4, 6, 8)])
    submit_all(stage1, [payload(s, 1) for s in (4, 6, 8)])
    stage1.wait(10)
    later = [step_dir_name(s) for s in (4, 6, 8)]
    deadline = time.monotonic() + 10  # a loaded machine writes them in its own time
    while [p.name for p in coordinator.written] != later and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [p.name for p in coordinator.written] == later
    with pytest.raises(TimeoutError):
        coordinator.wait(0.3)  # step 2 still waits for its missing share
    assert (root / LATEST).read_text().strip() == step_dir_name(8)
    assert read_meta(root / step_dir_name(8)).next_step == 8

    coordinator.give_up_waiting(0.0)
    coordinator.wait(10)
    assert coordinator.abandoned == [root / f".tmp-{step_dir_name(2)}-run1"]
    assert not (root / step_dir_name(2)).exists()
    assert (root / LATEST).read_text().strip() == step_dir_name(8)
    assert coordinator.errors == [] and stage1.errors == []


def step_2_lacks_stage_1s_share(writers: tuple[CheckpointWriter, CheckpointWriter]) -> None:
    """Steps 2 and 4 gathered by both stages; stage 1 has written step 4's share, not step 2's."""
    coordinator, stage1 = writers
    submit_all(coordinator, [payload(2, 0), payload(4, 0)])
    submit_all(stage1, [payload(4, 1)])
    stage1.wait(10)


def test_a_late_share_commits_without_moving_latest_back(
    writers: tuple[CheckpointWriter, CheckpointWriter], tmp_path: Path
) -> None:
    coordinator, stage1 = writers
    root = tmp_path / "ckpt"
    step_2_lacks_stage_1s_share(writers)
    with pytest.raises(TimeoutError):
        coordinator.wait(0.3)
    submit_all(stage1, [payload(2, 1)])  # a slow stage's share of step 2 arrives after step 4's
    coordinator.wait(10)
    assert sorted(p.name for p in coordinator.written) == [step_dir_name(2), step_dir_name(4)]
    assert (root / LATEST).read_text().strip() == step_dir_name(4)
    assert read_meta(root / step_dir_name(2)).next_step == 2
    assert coordinator.abandoned == [] and coordinator.errors == []


def test_a_give_up_covers_only_what_was_submitted_before_it(
    writers: tuple[CheckpointWriter, CheckpointWriter], tmp_path: Path
) -> None:
    coordinator, stage1 = writers
    root = tmp_path / "ckpt"
    submit_all(coordinator, [payload(2, 0)])
    coordinator.give_up_waiting(0.0)  # a plan after step 2 was gathered: its share never comes
    submit_all(coordinator, [payload(4, 0)])
    submit_all(stage1, [payload(4, 1)])
    coordinator.wait(10)
    assert coordinator.abandoned == [root / f".tmp-{step_dir_name(2)}-run1"]
    assert [p.name for p in coordinator.written] == [step_dir_name(4)]


# ---- which plans give up at once: `PlanFollowing._give_up_on_gone_writers` -------------------


class Follower(PlanFollowing):
    """The attributes `_give_up_on_gone_writers` reads, with a real coordinator writer."""

    def __init__(self, writer: CheckpointWriter) -> None:
        self.writer = writer
        self.args = SimpleNamespace(timeout_s=60.0)


OLD = make_uniform_layout(4, 2, 2, 8, 2)  # stage 0: ranks 0, 1 (writer 0); stage 1: ranks 2, 3 (writer 2)


def without(layout: Layout, *ranks: int) -> Layout:
    stages = tuple(replace(s, ranks=tuple(r for r in s.ranks if r not in ranks)) for s in layout.stages)
    return layout.replace(stages=stages)


@pytest.mark.parametrize(
    ("lost", "standby", "given_up"),
    [
        ((2,), (), True),  # stage 1's writer lost: its share of a checkpoint in flight never comes
        ((3,), (), False),  # a rank that writes nothing: every writer is alive and will write
        ((2,), (2,), False),  # the writer kept as a standby hands over and writes what it owes
    ],
)
def test_a_plan_without_a_stage_writer_gives_up_its_checkpoints_in_flight_at_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    lost: tuple[int, ...],
    standby: tuple[int, ...],
    given_up: bool,
) -> None:
    monkeypatch.setattr(worker_recovery, "RESTORE_COMMIT_WAIT_S", 0.2)
    coordinator = CheckpointWriter(tmp_path / "ckpt", META, "run1")
    submit_all(coordinator, [payload(2, 0)])  # stage 1's share of it is not written (yet)
    plan = Plan(1, OLD, without(OLD, *lost), ("test",), 0.0, standby=standby)
    Follower(coordinator)._give_up_on_gone_writers(plan)
    if given_up:
        coordinator.wait(5)
        assert coordinator.abandoned == [tmp_path / "ckpt" / f".tmp-{step_dir_name(2)}-run1"]
    else:
        with pytest.raises(TimeoutError):
            coordinator.wait(1.0)
        assert coordinator.abandoned == []


def test_a_give_up_for_some_stages_abandons_only_checkpoints_missing_their_share(
    writers: tuple[CheckpointWriter, CheckpointWriter], tmp_path: Path
) -> None:
    coordinator = writers[0]
    root = tmp_path / "ckpt"
    step_2_lacks_stage_1s_share(writers)
    coordinator.give_up_waiting(0.0, {0})  # stage 0 wrote everything it owes: nothing to give up
    with pytest.raises(TimeoutError):
        coordinator.wait(0.5)
    assert coordinator.abandoned == []
    coordinator.give_up_waiting(0.0, {1})
    coordinator.wait(10)
    assert coordinator.abandoned == [root / f".tmp-{step_dir_name(2)}-run1"]
    assert [p.name for p in coordinator.written] == [step_dir_name(4)]


class Restorer(Follower):
    """What `_restore_source` reads besides the writer: the checkpoint root and a real store."""

    def __init__(self, writer: CheckpointWriter, root: Path) -> None:
        super().__init__(writer)
        self.settings = SimpleNamespace(checkpoint_dir=root)
        self.resumed_from = None
        self.comm = SimpleNamespace(namespace="job", store=torch.distributed.HashStore())


def test_a_restore_names_the_last_complete_checkpoint_without_waiting_for_a_lost_writer(
    writers: tuple[CheckpointWriter, CheckpointWriter], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The grace a live stage's share gets: the lost stage's checkpoint must not wait it out.
    monkeypatch.setattr(worker_recovery, "RESTORE_COMMIT_WAIT_S", 60.0)
    coordinator, stage1 = writers
    root = tmp_path / "ckpt"
    submit_all(stage1, [payload(2, 1)])
    stage1.wait(10)
    submit_all(coordinator, [payload(2, 0), payload(4, 0)])  # stage 1's writer died before step 4's
    plan = Plan(1, OLD, without(OLD, 2, 3), ("test",), 0.0)  # stage 1 lost with both its ranks
    started = time.monotonic()
    source = Restorer(coordinator, root)._restore_source(plan)
    assert time.monotonic() - started < 10.0
    assert source == root / step_dir_name(2)
    assert coordinator.abandoned == [root / f".tmp-{step_dir_name(4)}-run1"]
