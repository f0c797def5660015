"""An operator checkpoints and stops a running job over REST; it resumes on another layout.

Real processes on loopback (harness.training): a Core, a store and four agents, each running the
GPT example (`examples/gpt/train.py`) as one rank of a PP=2 x DP=2 job with a checkpoint
directory. Once every worker has committed step 2, `POST /api/v1/jobs/demo/checkpoint
{"stop": true}` goes to the Core, which relays it through every agent. Every worker must save
the same step and leave at that boundary; the checkpoint must be complete; and the same script,
resumed from it in one process (another layout), must train the following steps exactly as a
fault-free single-process run of all the steps does (fp32 round-off: the DP reduction order differs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from executor.checkpoint import latest_checkpoint, read_meta
from harness.training import GPT_SCRIPT, TrainDemo, TrainDemoConfig, launch_job, wait_committed

# Long enough that the stop (about two seconds of steps ahead) always comes first.
CFG = TrainDemoConfig(pp=2, dp=2, steps=2000, kill_after_step=2, victim_rank=3, dropout=0.1)
AFTER_RESUME = 8  # steps compared after the resume


def _script(*args: str, out: Path, steps: int = CFG.steps) -> dict[int, float]:
    subprocess.run(
        [
            sys.executable,
            str(GPT_SCRIPT),
            "--steps",
            str(steps),
            "--layers",
            str(CFG.layers),
            "--dropout",
            str(CFG.dropout),
            "--global-batch",
            str(CFG.global_batch),
            "--micro-batches",
            str(CFG.micro_batches),
            "--losses-out",
            str(out),
            *args,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=120,
    )
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_operator_checkpoint_and_stop_then_resume_elsewhere(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    cfg = TrainDemoConfig(**{**CFG.__dict__, "checkpoint_dir": str(root)})
    demo = TrainDemo(tmp_path, cfg, timeout_s=120)
    try:
        launch_job(demo)
        wait_committed(demo, 2)
        assert demo.http is not None
        token = {"Authorization": f"Bearer {demo.scheduler_token}"}
        first = demo.http.post("/api/v1/jobs/demo/checkpoint", json={"stop": False}, headers=token)
        assert first.status_code == 202, first.text
        # A second request while the first is on its way joins it: same step, the stop added.
        response = demo.http.post("/api/v1/jobs/demo/checkpoint", json={"stop": True}, headers=token)
        assert response.status_code == 202, response.text
        after = response.json()["after_step"]
        assert after == first.json()["after_step"] and response.json()["stop"] is True
        results = demo.wait_results(list(range(cfg.pp * cfg.dp)))
    finally:
        demo.stop()
    for rank, res in results.items():
        assert res.get("stopped_after_step") == after, (rank, res.get("stopped_after_step"), after)
        assert res["committed_steps"] == after + 1 and "checkpoint_error" not in res, (rank, res)
    meta = read_meta(root)
    assert latest_checkpoint(root).name == f"step-{after + 1:08d}" and meta.next_step == after + 1
    assert meta.num_stages == 2 and meta.step_count == after + 1
    end = after + 1 + AFTER_RESUME
    fault_free = _script(out=tmp_path / "fault_free.json", steps=end)
    resumed = _script("--resume", str(root), out=tmp_path / "resumed.json", steps=end)
    assert sorted(resumed) == list(range(after + 1, end))
    for step, loss in resumed.items():
        assert loss == pytest.approx(fault_free[step], rel=2e-6), step


def test_checkpoint_request_is_refused_clearly_without_training_workers(tmp_path: Path) -> None:
    from harness.control_plane import Demo

    demo = Demo(tmp_path, 1, timeout_s=30)
    try:
        demo.start_core()
        assert demo.http is not None
        token = {"Authorization": f"Bearer {demo.scheduler_token}"}
        missing = demo.http.post("/api/v1/jobs/nope/checkpoint", json={}, headers=token)
        assert missing.status_code == 404, missing.text
        demo.http.post(
            "/api/v1/jobs", json={"name": "idle", "expected_workers": 1}, headers=token
        ).raise_for_status()
        idle = demo.http.post("/api/v1/jobs/idle/checkpoint", json={}, headers=token)
        assert idle.status_code == 409 and "no worker" in idle.json()["detail"], idle.text
        unauth = demo.http.post("/api/v1/jobs/idle/checkpoint", json={})
        assert unauth.status_code == 401
        bad = demo.http.post("/api/v1/jobs/idle/checkpoint", json={"stop": "soon"}, headers=token)
        assert bad.status_code == 422
    finally:
        demo.stop()


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_requested_checkpoint_reports_its_completion_and_delete_ends_the_job(tmp_path: Path) -> None:
    """The operator's checkpoint (no stop) is reported once written: a `checkpoint_written` event
    and the job view's `latest_checkpoint`; then DELETE ends the job: every worker leaves at one
    step boundary and the job is STOPPED (issue 27, items 4 and 7)."""
    root = tmp_path / "ckpt"
    cfg = TrainDemoConfig(**{**CFG.__dict__, "checkpoint_dir": str(root)})
    demo = TrainDemo(tmp_path, cfg, timeout_s=150)
    try:
        launch_job(demo)
        wait_committed(demo, 2)
        assert demo.http is not None
        token = {"Authorization": f"Bearer {demo.scheduler_token}"}
        asked = demo.http.post("/api/v1/jobs/demo/checkpoint", json={}, headers=token)
        assert asked.status_code == 202, asked.text
        expected = str(root / f"step-{asked.json()['after_step'] + 1:08d}")

        def written() -> list[dict]:
            assert demo.http is not None
            events = demo.http.get("/api/v1/jobs/demo/events", params={"limit": 10_000}).json()["events"]
            return [e for e in events if e["kind"] == "checkpoint_written"]

        job = demo.wait_for("the checkpoint to be reported written", lambda j: written())
        reported = written()
        assert [e["detail"] for e in reported] == [expected]
        assert demo.job()["latest_checkpoint"] == expected and job["phase"] != "STOPPED"
        ended = demo.http.delete("/api/v1/jobs/demo", params={"reason": "test over"}, headers=token)
        assert ended.status_code == 200 and ended.json()["phase"] == "STOPPED", ended.text
        results = demo.wait_results(list(range(cfg.pp * cfg.dp)))
    finally:
        demo.stop()
    stops = {res.get("stopped_after_step") for res in results.values()}
    assert len(stops) == 1 and None not in stops, stops  # every worker left at the same boundary
