"""`elaswave run`, the launcher: every process real (Core, store, agents, workers), on loopback.

Most tests drive the launcher with `launcher_fake_script.py`, a stand-in that describes a model
and "steps" without training, so they test the launcher alone: describe errors, placement on
simulated nodes, the worker contract in the environment, progress, a worker killed with SIGKILL,
Ctrl-C. The end-to-end tests at the bottom train a real model through `elaswave.train`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch

import elaswave
from elaswave.launcher_control import job_name, resume_command
from elaswave.launcher_monitor import EXIT_FAILED, EXIT_LEFT_RUNNING_JOB, Snapshot, format_event, outcome
from tests.pacing import paced_on_step, release

pytestmark = pytest.mark.multiproc
FAKE = Path(__file__).with_name("launcher_fake_script.py")
REPO = Path(__file__).resolve().parents[1]


def elaswave_run(*args: str | Path, cwd: Path, timeout_s: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elaswave.cli", "run", *map(str, args)],
        cwd=cwd,
        text=True,
        capture_output=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
        env=_env(),
    )


def _env() -> dict[str, str]:
    # The launcher and the scripts it runs import elaswave from this checkout, wherever cwd is.
    return dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )


class Launcher:
    """`elaswave run` in the background, its output collected line by line."""

    def __init__(self, *args: str | Path, cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elaswave.cli", "run", *map(str, args)],
            cwd=cwd,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_env(),
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, what: str, predicate: Any, timeout_s: float = 60) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"waiting for {what}; launcher output:\n{self.output[-4000:]}")

    def wait(self, timeout_s: float = 90) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"launcher still running after {timeout_s} s:\n{self.output[-4000:]}")
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def core_job(run_dir: Path, job: str) -> dict[str, Any]:
    """The job as the launcher's embedded Core shows it (its ports are in <run dir>/core.json)."""
    info = json.loads((run_dir / "core.json").read_text())
    return httpx.get(f"http://127.0.0.1:{info['http_port']}/api/v1/jobs/{job}", timeout=5).json()


def _member_steps(run_dir: Path, job: str) -> dict[str, int]:
    try:
        job_view = core_job(run_dir, job)
    except (OSError, httpx.HTTPError, ValueError):
        return {}
    return {
        m["worker_id"]: int((m.get("last_step") or {}).get("step", -1)) for m in job_view.get("members", [])
    }


# ---------------------------------------------------------------------------------------- describe


