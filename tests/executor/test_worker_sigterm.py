"""SIGTERM in the Core-driven worker (executor.worker): a reported preemption waits for the plan.

The multi-process outcome is in tests/test_preemption_e2e.py; here the decision alone, with no
engine: leave at the next boundary without a plan at once for a plain stop (no drain notice in
the control file), only after the worker's timeout when the agent reported the preemption.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from executor.worker import CoreDrivenWorker, link_peer
from wire.local_protocol import ControlFile, ControlReader, DrainNotice
from wire.worker_env import EXIT_TERMINATED, WorkerPlace


def _worker(control: Path | None, timeout_s: float = 20.0) -> CoreDrivenWorker:
    # The decision reads only these fields: skip building the engine.
    worker = object.__new__(CoreDrivenWorker)
    worker.args = WorkerPlace(
        "job", "rank-4", 4, ("127.0.0.1:1",), "127.0.0.1:2", Path("layout.json"), "", timeout_s
    )
    worker.control = None if control is None else ControlReader(control)
    worker._sigterm_at = None
    return worker


def test_no_sigterm_never_leaves(tmp_path: Path) -> None:
    assert not _worker(tmp_path / "control.json")._leave_without_plan()


def test_plain_stop_leaves_at_the_next_boundary(tmp_path: Path) -> None:
    for control in (None, tmp_path / "absent.json"):
        worker = _worker(control)
        worker._on_sigterm(signal.SIGTERM, None)
        assert worker._leave_without_plan()


def test_reported_preemption_waits_for_the_plan_then_gives_up(tmp_path: Path) -> None:
    path = tmp_path / "control.json"
    ControlFile(path).set_drain(DrainNotice("preempted (SIGTERM)", time.time() + 30, time.time()))
    worker = _worker(path, timeout_s=0.2)
    worker._on_sigterm(signal.SIGTERM, None)
    first = worker._sigterm_at
    worker._on_sigterm(signal.SIGTERM, None)  # a second SIGTERM does not restart the clock
    assert worker._sigterm_at == first
    assert not worker._leave_without_plan()
    time.sleep(0.25)
    assert worker._leave_without_plan()


def test_unreadable_control_file_is_a_plain_stop(tmp_path: Path) -> None:
    path = tmp_path / "control.json"
    path.write_text("not json")
    worker = _worker(path)
    worker._on_sigterm(signal.SIGTERM, None)
    assert worker._leave_without_plan()


def test_exit_status_of_a_worker_that_left_without_a_plan() -> None:
    assert EXIT_TERMINATED == 143


def test_a_failed_link_op_names_its_peer_and_other_groups_name_none() -> None:
    assert link_peer("link/1-4", 1) == 4 and link_peer("link/1-4", 4) == 1
    assert link_peer("dp/0", 1) is None  # a collective does not say which member failed it
