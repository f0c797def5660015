"""Which state a RESTORE plan reloads (`PlanFollowing._restore_source`): the job's newest complete
checkpoint, else the checkpoint the job resumed from, and the initial state only for a job that
started from scratch; every worker of the plan loads the one the first to ask named.

A resumed job used to fall back to the initial state (step 0) when it had written no checkpoint
of its own yet, so a loss in its first steps, a RESTORE since no copy is seeded before the first
step commits, trained the job again from scratch.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed import PrefixStore

from executor.checkpoint import LATEST
from executor.store_server import connect_store
from executor.worker_recovery import PlanFollowing
from tests.executor.stores import start_store


class Follower(PlanFollowing):
    """The attributes `_restore_source` reads, on a real store."""

    def __init__(self, store: Any, resumed_from: Path | None, checkpoint_dir: Path | None) -> None:
        self.settings = SimpleNamespace(checkpoint_dir=checkpoint_dir)
        self.args = SimpleNamespace(timeout_s=5.0)
        self.writer = None
        self.resumed_from = resumed_from
        self.comm = SimpleNamespace(store=store, namespace="ew")


def _checkpoint(root: Path, step: int) -> Path:
    """A checkpoint directory as `latest_checkpoint` finds it (only its meta.json is read here)."""
    ckpt = root / f"step-{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"next_step": step}))
    (root / LATEST).write_text(ckpt.name)
    return ckpt


@pytest.fixture(scope="module")
def server() -> Any:
    server = start_store()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def store(server: Any, tmp_path: Path) -> Any:
    """The module's store, under a key prefix of this test's own (plan epochs repeat)."""
    return PrefixStore(tmp_path.name, connect_store("127.0.0.1", server.port))


def test_a_job_from_scratch_with_no_checkpoint_restores_its_initial_state(store: Any, tmp_path: Path) -> None:
    assert Follower(store, None, None)._restore_source(SimpleNamespace(epoch=1)) is None
    assert Follower(store, None, tmp_path / "none yet")._restore_source(SimpleNamespace(epoch=2)) is None


def test_a_resumed_job_restores_its_resume_checkpoint_until_it_writes_its_own(
    store: Any, tmp_path: Path
) -> None:
    resumed = _checkpoint(tmp_path / "old-run", 40)
    own = tmp_path / "this-run"
    assert Follower(store, resumed, None)._restore_source(SimpleNamespace(epoch=1)) == resumed
    assert Follower(store, resumed, own)._restore_source(SimpleNamespace(epoch=2)) == resumed
    newer = _checkpoint(own, 48)
    assert Follower(store, resumed, own)._restore_source(SimpleNamespace(epoch=3)) == newer


def test_every_worker_of_a_plan_loads_what_the_first_named(store: Any, tmp_path: Path) -> None:
    resumed = _checkpoint(tmp_path / "old-run", 40)
    first = Follower(store, resumed, None)._restore_source(SimpleNamespace(epoch=5))
    # a worker that knows no resume checkpoint (a joiner started before it was resolved) agrees
    assert Follower(store, None, None)._restore_source(SimpleNamespace(epoch=5)) == first == resumed