@pytest.mark.timeout(60)
def test_a_script_that_never_calls_the_api_fails_clearly(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text("print('training the old way')\n")
    run = elaswave_run("--nproc-per-node", "2", script, cwd=tmp_path)
    assert run.returncode != 0
    assert "plain.py never called elaswave.train()" in run.stderr
    assert not (tmp_path / "elaswave-run").exists()  # nothing was launched


@pytest.mark.timeout(60)
def test_a_script_that_fails_while_describing_shows_its_stderr(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text(
        "import sys\nprint('loading data', file=sys.stderr)\nraise SystemExit('no such dataset: foo')\n"
    )
    run = elaswave_run(script, cwd=tmp_path)
    assert run.returncode != 0
    assert "broken.py exited with status 1 while describing its model" in run.stderr
    assert "loading data" in run.stderr and "no such dataset: foo" in run.stderr


PARENT_SCRIPT = """\
import os, sys
with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
    parent = f.read().replace(b"\\0", b" ").decode()
open(sys.argv[1], "w").write(parent)
raise SystemExit("described nothing")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cold", [False, True], ids=["zygote", "cold-workers"])
def test_the_describe_run_is_forked_from_the_zygote_unless_workers_start_cold(
    tmp_path: Path, cold: bool
) -> None:
    script, parent = tmp_path / "who.py", tmp_path / "parent.txt"
    script.write_text(PARENT_SCRIPT)
    run = elaswave_run(*(["--cold-workers"] if cold else []), script, str(parent), cwd=tmp_path)
    assert run.returncode != 0
    assert "who.py exited with status 1 while describing its model" in run.stderr
    assert "described nothing" in run.stderr  # its stderr, whichever process started it
    assert ("agent.zygote" in parent.read_text()) is not cold, parent.read_text()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pp", "3", "--nproc-per-node", "2"], "--pp 3 needs at least 3 workers"),
        (["--pp", "6", "--nproc-per-node", "6"], "--pp 6 needs at least 6 units"),
        (["--core", "10.0.0.1"], "--core '10.0.0.1': give the Core's REST address as HOST:PORT"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1"),
        (["--job", "bad name!"], "--job 'bad name!'"),
    ],
)
def test_bad_flags_are_refused_with_what_to_fix(tmp_path: Path, flags: list[str], message: str) -> None:
    run = elaswave_run(*flags, FAKE, cwd=tmp_path)
    assert run.returncode == 64, run.stderr
    assert message in run.stderr


@pytest.mark.timeout(60)
def test_a_describe_run_that_hangs_is_bounded(tmp_path: Path) -> None:
    script = tmp_path / "hangs.py"
    script.write_text("import time\ntime.sleep(120)\n")
    started = time.monotonic()
    run = elaswave_run("--describe-timeout", "2", script, cwd=tmp_path)
    assert run.returncode == 1 and time.monotonic() - started < 30
    assert "hangs.py did not finish describing its model within 2 s" in run.stderr


@pytest.mark.timeout(60)
def test_ctrl_c_while_describing_ends_the_launcher_and_the_script(tmp_path: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(120)\n")
    launcher = Launcher(script, cwd=tmp_path)
    launcher.wait_for(
        "the describe run", lambda: any("describing the model" in line for line in launcher.lines)
    )
    time.sleep(1.0)
    children = psutil.Process(launcher.proc.pid).children(recursive=True)
    launcher.proc.send_signal(signal.SIGINT)
    assert launcher.wait(timeout_s=20) == 128 + signal.SIGINT
    psutil.wait_procs(children, timeout=10)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_a_missing_script_is_refused(tmp_path: Path) -> None:
    run = elaswave_run("nothere.py", cwd=tmp_path, timeout_s=30)
    assert run.returncode == 64 and "script 'nothere.py' does not exist" in run.stderr


# -------------------------------------------------------------------------------- launch and watch


@pytest.mark.timeout(120)
def test_a_job_on_two_simulated_nodes_runs_to_completion(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run = elaswave_run(
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--pp",
        "2",
        "--job",
        "fake",
        "--checkpoint-dir",
        ckpt,
        "--checkpoint-every",
        "3",
        "--timeout",
        "7",
        FAKE,
        "--step-time",
        "0.1",
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    run_dir = tmp_path / "elaswave-run" / "fake"
    assert "job 'fake' finished: 6/6 steps, 4 of 4 workers finished" in run.stdout
    assert "WARNING" not in run.stderr  # every stage spans both nodes
    nodes = json.loads((run_dir / "nodes.json").read_text())
    assert nodes["rank_node"] == [0, 0, 1, 1] and nodes["exposed_stages"] == []
    layout = json.loads((run_dir / "layout.json").read_text())
    assert [s["ranks"] for s in layout["stages"]] == [[0, 2], [1, 3]]
    assert layout["num_layers"] == 5 and len(layout["layer_numel"]) == 5
    for rank in range(4):
        result = json.loads((run_dir / f"rank-{rank}.json").read_text())
        assert result["rank"] == rank and result["worker_id"] == f"rank-{rank}" and result["job"] == "fake"
        assert result["committed_steps"] == 6 and result["token_set"] and result["timeout_s"] == 7
        assert result["env"] == {
            "ELASWAVE_CHECKPOINT_DIR": str(ckpt),
            "ELASWAVE_CHECKPOINT_EVERY": "3",
            "ELASWAVE_RESUME_DIR": None,
        }
    assert re.search(r"loss (0\.8333|1\.0000|1\.2500)", run.stdout)  # the last stage's loss (5 / (step + 1))
    assert re.search(r"step \d/6 .* workers \d/4", run.stdout)


@pytest.mark.timeout(120)
def test_a_killed_worker_is_lost_and_the_launcher_waits_for_the_others(tmp_path: Path) -> None:
    launcher = Launcher(
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--pp",
        "2",
        "--job",
        "kill",
        FAKE,
        "--step-time",
        "0.2",
        "--steps",
        "40",
        cwd=tmp_path,
    )
    run_dir = tmp_path / "elaswave-run" / "kill"
    launcher.wait_for(
        "every worker to commit step 2",
        lambda: len(s := _member_steps(run_dir, "kill")) == 4 and min(s.values()) >= 2,
    )
    node0 = json.loads((run_dir / "nodes.json").read_text())["nodes"]["0"]
    victim = next(m for m in core_job(run_dir, "kill")["members"] if m["rank"] == node0[1])
    os.kill(victim["pid"], signal.SIGKILL)
    code = launcher.wait()
    out = launcher.output
    assert code == 0, out[-4000:]
    assert f"event: worker_lost rank-{node0[1]}" in out
    assert (
        f"job 'kill' finished: 40/40 steps, 3 of 4 workers finished; lost on the way and planned around: "
        f"rank-{node0[1]}" in out
    )


@pytest.mark.timeout(120)
def test_ctrl_c_stops_the_job_at_a_step_boundary_and_prints_the_resume_command(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    launcher = Launcher(
        "--nproc-per-node",
        "2",
        "--job",
        "stopme",
        "--checkpoint-dir",
        ckpt,
        FAKE,
        "--step-time",
        "0.2",
        "--steps",
        "500",
        cwd=tmp_path,
    )
    run_dir = tmp_path / "elaswave-run" / "stopme"
    launcher.wait_for("step 3", lambda: min(_member_steps(run_dir, "stopme").values() or [-1]) >= 3)
    pids = [m["pid"] for m in core_job(run_dir, "stopme")["members"]]
    launcher.proc.send_signal(signal.SIGINT)
    code = launcher.wait()
    out = launcher.output
    assert code == 128 + signal.SIGINT, out[-4000:]
    stop_after = json.loads((run_dir / "stop.json").read_text())["stop_after_step"]
    assert stop_after >= 5
    for rank in range(2):
        # The fake worker stops before step stop_after + 1, as the contract asks.
        assert json.loads((run_dir / f"rank-{rank}.json").read_text())["committed_steps"] == stop_after + 1
    assert f"job 'stopme' stopped on request after step {stop_after}" in out
    assert (
        f"resume with: elaswave run --nnodes 1 --nproc-per-node 2 --pp 1 --resume {ckpt} --job stopme "
        f"--checkpoint-dir {ckpt} {FAKE} --step-time 0.2 --steps 500" in out
    )
    for pid in pids:  # every worker is gone (the Core and store with the launcher's teardown)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.timeout(90)
def test_workers_that_all_fail_make_the_launcher_fail_with_their_logs(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text(
        FAKE.read_text().replace(
            "    layout = json.loads(",
            "    raise SystemExit('CUDA out of memory (pretend)')\n    layout = json.loads(",
            1,
        )
    )
    run = elaswave_run("--nproc-per-node", "2", "--timeout", "5", script, cwd=tmp_path)
    assert run.returncode == 1, run.stdout[-3000:]
    assert "job 'fails' failed" in run.stderr and "no worker finished" in run.stderr
    assert "CUDA out of memory (pretend)" in run.stderr  # the failed rank's log tail


# ------------------------------------------------------------------------------------ pure helpers


def test_job_name_comes_from_the_script() -> None:
    ns = argparse.Namespace(job=None, script=Path("dir/my train!.py"))
    assert job_name(ns) == "my-train"
    assert job_name(argparse.Namespace(job="x1", script=Path("a.py"))) == "x1"


def test_resume_command_repeats_the_run() -> None:
    ns = argparse.Namespace(
        nnodes=2,
        nproc_per_node=4,
        pp=2,
        job=None,
        checkpoint_dir=Path("ck"),
        checkpoint_every=10,
        timeout=20.0,
        script=Path("train.py"),
        script_args=["--lr", "3e-4"],
    )
    assert resume_command(ns, Path("ck")) == (
        "elaswave run --nnodes 2 --nproc-per-node 4 --pp 2 --resume ck "
        "--checkpoint-dir ck --checkpoint-every 10 train.py --lr 3e-4"
    )


def test_outcome_rules() -> None:
    snap = Snapshot(members=[{"worker_id": "rank-0", "state": "LEFT", "last_step": {"step": 9}}])
    finished = [{"kind": "worker_finished", "worker_id": "rank-0"}]
    lost = [{"kind": "worker_lost", "worker_id": "rank-1", "detail": "killed by signal 9"}]
    assert outcome("j", {0: 0, 1: 0}, finished, snap, 10, None).exit_code == 0
    done = outcome("j", {0: 0, 1: 137}, finished + lost, snap, 10, None)
    assert done.exit_code == 0 and "rank-1 (killed by signal 9)" in done.summary
    failed = outcome("j", {0: 1, 1: 137}, lost, snap, 10, None)
    assert failed.exit_code == 1 and failed.failed_ranks == (0, 1)
    assert outcome("j", {0: 0, 1: 0}, [], snap, 10, signal.SIGTERM).exit_code == 128 + signal.SIGTERM
    assert outcome("j", {0: 0, 1: 1}, [], snap, 10, signal.SIGINT).exit_code == 1
    # One node of two: its workers left (preempted) while the other node's still train.
    going_on = Snapshot(
        members=[
            {"worker_id": "rank-0", "state": "LEFT", "last_step": {"step": 9}},
            {"worker_id": "rank-2", "state": "RUNNING", "last_step": {"step": 9}},
        ],
        phase="RUNNING",
    )
    left = outcome("j", {0: 0}, [], going_on, 100, None, world=4, local_workers=frozenset({"rank-0"}))
    assert left.exit_code == EXIT_LEFT_RUNNING_JOB and "goes on with 1 worker(s)" in left.summary
    mine = [{"kind": "worker_finished", "worker_id": "rank-0"}]  # it finished: the job is done
    assert outcome("j", {0: 0}, mine, going_on, 100, None, 4, frozenset({"rank-0"})).exit_code == 0
    ended = Snapshot(members=snap.members, phase="FAILED")
    why = [{"kind": "job_failed", "worker_id": "", "detail": "every worker is lost"}]
    failed_job = outcome("j", {0: 0}, why, ended, 10, None)
    assert failed_job.exit_code == EXIT_FAILED and "every worker is lost" in failed_job.summary


def test_progress_lines_cut_event_details_at_a_word() -> None:
    event = {"kind": "plan_published", "worker_id": "", "detail": "predicted step time 0.01266 s " * 10}
    short = format_event(event, most=40)
    assert short == "plan_published (predicted step time 0.01266 s predicted ...)"
    assert format_event(event) == f"plan_published ({event['detail']})"  # event lines are whole


# ------------------------------------------------------------------ end to end, through elaswave.train

TINY = '''"""A tiny regression trained with elaswave.train (written by tests/test_launcher.py)."""
import argparse
import json

import torch
from torch import nn

import elaswave

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--losses-out")
p.add_argument("--state-out")
p.add_argument("--verify-every", type=int, default=elaswave.DEFAULT_VERIFY_EVERY)
args = p.parse_args()
g = torch.Generator().manual_seed(0)
x = torch.randn(256, 8, generator=g)
y = x.sum(dim=1, keepdim=True).tanh()
torch.manual_seed(0)  # every process must build the same initial weights
units = [nn.Linear(8, 16), nn.Sequential(nn.Tanh(), nn.Linear(16, 16)), nn.Sequential(nn.Tanh(), nn.Linear(16, 16)),
         nn.Sequential(nn.Tanh(), nn.Linear(16, 1))]


def loss_fn(out, target):
    return ((out - target) ** 2).mean(dim=1)


result = elaswave.train(units, loss_fn, torch.utils.data.TensorDataset(x, y), global_batch=8, micro_batches=2,
                        verify_every=args.verify_every,
                        steps=args.steps, optimizer=elaswave.AdamW(lr=1e-2))
if args.losses_out:
    with open(args.losses_out, "w") as f:
        json.dump({str(k): v for k, v in result.losses.items()}, f)
if args.state_out and result.state_dict is not None:
    torch.save(result.state_dict, args.state_out)
'''


def tiny_variant(old: str, new: str, base: str = TINY) -> str:
    """`base` (the tiny script) with `old` replaced by `new`; fails when `old` is not in it, so that a
    change to the script cannot silently drop a test's variant (its pacing, its precision)."""
    assert base.count(old) == 1, f"{old!r} is not once in the tiny script: update the variant"
    return base.replace(old, new)


def _tiny(tmp_path: Path) -> Path:
    pytest.importorskip("elaswave.api", reason="elaswave.train is not there yet")
    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    return script


def _reference_losses(script: Path, steps: int, state_out: Path | None = None) -> dict[int, float]:
    """The same script as one plain process (no launcher): the fault-free reference."""
    out = script.with_name("reference.json")
    extra = ["--state-out", str(state_out)] if state_out is not None else []
    subprocess.run(
        [sys.executable, str(script), "--steps", str(steps), "--losses-out", str(out), *extra],
        check=True,
        timeout=120,
        env=_env(),
        cwd=script.parent,
        capture_output=True,
    )
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


def _job_losses(run_dir: Path, ranks: list[int]) -> dict[int, float]:
    losses: dict[int, float] = {}
    for rank in ranks:
        for step, loss in json.loads((run_dir / f"rank-{rank}.json").read_text())["losses"].items():
            losses.setdefault(int(step), loss)
    return losses


@pytest.mark.timeout(180)
def test_end_to_end_pp2_dp2_trains_like_the_single_process_run(tmp_path: Path) -> None:
    script = _tiny(tmp_path)
    run = elaswave_run(
        "--nproc-per-node",
        "4",
        "--pp",
        "2",
        script,
        "--steps",
        "8",
        "--verify-every",
        "3",
        cwd=tmp_path,
        timeout_s=150,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "job 'tiny' finished: 8/8 steps, 4 of 4 workers finished" in run.stdout
    assert "losing it empties every stage" in run.stderr  # one machine: the warning says so
    run_dir = tmp_path / "elaswave-run" / "tiny"
    results = {r: json.loads((run_dir / f"rank-{r}.json").read_text()) for r in range(4)}
    assert all(res["committed_steps"] == 8 and res["rank"] == r for r, res in results.items())
    # the script's verify_every reached every rank: backups checked after steps 3 and 6, all sound
    assert all(
        res["verified_steps"] == [3, 6] and res["checksum_mismatches"] == 0 for res in results.values()
    )
    losses = _job_losses(run_dir, list(range(4)))
    reference = _reference_losses(script, 8)
    assert sorted(losses) == list(range(8))
    for step in range(8):
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), (step, losses, reference)


@pytest.mark.timeout(240)
def test_end_to_end_a_worker_killed_on_a_simulated_node_and_the_job_finishes(tmp_path: Path) -> None:
    script = _tiny(tmp_path)
    ckpt = tmp_path / "ckpt"
    launcher = Launcher(
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--pp",
        "2",
        "--checkpoint-dir",
        str(ckpt),
        script,
        "--steps",
        "60",
        cwd=tmp_path,
    )
    run_dir = tmp_path / "elaswave-run" / "tiny"
    launcher.wait_for(
        "every worker to commit step 3",
        lambda: len(s := _member_steps(run_dir, "tiny")) == 4 and min(s.values()) >= 3,
        timeout_s=120,
    )
    nodes = json.loads((run_dir / "nodes.json").read_text())
    victim_rank = nodes["nodes"]["0"][1]  # node 0's second rank: stage 1 keeps its rank on node 1
    victim = next(m for m in core_job(run_dir, "tiny")["members"] if m["rank"] == victim_rank)
    os.kill(victim["pid"], signal.SIGKILL)
    code = launcher.wait(timeout_s=180)
    out = launcher.output
    assert code == 0, out[-4000:]
    assert f"event: worker_lost rank-{victim_rank}" in out
    assert "job 'tiny' finished: 60/60 steps, 3 of 4 workers finished" in out
    survivors = [r for r in range(4) if r != victim_rank]
    results = {r: json.loads((run_dir / f"rank-{r}.json").read_text()) for r in survivors}
    assert all(res["committed_steps"] == 60 for res in results.values())
    # the default interval (50 steps), after the recovery too: one check, every backup sound
    assert all(res["verified_steps"] == [50] and res["checksum_mismatches"] == 0 for res in results.values())
    losses = _job_losses(run_dir, survivors)
    assert sorted(losses) == list(range(60))
    # Recovered in place, the job is the fault-free run: the same losses and, at the end, the same
    # parameters, up to fp32 round-off (the survivors split the batch differently).
    reference = _reference_losses(script, 60, state_out=tmp_path / "reference.pt")
    for step in range(60):
        assert losses[step] == pytest.approx(reference[step], rel=1e-4, abs=1e-6), step
    final = elaswave.load_model_state(ckpt)
    expected = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert final.keys() == expected.keys()
    worst = max(float((final[k] - expected[k]).abs().max()) for k in final)
    assert worst <= 1e-5, worst


def _launch_tiny(tmp_path: Path, nproc: int) -> tuple[Launcher, Path, Path]:
    """A PP=2 run of the tiny script on one node, checkpointing every 2 steps; returns it once
    every worker has committed step 5. Its steps are paced until the caller `release`s them, so
    that a loaded machine cannot finish the job before the caller's fault lands."""
    script = _tiny(tmp_path)
    script.write_text(
        tiny_variant(
            "optimizer=elaswave.AdamW(lr=1e-2))",
            "optimizer=elaswave.AdamW(lr=1e-2),\n                        " + paced_on_step(0.1) + ")",
        )
    )
    launcher = Launcher(
        "--nproc-per-node",
        str(nproc),
        "--pp",
        "2",
        "--checkpoint-dir",
        tmp_path / "ckpt",
        "--checkpoint-every",
        "2",
        script,
        "--steps",
        "40",
        cwd=tmp_path,
    )
    run_dir = tmp_path / "elaswave-run" / "tiny"
    launcher.wait_for(
        "every worker to commit step 5",
        lambda: len(s := _member_steps(run_dir, "tiny")) == nproc and min(s.values()) >= 5,
        timeout_s=120,
    )
    return launcher, run_dir, script


@pytest.mark.timeout(300)
def test_a_lost_stage_is_rebuilt_in_place_from_its_backup_and_the_job_finishes(tmp_path: Path) -> None:
    """Stage 1's only rank is killed. Its shard is backed up on stage 0 (planners.backup), so the
    Core's plan is in place: the survivor, the same process, takes stage 1's units from the
    backup it keeps, loses no step and trains to the end as the fault-free run."""
    launcher, run_dir, script = _launch_tiny(tmp_path, 2)
    victim = next(m for m in core_job(run_dir, "tiny")["members"] if m["stage"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    release(script)
    code = launcher.wait(timeout_s=120)
    out = launcher.output
    assert code == 0, out[-3000:]
    assert "restore in place" not in out, out[-3000:]
    assert "job 'tiny' finished: 40/40 steps" in out, out[-3000:]
    survivor = json.loads((run_dir / "rank-0.json").read_text())
    assert survivor["committed_steps"] == 40 and survivor["start_step"] == 0 and survivor["restores"] == []
    assert set(survivor["stage_of_step"].values()) == {0}
    # rank 0 reports the loss from the step it became the last stage on: each step once, from
    # the step after the kill on (no step replayed from disk)
    losses, reference = _job_losses(run_dir, [0]), _reference_losses(script, 40)
    assert sorted(losses) == list(range(min(losses), 40)) and 5 <= min(losses) < 40
    for step in losses:
        assert losses[step] == pytest.approx(reference[step], rel=1e-4, abs=1e-6), step


@pytest.mark.timeout(300)
def test_a_stage_and_its_backup_lost_are_restored_in_place_from_the_last_checkpoint(tmp_path: Path) -> None:
    """PP=2 over 3 ranks on one node: stage 1 is rank 2 alone, backed up on rank 0. Ranks 2 and
    0 are killed together, so no copy of stage 1's state is left in memory and the Core's plan
    is a RESTORE plan (planners.applicability). The survivor, the same process, reloads the
    latest periodic checkpoint on one stage, replays the steps after it and trains to the end
    as the fault-free run; the launcher reports a finished job."""
    launcher, run_dir, script = _launch_tiny(tmp_path, 3)
    members = core_job(run_dir, "tiny")["members"]
    victims = [m for m in members if m["rank"] in (0, 2)]
    assert {m["stage"] for m in victims} == {0, 1}
    for m in victims:
        os.kill(m["pid"], signal.SIGKILL)
    release(script)
    code = launcher.wait(timeout_s=120)
    out = launcher.output
    assert code == 0, out[-3000:]
    assert "restore in place from the latest durable checkpoint" in out, out[-3000:]
    assert "job 'tiny' finished: 40/40 steps" in out, out[-3000:]
    survivor = json.loads((run_dir / "rank-1.json").read_text())
    assert survivor["committed_steps"] == 40 and survivor["start_step"] == 0
    [restore] = survivor["restores"]
    saved = int(Path(restore["restored_from"]).name.split("-")[1])
    assert saved >= 2 and restore["resume_at"] == saved and restore["steps_lost"] == restore["step"] - saved
    assert restore["mode"] == "restore"
    assert set(survivor["stage_of_step"].values()) == {0}  # one stage after the restore: all units
    losses = _job_losses(run_dir, [1])
    assert set(range(saved, 40)) <= set(losses)
    reference = _reference_losses(script, 40)
    for step in range(saved, 40):
        assert losses[step] == pytest.approx(reference[step], rel=1e-4, abs=1e-6), step


@pytest.mark.timeout(300)
def test_the_store_lost_twice_is_replaced_and_the_job_trains_like_the_single_process_run(
    tmp_path: Path,
) -> None:
    """`elaswave run` keeps the store and a standby; the store is killed, the workers move to the
    standby in place and the launcher starts a new standby, whose address the workers learn from
    the store; then that one is killed too, and the job still finishes like the reference."""
    script = _tiny(tmp_path)
    # Slow steps (workers only): each new standby (forked from the zygote: milliseconds; cold it
    # would import torch, 10-15 s on a loaded 2-core machine) is up well before the job ends.
    script.write_text(
        tiny_variant(
            "optimizer=elaswave.AdamW(lr=1e-2))",
            "optimizer=elaswave.AdamW(lr=1e-2),\n                        " + paced_on_step(0.15) + ")",
        )
    )
    launcher = Launcher(
        "--nproc-per-node", "2", "--pp", "2", script, "--steps", str(STORE_LOSS_STEPS), cwd=tmp_path
    )
    run_dir = tmp_path / "elaswave-run" / "tiny"
    launcher.wait_for(
        "every worker to commit step 3",
        lambda: len(s := _member_steps(run_dir, "tiny")) == 2 and min(s.values()) >= 3,
        timeout_s=120,
    )
    first, standby = _local_stores(launcher)
    assert all(_forked_by_zygote(store) for store in (first, standby))
    first.kill()
    at = max(_member_steps(run_dir, "tiny").values())
    launcher.wait_for("a new standby store", lambda: "new standby store on" in launcher.output, timeout_s=150)
    ready = max(_member_steps(run_dir, "tiny").values())
    assert _forked_by_zygote(_local_stores(launcher)[-1])  # the replacement too: no torch import
    launcher.wait_for(
        "every worker 10 steps on (it re-reads the store list every 8)",
        lambda: min(_member_steps(run_dir, "tiny").values(), default=-1) >= max(at, ready) + 10,
        timeout_s=150,
    )
    assert [s.pid for s in _local_stores(launcher)][0] == standby.pid
    standby.kill()
    launcher.wait_for(
        "the second new standby",
        lambda: launcher.output.count("a new standby is starting") == 2,
        timeout_s=150,
    )
    release(script)
    code = launcher.wait(timeout_s=150)
    out = launcher.output
    assert code == 0, out[-3000:]
    assert f"job 'tiny' finished: {STORE_LOSS_STEPS}/{STORE_LOSS_STEPS} steps" in out, out[-3000:]
    assert out.count("a new standby is starting") == 2, out[-3000:]
    for rank in (0, 1):
        result = json.loads((run_dir / f"rank-{rank}.json").read_text())
        assert len(result["store_moves"]) == 2 and result["committed_steps"] == STORE_LOSS_STEPS
    losses, reference = _job_losses(run_dir, [1]), _reference_losses(script, STORE_LOSS_STEPS)
    assert sorted(losses) == list(range(STORE_LOSS_STEPS))
    for step in losses:
        assert losses[step] == pytest.approx(reference[step], rel=1e-4, abs=1e-6), step


STORE_LOSS_STEPS = 150


def _local_stores(launcher: Launcher) -> list[psutil.Process]:
    """The launcher's store processes, oldest first."""
    children = psutil.Process(launcher.proc.pid).children(recursive=True)  # forked by its zygote
    return sorted((c for c in children if _runs(c, "executor.store_server")), key=lambda c: c.create_time())


def _forked_by_zygote(process: psutil.Process) -> bool:
    parent = process.parent()
    return parent is not None and _runs(parent, "agent.zygote")


def _runs(process: psutil.Process, module: str) -> bool:
    """Whether `process` is alive (not a zombie waiting to be reaped) and runs `module`."""
    try:
        # a zygote's child shows its command as one string (agent.zygote sets its title)
        return process.status() != psutil.STATUS_ZOMBIE and module in " ".join(process.cmdline())
    except psutil.Error:
        return False
